"""Run by torchrun (gloo, CPU). `save DIR`: FSDP2 + strata.torch.AdamW
trains 4 steps, saves model and optimizer with
torch.distributed.checkpoint, trains 4 more; rank 0 prints those 4 losses
and writes the full (gathered) optimizer state as `DIR/full.pt`. `resume
DIR`: a fresh model and optimizer load the checkpoint and train the same
4 steps (prints the losses). `check DIR` (any world size): loads the
checkpoint and compares its full optimizer state with `full.pt`."""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

import strata.torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp2_train import groups, model, shard  # noqa: E402


def train(net, opt, steps, skip, rank):
    gen = torch.Generator().manual_seed(200 + rank)
    for _ in range(skip * 2):
        torch.randn(6, 24, generator=gen), torch.randint(0, 5, (6,), generator=gen)
    losses = []
    for _ in range(steps):
        total = torch.zeros(())
        for _ in range(2):
            x, y = torch.randn(6, 24, generator=gen), torch.randint(0, 5, (6,), generator=gen)
            loss = torch.nn.functional.cross_entropy(net(x), y) / 2
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def build(states, base, rank):
    net = shard(model())
    path = os.path.join(base, f"nvme-{states}-{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    opt = strata.torch.AdamW(
        groups(net), lr=3e-3, states=states, nvme_path=path, compute_dtype=torch.float32,
        moments="bf16", verbose=False,
    )
    return net, opt


def full_state(net, opt):
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(net, opt, options=options)


def main():
    mode, base, states = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net, opt = build(states, base, rank)
    ckpt = os.path.join(base, "ckpt")
    if mode == "save":
        train(net, opt, 4, 0, rank)
        dcp.save({"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)}, checkpoint_id=ckpt)
        full = full_state(net, opt)
        if rank == 0:
            torch.save(full, os.path.join(base, "full.pt"))
        result = train(net, opt, 4, 4, rank)
    else:
        state = {"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)}
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(net, state["model"])
        set_optimizer_state_dict(net, opt, state["optim"])
        if mode == "resume":
            result = train(net, opt, 4, 4, rank)
        else:
            got = full_state(net, opt)
            want = torch.load(os.path.join(base, "full.pt"), weights_only=False)
            result = sorted(want["state"]) == sorted(got["state"])
            for fqn, entry in want["state"].items():
                for key, value in entry.items():
                    result = result and torch.equal(torch.as_tensor(value), torch.as_tensor(got["state"][fqn][key]))
    opt.close()
    if rank == 0:
        print(json.dumps({"result": result}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
