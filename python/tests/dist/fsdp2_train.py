"""Run by torchrun (gloo, CPU): one model trained with FSDP2 three ways on
the same batches -- torch.optim.AdamW, strata.torch.AdamW with states in
host memory, and on NVMe, on NVMe with explicit forward prefetching, and on NVMe built over the
whole parameters before fully_shard swaps them (accelerate's order) --
30 steps of 4 micro-batches, clip_grad_norm_
every step. Rank 0 prints each run's losses (averaged over the ranks) as
JSON."""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import strata.torch

STEPS, ACCUMULATE = 30, 4


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 48), torch.nn.GELU(), torch.nn.Linear(48, 5)
    )


def shard(net):
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    return net


def groups(net):
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def train(net, opt, rank):
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        total = torch.zeros(())
        for _ in range(ACCUMULATE):
            x, y = torch.randn(6, 24, generator=gen), torch.randint(0, 5, (6,), generator=gen)
            loss = torch.nn.functional.cross_entropy(net(x), y) / ACCUMULATE
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    runs = {}
    net = shard(model())
    runs["torch"] = train(net, torch.optim.AdamW(groups(net), lr=3e-3), rank)
    for states in ("cpu", "nvme"):
        net = shard(model())
        path = os.path.join(base, f"rank{rank}")
        os.makedirs(path, exist_ok=True)
        opt = strata.torch.AdamW(
            groups(net), lr=3e-3, states=states, nvme_path=path, compute_dtype=torch.float32, verbose=rank == 0
        )
        runs[f"strata_{states}"] = train(net, opt, rank)
        opt.close()
    # Explicit forward prefetching: each layer's pre-forward all-gathers
    # the next layer's group, before that layer's own forward begins.
    net = shard(model())
    layers = [m for m in net if isinstance(m, torch.nn.Linear)]
    for layer, following in zip(layers, layers[1:]):
        layer.set_modules_to_forward_prefetch([following])
    path = os.path.join(base, f"rank{rank}-prefetch")
    os.makedirs(path, exist_ok=True)
    opt = strata.torch.AdamW(
        groups(net), lr=3e-3, states="nvme", nvme_path=path, compute_dtype=torch.float32, verbose=False
    )
    runs["strata_prefetch"] = train(net, opt, rank)
    opt.close()
    # accelerate's prepare under FSDP2: the optimizer is built over the
    # whole parameters, then fully_shard replaces them and each param group
    # is given the sharded DTensors (fsdp2_switch_optimizer_parameters).
    net = model()
    path = os.path.join(base, f"rank{rank}-swapped")
    os.makedirs(path, exist_ok=True)
    opt = strata.torch.AdamW(
        groups(net), lr=3e-3, states="nvme", nvme_path=path, compute_dtype=torch.float32, verbose=False
    )
    names = {id(p): n for n, p in net.named_parameters()}
    shard(net)
    sharded = dict(net.named_parameters())
    for group in opt.param_groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    runs["strata_swapped"] = train(net, opt, rank)
    opt.close()
    if rank == 0:
        print(json.dumps(runs))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
