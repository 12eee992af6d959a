"""The continuous engine's decode step against its cache width: does attention cost follow the filled width?

    PYTHONPATH=$PWD python scripts/rft_width_bench.py --json docs/bench/rft-width-cpu.json
    PYTHONPATH=$PWD python scripts/rft_width_bench.py --compile    # the compiled step (CUDA graphs on CUDA)

A random grouped-query llama (8 query heads on 1 key/value head) and one harness.rft.decode.SlotCache of S slots,
every slot filled with F tokens; the decode step (harness.rft.decode.Step, greedy) timed at cache widths 128 and 1024
with the width the engine attends over (`attend`: eager, the used columns rounded up to 32; compiled, the width
bucket of 64, 128, 256, ...) and, for contrast, over the whole width (what a step that ignores the filled part pays).
Issue 52's bar: width 1024 with 64 tokens filled costs <= 1.3x width 128. Medians of --steps steps (rounds of 4,
the cases interleaved), each after 3 warm-up steps.
Not a test: its output goes to docs/bench/ with the date, device and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def model_for(device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    c = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=1, max_position_embeddings=2048,
                    attn_implementation="sdpa")
    return LlamaForCausalLM(c).to(device).eval()


def time_step(step, cache, slots: int, attend: int, steps: int, device) -> float:
    """Median ms of a decode step over the first `slots` rows attending over `attend` columns."""
    cache.attend = attend
    times = []
    for k in range(steps + 3):
        cache.pos[:slots] = cache.pos[:slots] * 0 + FILLED  # the same filled position every step
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(cache, slots, False, None, None)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if k >= 3:
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


FILLED = 64


def main() -> None:
    from harness.rft.decode import SlotCache, Step, bucket_for, width_buckets

    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model_for(device)
    c = model.config
    step = Step(model, "cache", {"logits_to_keep": 1}, a.compile, print)
    rows, cases = [], []
    with torch.no_grad():
        for width in (128, 1024):
            cache = SlotCache(c.num_hidden_layers, a.slots, c.num_key_value_heads, width, c.head_dim, model.dtype,
                              device)
            cache.kv.normal_()
            used = FILLED + 1
            attend = bucket_for(used, width_buckets(width)) if a.compile else min(width, -(-used // 32) * 32)
            cases += [(width, cache, attend, []), (width, cache, width, [])]
        for _ in range(a.steps // 4):  # interleaved rounds: a shared machine's load drifts across all cases alike
            for width, cache, attend, times in cases:
                times.append(time_step(step, cache, a.slots, attend, 4, device))
        for k in (0, 2):
            (width, _, attend, fill), (_, _, _, whole) = cases[k], cases[k + 1]
            rows.append({"width": width, "filled": FILLED, "attend": attend,
                         "ms_per_step": round(statistics.median(fill), 3),
                         "ms_per_step_whole_width": round(statistics.median(whole), 3)})
            print(rows[-1], flush=True)
    ratio = rows[1]["ms_per_step"] / rows[0]["ms_per_step"]
    out = {"rows": rows, "ratio_1024_over_128": round(ratio, 3), "bar": 1.3, "compiled": a.compile,
           "slots": a.slots, "device": str(device), "torch": torch.__version__,
           "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
           "model": "llama, 2 layers, hidden 256, 8 query heads on 1 kv head, vocab 2048, fp32",
           "command": "PYTHONPATH=$PWD python scripts/rft_width_bench.py" + (" --compile" if a.compile else "")}
    print(f"width 1024 / width 128 with {FILLED} tokens filled: {ratio:.2f}x (bar <= 1.3x); over the whole width: "
          f"{rows[1]['ms_per_step_whole_width'] / rows[0]['ms_per_step_whole_width']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
