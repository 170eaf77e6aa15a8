"""Run by torchrun (gloo, CPU) at 2 ranks: a model converted to bf16
before FSDP2's fully_shard, gradients reduced in fp32
(MixedPrecisionPolicy(reduce_dtype=float32)), strata.torch.AdamW with its
default bf16 compute dtype. Rank 0 prints the gradients' dtype, whether
any fp32 tensor the size of a local shard exists after construction (it
must not), and the losses of 12 steps on one fixed batch."""

import gc
import json

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import strata.torch


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(24, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 5)
    ).to(torch.bfloat16)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(net, mp_policy=policy)
    opt = strata.torch.AdamW(net.parameters(), lr=3e-3, verbose=False)
    gc.collect()
    sizes = {p._local_tensor.numel() for p in net.parameters()}
    fp32 = [t for t in gc.get_objects() if torch.is_tensor(t) and t.dtype is torch.float32 and t.numel() in sizes]
    gen = torch.Generator().manual_seed(5 + rank)
    x, y = torch.randn(16, 24, generator=gen).to(torch.bfloat16), torch.randint(0, 5, (16,), generator=gen)
    losses, grad_dtypes = [], set()
    for _ in range(12):
        loss = torch.nn.functional.cross_entropy(net(x).float(), y)
        loss.backward()
        grad_dtypes |= {str(p.grad.dtype) for p in net.parameters()}
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    opt.close()
    if rank == 0:
        print(json.dumps({
            "param_dtypes": sorted({str(p.dtype) for p in net.parameters()}),
            "grad_dtypes": sorted(grad_dtypes),
            "fp32_copies": len(fp32),
            "losses": losses,
        }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
