#!/usr/bin/env python3
"""Where a CUDA training run parts from the CPU device's: the engine's bf16
run of a small model on the GPU against the same run on the CPU device, and
again in variants that each take one suspect away, step by step (the
relative loss gap, the gradient norms, and each step's flags: C clipped, L
updated late, S skipped).

A race changes bits from run to run, or goes away with
CUDA_LAUNCH_BLOCKING=1 or without prefetch; rounding repeats its bits in
every variant that keeps the same kernels, and moves with the attention
kernel (STRATA_FLASH_ATTENTION=0). The variants:

  cuda, cuda-again    as configured, twice (the bits must repeat)
  cuda-noclip         clip_norm = 0: no late updates, all speculative
  cuda-resident       params and optimizer on the device: the GPU's AdamW,
                      no CPU lane, no host copies (its own CPU reference)
  cuda-noprefetch     prefetch_ops = 0
  cuda-hostopt        optimizer states in host memory, not on NVMe (its
                      own CPU reference)
  cuda-blocking       CUDA_LAUNCH_BLOCKING=1: every launch synchronous
  cuda-noflash        STRATA_FLASH_ATTENTION=0: the other attention kernel

Each run takes a second or two on a GPU. Needs a GPU for the cuda runs
(without one they fail, each with strata's message).

Usage: python3 benches/cuda-variants.py [--strata target/release/strata]
       [--out DIR] [--lr 3e-3] [--steps 30]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

TEXT = "the quick brown fox jumps over the lazy dog. a stitch in time saves nine. " * 200


def config(out, name, lr, steps, device="cpu", clip=1.0, params="cpu", optimizer="nvme", prefetch=4,
           budget=None):
    """The engine test's bf16 model (train/tests/engine.rs,
    cuda_follows_the_cpu_loss_curve_and_repeats_its_own_bits)."""
    budget = budget or ("16MiB" if device == "cpu" else "256MiB")
    return f"""[model]
vocab = 256
seq = 16
hidden = 128
heads = 2
layers = 2
[train]
steps = {steps}
micro_batch = 4
warmup_steps = 2
lr = {lr}
clip_norm = {clip}
compute_dtype = "bf16"
[placement]
params = "{params}"
optimizer = "{optimizer}"
prefetch_ops = {prefetch}
[device]
kind = "{device}"
budget = "{budget}"
[host]
budget = "32MiB"
[nvme]
dirs = ["{os.path.join(out, 'swap-' + name)}"]
capacity = "64MiB"
create_dirs = true
"""


def run(args, text, name, env=None, **kw):
    """One run's step reports, or None (its error printed)."""
    path = os.path.join(args.out, name + ".toml")
    with open(path, "w") as f:
        f.write(config(args.out, name, args.lr, args.steps, **kw))
    started = time.time()
    done = subprocess.run([args.strata, "train", "--config", path, "--data", text, "--json",
                           "--log-level", "warn"],
                          capture_output=True, text=True, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        print(f"{name}: exit {done.returncode}: {done.stderr.strip()[-600:]}", flush=True)
        return None
    print(f"{name}: {time.time() - started:.1f} s", flush=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["reports"]


def flags(r):
    return ("C" if r["clip"] < 1 else "-") + ("L" if r["late"] else "-") + ("S" if r["skipped"] else "-")


def compare(name, ref, got):
    if ref is None or got is None:
        return
    rows, worst = [], 0.0
    for r, g in zip(ref, got):
        rel = abs(g["loss"] - r["loss"]) / abs(r["loss"])
        worst = max(worst, rel)
        rows.append(f"  {r['step']:>3} ref {r['loss']:.6f} {flags(r)} got {g['loss']:.6f} {flags(g)} "
                    f"rel {rel:.2e} norm {r['grad_norm']:.4f}/{g['grad_norm']:.4f}")
    same = all(r["loss"] == g["loss"] for r, g in zip(ref, got))
    print(f"== {name}: worst rel {worst:.2e}{' (the same bits)' if same else ''}")
    print("\n".join(rows), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strata", default="target/release/strata")
    ap.add_argument("--out", help="where the configs and swap folders go (default: a temporary folder)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    if not os.access(args.strata, os.X_OK):
        sys.exit(f"{args.strata} is not an executable: build it with cargo build --release")
    if args.steps < 1 or not args.lr > 0:
        sys.exit("--steps and --lr must be positive")
    args.strata = os.path.abspath(args.strata)
    with tempfile.TemporaryDirectory(prefix="strata-variants-") as scratch:
        args.out = os.path.abspath(args.out or scratch)
        os.makedirs(args.out, exist_ok=True)
        text = os.path.join(args.out, "text.txt")
        with open(text, "w") as f:
            f.write(TEXT)
        reference = run(args, text, "cpu")
        if reference is None:
            sys.exit("the CPU reference failed: nothing to compare with")
        references = {
            "cuda-noclip": run(args, text, "cpu-noclip", clip=0.0),
            "cuda-resident": run(args, text, "cpu-resident", params="device", optimizer="device",
                                 budget="32MiB"),
            "cuda-hostopt": run(args, text, "cpu-hostopt", optimizer="cpu"),
        }
        variants = [
            ("cuda", {}, {}),
            ("cuda-again", {}, {}),
            ("cuda-noclip", {}, {"clip": 0.0}),
            ("cuda-resident", {}, {"params": "device", "optimizer": "device"}),
            ("cuda-noprefetch", {}, {"prefetch": 0}),
            ("cuda-hostopt", {}, {"optimizer": "cpu"}),
            ("cuda-blocking", {"CUDA_LAUNCH_BLOCKING": "1"}, {}),
            ("cuda-noflash", {"STRATA_FLASH_ATTENTION": "0"}, {}),
        ]
        first = None
        for name, env, kw in variants:
            got = run(args, text, name, env=env, device="cuda", **kw)
            compare(name, references.get(name, reference), got)
            if name == "cuda":
                first = got
            elif name == "cuda-again" and first is not None and got is not None:
                compare("cuda-again against cuda", first, got)


if __name__ == "__main__":
    main()
