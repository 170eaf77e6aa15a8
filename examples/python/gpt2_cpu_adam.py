#!/usr/bin/env python3
"""A small GPT-2-style PyTorch training loop with ZeRO-Offload's CPU Adam.

Switching from DeepSpeed to strata is this one import (`--optimizer` only
picks which of the two lines runs, so both can be compared):

    from deepspeed.ops.adam import DeepSpeedCPUAdam           # DeepSpeed
    from strata.optim import CPUAdam as DeepSpeedCPUAdam      # strata

    python3 examples/python/gpt2_cpu_adam.py --optimizer strata
    python3 examples/python/gpt2_cpu_adam.py --compare        # both, losses side by side

Trains on the bytes of examples/data/tiers.txt, on the CPU, deterministic
(fixed seeds, one torch thread for the model), and prints each step's loss.
"""

import argparse
import json
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(d)
        self.c_attn = torch.nn.Linear(d, 3 * d)
        self.c_proj = torch.nn.Linear(d, d)
        self.ln_2 = torch.nn.LayerNorm(d)
        self.c_fc = torch.nn.Linear(d, 4 * d)
        self.mlp_proj = torch.nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt(torch.nn.Module):
    def __init__(self, vocab=256, seq=64, d=128, layers=2, heads=4):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Embedding(seq, d)
        self.h = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        torch.nn.init.normal_(self.wte.weight, std=0.02)
        torch.nn.init.normal_(self.wpe.weight, std=0.01)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()  # tied head


def train(optimizer_name, steps, seed=0, batch=8, seq=64, lr=1e-3):
    if optimizer_name == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    else:
        from strata.optim import CPUAdam as DeepSpeedCPUAdam

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    data = torch.tensor(list(open(os.path.join(HERE, "..", "data", "tiers.txt"), "rb").read()), dtype=torch.long)
    model = Gpt(seq=seq)
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq] for s in starts])
        y = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
        loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", choices=["strata", "deepspeed"], default="strata")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--compare", action="store_true", help="run both (each in its own process) and compare")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if not args.compare:
        losses = train(args.optimizer, args.steps)
        if args.json:
            print(json.dumps({"optimizer": args.optimizer, "losses": losses}))
        else:
            for i, loss in enumerate(losses, 1):
                print(f"step {i:4}  loss {loss:.6f}")
        return 0
    runs = {}
    for name in ("deepspeed", "strata"):
        out = subprocess.run([sys.executable, __file__, "--optimizer", name, "--steps", str(args.steps), "--json"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{name} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
            return 1
        runs[name] = json.loads(out.stdout.strip().splitlines()[-1])["losses"]
    gap = max(abs(a - b) for a, b in zip(runs["deepspeed"], runs["strata"]))
    result = {"steps": args.steps, "max_abs_loss_gap": gap, "first": {k: v[0] for k, v in runs.items()},
              "last": {k: v[-1] for k, v in runs.items()}, "within_1e-5": gap <= 1e-5}
    if args.json:
        print(json.dumps(result))
    else:
        for i, (a, b) in enumerate(zip(runs["deepspeed"], runs["strata"]), 1):
            print(f"step {i:4}  deepspeed {a:.7f}  strata {b:.7f}  gap {abs(a - b):.1e}")
        print(f"largest gap over {args.steps} steps: {gap:.2e} ({'within' if gap <= 1e-5 else 'NOT within'} 1e-5)")
    return 0 if math.isfinite(gap) else 1


if __name__ == "__main__":
    sys.exit(main())
