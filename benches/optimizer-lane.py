#!/usr/bin/env python3
"""The optimizer issue's lane bar: in training, the engine's CPU optimizer
lane at least 0.9x `strata bench adam`'s engine-shaped kernel
(engine_step_bf16: out of place, bf16 gradients in, the buffers walked in
host chunks) at the same thread count.

Per thread count and round, interleaved: one `strata bench adam --kernels
engine_step_bf16` at the size of one group's update, and one `strata train`
of a model whose states live in pinned host memory, with bf16 compute (so
gradients reach the lane as bf16, as on a GPU) and `[optim] threads` set;
the lane's rate is the median of each step's `optimizer_params_per_s`
(parameters over the lane's busy time, each update's from when its inputs
were at hand: waiting for a gradient's copy from the device is not the
lane's work), its first steps left out as
warm-up. Medians over rounds; the ratio lane / bench per thread count.

On a machine without a GPU the model computes on the CPU device, on the
same cores as the lane; on the GPU machine's host the compute is the
GPU's (pass --config with `[device] kind = "cuda"`).

Usage: python3 benches/optimizer-lane.py [--strata target/release/strata]
       [--threads 1,2] [--rounds 3] [--steps 12] [--config FILE] [--json]
       python3 benches/optimizer-lane.py --print-config   (the built-in model)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

BAR = 0.9
WARMUP_STEPS = 3

# 4 blocks of 12 x 512^2 = 3.1M parameters each (a group's update is long
# enough to stream its outputs), every state in pinned host memory.
DEFAULT_CONFIG = """
[model]
vocab = 256
seq = 64
hidden = 512
heads = 8
layers = 4

[train]
micro_batch = 2
compute_dtype = "bf16"

[placement]
params = "cpu"
optimizer = "cpu"

[device]
kind = "cpu"
budget = "64MiB"

[host]
budget = "1GiB"
"""


def group_params(config_text):
    """A block's parameters (the largest group's update): 12 h^2 + 13 h."""
    hidden = None
    for line in config_text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "hidden":
            hidden = int(value.split("#")[0])
    if hidden is None:
        sys.exit("the config names no model.hidden")
    return 12 * hidden * hidden + 13 * hidden


def bench(args, threads, params):
    cmd = [args.strata, "bench", "adam", "--kernels", "engine_step_bf16", "--threads", str(threads),
           "--params", str(params), "--rounds", "3", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)["results"][0]["params_per_s"]


def lane(args, work, base, threads):
    if "[optim]" in base:
        sys.exit("--config: leave [optim] to this script (it sets optim.threads)")
    path = os.path.join(work, f"lane-{threads}.toml")
    with open(path, "w") as f:
        f.write(base + f"\n[optim]\nthreads = {threads}\n")
    cmd = [args.strata, "train", "--config", path, "--steps", str(args.steps), "--json"]
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    reports = json.loads(done.stdout.strip().splitlines()[-1])["reports"][WARMUP_STEPS:]
    rates = [r["optimizer_params_per_s"] for r in reports if r["optimizer_params_per_s"] > 0]
    if not rates:
        sys.exit(f"{' '.join(cmd)}: no step after the warm-up reported the lane's rate")
    return statistics.median(rates)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strata", default="target/release/strata")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--config", help="a training config without [optim] (default: a built-in host-placed model)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--print-config", action="store_true",
                    help="print the built-in model's config (for scripts that vary it) and exit")
    args = ap.parse_args()
    if args.print_config:
        print(DEFAULT_CONFIG.strip())
        return
    try:
        thread_counts = [int(t) for t in args.threads.split(",")]
    except ValueError:
        sys.exit(f"--threads {args.threads!r}: give integers, comma-separated (e.g. 1,2,14)")
    if any(t < 1 for t in thread_counts) or args.rounds < 1:
        sys.exit("--threads and --rounds must be positive")
    if args.steps <= WARMUP_STEPS:
        sys.exit(f"--steps {args.steps}: run more than the {WARMUP_STEPS} warm-up steps")
    if not os.access(args.strata, os.X_OK):
        sys.exit(f"{args.strata} is not an executable: build it with cargo build --release")
    args.strata = os.path.abspath(args.strata)
    base = DEFAULT_CONFIG
    if args.config:
        with open(args.config) as f:
            base = f.read()
    params = group_params(base)
    rates = {t: {"bench": [], "lane": []} for t in thread_counts}
    with tempfile.TemporaryDirectory(prefix="strata-lane-") as work:
        for round_ in range(args.rounds):
            for t in thread_counts:
                rates[t]["bench"].append(bench(args, t, params))
                rates[t]["lane"].append(lane(args, work, base, t))
                print(f"round {round_ + 1} threads {t}: bench {rates[t]['bench'][-1] / 1e9:.3f}, "
                      f"lane {rates[t]['lane'][-1] / 1e9:.3f} G params/s", file=sys.stderr)
    rows = {}
    for t, r in rates.items():
        b, l = statistics.median(r["bench"]), statistics.median(r["lane"])
        rows[str(t)] = {"bench_params_per_s": b, "lane_params_per_s": l, "ratio": l / b, "held": l / b >= BAR}
    if args.json:
        print(json.dumps({"group_params": params, "rounds": args.rounds, "steps": args.steps, "bar": BAR,
                          "threads": rows}))
    else:
        for t, row in rows.items():
            print(f"threads {t:>3}: lane {row['lane_params_per_s'] / 1e9:.3f} G params/s, bench "
                  f"{row['bench_params_per_s'] / 1e9:.3f} ({row['ratio']:.2f}x; bar {BAR}x: "
                  f"{'held' if row['held'] else 'MISSED'})")


if __name__ == "__main__":
    main()
