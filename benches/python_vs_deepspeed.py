#!/usr/bin/env python3
"""strata from Python against DeepSpeed, side by side in one process.

Optimizer: strata.optim.CPUAdam (fp32 states, and bf16 moments:
state_dtype="bf16-moments") vs DeepSpeedCPUAdam vs torch.optim.AdamW
(fused=True), each stepping the same parameters and gradients in memory
(with its own moments, or with `--states shared` the same moments too,
but for bf16 moments, which keep their own) on
the same number of threads; rounds interleaved, systems in a fresh order
each round, medians of params/s. That their updates agree is checked
apart, each on its own copy of a 1M-parameter slice.
Each step starts after `--settle` seconds idle (default 0.05): DeepSpeed's
op and torch share one OpenMP pool whose threads spin for milliseconds
after a parallel region, so without it whichever system runs next competes
with them for the cores (and DeepSpeed or torch, running after each other,
find that pool already awake); `--settle 0` measures back to back.

I/O: strata.io.AsyncIO vs DeepNVMe's aio_handle
(AsyncIOBuilder().load().aio_handle(...); needs libaio-dev), the same file
size, block size, queue depth and threads, each with its own locked buffers
(new_cpu_locked_tensor) and with ordinary torch-allocated tensors, every
turn starting after os.sync() (untimed) so that no dirty pages left by
the previous turn are written back during this one; writes then
reads of the same files (one per buffer kind, shared by both systems, so
neither gains from where its file's blocks happen to lie), rounds
interleaved, medians of GB/s.

    python3 benches/python_vs_deepspeed.py                   # 64M params, 1 GiB files in ./strata-pybench
    python3 benches/python_vs_deepspeed.py --dir /nvme/x --threads 14 --io-threads 4
    python3 benches/python_vs_deepspeed.py --tiny --json     # seconds; what the tests run

Prints ratios (strata / peer); exits 0 whatever they are (bars are read
off the output, not asserted). A peer that does not import or build is
reported and skipped.
"""

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time


def parse_size(text):
    units = {"": 1, "K": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GIB": 1 << 30}
    text = text.strip().upper()
    digits = text.rstrip("KMGIB")
    unit = text[len(digits):]
    if unit not in units or not digits:
        raise argparse.ArgumentTypeError(f"{text!r}: use a number with K, M or G (e.g. 64M, 1GiB)")
    return int(float(digits) * units[unit])


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def round_order(order, round_, seed):
    """`order` shuffled afresh each round (seeded by `--order-seed` and the
    round): a fixed rotation would keep every system behind the same
    predecessor, and what one leaves behind (spinning OpenMP threads, dirty
    pages being written back) would always land on the same one. Another
    seed gives other orders, to check a result does not hang on them."""
    shuffled = list(order)
    random.Random(f"{seed}:{round_}").shuffle(shuffled)
    return shuffled


# ---------------------------------------------------------------- optimizers


def adam_systems(torch, threads):
    """(name, factory) for every optimizer that loads; reasons for those that do not."""
    systems, skipped = [], {}
    from strata.optim import CPUAdam

    systems.append(("strata", lambda ps: CPUAdam(ps, lr=1e-3, weight_decay=0.01, threads=threads)))
    # bf16 moments rounded stochastically: 20 bytes a parameter a step, not 28.
    systems.append(("strata_bf16_moments", lambda ps: CPUAdam(ps, lr=1e-3, weight_decay=0.01, threads=threads,
                                                                state_dtype="bf16-moments")))
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        probe = torch.nn.Parameter(torch.zeros(4))
        DeepSpeedCPUAdam([probe])
        systems.append(("deepspeed", lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3, weight_decay=0.01)))
    except Exception as err:  # not installed, or its op failed to build
        skipped["deepspeed"] = f"{type(err).__name__}: {err}"
    systems.append(("torch_fused", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True)))
    # strata beneath a torch loop: fp32 CPU parameters are their own masters
    # (stepped in place), moments in strata's page-locked arena; each step
    # waited for, so the whole update is timed.
    import strata.torch

    systems.append(("strata_torch", lambda ps: Synchronized(strata.torch.AdamW(
        ps, lr=1e-3, weight_decay=0.01, compute_dtype=torch.float32, threads=threads, verbose=False))))
    return systems, skipped


class Synchronized:
    """strata.torch.AdamW with each step waited for (its update runs behind
    the loop otherwise)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.state = optimizer.state

    def step(self):
        self.optimizer.step()
        self.optimizer.synchronize()


def tensor_sizes(params, tensors):
    """`params` elements cut into `tensors` sizes (the last takes the rest)."""
    sizes = [params // tensors] * tensors
    sizes[-1] += params - sum(sizes)
    return sizes


def bench_adam(args, torch):
    """Every optimizer steps the very same parameters and gradients, so
    where their memory landed cannot favour one of them: on a VM two
    allocations of the same size can differ by several percent in
    bandwidth. With `--states own` (the default) each keeps the moments it
    allocates itself, as it would in a trainer (strata's lie on transparent
    huge pages, DeepSpeed's and torch's wherever torch's allocator puts
    them); with `--states shared` every optimizer steps the first one's
    moments after its own first step, so only the kernels differ. Their
    results are compared apart, on separate copies of a small slice
    (`agreement`)."""
    torch.set_num_threads(args.threads)
    systems, skipped = adam_systems(torch, args.threads)
    sizes = tensor_sizes(args.params, args.tensors)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.numel(), generator=gen) * 1e-2
    optimizers = {}
    shared = None
    for name, factory in systems:
        optimizer = factory(params)
        optimizer.step()  # states allocated, first-touch done, JIT warm
        if shared is None:
            shared = [optimizer.state[p] for p in params]
        elif args.states == "shared" and name not in ("strata_bf16_moments", "strata_torch"):
            # (bf16 moments keep their own: fp32 ones would make it fp32;
            # strata.torch's moments are strata's, not torch tensors.)
            for p, first in zip(params, shared):
                for key in ("exp_avg", "exp_avg_sq"):
                    optimizer.state[p][key] = first[key]
        optimizers[name] = optimizer
    times = {name: [] for name, _ in systems}
    order = [name for name, _ in systems]
    for round_ in range(args.rounds):
        for name in round_order(order, round_, args.order_seed):
            time.sleep(args.settle)
            start = time.perf_counter()
            optimizers[name].step()
            times[name].append(time.perf_counter() - start)
    rates = {name: args.params / median(ts) / 1e9 for name, ts in times.items()}
    return {
        "params": args.params,
        "tensors": args.tensors,
        "states": args.states,
        "threads": args.threads,
        "rounds": args.rounds,
        "order_seed": args.order_seed,
        "gparams_per_s": rates,
        "max_abs_diff_from_strata": agreement(torch, systems, min(args.params, 1 << 20), args.tensors),
        "skipped": skipped,
        "ratios": adam_ratios(rates),
    }


def adam_ratios(rates):
    """strata (fp32 states) over each peer; bf16 moments over fp32 states
    and over each peer."""
    peers = [name for name in rates if not name.startswith("strata")]
    ratios = {f"strata/{name}": rates["strata"] / rates[name] for name in peers}
    if "strata_torch" in rates:
        for name in ["strata", *peers]:
            ratios[f"strata_torch/{name}"] = rates["strata_torch"] / rates[name]
    if "strata_bf16_moments" in rates:
        for name in ["strata", *peers]:
            ratios[f"strata_bf16_moments/{name}"] = rates["strata_bf16_moments"] / rates[name]
    return ratios


def agreement(torch, systems, params, tensors):
    """Largest difference from strata's parameters after 3 steps, each
    system on its own copy of the same `params` values and gradients."""
    sizes = tensor_sizes(params, tensors)
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) * 1e-2 for n in sizes]
    results = {}
    for name, factory in systems:
        copies = [torch.nn.Parameter(t.clone()) for t in init]
        for p, g in zip(copies, grads):
            p.grad = g.clone()
        optimizer = factory(copies)
        for _ in range(3):
            optimizer.step()
        results[name] = copies
    return {
        name: max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(ps, results["strata"]))
        for name, ps in results.items()
    }


# ---------------------------------------------------------------------- I/O


def io_systems(args, torch):
    systems, skipped = [], {}
    import strata.io

    handle = strata.io.AsyncIO(
        block_size=args.block_size, queue_depth=args.queue_depth, threads=args.io_threads
    )
    systems.append(("strata", handle))
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            raise RuntimeError("AsyncIOBuilder is not compatible here (install libaio-dev)")
        ds = builder.load(verbose=False).aio_handle(args.block_size, args.queue_depth, False, False, args.io_threads)
        systems.append(("deepnvme", ds))
    except Exception as err:
        skipped["deepnvme"] = f"{type(err).__name__}: {err}"
    return systems, skipped


def bench_io(args, torch):
    os.makedirs(args.dir, exist_ok=True)
    systems, skipped = io_systems(args, torch)
    n = args.io_bytes
    gen = torch.Generator().manual_seed(1)
    payload = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    buffers = {}
    for name, handle in systems:
        locked = handle.new_cpu_locked_tensor(n, payload)
        locked.copy_(payload)
        user = payload.clone()
        buffers[name] = {"locked": locked, "user": user}
    results = {f"{name}/{kind}/{op}": [] for name, _ in systems for kind in ("locked", "user") for op in ("write", "read")}
    order = [(name, handle, kind) for name, handle in systems for kind in ("locked", "user")]
    turn = 0
    for round_ in range(args.rounds):
        for name, handle, kind in round_order(order, round_, args.order_seed):
            buf = buffers[name][kind]
            path = os.path.join(args.dir, f"{kind}.bin")
            # Every 4 KiB block carries this turn's stamp (untimed): the
            # systems share the files, so a write that did nothing would
            # otherwise still read back an earlier turn's equal bytes.
            turn += 1
            payload.view(-1, 4096)[:, 0] = turn % 255 + 1
            buf.view(-1, 4096)[:, 0] = turn % 255 + 1
            os.sync()  # no write-back left from the previous system's turn
            start = time.perf_counter()
            handle.async_pwrite(buf, path)
            handle.wait()
            if args.sync:
                os.sync()
            results[f"{name}/{kind}/write"].append(n / (time.perf_counter() - start) / 1e9)
            buf.zero_()
            start = time.perf_counter()
            handle.async_pread(buf, path)
            handle.wait()
            results[f"{name}/{kind}/read"].append(n / (time.perf_counter() - start) / 1e9)
            if not torch.equal(buf, payload):
                raise SystemExit(f"{name} {kind}: bytes read back differ from those written")
    gbps = {key: median(values) for key, values in results.items()}
    ratios = {}
    if "deepnvme" in dict(systems):
        for kind in ("locked", "user"):
            for op in ("write", "read"):
                ratios[f"{kind}/{op}"] = gbps[f"strata/{kind}/{op}"] / gbps[f"deepnvme/{kind}/{op}"]
    for name, handle in systems:
        handle.free_cpu_locked_tensor(buffers[name]["locked"])
    if not args.keep:
        for kind in ("locked", "user"):
            try:
                os.remove(os.path.join(args.dir, f"{kind}.bin"))
            except FileNotFoundError:
                pass
    return {
        "bytes": n,
        "block_size": args.block_size,
        "queue_depth": args.queue_depth,
        "threads": args.io_threads,
        "dir": os.path.abspath(args.dir),
        "rounds": args.rounds,
        "order_seed": args.order_seed,
        "gb_per_s": gbps,
        "skipped": skipped,
        "ratios": {f"strata/deepnvme {k}": v for k, v in ratios.items()},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=parse_size, default=parse_size("64M"))
    parser.add_argument("--tensors", type=int, default=8, help="the parameters are split into this many tensors")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="optimizer threads for every system")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--order-seed", type=int, default=0, help="seeds each round's order of the systems")
    parser.add_argument("--states", choices=["own", "shared"], default="own",
                        help="each optimizer's moments as it allocates them (as in a trainer), or the first's "
                             "handed to all (only the kernels differ)")
    parser.add_argument("--settle", type=float, default=0.05,
                        help="seconds of idle before each optimizer step (see the module docstring)")
    parser.add_argument("--io-bytes", type=parse_size, default=parse_size("1GiB"))
    parser.add_argument("--block-size", type=parse_size, default=parse_size("1MiB"))
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--io-threads", type=int, default=1, help="DeepNVMe's intra_op_parallelism")
    parser.add_argument("--dir", default="strata-pybench", help="where the I/O files go (an NVMe directory)")
    parser.add_argument("--only", choices=["adam", "io"])
    parser.add_argument("--sync", action="store_true", help="os.sync() after each write")
    parser.add_argument("--keep", action="store_true", help="keep the I/O files")
    parser.add_argument("--tiny", action="store_true", help="a few seconds: 1M params, 16 MiB files, 2 rounds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.params, args.tensors, args.rounds = 1 << 20, 4, 2
        args.io_bytes, args.block_size = 16 << 20, 1 << 20
    if args.params < args.tensors or args.tensors < 1:
        parser.error(f"--params {args.params} must be at least --tensors {args.tensors} (>= 1)")
    if not 0 <= args.settle <= 10:
        parser.error(f"--settle {args.settle}: use 0 to 10 seconds")
    if args.threads < 1 or args.rounds < 1 or args.queue_depth < 1 or args.io_threads < 1:
        parser.error("--threads, --rounds, --queue-depth and --io-threads must be at least 1")
    if args.io_bytes % 4096 or args.block_size % 4096:
        parser.error("--io-bytes and --block-size must be multiples of 4096")
    try:
        import torch
    except ImportError as err:
        print(f"torch is not importable ({err}): both comparisons need it (pip install torch)", file=sys.stderr)
        return 2
    if args.only != "adam":
        parent = os.path.dirname(os.path.abspath(args.dir)) or "."
        if shutil.disk_usage(parent).free < 3 * args.io_bytes:
            print(f"{parent} has less than {3 * args.io_bytes} bytes free for the I/O files: use --dir or --io-bytes",
                  file=sys.stderr)
            return 2
    if args.json:
        # Only the report on stdout: DeepSpeed prints its accelerator
        # warning there when it imports, and its op builds' compilers
        # write to file descriptor 1; all of it goes to stderr meanwhile.
        sys.stdout.flush()
        report_fd = os.dup(1)
        os.dup2(2, 1)
    report = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "torch": torch.__version__}
    try:
        import deepspeed

        report["deepspeed"] = deepspeed.__version__
    except Exception as err:
        report["deepspeed"] = f"not importable: {err}"
    if args.only != "io":
        report["adam"] = bench_adam(args, torch)
    if args.only != "adam":
        report["io"] = bench_io(args, torch)
    if args.json:
        sys.stdout.flush()
        os.dup2(report_fd, 1)
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['date']}  {report['cpus']} CPUs  torch {report['torch']}  deepspeed {report['deepspeed']}")
    if "adam" in report:
        a = report["adam"]
        print(f"\nAdamW, {a['params']} params in {a['tensors']} tensors, {a['states']} states, {a['threads']} threads, "
              f"medians of {a['rounds']} rounds (Gparams/s):")
        for name, rate in a["gparams_per_s"].items():
            print(f"  {name:20} {rate:8.3f}   max |p - strata's p| {a['max_abs_diff_from_strata'][name]:.2e}")
        print_ratios_and_skips(a, 34)
    if "io" in report:
        r = report["io"]
        print(f"\nI/O, {r['bytes']} bytes per file in {r['dir']}, block {r['block_size']}, queue depth "
              f"{r['queue_depth']}, {r['threads']} threads, medians of {r['rounds']} rounds (GB/s):")
        for key, value in r["gb_per_s"].items():
            print(f"  {key:24} {value:8.3f}")
        print_ratios_and_skips(r, 30)
    return 0


def print_ratios_and_skips(section, width):
    for name, ratio in section["ratios"].items():
        print(f"  {name:{width}} {ratio:6.2f}x")
    for name, why in section["skipped"].items():
        print(f"  {name} skipped: {why}")


if __name__ == "__main__":
    sys.exit(main())
