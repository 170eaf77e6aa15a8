"""Run by torchrun (gloo, CPU) at 2 ranks: a 4-layer MLP cut into two
pipeline stages (torch.distributed.pipelining, GPipe over 4
micro-batches), each stage's parameters under its own strata.torch.AdamW
(states in host memory), 15 steps; the last stage reports the losses and
rank 0 trains the whole model in one process with torch AdamW on the same
batches (gradients summed over the micro-batches, as GPipe does)."""

import json

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import strata.torch

STEPS, MICRO = 15, 4


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 48), torch.nn.GELU(),
        torch.nn.Linear(48, 48), torch.nn.GELU(), torch.nn.Linear(48, 5),
    )


def batches():
    gen = torch.Generator().manual_seed(11)
    return [(torch.randn(16, 24, generator=gen), torch.randint(0, 5, (16,), generator=gen)) for _ in range(STEPS)]


def loss_fn(out, y):
    return torch.nn.functional.cross_entropy(out, y)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    whole = model()
    part = whole[:4] if rank == 0 else whole[4:]
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=MICRO, loss_fn=loss_fn)
    opt = strata.torch.AdamW(part.parameters(), lr=3e-3, compute_dtype=torch.float32, verbose=False)
    losses = []
    for x, y in batches():
        if rank == 0:
            schedule.step(x)
        else:
            micro = []
            schedule.step(target=y, losses=micro)
            losses.append(sum(m.item() for m in micro) / MICRO)
        opt.step()
        opt.zero_grad()
    opt.close()
    if rank == world - 1:
        dist.send(torch.tensor(losses), 0)
    if rank == 0:
        got = torch.zeros(STEPS)
        dist.recv(got, world - 1)
        plain = model()
        ref = torch.optim.AdamW(plain.parameters(), lr=3e-3)
        want = []
        for x, y in batches():
            total = 0.0
            for xs, ys in zip(x.chunk(MICRO), y.chunk(MICRO)):
                loss = loss_fn(plain(xs), ys)
                loss.backward()
                total += loss.item()
            ref.step()
            ref.zero_grad()
            want.append(total / MICRO)
        print(json.dumps({"pipeline": got.tolist(), "one_process": want}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
