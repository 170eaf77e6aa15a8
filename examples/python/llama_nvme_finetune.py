#!/usr/bin/env python3
"""Fine-tune a Hugging Face Llama on one device with strata.torch.AdamW:
the fp32 master weights and moments on NVMe, the model in bf16 only.

    python3 examples/python/llama_nvme_finetune.py --nvme /nvme/run1
    python3 examples/python/llama_nvme_finetune.py --nvme /nvme/run1 --model ~/models/Llama-3.2-1B

Without --model, a small Llama built from a config (no download) learns one
fixed batch of random tokens, so the loss must fall. With --model (a local
Hugging Face folder) its weights load in bf16 and train on random tokens of
its vocabulary: swap in your own data. The GPU is used when torch sees one
(each updated parameter is copied up before its module's next forward),
else the CPU. Each step's loss is printed (``--json``: one JSON object).
"""

import argparse
import json
import os
import sys
import time

import torch
import transformers

import strata.torch


def build(args, device):
    if args.model:
        net = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    else:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        )
        net = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    return net.to(device)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvme", required=True, help="a directory on the drive for the optimizer's states (must exist)")
    ap.add_argument("--model", help="a local Hugging Face folder (default: a small Llama from a config)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    net = build(args, device)
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    opt = strata.torch.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), states="nvme", nvme_path=args.nvme, verbose=not args.json,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, net.config.vocab_size, (args.batch, args.seq), generator=gen).to(device)
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        loss = net(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        if not args.json:
            print(f"step {step + 1:4d}  loss {losses[-1]:.4f}", flush=True)
    opt.synchronize()
    seconds = time.perf_counter() - start
    if args.json:
        json.dump({"device": str(device), "losses": losses, "seconds": seconds, "plan": opt.plan()}, sys.stdout)
        print()
    opt.close()


if __name__ == "__main__":
    main()
