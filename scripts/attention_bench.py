"""Attention kernels on packed rows: which kernel runs, and how fast, forward + backward.

    python scripts/attention_bench.py                 # the 1B recipe's shape (configs/gpu-1b.yaml), bf16, on a GPU
    python scripts/attention_bench.py --cpu-smoke     # the same code on a CPU, tiny shape (checks the script only)

Packed rows hold several documents; a token must attend only to earlier tokens of its own document. The ways to run
that, each timed on the same packed batch (document lengths drawn from a fixed seed, log-uniform 16..2048 tokens):
- sdpa_causal: one causal mask over the whole row (attends across documents: wrong for packing; the speed floor);
- sdpa_mask: a block-diagonal causal boolean mask, what transformers builds for sdpa from packed position_ids;
  also with each sdpa backend forced (efficient, cudnn, math), and the kernels the default call launched (profiler);
- flex: flex_attention with a document BlockMask (compiled; what model.attn_implementation=flex_attention runs);
- varlen: torch.nn.attention.varlen.varlen_attn over cu_seqlens (flash-attention's varlen kernel), where torch has it.
Each result is checked against the math kernel in float32 (relative error) and printed as a table; --json writes it.
Not a test: the figures go to docs/benchmarks.md with date and device.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def doc_lengths(rows: int, width: int, seed: int) -> list[list[int]]:
    """Per row, document lengths that fill it exactly (log-uniform 16..width, the last one cut to fit)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        left, row = width, []
        while left > 0:
            n = min(left, int(math.exp(rng.uniform(math.log(16), math.log(width)))))
            row.append(n)
            left -= n
        out.append(row)
    return out


def doc_ids(lengths: list[list[int]], device) -> torch.Tensor:
    """[rows, width]: each token's document index within its row."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths]).to(device)


def block_mask_bool(lengths: list[list[int]], width: int, device) -> torch.Tensor:
    doc = doc_ids(lengths, device)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    return (doc[:, :, None] == doc[:, None, :]) & causal  # [B, S, S]


def timed(fn, steps: int, cuda: bool) -> float:
    """Median milliseconds of fn() over `steps` calls after 3 warm-ups (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        print("attention_bench: no CUDA GPU here (--cpu-smoke checks the script on a CPU)", file=sys.stderr)
        return 2
    if args.cpu_smoke:
        args.rows, args.width, args.heads, args.kv_heads, args.head_dim, args.steps = 2, 128, 4, 2, 16, 2
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    B, S, H, KV, D = args.rows, args.width, args.heads, args.kv_heads, args.head_dim
    lengths = doc_lengths(B, S, seed=0)
    torch.manual_seed(0)
    q0 = torch.randn(B, H, S, D, device=dev, dtype=dtype)
    k0 = torch.randn(B, KV, S, D, device=dev, dtype=dtype)
    v0 = torch.randn(B, KV, S, D, device=dev, dtype=dtype)
    g0 = torch.randn(B, H, S, D, device=dev, dtype=dtype)
    mask = block_mask_bool(lengths, S, dev)[:, None]  # [B, 1, S, S]
    rep = H // KV

    def expand(k):  # GQA: every query head's own key/value head (what transformers' sdpa path does)
        return k.repeat_interleave(rep, dim=1)

    def sdpa_masked(q, k, v):
        return F.scaled_dot_product_attention(q, expand(k), expand(v), attn_mask=mask)

    def sdpa_causal(q, k, v):
        return F.scaled_dot_product_attention(q, expand(k), expand(v), is_causal=True)

    methods = {"sdpa_causal (crosses documents)": sdpa_causal, "sdpa_mask (default backend)": sdpa_masked}
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for name, backend in [("efficient", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("math", SDPBackend.MATH)]:
        def forced(q, k, v, backend=backend):
            with sdpa_kernel([backend]):
                return sdpa_masked(q, k, v)
        methods[f"sdpa_mask ({name} forced)"] = forced
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        doc = doc_ids(lengths, dev)

        def document_causal(b, h, qi, ki):
            return (doc[b, qi] == doc[b, ki]) & (qi >= ki)
        bm = create_block_mask(document_causal, B, None, S, S, device=dev)
        flex = torch.compile(flex_attention, dynamic=False)
        methods["flex (document BlockMask)"] = lambda q, k, v: flex(q, k, v, block_mask=bm, enable_gqa=True)
    except Exception as e:  # noqa: BLE001 - reported as a row
        methods["flex (document BlockMask)"] = e
    try:
        from torch.nn.attention.varlen import varlen_attn
        cu = torch.tensor([0] + list(torch.tensor([n for r in lengths for n in r]).cumsum(0)), device=dev,
                          dtype=torch.int32)
        longest = max(n for r in lengths for n in r)

        params = inspect.signature(varlen_attn).parameters  # the causal switch changed name between torch versions
        causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        gqa = "enable_gqa" in params

        def varlen(q, k, v):
            flat = lambda t: t.transpose(1, 2).reshape(B * S, t.shape[1], D)  # noqa: E731 [total, heads, dim]
            k, v = (k, v) if gqa else (expand(k), expand(v))
            out = varlen_attn(flat(q), flat(k), flat(v), cu, cu, longest, longest, **causal,
                              **({"enable_gqa": True} if gqa else {}))
            return out.reshape(B, S, H, D).transpose(1, 2)
        methods["varlen (flash varlen, cu_seqlens)"] = varlen
    except Exception as e:  # noqa: BLE001
        methods["varlen (flash varlen, cu_seqlens)"] = e

    ref = F.scaled_dot_product_attention(q0.float(), expand(k0.float()), expand(v0.float()), attn_mask=mask)
    rows = []
    for name, fn in methods.items():
        row = {"method": name}
        rows.append(row)
        if isinstance(fn, Exception):
            row["error"] = f"{type(fn).__name__}: {str(fn).splitlines()[0][:160]}"
            continue
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        try:
            out = fn(q, k, v)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            row["rel_err_vs_math_fp32"] = err

            def fwd_bwd():
                q.grad = k.grad = v.grad = None
                fn(q, k, v).backward(g0)
            row["fwd_ms"] = timed(lambda: fn(q, k, v), args.steps, cuda)
            row["fwd_bwd_ms"] = timed(fwd_bwd, args.steps, cuda)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    if cuda:  # which kernels the default sdpa call with a mask launches
        from torch.profiler import ProfilerActivity, profile
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            sdpa_masked(q, k, v).backward(g0)
            torch.cuda.synchronize()
        kernels = sorted({e.key for e in prof.key_averages() if any(w in e.key.lower() for w in
                          ("fmha", "flash", "attention", "cudnn", "efficient", "softmax", "bmm", "gemm"))})
        rows.append({"method": "kernels launched by sdpa_mask (default)", "kernels": [k[:120] for k in kernels]})
    docs = sum(len(r) for r in lengths)
    print(f"\nB={B} S={S} heads={H} kv_heads={KV} head_dim={D} {dtype} on {torch.cuda.get_device_name() if cuda else 'cpu'}"
          f"; {docs} documents in {B} rows (mean {B * S / docs:.0f} tokens)")
    print(f"{'method':<40}{'fwd ms':>9}{'fwd+bwd ms':>12}{'rel err':>10}")
    for r in rows:
        if "kernels" in r:
            print(f"{r['method']}:\n  " + "\n  ".join(r["kernels"]))
        elif "error" in r:
            print(f"{r['method']:<40} failed: {r['error']}")
        else:
            print(f"{r['method']:<40}{r['fwd_ms']:>9.3f}{r['fwd_bwd_ms']:>12.3f}{r['rel_err_vs_math_fp32']:>10.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": [B, S, H, KV, D], "dtype": str(dtype), "torch": torch.__version__,
                       "device": torch.cuda.get_device_name() if cuda else "cpu", "lengths": lengths, "rows": rows},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
