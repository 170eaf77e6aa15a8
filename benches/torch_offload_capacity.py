#!/usr/bin/env python3
"""Capacity: a Hugging Face Llama larger than FSDP2 + torch AdamW fits in
this machine's memory trains under FSDP2 on CPU ranks (gloo) with
strata.torch.AdamW's states on NVMe, then saves one checkpoint through
torch.distributed.checkpoint (the states streamed: read one tensor at a
time from the drive).

The model is built on the meta device, sharded by ``fully_shard`` (each
decoder layer, the embedding, the norm with the head, then the root),
then materialized: each rank only ever
holds its shard of the bf16 compute copies, one or two layers unsharded,
its bf16 gradient shard, and strata's staging buffers. The fp32 masters
and moments are on the drive. Each rank reports its peak resident set
(VmHWM, pinned buffers included) after the checkpoint; the report gives
their sum, the disk the states and the checkpoint took, and what FSDP2 +
torch.optim.AdamW would need for the same model by arithmetic (fp32
sharded parameters, fp32 gradients and two fp32 moments: 16 bytes a
parameter, before activations and unsharded layers).

    python3 benches/torch_offload_capacity.py [--params 2B] [--ranks 2]
        [--steps 3] [--seq 128] [--moments bf16] [--dir DIR] [--keep]
        [--json] [--tiny]

``--dir`` is where the states and the checkpoint go (default a new
directory under the current one; removed afterwards unless ``--keep``).
``--tiny`` runs a small model in seconds (the tests' mode). The ranks run
with ``MALLOC_MMAP_THRESHOLD_=1048576`` unless it is set (see ``main``).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

# Shapes by size: hidden, intermediate, layers, heads (Llama's ratios,
# Llama 2's 32,000-token vocabulary, untied embeddings).
SHAPES = {
    "tiny": (64, 176, 2, 4, 512),
    "1B": (2048, 5632, 22, 16, 32000),
    "2B": (2560, 6912, 24, 20, 32000),
    "3B": (3200, 8640, 26, 25, 32000),
}


def config(size, seq):
    from transformers import LlamaConfig

    hidden, inter, layers, heads, vocab = SHAPES[size]
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=max(seq, 128),
        tie_word_embeddings=False,
    )


def vm_bytes(key="VmHWM"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key} line")


def du_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    import strata.torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(args.size, args.seq)
    started = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    # Each decoder layer, the embedding, and the final norm with the head
    # are groups of their own (torchtitan's wrapping), so that no more than
    # one or two of them are unsharded at once; the root holds the rest.
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.model.embed_tokens)
    fully_shard([model.model.norm, model.lm_head])
    fully_shard(model)
    model.to_empty(device="cpu")
    model.model.rotary_emb = LlamaRotaryEmbedding(cfg)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1 + rank)
        for name, p in model.named_parameters():
            local = p.to_local()
            if "norm" in name:
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02, generator=gen)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    states_dir = os.path.join(args.dir, "states", f"rank-{rank}")
    os.makedirs(states_dir, exist_ok=True)
    opt = strata.torch.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-4,
        states="nvme",
        nvme_path=states_dir,
        moments=args.moments,
        threads=1,
        staging=2,
        verbose=rank == 0,
    )
    built_s = time.perf_counter() - started
    phases = {"built": vm_bytes()}
    gen = torch.Generator().manual_seed(100 + rank)
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        ids = torch.randint(0, cfg.vocab_size, (1, args.seq), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        phases.setdefault("backward", vm_bytes())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        steps.append({"loss": total.item() / world, "s": time.perf_counter() - t0})
    phases["steps"] = vm_bytes()
    t0 = time.perf_counter()
    ckpt = os.path.join(args.dir, "ckpt")
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)
    save_s = time.perf_counter() - t0
    # The swap files go when the optimizer closes: measured before.
    states_bytes = du_bytes(states_dir)
    opt.close()
    report = {
        "rank": rank,
        "params": params,
        "local_params": sum(p.to_local().numel() for p in model.parameters()),
        "build_s": built_s,
        "steps": steps,
        "save_s": save_s,
        "vm_hwm_bytes": vm_bytes(),
        "vm_hwm_bytes_after": phases,
        "states_bytes": states_bytes,
    }
    with open(os.path.join(args.dir, f"report-{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="2B", choices=[k for k in SHAPES if k != "tiny"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--moments", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--dir")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    size = "tiny" if args.tiny else args.params
    base = args.dir or tempfile.mkdtemp(prefix="capacity-", dir=os.getcwd())
    os.makedirs(base, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
        os.path.abspath(__file__), "--worker", "--size", size, "--dir", base, "--steps", str(args.steps),
        "--seq", str(args.seq), "--moments", args.moments,
    ]
    # glibc's malloc raises its mmap threshold as large blocks are freed,
    # after which FSDP2's per-layer buffers come from the heap and stay
    # there (each rank's peak 1-3 GiB higher); a fixed 1 MiB threshold
    # returns every large tensor to the OS when it is freed.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    started = time.perf_counter()
    try:
        # The ranks' output goes to stderr: stdout is the report's.
        run = subprocess.run(cmd, env=env, stdout=sys.stderr)
        ranks = []
        for rank in range(args.ranks):
            path = os.path.join(base, f"report-{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks.append(json.load(f))
        if run.returncode != 0 or len(ranks) != args.ranks:
            raise SystemExit(f"the ranks failed (exit {run.returncode}, {len(ranks)} of {args.ranks} reported)")
        ckpt_bytes = du_bytes(os.path.join(base, "ckpt"))
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    params = ranks[0]["params"]
    hwm = sum(r["vm_hwm_bytes"] for r in ranks)
    states_bytes = sum(r["states_bytes"] for r in ranks)
    gib = 1 << 30
    report = {
        "model": f"LlamaForCausalLM {size} ({params / 1e9:.3f}B parameters, bf16 compute copies)",
        "ranks": args.ranks,
        "seq": args.seq,
        "moments": args.moments,
        "steps": [r["steps"] for r in ranks][0],
        "build_s": max(r["build_s"] for r in ranks),
        "save_s": max(r["save_s"] for r in ranks),
        "vm_hwm_gib_per_rank": [round(r["vm_hwm_bytes"] / gib, 3) for r in ranks],
        "vm_hwm_gib_sum": round(hwm / gib, 3),
        "vm_hwm_gib_sum_after": {
            phase: round(sum(r["vm_hwm_bytes_after"][phase] for r in ranks) / gib, 3)
            for phase in ranks[0]["vm_hwm_bytes_after"]
        },
        "states_on_disk_gib": round(states_bytes / gib, 3),
        "checkpoint_on_disk_gib": round(ckpt_bytes / gib, 3),
        "fsdp2_torch_adamw_gib": round(params * 16 / gib, 3),
        "fsdp2_torch_adamw_accounting": "fp32 sharded parameters + fp32 gradients + exp_avg + exp_avg_sq, "
        "16 bytes a parameter over all ranks, before activations and unsharded layers",
        "wall_s": time.perf_counter() - started,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
