"""Host time per decode step of the continuous engine with two stop strings against none, runs interleaved.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python scripts/rft_stop_bench.py --model /tmp/a52model \
        --json docs/bench/rft-stop-strings-interleaved-cpu.json

`harness rft bench` runs one configuration at a time; on a shared machine whose load drifts between two such runs
the host times are not comparable (docs/bench/rft-stop-strings-cpu.txt). Here one engine without stop strings and
one with two (`Question:`, `answer.`), 256 slots, sample the same questions (rft-tiny's task, --questions x 8
samples, 64 new tokens) in alternating rounds on one model; each round's `host_ms_per_step` (the engine's own work
outside the model calls: rows, readback, stop checks) is recorded, and the medians compared. Issue 52's bar: <= 1.25x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch


def main() -> None:
    from harness.config import load_config
    from harness.rft.contract import Sampling, encode
    from harness.rft.engine import ContinuousEngine
    from harness.rft.sampling import load_for_generation, prompt_text
    from harness.rft.tasks import build_task

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    r = load_config("configs/rft-tiny.yaml", ["rft.max_new_tokens=64"]).rft
    task = build_task(r)
    model, tok = load_for_generation(a.model, torch.device("cpu"))
    prompts = encode(tok, [prompt_text(task, q, tok) for q in task.split("train")[:a.questions]])  # ids in
    stops = ("Question:", "answer.")
    engines = {"none": ContinuousEngine(model, tok, 64, 256, say=lambda m: None),
               "two": ContinuousEngine(model, tok, 64, 256, stop_strings=stops, say=lambda m: None)}
    runs: dict = {k: [] for k in engines}
    for _ in range(a.rounds):
        for name, e in engines.items():
            e.stats = type(e.stats)()
            e.generate(prompts, 8, Sampling(1.0, 1.0, seed=0))
            st = e.stats
            runs[name].append({"host_ms_per_step": round(st.host_ms_per_step(), 3),
                               "model_ms_per_step": round(1000 * st.model_seconds / st.steps, 3),
                               "steps": st.steps, "tokens": st.tokens})
            print(name, runs[name][-1], flush=True)
    med = {k: statistics.median(x["host_ms_per_step"] for x in v) for k, v in runs.items()}
    out = {"runs": runs, "median_host_ms_per_step": med, "ratio": round(med["two"] / med["none"], 3), "bar": 1.25,
           "stop_strings": list(stops), "slots": 256, "questions": len(prompts), "samples": 8,
           "max_new_tokens": 64, "load_average": os.getloadavg(), "torch": torch.__version__,
           "command": f"OMP_NUM_THREADS=1 PYTHONPATH=$PWD python scripts/rft_stop_bench.py --model {a.model}"}
    print(f"host ms/step: none {med['none']:.3f}, two stop strings {med['two']:.3f}: {out['ratio']}x (bar <= 1.25x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
