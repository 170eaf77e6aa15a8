#!/usr/bin/env python3
"""strata's CPU optimizer kernels against DeepSpeed's CPUAdam and PyTorch's
fused CPU AdamW, side by side in one run, over a sweep of thread counts.

For each thread count T, each round runs in a rotated order:
  strata      `strata bench adam --threads T --rounds 1 --json` for
              adamw_fp32, offload_step_bf16, engine_step_bf16 (the engine's
              shape: out of place, bf16 gradient in), the bf16-state steps
              offload_step_bf16_moments_sr and offload_step_bf16_master, and
              roofline_4r3w (their order rotated each round);
  torch       torch.optim.AdamW(fused=True).step() on fp32;
  ds_adam     DeepSpeedCPUAdam(adamw_mode=True).step() on fp32;
  ds_offload  what DeepSpeed 0.19.8's ZeRO-1/2 offload does on the CPU per
              step with bf16 (stage_1_and_2.py step(), lines 3080-3096):
              unscale and clip the fp32 gradient (mul_, run whenever
              gradient_clipping is set, 1.0 by default), the CPUAdam step,
              and the fp32 params narrowed into the bf16 partition buffer.
              The gradients arrive already in fp32: DeepSpeed converts them
              on the GPU and DMAs them into the pinned fp32 buffer during
              backward (async_inplace_copy_grad_to_fp32_buffer_from_gpu), so
              no CPU conversion is timed. 3 passes, 42 bytes per parameter;
              strata's offload_step_bf16 is one pass of 28 (its gradients
              arrive as bf16, half the PCIe bytes). ZeRO-3 runs the same
              three passes, plus a temporary and a blocking copy to the GPU
              that a CPU-only bench cannot reproduce.
With --idle, each also steps idle parameters (adamw_fp32_idle; torch and
ds_adam as *_idle): zero gradients, m zero and v subnormal (1e-39), as for
an embedding row whose token has not been seen for tens of thousands of
steps (rounding to nearest never takes it to zero: 0.999 v rounds back to
v at 500 x 2^-149, and every multiply that reads it takes a microcode
assist on x86). strata reads such moments as zero, so it is timed in its
steady state after the warm-up, the peers in theirs.
The peers run in a worker process per thread count and round, started with
OMP_NUM_THREADS=T and torch.set_num_threads(T) (DeepSpeed's op may link its
own OpenMP runtime, which only the environment reaches); one worker lives
at a time, beside strata's process, so the peers' tensors are held once,
not once per thread count. A worker dies with the bench (PR_SET_PDEATHSIG,
and the bench ends its workers on any exit), never outliving it. Medians
over rounds are reported per thread count, with GB/s per thread, `lscpu`'s
topology, the ratios the optimizer issue sets as bars, and optionally an
SVG chart of params/s against threads. Needs torch and deepspeed (pip install torch
deepspeed ninja; the first DeepSpeedCPUAdam JIT-builds its op, about a
minute) unless --peers none. Memory: 16-18 bytes a parameter per peer
system in the one worker (3.1 GiB for torch and DeepSpeed at 64M params)
plus strata's buffers (2.2 GiB); a sweep that would not fit the memory
available is refused before it starts, naming the --params that fits.
Thread counts are those the bench may run on (its CPU affinity): the
default list keeps those that fit and adds the machine's count; a count
given above it is refused.

Usage: python3 benches/adam_vs_deepspeed.py [--strata target/release/strata]
       [--threads 1,2,4,8,14,16 (those the machine has)] [--params 67108864] [--rounds 3]
       [--peers torch,deepspeed|none] [--plot adam-threads.svg] [--check]
       [--idle] [--json]
"""

import argparse
import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import time

STRATA_KERNELS = [
    "adamw_fp32",
    "offload_step_bf16",
    "engine_step_bf16",
    "offload_step_bf16_moments_sr",
    "offload_step_bf16_master",
    "roofline_4r3w",
]
# Bytes each peer system holds per parameter in its worker: the fp32
# parameter, gradient and two moments (ds_offload_bf16 adds the bf16 copy).
PEER_HELD = {"torch_fused_adamw": 16, "ds_cpu_adam": 16, "ds_offload_bf16": 18,
             "torch_fused_adamw_idle": 16, "ds_cpu_adam_idle": 16}
# What `strata bench adam` holds for STRATA_KERNELS at once, per parameter
# (strata_optim::bench::buffer_bytes: 2.2 GiB at 64M; it checks again).
STRATA_HELD = 36
DEFAULT_THREADS = [1, 2, 4, 8, 14, 16]
# Bytes each peer step reads and writes per parameter.
PEER_BYTES = {"torch_fused_adamw": 28, "ds_cpu_adam": 28, "ds_offload_bf16": 42,
              "torch_fused_adamw_idle": 28, "ds_cpu_adam_idle": 28}
PEERS = {"torch": ["torch_fused_adamw"], "deepspeed": ["ds_cpu_adam", "ds_offload_bf16"]}
# With --idle: strata's kernel and each peer's system on idle parameters.
IDLE = {"strata": ["adamw_fp32_idle"], "torch": ["torch_fused_adamw_idle"], "deepspeed": ["ds_cpu_adam_idle"]}
# v of an idle parameter: subnormal, as after ~65,000 steps without its token.
IDLE_V = 1e-39


def steps_per_s(fn, reps):
    fn()  # warm
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return reps / (time.perf_counter() - start)


def die_with_parent(parent):
    """This worker gets SIGKILL when the bench's process ends, however it
    ends (Linux's PR_SET_PDEATHSIG); where that call is missing the worker
    still ends at the end of its standard input."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the bench ended before the call
        os._exit(1)


def worker(threads, n, reps, systems, parent):
    """Serves one thread count's peers: reads a system's name per line,
    answers with its params/s as one JSON line."""
    die_with_parent(parent)
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)

    def param():
        p = torch.nn.Parameter(torch.rand(n) * 2 - 1)
        p.grad = (torch.rand(n) * 2 - 1) * 1e-2
        return p

    def idle(p, opt):
        """`p` made idle: zero gradient, m zero, v subnormal (one step
        first, so that the optimizer has made its state)."""
        p.grad.zero_()
        opt.step()
        state = opt.state[p]
        state["exp_avg"].zero_()
        state["exp_avg_sq"].fill_(IDLE_V)
        assert state["exp_avg_sq"][0].item() != 0.0, "torch flushes denormals here: idle moments would be zero"

    steps = {}
    if "torch_fused_adamw_idle" in systems:
        p_idle = param()
        torch_idle = torch.optim.AdamW([p_idle], lr=1e-4, weight_decay=0.01, fused=True)
        idle(p_idle, torch_idle)
        steps["torch_fused_adamw_idle"] = torch_idle.step
    if "ds_cpu_adam_idle" in systems:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p_ds_idle = param()
        ds_idle = DeepSpeedCPUAdam([p_ds_idle], lr=1e-4, weight_decay=0.01, adamw_mode=True)
        idle(p_ds_idle, ds_idle)
        steps["ds_cpu_adam_idle"] = ds_idle.step
    if "torch_fused_adamw" in systems:
        p_torch = param()
        torch_opt = torch.optim.AdamW([p_torch], lr=1e-4, weight_decay=0.01, fused=True)
        steps["torch_fused_adamw"] = torch_opt.step
    if "ds_cpu_adam" in systems:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p_ds = param()
        ds_opt = DeepSpeedCPUAdam([p_ds], lr=1e-4, weight_decay=0.01, adamw_mode=True)
        steps["ds_cpu_adam"] = ds_opt.step
        p_off = param()
        off_opt = DeepSpeedCPUAdam([p_off], lr=1e-4, weight_decay=0.01, adamw_mode=True)
        params_bf16 = torch.empty(n, dtype=torch.bfloat16)
        # bf16 training: loss scale 1 and the clip not triggered, so
        # DeepSpeed multiplies by 1.0 - still a full pass. (A scale below 1
        # applied every step without refreshing the gradient would drive it
        # into denormals.)
        combined_scale_inv = 1.0

        def ds_offload_step():
            p_off.grad.mul_(combined_scale_inv)  # unscale_and_clip_grads
            off_opt.step()  # _optimizer_step: DeepSpeedCPUAdam, no copy-out
            params_bf16.copy_(p_off.data)  # bit16_partition_buffer.copy_(fp32 partition)

        steps["ds_offload_bf16"] = ds_offload_step
    print(json.dumps({"ready": torch.__version__}), flush=True)
    for line in sys.stdin:
        name = line.strip()
        print(json.dumps({name: n * steps_per_s(steps[name], reps)}), flush=True)
    # Out without the interpreter's teardown, which can wait on OpenMP
    # threads of the peers' libraries.
    sys.stdout.flush()
    os._exit(0)


class Worker:
    """A peer worker process for one thread count."""

    def __init__(self, threads, args, systems):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        cmd = [sys.executable, __file__, "--worker", str(threads), "--params", str(args.params),
               "--reps", str(args.reps), "--systems", ",".join(systems), "--parent", str(os.getpid())]
        self.threads = threads
        self.process = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.version = self.read()["ready"]

    def read(self):
        # Libraries print to stdout too (DeepSpeed's accelerator warning):
        # only lines that are JSON objects are answers.
        while True:
            line = self.process.stdout.readline()
            if not line:
                code = self.process.wait()
                sys.exit(f"the {self.threads}-thread peer worker exited ({code}) before answering: see its error above")
            if line.lstrip().startswith("{"):
                return json.loads(line)

    def run(self, name):
        self.process.stdin.write(name + "\n")
        self.process.stdin.flush()
        return self.read()[name]

    def close(self):
        """Ends the worker: at the end of its input, else killed."""
        try:
            self.process.stdin.close()
            self.process.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def strata_round(args, threads, r):
    """One round of strata's kernels, their order rotated by the round `r`
    (one round per process, so no kernel always runs first)."""
    names = STRATA_KERNELS + (IDLE["strata"] if args.idle else [])
    kernels = names[r % len(names):] + names[:r % len(names)]
    cmd = [args.strata, "bench", "adam", "--params", str(args.params), "--threads", str(threads),
           "--rounds", "1", "--kernels", ",".join(kernels), "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({run.returncode}): {run.stderr.strip()}")
    report = json.loads(run.stdout.strip().splitlines()[-1])
    rates = {f"strata_{r['kernel']}": (r["params_per_s"], r["bytes_per_s"]) for r in report["results"]}
    return rates, report.get("prefetch_elems")


def lscpu():
    """The topology the bars depend on, from `lscpu` (empty where absent)."""
    keys = ["Model name", "Socket(s)", "Core(s) per socket", "Thread(s) per core", "NUMA node(s)", "CPU(s)"]
    try:
        out = subprocess.run(["lscpu"], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    found = {}
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            found[key.strip()] = value.strip()
    return found


def bars(med, threads):
    """The optimizer issue's bars that this sweep can check: name ->
    (ratio, bar)."""
    held = {}
    for t, m in med.items():
        adamw = m["strata_adamw_fp32"]
        if t in (2, 16):
            held[f"adamw_vs_roofline@{t}"] = (adamw / m["strata_roofline_4r3w"], 0.95)
            peers = [m[k] for k in ("torch_fused_adamw", "ds_cpu_adam") if k in m]
            if peers:
                held[f"adamw_vs_best_peer@{t}"] = (adamw / max(peers), 1.0)
        if t == 16 and "ds_offload_bf16" in m:
            held["offload_vs_ds_offload@16"] = (m["strata_offload_step_bf16"] / m["ds_offload_bf16"], 2.0)
        base = m["strata_offload_step_bf16"]
        held[f"bf16_moments_vs_fp32_states@{t}"] = (m["strata_offload_step_bf16_moments_sr"] / base, 1.3)
        held[f"bf16_master_vs_fp32_states@{t}"] = (m["strata_offload_step_bf16_master"] / base, 1.8)
    if 14 in med and 16 in med:
        held["adamw_14_vs_16_threads"] = (med[14]["strata_adamw_fp32"] / med[16]["strata_adamw_fp32"], 0.95)
    return held


def idle_ratios(med):
    """strata's AdamW on idle parameters against the faster peer's, and
    against its own AdamW on ordinary ones, per thread count (no bar)."""
    ratios = {}
    for t, m in med.items():
        if "strata_adamw_fp32_idle" not in m:
            continue
        idle = m["strata_adamw_fp32_idle"]
        ratios[f"idle_adamw_vs_ordinary@{t}"] = idle / m["strata_adamw_fp32"]
        peers = [m[k] for k in ("torch_fused_adamw_idle", "ds_cpu_adam_idle") if k in m]
        if peers:
            ratios[f"idle_adamw_vs_best_peer@{t}"] = idle / max(peers)
    return ratios


def svg_chart(path, med, threads):
    """params/s against threads, one line per system, as a small SVG."""
    names = sorted({k for m in med.values() for k in m})
    width, height, left, bottom, top, right = 900, 560, 70, 50, 40, 260
    y_max = max(v for m in med.values() for v in m.values()) * 1.1 / 1e9
    x_max = max(threads)

    def x(t):
        return left + (width - left - right) * t / x_max

    def y(v):
        return height - bottom - (height - bottom - top) * v / y_max

    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
              "#bcbd22", "#17becf"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
             '<rect width="100%" height="100%" fill="white"/>',
             f'<text x="{left}" y="24" font-size="16">CPU Adam: G params/s against threads (medians)</text>',
             f'<line x1="{left}" y1="{y(0)}" x2="{x(x_max)}" y2="{y(0)}" stroke="black"/>',
             f'<line x1="{left}" y1="{y(0)}" x2="{left}" y2="{top}" stroke="black"/>']
    for t in threads:
        parts.append(f'<text x="{x(t)}" y="{y(0) + 18}" text-anchor="middle">{t}</text>')
    for k in range(6):
        v = y_max * k / 5
        parts.append(f'<text x="{left - 8}" y="{y(v) + 4}" text-anchor="end">{v:.1f}</text>')
        parts.append(f'<line x1="{left}" y1="{y(v)}" x2="{x(x_max)}" y2="{y(v)}" stroke="#ddd"/>')
    parts.append(f'<text x="{(left + x(x_max)) / 2}" y="{height - 10}" text-anchor="middle">threads</text>')
    parts.append(f'<text x="16" y="{(top + y(0)) / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 16 {(top + y(0)) / 2})">G params/s</text>')
    for i, name in enumerate(names):
        color = colors[i % len(colors)]
        points = [(x(t), y(med[t][name] / 1e9)) for t in threads if name in med[t]]
        path_d = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
        parts.append(f'<polyline points="{path_d}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts.extend(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{color}"/>' for px, py in points)
        ly = top + 18 * i
        parts.append(f'<line x1="{width - right + 16}" y1="{ly}" x2="{width - right + 36}" y2="{ly}" stroke="{color}" stroke-width="2"/>')
        parts.append(f'<text x="{width - right + 42}" y="{ly + 4}">{name}</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def usable_cpus():
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def thread_counts(given):
    """The sweep's thread counts: those given (each at most the CPUs the
    bench may use), else the default list's that fit and the CPUs' count."""
    cpus = usable_cpus()
    if given is None:
        counts = sorted({t for t in DEFAULT_THREADS if t <= cpus} | {cpus})
        dropped = [t for t in DEFAULT_THREADS if t > cpus]
        if dropped:
            print(f"threads {','.join(map(str, dropped))} left out: this bench may use {cpus} CPUs", file=sys.stderr)
        return counts
    try:
        counts = sorted({cpus if t == "all" else int(t) for t in given.split(",")})
    except ValueError:
        sys.exit(f"--threads {given!r}: give positive integers or 'all', comma-separated (e.g. 1,2,4,8,14,16)")
    if not counts or counts[0] < 1:
        sys.exit(f"--threads {given!r}: every thread count must be at least 1")
    if counts[-1] > cpus:
        sys.exit(f"--threads {given!r}: this bench may use {cpus} CPUs (its affinity), so at most {cpus} threads; "
                 f"leave --threads out for the counts that fit")
    return counts


def mem_available():
    """MemAvailable from /proc/meminfo in bytes, or None where absent."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(params, systems):
    """Refuses a sweep whose one peer worker and strata's buffers would not
    fit the memory available now, naming the --params that would."""
    available = mem_available()
    per_param = STRATA_HELD + sum(PEER_HELD[s] for s in systems)
    if available is None or params * per_param <= available:
        return
    gib = 1 << 30
    fits = available // per_param
    sys.exit(f"--params {params}: strata's buffers and the peers' tensors need {params * per_param / gib:.1f} GiB "
             f"({per_param} bytes a parameter) but {available / gib:.1f} GiB of memory is available; "
             f"use --params {fits} or fewer, or fewer --peers")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strata", default="target/release/strata")
    ap.add_argument("--threads", default=None,
                    help="thread counts, comma-separated (default 1,2,4,8,14,16; 'all' is os.cpu_count())")
    ap.add_argument("--params", type=int, default=64 * 1024 * 1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5, help="steps timed per peer per round")
    ap.add_argument("--peers", default="torch,deepspeed", help="torch, deepspeed, both, or none")
    ap.add_argument("--plot", help="also draw params/s against threads into this SVG file")
    ap.add_argument("--check", action="store_true", help="exit 1 unless every bar the sweep can check holds")
    ap.add_argument("--idle", action="store_true",
                    help="also time AdamW on idle parameters (zero gradients, subnormal v)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--systems", help=argparse.SUPPRESS)
    ap.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        return worker(args.worker, args.params, args.reps, args.systems.split(","), args.parent)

    threads = thread_counts(args.threads)
    if args.params < 1 or args.rounds < 1 or args.reps < 1:
        sys.exit("--params, --rounds and --reps must be positive")
    peers = [] if args.peers == "none" else args.peers.split(",")
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        sys.exit(f"--peers: unknown {unknown}; choose from {sorted(PEERS)} or none")
    if args.plot:
        if not args.plot.endswith(".svg"):
            sys.exit(f"--plot {args.plot}: the chart is SVG; name the file *.svg")
        with open(args.plot, "a"):
            pass  # writable now, not after the sweep
    if not os.access(args.strata, os.X_OK):
        sys.exit(f"{args.strata} is not an executable: build it with cargo build --release")
    systems = [s for p in peers for s in PEERS[p] + (IDLE[p] if args.idle else [])]
    check_memory(args.params, systems)
    if systems:
        try:
            import torch  # noqa: F401
            if "deepspeed" in peers:
                from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
        except ImportError as error:
            sys.exit(f"needs torch and deepspeed: pip install torch deepspeed ninja, or --peers none ({error})")

    # A SIGTERM ends the bench through its `finally`, which ends the worker.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    samples = {t: {} for t in threads}
    prefetch = None
    names = ["strata"] + systems
    version = None
    for r in range(args.rounds):
        for i in range(len(threads)):
            t = threads[(r + i) % len(threads)]
            # One worker at a time: its tensors and strata's, never those
            # of every thread count at once.
            peer = Worker(t, args, systems) if systems else None
            try:
                version = peer.version if peer else version
                for k in range(len(names)):
                    name = names[(r + k) % len(names)]
                    if name == "strata":
                        rates, prefetch = strata_round(args, t, r)
                        for key, value in rates.items():
                            samples[t].setdefault(key, []).append(value)
                    else:
                        rate = peer.run(name)
                        samples[t].setdefault(name, []).append((rate, rate * PEER_BYTES[name]))
            finally:
                if peer:
                    peer.close()
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    med = {t: {k: statistics.median(v[0] for v in vs) for k, vs in s.items()} for t, s in samples.items()}
    gbps = {t: {k: statistics.median(v[1] for v in vs) / 1e9 for k, vs in s.items()} for t, s in samples.items()}
    held = bars(med, threads)
    report = {
        "params": args.params,
        "threads": threads,
        "rounds": args.rounds,
        "lscpu": lscpu(),
        "params_per_s_median": med,
        "gb_per_s_per_thread": {t: {k: v / t for k, v in g.items()} for t, g in gbps.items()},
        "ratios": {k: v for k, (v, _) in held.items()},
        "bars_held": {k: v >= bar for k, (v, bar) in held.items()},
        "idle_ratios": idle_ratios(med),
        "torch": version,
        "strata_prefetch_elems": prefetch,
    }
    if args.plot:
        try:
            svg_chart(args.plot, med, threads)
        except OSError as error:
            print(f"could not write the chart {args.plot}: {error}", file=sys.stderr)
    if args.json:
        print(json.dumps(report))
    else:
        topo = report["lscpu"]
        print(f"{args.params} params, medians of {args.rounds} interleaved rounds, strata prefetching "
              f"{prefetch} elements ahead; " + ", ".join(f"{k}: {v}" for k, v in topo.items()))
        print(f"  {'system':<36}" + "".join(f"{t:>9}" for t in threads) + "   threads")
        for name in sorted({k for m in med.values() for k in m}):
            row = "".join(f"{med[t][name] / 1e9:9.3f}" if name in med[t] else f"{'-':>9}" for t in threads)
            print(f"  {name:<36}{row}   G params/s")
            row = "".join(f"{gbps[t][name] / t:9.2f}" if name in gbps[t] else f"{'-':>9}" for t in threads)
            print(f"  {'':<36}{row}   GB/s per thread")
        for k, (v, bar) in held.items():
            print(f"  {k:<36} {v:7.3f}x  (bar {bar}x: {'held' if v >= bar else 'MISSED'})")
        for k, v in report["idle_ratios"].items():
            print(f"  {k:<36} {v:7.3f}x")
    if args.check and not all(report["bars_held"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
