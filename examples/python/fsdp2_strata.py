#!/usr/bin/env python3
"""torchrun + FSDP2 (+ tensor parallelism) + strata.torch.AdamW: every
rank keeps the fp32 masters and moments of its own shards in strata's
pinned host memory or on NVMe, and collectives stay torch.distributed's.

    torchrun --nproc-per-node 2 examples/python/fsdp2_strata.py
    torchrun --nproc-per-node 4 examples/python/fsdp2_strata.py --tp 2 --states nvme --nvme /nvme/run1

A stack of MLP blocks, each block sharded by ``fully_shard`` over the data
parallel dimension and, with ``--tp N``, its two Linears split column-wise
then row-wise over the tensor parallel one (a 2D mesh). NCCL on GPUs, gloo
on the CPU. Every data-parallel group learns its own fixed batch, so the
loss must fall. Rank 0 prints the losses (``--json``: one JSON object).
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import strata.torch


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, width, depth, classes):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def clip_grad_norm(params, max_norm):
    """``clip_grad_norm_`` for a 2D model: torch's stacks the gradients'
    norms, which fails when they lie on different meshes (the TP'd Linears
    on dp x tp, the rest on dp alone), so each norm is made whole first
    and each gradient scaled on its own mesh."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = [g.norm() for g in grads]
    norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
    total = torch.stack(norms).norm()
    coefficient = min(1.0, max_norm / (float(total) + 1e-6))
    for g in grads:
        g.mul_(coefficient)
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (divides the world size)")
    ap.add_argument("--states", choices=["cpu", "nvme"], default="cpu")
    ap.add_argument("--nvme", help="states=nvme: a directory; each rank uses its own rank<N> inside it")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.tp:
        sys.exit(f"--tp {args.tp} does not divide the world size {world}")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    net = Net(args.width, args.depth, 10).to(device)
    for block in net.blocks:
        if args.tp > 1:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(net, mesh=mesh["dp"])
    nvme = None
    if args.states == "nvme":
        if not args.nvme:
            sys.exit("--states nvme needs --nvme DIR")
        nvme = os.path.join(args.nvme, f"rank{rank}")
        os.makedirs(nvme, exist_ok=True)
    opt = strata.torch.AdamW(
        net.parameters(), lr=3e-3, weight_decay=0.01, states=args.states, nvme_path=nvme,
        compute_dtype=torch.float32, verbose=rank == 0 and not args.json,
    )
    dp_rank = mesh["dp"].get_local_rank()
    gen = torch.Generator().manual_seed(100 + dp_rank)
    x = torch.randn(32, args.width, generator=gen).to(device)
    y = torch.randint(0, 10, (32,), generator=gen).to(device)
    losses = []
    for step in range(args.steps):
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        clip_grad_norm(list(net.parameters()), 1.0)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if rank == 0 and not args.json:
            print(f"step {step + 1:3d}  loss {losses[-1]:.4f}", flush=True)
    opt.close()
    if rank == 0 and args.json:
        json.dump({"world": world, "tp": args.tp, "states": args.states, "losses": losses}, sys.stdout)
        print()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
