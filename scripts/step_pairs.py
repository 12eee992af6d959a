"""The step time of the harness, the raw loop and the HF Trainer, step by step on the same batches (issue 56).

    python scripts/step_pairs.py --rounds 3 --json docs/bench/step-pairs-cpu.json      # about 6 minutes on 2 cores

`harness bench` times each contender over steps W+1..W+N as a whole. On a shared 2-core VM one contender's whole
run can be 10-30% slower than the same code's next run (docs/bench/step-56-cpu.txt), so three rounds of totals
cannot tell 2% apart. Every contender trains the same batches in the same order (the bench's seeded sampler), and a
step's time depends mostly on its batch's padded width: the ratio of the harness's step k to the raw loop's step k
in the same round is a paired comparison, and its median over the N steps leaves out the bursts where the machine
was busy elsewhere.

One clock for all three: each contender runs in its own process (as `harness bench` starts it, with its forced
overrides: no packing, no compile, no evaluation or checkpoints) with `torch.optim.lr_scheduler.LambdaLR.step`
timed, which each of them calls once after every optimizer step (the harness's schedule, the raw loop's, and the one
handed to the Trainer). Step k's time is the time between the calls after steps k-1 and k. The harness logs every
step here (train.log_every=1: on a CPU its log line costs no measurable time, docs/bench/step-56-cpu.txt part 3).

CPU only: on a GPU the calls come when the host enqueues the step, not when it ends. Not a test: the figures go to
docs/bench/ with the date and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from harness.tools.bench import _child_env, describe_device, forced_overrides  # as `harness bench` starts a run

ROOT = Path(__file__).resolve().parents[1]
CONTENDERS = ("raw", "trainer", "harness")


def child(kind: str, config: str, warmup: int, steps: int, threads: int, marks_out: str) -> None:
    """Run one contender in this process with the scheduler's step timed; the marks go to `marks_out`."""
    import atexit

    import torch

    marks: list[float] = []
    step = torch.optim.lr_scheduler.LambdaLR.step

    def timed(self, *a, **k):
        marks.append(time.perf_counter())
        return step(self, *a, **k)

    torch.optim.lr_scheduler.LambdaLR.step = timed
    atexit.register(lambda: Path(marks_out).write_text(json.dumps(marks)))
    extra = forced_overrides(warmup, steps, plain=True)
    if kind == "harness":
        out = tempfile.mkdtemp(prefix="step-pairs-")
        sys.argv = ["harness.train", "--config", config, *extra, "train.log_every=1", f"train.output_dir={out}"]
        runpy.run_module("harness.train", run_name="__main__")
    else:
        sys.argv = ["harness.tools.bench", "--worker", kind, config, *extra, "--steps", str(steps), "--warmup",
                    str(warmup), "--threads", str(threads)]
        try:
            runpy.run_module("harness.tools.bench", run_name="__main__")
        except SystemExit as e:
            if e.code:
                raise


def run(kind: str, a) -> list[float]:
    """Step k's seconds for k = W+1..W+N of one contender's run."""
    with tempfile.TemporaryDirectory() as tmp:
        marks_out = os.path.join(tmp, "marks.json")
        cmd = [sys.executable, __file__, "--child", kind, "--config", a.config, "--warmup", str(a.warmup),
               "--steps", str(a.steps), "--threads", str(a.threads), "--marks-out", marks_out]
        proc = subprocess.run(cmd, cwd=ROOT, env=_child_env(a.threads), capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{kind} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        marks = json.loads(Path(marks_out).read_text())
    marks = marks[-(a.steps + 1):]  # the calls after steps W..W+N (each contender's last step is W+N)
    return [b - x for x, b in zip(marks, marks[1:])]


def summarise(rounds: list[dict]) -> dict:
    out: dict = {}
    for other in ("raw", "trainer"):
        paired = [statistics.median(h / o for h, o in zip(r["harness"], r[other])) for r in rounds]
        totals = [sum(r["harness"]) / sum(r[other]) for r in rounds]
        out[f"harness_over_{other}"] = {"paired_step_median_by_round": [round(x, 4) for x in paired],
                                        "paired_step_median": round(statistics.median(paired), 4),
                                        "total_by_round": [round(x, 4) for x in totals],
                                        "total_median": round(statistics.median(totals), 4)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--marks-out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.child, a.config, a.warmup, a.steps, a.threads, a.marks_out)
    rounds = []
    for k in range(a.rounds):
        r = {}
        for kind in CONTENDERS:
            load = os.getloadavg()[0]
            r[kind] = run(kind, a)
            print(f"round {k + 1}/{a.rounds} {kind}: {1e3 * statistics.median(r[kind]):.1f} ms median step, "
                  f"{1e3 * sum(r[kind]) / a.steps:.1f} ms mean (load average {load:.1f} before)", flush=True)
        rounds.append(r)
    summary = summarise(rounds)
    for other in ("raw", "trainer"):
        s = summary[f"harness_over_{other}"]
        print(f"harness / {other} step time: paired per-step median {s['paired_step_median']:.3f} "
              f"(rounds {s['paired_step_median_by_round']}), totals {s['total_median']:.3f} "
              f"(rounds {s['total_by_round']})")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": describe_device(a.threads),
            "command": "python scripts/step_pairs.py " + " ".join(sys.argv[1:]),
            "settings": {"config": a.config, "warmup": a.warmup, "steps": a.steps, "threads": a.threads},
            "summary": summary,
            "rounds_ms": [{k: [round(1e3 * x, 2) for x in v] for k, v in r.items()} for r in rounds]},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
