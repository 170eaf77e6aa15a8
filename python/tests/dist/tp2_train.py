"""Run by torchrun (gloo, CPU) at 2 ranks: an MLP under DTensor tensor
parallelism (the first Linear column-wise, the second row-wise) with
strata.torch.AdamW, 20 steps with clipping, every rank on the same
batches; rank 0 then trains the same model in one process (no
parallelism) with torch AdamW and prints both loss lists as JSON."""

import json
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import strata.torch

STEPS = 20


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.GELU(), torch.nn.Linear(64, 5))


def train(net, opt):
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 24, generator=gen), torch.randint(0, 5, (8,), generator=gen)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    net = parallelize_module(model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    path = tempfile.mkdtemp(prefix=f"tp-rank{rank}-")
    opt = strata.torch.AdamW(
        net.parameters(), lr=3e-3, states="nvme", nvme_path=path, compute_dtype=torch.float32, verbose=False
    )
    tp = train(net, opt)
    opt.close()
    if rank == 0:
        plain = model()
        one = train(plain, torch.optim.AdamW(plain.parameters(), lr=3e-3))
        print(json.dumps({"tp": tp, "one_process": one}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
