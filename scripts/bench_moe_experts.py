"""transformers 5's experts implementations on a mixture-of-experts block, forward + backward: which is fastest here.

    python scripts/bench_moe_experts.py                      # configs/moe-tiny.yaml's shape and a wider one
    python scripts/bench_moe_experts.py --json docs/bench/moe-experts-cpu.json

Each implementation (eager: a loop over the experts hit; batched_mm: the chosen experts' weights gathered per token
and one batched matmul; grouped_mm: torch's grouped matmul over tokens sorted by expert) runs the same random-init
Qwen3-MoE causal LM (2 layers, every layer sparse) on the same batch: the loss's forward and backward, timed after
warm-up (median of the repeats). The losses are checked equal (float32, 1e-5 relative). Not a test: the figures go to
docs/bench/ with the date and device; model.experts_implementation=auto takes the CPU's fastest (harness/moe/router.py
CPU_EXPERTS) and grouped_mm on a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date

import torch
from transformers import AutoConfig, AutoModelForCausalLM

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
SHAPES = {  # name: (hidden, expert width, experts, top-k, batch rows, row length)
    "moe-tiny": (128, 128, 8, 2, 8, 128),
    "wider": (256, 128, 16, 4, 4, 128),
}


def time_one(impl: str, shape: tuple, repeats: int) -> tuple[float, float]:
    h, i, e, k, rows, length = shape
    conf = AutoConfig.for_model("qwen3_moe", vocab_size=1024, hidden_size=h, intermediate_size=2 * h,
                                moe_intermediate_size=i, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=h // 4, num_experts=e, num_experts_per_tok=k,
                                decoder_sparse_step=1, router_aux_loss_coef=0.02)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(conf, experts_implementation=impl)
    x = torch.randint(0, 1024, (rows, length), generator=torch.Generator().manual_seed(1))
    times, loss = [], None
    for n in range(repeats + 2):  # two warm-up passes
        start = time.perf_counter()
        out = model(x, labels=x, output_router_logits=True).loss
        out.backward()
        loss = out.item()
        if n >= 2:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times), loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    results = {"date": date.today().isoformat(), "device": platform.processor() or platform.machine(),
               "threads": torch.get_num_threads(), "torch": torch.__version__, "shapes": {}}
    for name, shape in SHAPES.items():
        row = {impl: time_one(impl, shape, args.repeats) for impl in IMPLEMENTATIONS}
        ref = row["eager"][1]
        for impl, (s, loss) in row.items():
            assert abs(loss - ref) <= 1e-5 * abs(ref), (name, impl, loss, ref)
            print(f"{name:9s} {impl:11s} {s * 1e3:8.1f} ms  loss {loss:.6f}")
        results["shapes"][name] = {"shape": dict(zip(("hidden", "expert_width", "experts", "top_k", "rows", "length"),
                                                     shape)), **{impl: s for impl, (s, _) in row.items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
