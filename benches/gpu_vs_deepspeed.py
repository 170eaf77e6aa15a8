#!/usr/bin/env python3
"""strata training on a GPU against DeepSpeed and PyTorch, side by side in
one run, on the same GPT shape, the same tokens and the same batch.

Peers (each in a worker process of its own, one after the other):
  strata-offload    strata train, [device] kind = "cuda", parameters and
                    optimizer states on the host (the CPU optimizer
                    overlapped with backward);
  strata-resident   strata train, parameters and optimizer states on the
                    device (fp32 states, updated there by the backend's
                    fused AdamW);
  ds-zero3-offload  DeepSpeed ZeRO-3, offload_param and offload_optimizer
                    on cpu (pinned);
  ds-zero2-offload  DeepSpeed ZeRO-2, offload_optimizer on cpu;
  ds-infinity       DeepSpeed ZeRO-3, offload_param and offload_optimizer
                    on nvme (--nvme, the disk strata's peers would use);
  torch             plain PyTorch, everything resident, fused AdamW, bf16
                    autocast.
Every peer trains the model strata trains (GPT-2 blocks: pre-LayerNorm,
GELU (tanh), tied embeddings, no dropout; transformers' GPT2LMHeadModel for
the Python peers), bf16 compute with fp32 master weights, AdamW, gradient
clipping at --max-grad-norm (1.0 by default; 0 turns clipping off for every
peer, so unclipped steps can be measured; --clip-all: a threshold every
step passes, so every step is clipped), micro-batch x accumulation
sequences per step. The tokens come
from one shared file of uint16 ids (--tokens, else a seeded one written
first); each step's windows are strata's random order
(`[data] order = "random"`, `strata_train::window_start`, replayed here), so all peers see the same sequences.

Each peer runs --warmup steps untimed (NVRTC compiles, cuBLASLt plans,
DeepSpeed's JIT ops, allocator warm-up), then --steps timed. Reported per
peer: seconds per step (median), tokens/s, model TFLOPS ((6 x params + 12 x
layers x hidden x seq) x tokens/s), the share of clipped steps, the last
loss, and the ratios the GPU issue sets as bars (strata-offload against
ds-zero3-offload and torch, strata-resident against torch). The DeepSpeed
configs are printed. A peer that fails (DeepSpeed's ZeRO-Infinity buffer
assertions, out of memory) is reported with the tail of its error.

Needs a GPU for every peer but torch and strata in --tiny mode; DeepSpeed
peers need deepspeed (a wheel; TORCH_CUDA_ARCH_LIST=9.0 on the H100 image)
and, for ds-infinity, libaio.

Usage: python3 benches/gpu_vs_deepspeed.py [--strata target/release/strata]
       [--hidden 4096 --heads 32 --layers 12 --seq 1024 --vocab 50304]
       [--micro-batch 8 --accumulation 4] [--steps 10 --warmup 3]
       [--peers strata-offload,strata-resident,ds-zero3-offload,...]
       [--nvme /mnt/nvme0/bench] [--max-grad-norm X | --clip-all]
       [--tokens FILE] [--json]
       [--tiny]   (a tiny model on whatever device there is, for the tests)
"""

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PEERS = [
    "strata-offload",
    "strata-resident",
    "ds-zero3-offload",
    "ds-zero2-offload",
    "ds-infinity",
    "torch",
]
M64 = (1 << 64) - 1
LR = 3e-4


def mix(seed, step, window):
    """strata's data mixer (train/src/engine/data.rs `mix`), in u64."""
    z = (
        seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + window * 0x94D049BB133111EB
    ) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def window_start(seed, step, window, length, seq):
    """`strata_train::window_start`: where window `window` of `step` starts."""
    return mix(seed, step, window) % (length - seq - 1)


def step_windows(tokens, seed, step, micro_batch, accumulation, seq):
    """Rank 0 of 1's windows for `step` (from 1), as strata reads them:
    per micro-batch, `micro_batch` lists of `seq + 1` token ids."""
    out = []
    for m in range(accumulation):
        rows = []
        for i in range(micro_batch):
            start = window_start(seed, step, m * micro_batch + i, len(tokens), seq)
            rows.append(list(tokens[start : start + seq + 1]))
        out.append(rows)
    return out


def open_tokens(path):
    """The token file's little-endian u16 ids, mapped."""
    import mmap

    if sys.byteorder != "little":
        raise RuntimeError("this replay reads little-endian token files on little-endian hosts")
    with open(path, "rb") as f:
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)).cast("H")


def params_count(a):
    h = a.hidden
    return a.vocab * h + a.seq * h + a.layers * (12 * h * h + 13 * h) + 2 * h


def flops_per_token(a):
    return 6 * params_count(a) + 12 * a.layers * a.hidden * a.seq


def clip_norm(a):
    """The norm every peer clips to; 0 is no clipping (strata's
    `train.clip_norm` and DeepSpeed's `gradient_clipping` both read 0 so;
    torch then skips `clip_grad_norm_`). --clip-all is a threshold every
    gradient norm passes: every step is clipped."""
    return 1e-6 if a.clip_all else a.max_grad_norm


def clipping(a):
    """How the peers clip, in words."""
    if a.clip_all:
        return "every step"
    return f"at {a.max_grad_norm}" if a.max_grad_norm > 0 else "off"


def clipped_share(a, norms):
    """The share of `norms` a peer clipped (none when clipping is off)."""
    if clip_norm(a) == 0:
        return 0.0
    return sum(1 for n in norms if n > clip_norm(a)) / max(1, len(norms))


def ds_config(peer, a):
    offload = {"device": "cpu", "pin_memory": True}
    zero = {
        "ds-zero3-offload": {
            "stage": 3,
            "offload_param": dict(offload),
            "offload_optimizer": dict(offload),
        },
        "ds-zero2-offload": {"stage": 2, "offload_optimizer": dict(offload)},
        "ds-infinity": {
            "stage": 3,
            "offload_param": {
                "device": "nvme",
                "nvme_path": a.nvme,
                "pin_memory": True,
                "buffer_count": 5,
                "buffer_size": max(int(1e8), a.vocab * a.hidden + 1),
            },
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": a.nvme,
                "pin_memory": True,
                "buffer_count": 4,
            },
        },
    }[peer]
    config = {
        "train_batch_size": a.micro_batch * a.accumulation,
        "train_micro_batch_size_per_gpu": a.micro_batch,
        "gradient_accumulation_steps": a.accumulation,
        "gradient_clipping": clip_norm(a),
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if peer == "ds-infinity":
        config["aio"] = {"block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 4}
    return config


def hf_model(a, torch):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=a.vocab,
        n_positions=a.seq,
        n_embd=a.hidden,
        n_layer=a.layers,
        n_head=a.heads,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(a.seed)
    return GPT2LMHeadModel(config)


def next_token_loss(model, window, torch):
    """Mean cross-entropy of every position's next token (strata's loss)."""
    inputs, targets = window[:, :-1], window[:, 1:]
    logits = model(input_ids=inputs).logits
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )


def timed_steps(a, step_fn, sync):
    """Runs warmup + steps steps; returns per-step seconds (timed ones),
    losses and gradient norms."""
    seconds, losses, norms = [], [], []
    for step in range(1, a.warmup + a.steps + 1):
        sync()
        started = time.perf_counter()
        loss, norm = step_fn(step)
        sync()
        if step > a.warmup:
            seconds.append(time.perf_counter() - started)
        losses.append(loss)
        norms.append(norm)
    return seconds, losses, norms


def worker_torch(a, tokens):
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = hf_model(a, torch).to(device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=cuda
    )
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step_fn(step):
        total = torch.zeros((), device=device)
        for window in step_windows(tokens, a.seed, step, a.micro_batch, a.accumulation, a.seq):
            window = torch.tensor(window, dtype=torch.long).to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = next_token_loss(model, window, torch) / a.accumulation
            loss.backward()
            total += loss.detach()
        if clip_norm(a) > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm(a)).item()
        else:
            norm = float("nan")  # not computed: an unclipped step reads no norm
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total.item(), norm

    return timed_steps(a, step_fn, sync)


def worker_deepspeed(peer, a, tokens):
    import torch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import deepspeed

    if not torch.cuda.is_available():
        raise RuntimeError("DeepSpeed's offload peers need a GPU")
    model = hf_model(a, torch)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(peer, a)
    )
    device = engine.device

    def step_fn(step):
        total = torch.zeros((), device=device)
        for window in step_windows(tokens, a.seed, step, a.micro_batch, a.accumulation, a.seq):
            window = torch.tensor(window, dtype=torch.long).to(device, non_blocking=True)
            loss = next_token_loss(engine, window, torch)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / a.accumulation
        norm = engine.get_global_grad_norm()
        return total.item(), float(norm) if norm is not None else float("nan")

    return timed_steps(a, step_fn, torch.cuda.synchronize)


# strata's pinned host pool: the offloaded peer's states, and for the
# resident one room to stage two of its largest tensor (the runtime keeps
# it: 5.05 GB at the 2.63B shape, whose 2 GiB was refused) and its few host
# tensors. A pool it does not use costs its start-up the time to commit and
# register it: 36 s for 100 GiB on an H200 host.
HOST_BUDGET_OFFLOAD = "100GiB"
HOST_BUDGET_RESIDENT = "16GiB"


def default_device_budget():
    """The first GPU's memory less 6 GiB (the CUDA context, cuBLASLt's
    workspace and the allocator's slack), or 70GiB when nvidia-smi cannot
    say (an 80 GB H100's share)."""
    # strata trains on device 0 of those CUDA_VISIBLE_DEVICES shows.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    select = ["-i", visible] if visible else []
    try:
        out = subprocess.run(["nvidia-smi", *select, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
        mib = int(out.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return "70GiB"
    return f"{max(mib - 6 * 1024, 1024)}MiB"


def strata_toml(peer, a, device_kind):
    params = "cpu" if peer == "strata-offload" else "device"
    lines = [
        "[model]",
        f"hidden = {a.hidden}",
        f"heads = {a.heads}",
        f"layers = {a.layers}",
        f"seq = {a.seq}",
        f"vocab = {a.vocab}",
        "[train]",
        f"steps = {a.warmup + a.steps}",
        f"micro_batch = {a.micro_batch}",
        f"grad_accumulation = {a.accumulation}",
        f"clip_norm = {clip_norm(a)}",
        f"seed = {a.seed}",
        f"lr = {LR}",
        "[device]",
        f'kind = "{device_kind}"',
        f'budget = "{a.device_budget}"',
        "[host]",
        f'budget = "{a.host_budget or (HOST_BUDGET_OFFLOAD if peer == "strata-offload" else HOST_BUDGET_RESIDENT)}"',
        "[placement]",
        f'params = "{params}"',
        f'optimizer = "{"cpu" if peer == "strata-offload" else "device"}"',
        # The order the peers replay (`window_start`), not the epoch order.
        "[data]",
        'order = "random"',
    ]
    return "\n".join(lines) + "\n"


def worker_strata(peer, a, tokens_path):
    device_kind = "auto" if a.tiny else "cuda"
    with tempfile.TemporaryDirectory() as scratch:
        config = os.path.join(scratch, "run.toml")
        with open(config, "w") as f:
            f.write(strata_toml(peer, a, device_kind))
        command = [
            a.strata,
            "train",
            "--config",
            config,
            "--tokens",
            tokens_path,
            "--token-dtype",
            "u16",
            "--json",
        ]
        run = subprocess.run(command, cwd=scratch, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{run.stderr[-3000:]}")
        summary = json.loads(run.stdout.strip().splitlines()[-1])
    reports = summary["reports"]
    seconds = [r["seconds"] for r in reports[a.warmup :]]
    losses = [r["loss"] for r in reports]
    norms = [r["grad_norm"] for r in reports]
    extra = {"recomputed_blocks": summary["recomputed_blocks"], "log_tail": run.stderr[-2000:]}
    # The optimizer over the timed steps (the CPU lane with offloaded
    # states, the device's inline updates with resident ones): its rate and
    # how long compute waited for it, medians.
    timed = reports[a.warmup :]
    lane = [r["optimizer_params_per_s"] for r in timed if r.get("optimizer_params_per_s", 0) > 0]
    if lane:
        extra["lane_params_per_s"] = statistics.median(lane)
        extra["optimizer_wait_s"] = statistics.median(r["optimizer_wait_s"] for r in timed)
    return seconds, losses, norms, extra


def worker(a):
    """One peer in this process; prints one JSON line."""
    peer = a.worker
    needs = {"torch": ["torch", "transformers"]}.get(peer, [])
    if peer.startswith("ds-"):
        needs = ["torch", "transformers", "deepspeed"]
    for module in needs:
        try:
            __import__(module)
        except ImportError as err:
            print(json.dumps({"peer": peer, "skipped": f"{module} is not installed ({err})"}))
            return
    if peer.startswith("ds-"):
        import torch

        if not torch.cuda.is_available():
            print(json.dumps({"peer": peer, "skipped": "DeepSpeed's offload needs a GPU"}))
            return
    tokens = open_tokens(a.tokens)
    extra = {}
    if peer.startswith("strata"):
        seconds, losses, norms, extra = worker_strata(peer, a, a.tokens)
    elif peer == "torch":
        seconds, losses, norms = worker_torch(a, tokens)
    else:
        seconds, losses, norms = worker_deepspeed(peer, a, tokens)
    timed_norms = norms[a.warmup :]
    print(
        json.dumps(
            {
                "peer": peer,
                "seconds": seconds,
                "losses": losses,
                "clipped": clipped_share(a, timed_norms),
                **extra,
            }
        )
    )


def write_tokens(path, a):
    """A seeded file of u16 ids below the vocabulary, long enough that the
    windows of a run rarely repeat."""
    import array
    import random

    if a.vocab > 1 << 16:
        raise SystemExit(f"--vocab {a.vocab}: a u16 token file holds ids below 65536")
    count = max(1 << 20, 64 * (a.warmup + a.steps) * a.micro_batch * a.accumulation * (a.seq + 1))
    rng = random.Random(a.seed)
    ids = array.array("H", (rng.randrange(a.vocab) for _ in range(count)))
    if sys.byteorder != "little":
        ids.byteswap()
    with open(path, "wb") as f:
        ids.tofile(f)


def run_peer(peer, a):
    command = [sys.executable, os.path.abspath(__file__), "--worker", peer] + a.passthrough
    started = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        tail = "\n".join(run.stderr.strip().splitlines()[-6:])
        return {"peer": peer, "error": tail or f"exit {run.returncode}"}
    lines = [l for l in run.stdout.splitlines() if l.startswith("{")]
    result = json.loads(lines[-1])
    result["wall_s"] = time.perf_counter() - started
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strata", default="target/release/strata")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--accumulation", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device-budget", default=None,
                   help="strata's device budget (default: the GPU's memory less 6 GiB, as nvidia-smi reports it; "
                        "70GiB where it cannot)")
    p.add_argument("--host-budget", default=None,
                   help=f"strata's pinned host pool (default: {HOST_BUDGET_OFFLOAD} offloaded, "
                        f"{HOST_BUDGET_RESIDENT} resident)")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--nvme", default=None)
    p.add_argument("--tokens", default=None)
    clip = p.add_mutually_exclusive_group()
    clip.add_argument("--max-grad-norm", type=float, default=1.0,
                      help="clip every peer's gradients to this global norm; 0 turns clipping off (default 1.0)")
    clip.add_argument("--clip-all", action="store_true",
                      help="clip at a norm every step passes (1e-6): every step is clipped")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.device_budget is None:
        a.device_budget = default_device_budget()
    if a.tiny:
        a.hidden, a.heads, a.layers, a.seq, a.vocab = 64, 2, 2, 32, 512
        a.micro_batch, a.accumulation, a.steps, a.warmup = 2, 2, 3, 1
        a.device_budget, a.host_budget = "64MiB", "64MiB"
    if not (a.max_grad_norm >= 0 and math.isfinite(a.max_grad_norm)):
        p.error(f"--max-grad-norm {a.max_grad_norm}: use 0 (no clipping) or a positive norm")
    if a.worker:
        return worker(a)
    peers = [x for x in a.peers.split(",") if x]
    unknown = [x for x in peers if x not in PEERS]
    if unknown:
        p.error(f"--peers {','.join(unknown)}: use some of {','.join(PEERS)}")
    if "ds-infinity" in peers and not a.nvme:
        p.error("ds-infinity needs --nvme DIR (the disk to swap to)")
    a.strata = os.path.abspath(a.strata)
    if any(x.startswith("strata") for x in peers) and not os.access(a.strata, os.X_OK):
        p.error(f"--strata {a.strata}: not an executable (cargo build --release)")
    scratch = tempfile.mkdtemp(prefix="gpu-vs-ds-")
    try:
        if not a.tokens:
            a.tokens = os.path.join(scratch, "tokens.u16")
            write_tokens(a.tokens, a)
        a.tokens = os.path.abspath(a.tokens)
        # The workers get this run's settings (the tiny ones reapply --tiny).
        a.passthrough = []
        for name, value in vars(a).items():
            flag = "--" + name.replace("_", "-")
            # (`is`: a value of 0 is passed on, not taken for False.)
            if name in ("worker", "peers", "json", "passthrough") or value is None or value is False:
                continue
            if name == "max_grad_norm" and a.clip_all:
                continue  # the two are exclusive; --clip-all says it
            a.passthrough += [flag] if value is True else [flag, str(value)]
        for peer in peers:
            if peer.startswith("ds-"):
                print(f"DeepSpeed config of {peer}: {json.dumps(ds_config(peer, a))}", file=sys.stderr)
        results = []
        for peer in peers:
            results.append(run_peer(peer, a))
            # Each peer's result as it comes (a run cut short keeps them).
            print(f"{peer}: {json.dumps(results[-1])}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tokens_per_step = a.micro_batch * a.accumulation * a.seq
    by_peer = {}
    for r in results:
        if "error" in r or "skipped" in r:
            continue
        median = statistics.median(r["seconds"])
        r["s_per_step"] = median
        r["tokens_per_s"] = tokens_per_step / median
        r["tflops"] = flops_per_token(a) * r["tokens_per_s"] / 1e12
        by_peer[r["peer"]] = r
    ratios = {}
    for name, x, y in [
        ("strata_offload_vs_ds_zero3_offload", "strata-offload", "ds-zero3-offload"),
        ("strata_offload_vs_torch", "strata-offload", "torch"),
        ("strata_resident_vs_torch", "strata-resident", "torch"),
    ]:
        if x in by_peer and y in by_peer:
            ratios[name] = by_peer[x]["tokens_per_s"] / by_peer[y]["tokens_per_s"]
    summary = {
        "shape": {
            "hidden": a.hidden,
            "heads": a.heads,
            "layers": a.layers,
            "seq": a.seq,
            "vocab": a.vocab,
            "params": params_count(a),
            "micro_batch": a.micro_batch,
            "accumulation": a.accumulation,
            "clip_all": a.clip_all,
            "max_grad_norm": clip_norm(a),
        },
        "peers": results,
        "ratios": ratios,
    }
    if a.json:
        print(json.dumps(summary))
        return
    print(
        f"GPT hidden {a.hidden}, {a.layers} layers, seq {a.seq}, vocab {a.vocab}: "
        f"{params_count(a) / 1e9:.2f}B params; {a.micro_batch} x {a.accumulation} sequences per step; "
        f"{a.steps} timed steps after {a.warmup}; clipping {clipping(a)}"
    )
    print(f"{'peer':<18} {'s/step':>8} {'tokens/s':>10} {'TFLOPS':>8} {'clipped':>8} {'last loss':>10}")
    for r in results:
        if "error" in r:
            print(f"{r['peer']:<18} failed: {r['error']}")
            continue
        if "skipped" in r:
            print(f"{r['peer']:<18} skipped: {r['skipped']}")
            continue
        recomputed = (
            f"  ({r['recomputed_blocks']} of {a.layers} blocks recompute)" if "recomputed_blocks" in r else ""
        )
        if "lane_params_per_s" in r:
            recomputed += (f"  (optimizer {r['lane_params_per_s'] / 1e9:.2f} G params/s, "
                           f"compute waited {r['optimizer_wait_s']:.3f} s a step for it)")
        print(
            f"{r['peer']:<18} {r['s_per_step']:>8.3f} {r['tokens_per_s']:>10.0f} "
            f"{r['tflops']:>8.1f} {r['clipped']:>8.0%} {r['losses'][-1]:>10.4f}{recomputed}"
        )
    # strata's offloaded step against torch: 0.8x on unclipped steps, 0.7x
    # where strata clipped any (a clipped step's update waits for the norm).
    offload_clipped = by_peer.get("strata-offload", {}).get("clipped", 0) > 0
    bars = {
        "strata_offload_vs_ds_zero3_offload": 2.0,
        "strata_offload_vs_torch": 0.7 if offload_clipped else 0.8,
        "strata_resident_vs_torch": 0.9,
    }
    for name, value in ratios.items():
        verdict = "held" if value >= bars[name] else "missed"
        print(f"{name}: {value:.3f}x (bar {bars[name]}x: {verdict})")


if __name__ == "__main__":
    main()
