"""Cold compile time, regional vs full torch.compile, on a deeper tiny model (issue 5, point 3).

    .venv/bin/python scripts/compile_bench.py --layers 8 --rounds 2 --out docs/bench/compile-cpu.json

Each run is `python -m harness.train` on the default recipe with N decoder layers, packing, micro-batch 4 and 3 steps,
in its own process with an empty TORCHINDUCTOR_CACHE_DIR (nothing reused from an earlier compile); the modes
alternate within each round. Cold compile = dynamo + inductor seconds (forward and backward graphs) spent during the
first step, from report.json's `compile` section, which also shows that the compiled decoder blocks ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(mode: str, layers: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="compile-bench-") as tmp:
        out = Path(tmp, "run")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp, "inductor")), "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "harness.train", "--config", str(ROOT / "configs/default.yaml"),
               f"model.config.num_hidden_layers={layers}", f"train.compile={mode}", "data.packing=true",
               "train.micro_batch_size=4", "train.max_steps=3", f"train.output_dir={out}", "train.progress_bar=false",
               "data.eval_files=[]", "train.report_to=[]", "train.save_final=false", "train.resume=null"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        report = json.loads((out / "report.json").read_text())
        rep, startup = report["compile"], report["timings"]["startup_s"]
        return {"mode": mode, "load_1min": os.getloadavg()[0], "startup_s": startup,
                "process_start_to_first_step_end_s": startup + rep["first_step_s"], **rep}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON with every run and the medians")
    a = p.parse_args()
    runs = []
    for r in range(a.rounds):
        for mode in ("regional", "full"):
            res = one(mode, a.layers)
            runs.append(res)
            print(f"round {r + 1} {mode:8s}: cold compile {res['cold_compile_s']:.1f} s, first step "
                  f"{res['first_step_s']:.1f} s, graphs {res['graphs']}, compiled block calls "
                  f"{res['block_calls_compiled']} (eager {res['block_calls_eager']}), load {res['load_1min']:.1f}",
                  flush=True)
    med = {m: statistics.median(r["cold_compile_s"] for r in runs if r["mode"] == m) for m in ("regional", "full")}
    ratio = med["regional"] / med["full"]
    print(f"{a.layers} layers: regional {med['regional']:.1f} s, full {med['full']:.1f} s (medians of {a.rounds}); "
          f"regional / full = {ratio:.2f}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                           "layers": a.layers, "median_cold_compile_s": med, "ratio": ratio,
                                           "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
