#!/usr/bin/env python3
"""A long loss curve of strata beside transformers + torch AdamW on real text.

Both train the same Llama of about 5M parameters (seq 128, 8 sequences a
step), initialized from one shared safetensors file (transformers'
`save_pretrained` of a seeded `LlamaForCausalLM`; strata reads it with
`--init-from`), on the same token file (Debian's `fortunes` through a
byte-level BPE of 8192 ids trained on it, tokenized by `strata bench
tokenize`), the same windows in the same order (`[data] order = "random"`,
replayed here with `strata_train::window_start`), the same learning rate at
every step (strata's warmup and cosine decay, read from its per-step
reports), AdamW betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on the
matrices and the embedding (not the norms, as strata), clipping at 1.0,
f32 on the CPU. strata keeps bf16 copies of the parameters for compute
(f32 masters), transformers computes with its f32 parameters: that is the
one difference in what they compute.

The bars (issue 50): at every 100th step the mean loss of the 10 steps
around it within 1% of each other; transformers' final loss (mean of the
last 50 steps) within the spread of three strata runs (data order seeds 1,
2 and 3, the first the one transformers replays). It writes a JSON record
(--out) and an SVG chart of both curves (--chart).

usage: python3 benches/convergence_vs_transformers.py --strata target/release/strata
       [--steps 1000] [--out docs/convergence.json] [--chart docs/convergence.svg]
       [--tiny]   (a few steps of a smaller model: the test of this script)

Needs torch and transformers (pinned: torch 2.15, transformers 5.24) and
tokenizers; not run in CI (torch is not installed there).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_vs_deepspeed import open_tokens, step_windows  # noqa: E402
from tokenize_vs_transformers import fortune_corpus, train_tokenizer  # noqa: E402

SEQ, BATCH = 128, 8
BETAS, EPS, WEIGHT_DECAY, CLIP = (0.9, 0.95), 1e-8, 0.1, 1.0
LR, LR_MIN, WARMUP = 1e-3, 1e-4, 100
SEEDS = (1, 2, 3)


def shape(a):
    if a.tiny:
        return dict(vocab=512, hidden=64, ffn=172, layers=2, heads=4)
    return dict(vocab=8192, hidden=256, ffn=688, layers=4, heads=4)


def make_model(a, directory):
    """The shared initial weights: a seeded LlamaForCausalLM, saved."""
    import torch
    import transformers

    s = shape(a)
    config = transformers.LlamaConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["heads"],
        max_position_embeddings=SEQ,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def strata_run(a, scratch, model_dir, tokens, seed):
    config = os.path.join(scratch, f"seed{seed}.toml")
    with open(config, "w") as f:
        f.write(
            "\n".join(
                [
                    "[model]",
                    f'init_from = "{model_dir}"',
                    f"seq = {SEQ}",
                    "[train]",
                    f"steps = {a.steps}",
                    f"micro_batch = {BATCH}",
                    f"seed = {seed}",
                    f"lr = {LR}",
                    f"lr_min = {LR_MIN}",
                    f"warmup_steps = {WARMUP if not a.tiny else 2}",
                    f"beta1 = {BETAS[0]}",
                    f"beta2 = {BETAS[1]}",
                    f"eps = {EPS}",
                    f"weight_decay = {WEIGHT_DECAY}",
                    f"clip_norm = {CLIP}",
                    'compute_dtype = "f32"',
                    "[device]",
                    'kind = "cpu"',
                    'budget = "2GiB"',
                    "[host]",
                    'budget = "2GiB"',
                    "[placement]",
                    'params = "device"',
                    'optimizer = "device"',
                    "[data]",
                    'order = "random"',
                ]
            )
            + "\n"
        )
    command = [a.strata, "train", "--config", config, "--tokens", tokens, "--json"]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=scratch, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    reports = summary["reports"]
    print(f"strata seed {seed}: {len(reports)} steps in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return [r["loss"] for r in reports], [r["lr"] for r in reports]


def torch_run(a, model_dir, tokens, lrs):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    model.train()
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": WEIGHT_DECAY},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lrs[0],
        betas=BETAS,
        eps=EPS,
    )
    losses = []
    started = time.perf_counter()
    for step in range(1, a.steps + 1):
        for group in opt.param_groups:
            group["lr"] = lrs[step - 1]
        (window,) = step_windows(tokens, SEEDS[0], step, BATCH, 1, SEQ)
        window = torch.tensor(window, dtype=torch.long)
        logits = model(input_ids=window[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    print(f"transformers: {a.steps} steps in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return losses


def around(losses, step, half=5):
    """The mean loss of the 10 steps around `step` (from 1)."""
    lo, hi = max(0, step - half), min(len(losses), step + half)
    return statistics.fmean(losses[lo:hi])


def svg_chart(path, curves, steps):
    """Both loss curves (a running mean of 10 steps), as an SVG."""
    width, height, pad = 720, 420, 50
    smooth = {
        name: [statistics.fmean(v[max(0, i - 9) : i + 1]) for i in range(len(v))]
        for name, v in curves.items()
    }
    lo = min(min(v) for v in smooth.values())
    hi = max(max(v) for v in smooth.values())
    x = lambda i: pad + (width - 2 * pad) * i / max(1, steps - 1)  # noqa: E731
    y = lambda v: height - pad - (height - 2 * pad) * (v - lo) / max(1e-9, hi - lo)  # noqa: E731
    colors = ["#1f77b4", "#d62728", "#9ecae1", "#c6dbef"]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
        f'<text x="{width / 2}" y="{height - 12}" text-anchor="middle">step</text>',
        f'<text x="14" y="{height / 2}" transform="rotate(-90 14 {height / 2})" text-anchor="middle">loss (mean of 10 steps)</text>',
    ]
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        parts.append(f'<text x="{pad - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for k in range(0, steps + 1, max(1, steps // 5)):
        parts.append(f'<text x="{x(max(0, k - 1)):.1f}" y="{height - pad + 16}" text-anchor="middle">{k}</text>')
    for n, (name, values) in enumerate(smooth.items()):
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(values))
        parts.append(f'<polyline fill="none" stroke="{colors[n % 4]}" stroke-width="1.5" points="{points}"/>')
        parts.append(f'<text x="{width - pad - 200}" y="{pad + 16 * n}" fill="{colors[n % 4]}">{name}</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strata", default="target/release/strata")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--out", help="write the JSON record here")
    p.add_argument("--chart", help="write the SVG chart here")
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args()
    if a.tiny:
        a.steps = min(a.steps, 6)
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as scratch:
        corpus = os.path.join(scratch, "fortunes.jsonl")
        documents = fortune_corpus(corpus)
        tokenizer = os.path.join(scratch, "tokenizer")
        train_tokenizer(corpus, tokenizer, shape(a)["vocab"])
        kept = os.path.join(scratch, "kept")
        command = [a.strata, "bench", "tokenize", "--data", corpus, "--tokenizer", tokenizer,
                   "--rounds", "1", "--json", "--keep", kept]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
        tokenized = json.loads(done.stdout.strip().splitlines()[-1])
        tokens_path = tokenized["token_file"]
        tokens = open_tokens(tokens_path)
        model_dir = os.path.join(scratch, "init")
        params = make_model(a, model_dir)
        runs = {seed: strata_run(a, scratch, model_dir, tokens_path, seed) for seed in SEEDS}
        lrs = runs[SEEDS[0]][1]
        reference = torch_run(a, model_dir, tokens, lrs)
    strata = runs[SEEDS[0]][0]
    every = 100 if not a.tiny else 2
    checks = []
    for step in range(every, a.steps + 1, every):
        s, t = around(strata, step), around(reference, step)
        checks.append({"step": step, "strata": s, "transformers": t, "relative": abs(s - t) / t})
    last = min(50, a.steps)
    finals = {seed: statistics.fmean(runs[seed][0][-last:]) for seed in SEEDS}
    final_ref = statistics.fmean(reference[-last:])
    spread = (min(finals.values()), max(finals.values()))
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "params": params,
        "shape": shape(a),
        "seq": SEQ,
        "batch": BATCH,
        "steps": a.steps,
        "documents": documents,
        "tokens": tokenized["tokens"],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "checks": checks,
        "worst_relative": max(c["relative"] for c in checks),
        "final_strata": finals,
        "final_transformers": final_ref,
        "final_within_spread": spread[0] <= final_ref <= spread[1],
        "losses": {"strata": {str(s): runs[s][0] for s in SEEDS}, "transformers": reference},
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f)
    if a.chart:
        svg_chart(
            a.chart,
            {
                "strata (seed 1)": strata,
                "transformers + torch AdamW": reference,
                "strata (seed 2)": runs[2][0],
                "strata (seed 3)": runs[3][0],
            },
            a.steps,
        )
    print(f"{params / 1e6:.2f}M parameters, {tokenized['tokens']} tokens, {a.steps} steps")
    print(f"{'step':>6} {'strata':>9} {'transformers':>13} {'relative':>9}")
    for c in checks:
        print(f"{c['step']:>6} {c['strata']:>9.4f} {c['transformers']:>13.4f} {c['relative']:>9.2%}")
    print(
        f"final (mean of the last {last}): transformers {final_ref:.4f}; strata "
        + ", ".join(f"seed {s} {v:.4f}" for s, v in finals.items())
        + f" -> {'within' if record['final_within_spread'] else 'outside'} strata's spread"
    )
    ok = record["worst_relative"] <= 0.01 and record["final_within_spread"]
    print(f"bars: every 100th step within 1%: {record['worst_relative']:.2%} worst; {'met' if ok else 'missed'}")
    return 0 if ok or a.tiny else 1


if __name__ == "__main__":
    sys.exit(main())
