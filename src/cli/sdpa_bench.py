# torch's scaled_dot_product_attention on the shapes `strata bench kernels`
# measures, run beside strata's kernels by that command (it passes this
# file to `python3 -c` with one JSON argument). Prints one JSON object:
# {"torch": version, "results": [{"attention": i, "op": "attention_forward"
# | "attention_backward", "seconds": median}]},
# or {"error": why} with exit status 3 where torch cannot run them.
#
# The input: {"device": "cuda" | "cpu", "ordinal": n, "dtype": "bf16" |
# "f32", "rounds": r, "round_ms": ms, "attentions": [{"batch", "seq",
# "heads", "kv_heads", "head_dim", "documents": len | null}]}.
#
# Each attention is causal; grouped-query heads go through
# `enable_gqa=True` (K and V not repeated), packed documents through a
# block-diagonal causal boolean mask (SDPA has no position ids; the mask
# takes its memory-efficient or math kernel). Forward: one SDPA call.
# Backward: torch.autograd.grad of the output against q, k and v with a
# fixed upstream gradient, the graph kept. Calls are sized so a round takes
# round_ms; rounds alternate the ops; the median per call is reported.
import json
import sys
import time


def main():
    spec = json.loads(sys.argv[1])
    try:
        import torch
        import torch.nn.functional as F
    except Exception as err:  # noqa: BLE001 - any import failure means no peer
        print(json.dumps({"error": f"torch is not importable: {err}"}))
        sys.exit(3)
    cuda = spec["device"] == "cuda"
    if cuda and not torch.cuda.is_available():
        print(json.dumps({"error": "torch sees no CUDA device"}))
        sys.exit(3)
    device = torch.device(f"cuda:{spec['ordinal']}" if cuda else "cpu")
    dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    generator = torch.Generator(device="cpu").manual_seed(0)

    def tensor(*shape):
        x = torch.rand(*shape, generator=generator) * 4.0 - 2.0
        return x.to(device=device, dtype=dtype).requires_grad_(True)

    def timed(calls, op):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            op()
        sync()
        return time.perf_counter() - start

    ops = []
    for i, a in enumerate(spec["attentions"]):
        b, s, h, kv, d = a["batch"], a["seq"], a["heads"], a["kv_heads"], a["head_dim"]
        q, k, v = tensor(b, h, s, d), tensor(b, kv, s, d), tensor(b, kv, s, d)
        mask = None
        if a["documents"]:
            place = torch.arange(s, device=device)
            document = place // a["documents"]
            mask = (document[:, None] == document[None, :]) & (place[:, None] >= place[None, :])

        def forward(q=q, k=k, v=v, mask=mask):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=kv != h
            )

        out = forward()
        dout = torch.rand(out.shape, generator=generator).to(device=device, dtype=dtype)

        def backward(out=out, dout=dout, q=q, k=k, v=v):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        def forward_only(forward=forward):
            with torch.no_grad():
                forward()

        ops.append((i, "attention_forward", forward_only))
        ops.append((i, "attention_backward", backward))

    least = max(spec["round_ms"], 1) / 1e3
    calls = []
    for _, _, op in ops:
        once = min(timed(1, op), timed(1, op))
        calls.append(max(1, min(1_000_000, int(-(-least // max(once, 1e-6))))))
    samples = [[] for _ in ops]
    for _ in range(max(spec["rounds"], 1)):
        for j, (_, _, op) in enumerate(ops):
            samples[j].append(timed(calls[j], op) / calls[j])
    results = []
    for (i, name, _), times in zip(ops, samples):
        times.sort()
        results.append({"attention": i, "op": name, "seconds": times[len(times) // 2]})
    print(json.dumps({"torch": torch.__version__, "results": results}))


main()
