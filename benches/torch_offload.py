#!/usr/bin/env python3
"""strata.torch.AdamW against torch's fused CPU AdamW, from the same loop.

1. The step: parameters of ``--params`` elements in tensors of 4M, each
   optimizer stepping the same gradients, interleaved rounds, medians:
   torch.optim.AdamW(fused=True) on fp32 parameters; strata.optim.CPUAdam
   (strata's kernel called in place, the roofline the offloaded step is
   held to); strata.torch.AdamW with fp32 and with bf16 moments, states in
   page-locked host memory, each ``step()`` followed by ``synchronize()``
   (nothing overlapped), and with bf16 parameters and gradients (what a
   GPU run hands it). With ``--fsdp2`` every parameter is an FSDP2
   shard (``fully_shard`` on a one-rank gloo group: DTensors, as a rank of
   a larger group steps them; the kernel row steps the shards' local
   tensors).
2. The overlap: torch on one thread (``torch.set_num_threads(1)``), the
   update on one strata thread, an MLP whose backward takes 1.5-2x the
   update, its parameters in decay and no-decay groups (HF Trainer's). Per step: the loop without an optimizer, with strata.torch.AdamW
   (deferred update: it runs while the next forward goes on), and the
   update alone; exposed = (with - without) / update. Unclipped and with
   ``clip_grad_norm_`` every step.

    python3 benches/torch_offload.py [--params 64M] [--rounds 5] [--fsdp2] [--json] [--tiny]
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

import strata.optim
import strata.torch

CHUNK = 1 << 22


def parse_count(text):
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def tensors(n):
    sizes = [CHUNK] * (n // CHUNK) + ([n % CHUNK] if n % CHUNK else [])
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) for s in sizes]


def step_rows(n, rounds, threads, fsdp2=False):
    base = tensors(n)
    grads = [torch.randn(t.numel(), generator=torch.Generator().manual_seed(1)) * 1e-3 for t in base]
    made = {}

    def params(dtype=torch.float32, local=False):
        ps = [torch.nn.Parameter(t.clone().to(dtype)) for t in base]
        if fsdp2:
            ps = _fsdp2_shards(ps)
        for p, g in zip(ps, grads):
            p.grad = _like(p, g.to(dtype))
        if local and fsdp2:
            # strata.optim.CPUAdam is the kernel over plain tensors: the shards'.
            return [_local_param(p) for p in ps]
        return ps

    p = params()
    made["torch_fused"] = (torch.optim.AdamW(p, lr=1e-3, fused=True), None)
    made["strata_kernel"] = (strata.optim.CPUAdam(params(local=True), lr=1e-3, threads=threads), None)
    for name, moments in (("strata_torch", "fp32"), ("strata_torch_bf16_moments", "bf16")):
        p = params()
        opt = strata.torch.AdamW(p, lr=1e-3, compute_dtype=torch.float32, moments=moments, threads=threads, verbose=False)
        made[name] = (opt, opt.synchronize)
    # ZeRO-Offload's own shape: bf16 parameters and gradients on the device side.
    p = params(torch.bfloat16)
    opt = strata.torch.AdamW(p, lr=1e-3, moments="fp32", threads=threads, verbose=False)
    made["strata_torch_bf16_params"] = (opt, opt.synchronize)
    times = {name: [] for name in made}
    for _ in range(rounds):
        for name, (opt, sync) in made.items():
            start = time.perf_counter()
            opt.step()
            if sync:
                sync()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        "params": n,
        "fsdp2": fsdp2,
        "threads": threads,
        "seconds": medians,
        "gparams_per_s": {name: n / s / 1e9 for name, s in medians.items()},
        "ratios": {
            "strata_torch/torch_fused": medians["torch_fused"] / medians["strata_torch"],
            "strata_torch/strata_kernel": medians["strata_kernel"] / medians["strata_torch"],
            "strata_torch_bf16_moments/torch_fused": medians["torch_fused"] / medians["strata_torch_bf16_moments"],
        },
    }


def _fsdp2_shards(ps):
    """``ps`` as FSDP2 shards: a module of them under ``fully_shard`` on a
    one-rank gloo group (DTensors over a one-device mesh, each shard the
    whole tensor: the local step a rank of a larger group runs)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    holder = torch.nn.Module()
    holder.ps = torch.nn.ParameterList(ps)
    fully_shard(holder)
    return list(holder.ps)


def _like(p, g):
    """``g`` as ``p`` is: a DTensor of its mesh and placements for a shard."""
    if not hasattr(p, "placements"):
        return g
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(g, p.device_mesh, p.placements)


def _local_param(p):
    local = torch.nn.Parameter(p.to_local().detach())
    local.grad = p.grad.to_local()
    return local


def mlp(width, depth):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def overlap_rows(width, depth, batch, rounds, steps):
    torch.set_num_threads(1)
    x = torch.randn(batch, width)

    def loop(net, opt, clip, synchronize_each=False):
        """Medians per step: the whole step, its backward, and (with
        ``synchronize_each``) the update waited for at once."""
        whole, backward, update = [], [], []
        for s in range(steps + 1):
            start = time.perf_counter()
            loss = net(x).square().mean()
            mark = time.perf_counter()
            loss.backward()
            done = time.perf_counter()
            if clip:
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)
            if opt is not None:
                before = time.perf_counter()
                opt.step()
                if synchronize_each:
                    opt.synchronize()
                    update.append(time.perf_counter() - before)
                opt.zero_grad()
            else:
                for p in net.parameters():
                    p.grad = None
            if s:
                whole.append(time.perf_counter() - start)
                backward.append(done - mark)
        if opt is not None:
            opt.synchronize()
        median = statistics.median
        return median(whole), median(backward), median(update[1:]) if update else None

    def strata_opt(net):
        # HF Trainer's groups: decay on the matrices, none on the biases
        # (so param_groups order is not the forward's).
        decay = [p for p in net.parameters() if p.dim() >= 2]
        rest = [p for p in net.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        return strata.torch.AdamW(groups, lr=1e-4, compute_dtype=torch.float32, threads=1, verbose=False)

    rows = {}
    for clip in (False, True):
        plain, deferred, blocking, backward, update = [], [], [], [], []
        for _ in range(rounds):
            whole, back, _ = loop(mlp(width, depth), None, clip)
            plain.append(whole)
            backward.append(back)
            net = mlp(width, depth)
            opt = strata_opt(net)
            deferred.append(loop(net, opt, clip)[0])
            opt.close()
            net = mlp(width, depth)
            opt = strata_opt(net)
            whole, _, up = loop(net, opt, clip, synchronize_each=True)
            blocking.append(whole)
            update.append(up)
            opt.close()
        p, d, b, back, up = (statistics.median(v) for v in (plain, deferred, blocking, backward, update))
        rows["clipped" if clip else "unclipped"] = {
            "step_without_optimizer_s": p,
            "step_deferred_s": d,
            "step_update_not_overlapped_s": b,
            "backward_s": back,
            "update_s": up,
            "backward_over_update": back / up,
            "exposed_over_update": max(d - p, 0.0) / up,
        }
    return {"width": width, "depth": depth, "batch": batch, "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="64M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="strata's threads (default: one per core)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--fsdp2", action="store_true", help="the step over FSDP2 shards (DTensors), not plain tensors")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="a few seconds: the tests' mode")
    args = ap.parse_args()
    n = parse_count(args.params)
    rounds, steps = args.rounds, 6
    if args.tiny:
        n, rounds, steps, args.width, args.depth, args.batch = 1 << 20, 2, 3, 128, 2, 16
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "cores": os.cpu_count(),
        "step": step_rows(n, rounds, args.threads, args.fsdp2),
    }
    report["overlap"] = overlap_rows(args.width, args.depth, args.batch, rounds, steps)
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
        return
    step = report["step"]
    print(f"step over {n / 1e6:.0f}M fp32 parameters, medians of {rounds} interleaved rounds:")
    for name, rate in step["gparams_per_s"].items():
        print(f"  {name:28s} {rate:6.3f} Gparams/s  ({step['seconds'][name] * 1e3:.1f} ms)")
    for name, ratio in step["ratios"].items():
        print(f"  {name:40s} {ratio:.2f}x")
    o = report["overlap"]
    print(f"overlap: MLP {o['depth']} x {o['width']}, batch {o['batch']}, torch and strata on one thread each:")
    for name, row in o["rows"].items():
        print(
            f"  {name:9s} step {row['step_without_optimizer_s'] * 1e3:.1f} ms without an optimizer, "
            f"{row['step_deferred_s'] * 1e3:.1f} ms deferred; backward {row['backward_s'] * 1e3:.1f} ms, "
            f"update {row['update_s'] * 1e3:.1f} ms ({row['backward_over_update']:.2f}x): "
            f"exposed {row['exposed_over_update']:.2f}x the update"
        )


if __name__ == "__main__":
    main()
