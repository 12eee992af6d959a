"""Compiled shapes for runs whose batches change shape (issue 30): eager against regional compile with dynamic
shapes (the default for such runs), dynamo's default (static first, dynamic after a size changes), padding up to
width buckets, and both.

    .venv/bin/python scripts/compile_shapes_bench.py --steps 100 --out docs/bench/compile-shapes-cpu.json
    .venv/bin/python scripts/compile_shapes_bench.py --steps 20 \
      --variants "eager,emb unbucketed dynamic,emb buckets static warmed" --out docs/bench/compile-buckets-cpu.json \
      data.packing=true   # issue 45

Each variant is `python -m harness.train` on configs/gritlm-tiny.yaml (the GritLM objective: generative rows,
queries and passages, each padded to its batch's longest) with 2 decoder layers, in its own process. `--cache cold`
gives every run an empty TORCHINDUCTOR_CACHE_DIR (a first run on a new box); `warm` runs each variant once to fill
its own cache and measures the second run (a rerun or a resume on the same box). Per run: training time (the loop,
evaluations excluded), steady seconds per step, tokens/s, the recompiles after step 1, graphs, whether dynamo's
recompile limit was hit, compile seconds, the padding share (padded positions / all positions) and the final loss.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {
    "eager": ["train.compile=none"],
    "dynamic (default)": ["train.compile=regional"],
    "dynamo default (static first)": ["train.compile=regional", "train.compile_dynamic=false"],
    "buckets (4) static first": ["train.compile=regional", "train.compile_dynamic=false", "data.pad_buckets=4"],
    "buckets (4) + dynamic": ["train.compile=regional", "data.pad_buckets=4"],
    # issue 45 (run with data.packing=true): embedding passes unbucketed with dynamic shapes, against fixed width
    # buckets compiled static and warmed before step 1 (the default under compile with packed rows)
    "emb unbucketed dynamic": ["train.compile=regional", "data.embed_length_buckets=0"],
    "emb buckets static warmed": ["train.compile=regional", "data.embed_length_buckets=auto"],
}


def one(name: str, steps: int, cache: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="shapes-bench-") as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        out = Path(tmp, "run")
        cmd = [sys.executable, "-m", "harness.train", "--config", str(ROOT / "configs/gritlm-tiny.yaml"),
               "model.config.num_hidden_layers=2", f"train.max_steps={steps}", f"train.output_dir={out}",
               "train.progress_bar=false", "train.report_to=[]", "train.summary=false", "train.save_final=false",
               *VARIANTS[name], *extra]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        rep = json.loads((out / "report.json").read_text())
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if "loss" in r]
        c = rep["compile"] or {}
        steady = rep["timings"]["steady_s_per_step"]
        return {"variant": name, "steps": rep["steps"], "train_time_s": rep["train_time_s"],
                "steady_s_per_step": steady, "tokens_per_s": rep["tokens_per_s"],
                "steady_tokens_per_s": rep["tokens"] / rep["steps"] / steady if steady else None,
                "recompiles_after_first_step": c.get("recompiles_after_first_step"), "graphs": c.get("graphs"),
                "recompile_limit_hit": c.get("recompile_limit_hit"), "compile_time_total_s": c.get("compile_time_total_s"),
                "compile_after_first_step_s": (c["compile_time_total_s"] - c["cold_compile_s"]) if c else None,
                "warmed_embedding_shapes": c.get("warmed_embedding_shapes"),
                "losses": [r["loss"] for r in train],
                "first_step_s": c.get("first_step_s"), "block_calls_eager": c.get("block_calls_eager"),
                "padding_share": sum(r["padding_share"] for r in train) / len(train), "final_loss": rep["final_loss"],
                "eval_s": rep["timings"]["eval_s"], "load_1min": os.getloadavg()[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--cache", choices=["cold", "warm"], default="cold")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names from: " + "; ".join(VARIANTS))
    p.add_argument("--out", default=None)
    p.add_argument("overrides", nargs="*", help="section.key=value for every run")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="shapes-cache-") as caches:
        for name in a.variants.split(","):
            cache = str(Path(caches, str(len(rows))))
            if a.cache == "warm":
                one(name, a.steps, cache, a.overrides)
            row = {**one(name, a.steps, cache, a.overrides), "cache": a.cache}
            rows.append(row)
            print(json.dumps(row), flush=True)
    eager = next((r for r in rows if r["variant"] == "eager"), None)
    for r in rows:
        if eager:
            r["train_time_vs_eager"] = r["train_time_s"] / eager["train_time_s"]
            r["steady_tokens_per_s_vs_eager"] = r["steady_tokens_per_s"] / eager["steady_tokens_per_s"]
        print(f"{r['variant']:32s} train {r['train_time_s']:6.1f} s ({r.get('train_time_vs_eager', 1):.2f}x eager), "
              f"steady {r['steady_s_per_step']:.3f} s/step ({r.get('steady_tokens_per_s_vs_eager', 1):.2f}x eager "
              f"tokens/s), recompiles after step 1 {r['recompiles_after_first_step']}, graphs {r['graphs']}, "
              f"padding {r['padding_share']:.3f}, loss {r['final_loss']:.4f}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                           "steps": a.steps, "cache": a.cache, "overrides": a.overrides,
                                           "runs": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
