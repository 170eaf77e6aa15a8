#!/usr/bin/env python3
"""The optimizer issue's loss bar for bf16 optimizer states: the default
model trained with each `optim.state_dtype` (fp32, bf16-moments, bf16) for
the same steps and seeds; each run's final loss (the mean of its last 50
steps, which the noise of one batch does not move) against fp32 states' at
the same seed. Bars: bf16-moments within 1%, bf16 within 2%.

--null DTYPES runs those bf16 dtypes once more at each seed with another
rounding seed (optim.rounding_seed; the data, the start and every other
bit are the same), and reports how far that alone moves the final loss:
the floor under which a gap to fp32 is the rounding noise's chance path,
not a bias. The signed mean gap says whether bf16 states lose on average.

Runs are independent processes, seed by seed, the state dtypes of a seed
together; each in its own scratch directory (its swap files) under --work.

Usage: python3 benches/state-dtype-loss.py [--strata target/release/strata]
       [--steps 2000] [--seeds 1,2,3] [--null bf16-moments,bf16]
       [--config FILE] [--check] [--json]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

DTYPES = ["fp32", "bf16-moments", "bf16"]
BARS = {"bf16-moments": 0.01, "bf16": 0.02}
TAIL = 50
# The --null runs' rounding seed is the data seed plus this.
NULL_SEED_OFFSET = 1_000_003


def run(args, work, seed, dtype, rounding_seed=None):
    """One training run (rounding with `rounding_seed`, or the data seed
    without it); its per-step losses."""
    base = ""
    if args.config:
        with open(args.config) as f:
            base = f.read()
    if "[optim]" in base or "seed" in base:
        sys.exit(f"--config {args.config}: leave [optim] and train.seed to this script")
    text = base.replace("[train]", f"[train]\nseed = {seed}", 1) if "[train]" in base else base + f"\n[train]\nseed = {seed}\n"
    text += f'\n[optim]\nstate_dtype = "{dtype}"\n'
    if rounding_seed is not None:
        text += f"rounding_seed = {rounding_seed}\n"
    where = os.path.join(work, f"{dtype}-{seed}" + ("" if rounding_seed is None else f"-r{rounding_seed}"))
    os.makedirs(where)
    with open(os.path.join(where, "config.toml"), "w") as f:
        f.write(text)
    cmd = [os.path.abspath(args.strata), "train", "--config", "config.toml", "--steps", str(args.steps), "--json"]
    done = subprocess.run(cmd, cwd=where, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{dtype} seed {seed} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["losses"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strata", default="target/release/strata")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--null", default="", help="bf16 dtypes to run again with another rounding seed (comma-separated)")
    ap.add_argument("--config", help="a base config (without [optim] and train.seed); default: the built-in model")
    ap.add_argument("--work", help="scratch directory (default: a temporary one, removed)")
    ap.add_argument("--check", action="store_true", help="exit 1 unless both bars hold at every seed")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        sys.exit(f"--seeds {args.seeds!r}: give integers, comma-separated (e.g. 1,2,3)")
    null = [d for d in args.null.split(",") if d]
    for d in null:
        if d not in BARS:
            sys.exit(f"--null {args.null!r}: {d!r} is not a bf16 state dtype; give some of {', '.join(BARS)}")
    if args.steps < 1:
        sys.exit("--steps must be positive")
    if not os.access(args.strata, os.X_OK):
        sys.exit(f"{args.strata} is not an executable: build it with cargo build --release")
    scratch = None if args.work else tempfile.TemporaryDirectory(prefix="strata-loss-")
    work = args.work or scratch.name
    final = {}
    runs = [(dtype, None) for dtype in DTYPES] + [(dtype, NULL_SEED_OFFSET) for dtype in null]
    for seed in seeds:
        for dtype, offset in runs:
            label = dtype if offset is None else f"{dtype}/reseeded"
            losses = run(args, work, seed, dtype, None if offset is None else seed + offset)
            tail = losses[-TAIL:]
            final[(label, seed)] = statistics.fmean(tail)
            print(f"seed {seed} {label:<22} final loss {final[(label, seed)]:.4f} (mean of the last {len(tail)})",
                  file=sys.stderr)

    def gap(a, b, s):
        return final[(a, s)] / final[(b, s)] - 1

    rows = {}
    for dtype, bar in BARS.items():
        signed = [gap(dtype, "fp32", s) for s in seeds]
        gaps = [abs(g) for g in signed]
        rows[dtype] = {"gap_max": max(gaps), "gaps": gaps, "signed_mean": statistics.fmean(signed),
                       "bar": bar, "held": max(gaps) <= bar}
    floors = {}
    for dtype in null:
        gaps = [abs(gap(f"{dtype}/reseeded", dtype, s)) for s in seeds]
        floors[dtype] = {"gap_max": max(gaps), "gaps": gaps}
    report = {
        "steps": args.steps,
        "seeds": seeds,
        "final_loss": {f"{d}@{s}": v for (d, s), v in final.items()},
        "against_fp32": rows,
        "rounding_seed_only": floors,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for dtype, row in rows.items():
            gaps = ", ".join(f"{g * 100:.2f}%" for g in row["gaps"])
            print(f"{dtype:<13} against fp32 states: {gaps} (bar {row['bar'] * 100:.0f}%: "
                  f"{'held' if row['held'] else 'MISSED'}); signed mean {row['signed_mean'] * 100:+.2f}%")
        for dtype, row in floors.items():
            gaps = ", ".join(f"{g * 100:.2f}%" for g in row["gaps"])
            print(f"{dtype:<13} against itself with another rounding seed: {gaps}")
    if scratch:
        scratch.cleanup()
    if args.check and not all(r["held"] for r in rows.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
