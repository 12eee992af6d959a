"""Where a training attempt's wall time goes, and the time window it must fit in.

`Timings` (report.json `timings`; `harness plan` calibrates from it) and `BudgetTracker` (train.time_budget_hours:
elapsed, remaining, ETA and on-track on every log line) are filled by the loop; the planner reads them.
`plan_vs_actual`: report.json's `plan`, the estimate of the plan.json that `harness plan` wrote for this config
(`config_fingerprint`) against the run's wall time.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from harness.config import Config

# Steps after which a run's pace is taken as steady: the first ones carry compilation and the allocator's and caches'
# first touches. The planner's calibration times the steps after these; report.json `timings.warmup_*` name them
# (not the learning-rate warm-up, optim.warmup_steps).
SETTLE_STEPS = 5


def fmt_s(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.1f} s"
    h, rem = divmod(int(round(seconds)), 3600)
    return f"{h} h {rem // 60:02d} min" if h else f"{rem // 60} min {rem % 60:02d} s"





@dataclass
class Timings:
    """Where a training attempt's wall time went (report.json `timings`; calibration reads these)."""

    startup_s: float = 0.0  # process start -> first step, without the step-0 evaluation
    eval_s: float = 0.0
    evals: int = 0
    save_s: float = 0.0
    saves: int = 0
    optimizer_s: float = 0.0  # clip + optimizer step + zero_grad, summed
    eval_before_loop_s: float = 0.0  # the step-0 evaluation (before the loop's clock starts)
    warmup_done_s: Optional[float] = None  # loop time (without evaluations and saves) after SETTLE_STEPS steps
    steady_s_per_step: Optional[float] = None
    warmup_extra_s: float = 0.0
    export_s: float = 0.0  # after the loop: final export and report, without the final evaluation
    process_wall_s: float = 0.0

    def loop_started(self, t_process: float) -> None:
        self.eval_before_loop_s = self.eval_s
        self.startup_s = time.time() - t_process - self.eval_s

    def add(self, what: str, seconds: float) -> None:
        setattr(self, f"{what}_s", getattr(self, f"{what}_s") + seconds)
        setattr(self, f"{what}s", getattr(self, f"{what}s") + 1)

    def loop(self, compute: float, steps: int) -> None:
        """Steady seconds per step after the warm-up steps, and what the warm-up steps cost beyond that (compute: the
        training clock's seconds on steps, metrics.Throughput.trained)."""
        if self.warmup_done_s is not None and steps > SETTLE_STEPS:
            self.steady_s_per_step = (compute - self.warmup_done_s) / (steps - SETTLE_STEPS)
            self.warmup_extra_s = max(0.0, self.warmup_done_s - SETTLE_STEPS * self.steady_s_per_step)
        elif steps:
            self.steady_s_per_step = compute / steps

    def as_dict(self) -> dict:
        return asdict(self)


class BudgetTracker:
    """train.time_budget_hours: the window counts from the process start; elapsed, remaining, ETA of the planned
    steps at the current pace, and whether they finish in the window with room for the final save and export."""

    def __init__(self, t_process: float, hours: float, reserve_s: float = 60.0):
        self.t0, self.budget_s, self.reserve_s = t_process, hours * 3600, reserve_s
        self.deadline = t_process + self.budget_s

    def status(self, steps_done: int, steps_left: int, loop_s: float, now: Optional[float] = None) -> dict:
        elapsed = (now or time.time()) - self.t0
        eta = loop_s / steps_done * steps_left if steps_done else None
        remaining = self.budget_s - elapsed
        return {"budget_elapsed_s": elapsed, "budget_remaining_s": remaining, "eta_s": eta,
                "on_track": None if eta is None else int(eta + self.reserve_s <= remaining)}

    @staticmethod
    def short(r: dict) -> str:
        return f"{fmt_s(r['budget_remaining_s'])} left" + ("" if r["on_track"] is None else
                                                         " ok" if r["on_track"] else " SHORT")

    @staticmethod
    def describe(r: dict) -> str:
        eta = "?" if r["eta_s"] is None else fmt_s(r["eta_s"])
        track = {None: "", 1: ", on track", 0: ", NOT on track: will stop at the window with a checkpoint"}
        return (f"window: {fmt_s(r['budget_elapsed_s'])} elapsed, {fmt_s(r['budget_remaining_s'])} left, "
                f"ETA {eta}{track[r['on_track']]}")

    def summary(self, used_s: float, stopped: bool) -> dict:
        return {"hours": self.budget_s / 3600, "used_s": used_s, "left_s": self.budget_s - used_s,
                "stopped_by_budget": stopped}


# ----------------------------------------------------------------------------------------------- plan vs actual


def config_fingerprint(cfg: Config) -> str:
    """What a plan was made for: the resolved config, without the keys that do not change the run's speed."""
    d = cfg.to_dict()
    for key in ("output_dir", "resume", "progress_bar", "time_budget_hours", "stop_at_step"):
        d["train"].pop(key, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def plan_vs_actual(plan_path: Path, mine: str, actual_s: float) -> Optional[dict]:
    """The plan's estimate against this run's wall time (report.json `plan`), when `harness plan` wrote one; `mine`:
    this run's `config_fingerprint`."""
    try:
        plan = json.loads(Path(plan_path).read_text())
        est = float(plan["estimated_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    chosen, which = plan.get("estimate", {}), "plan"
    for a in plan.get("adjustments", []):
        if a.get("fingerprint") == mine:  # this run applied one of the plan's adjustments
            chosen, est = a["estimate"], float(a["estimate"]["total_s"])
            which = "adjustment " + " ".join(f"{k}={v}" for k, v in a["overrides"].items())
    return {"path": str(plan_path), "estimate_of": which, "estimated_s": est, "actual_s": actual_s,
            "error_pct": 100 * (est - actual_s) / actual_s, "accuracy": 1 - abs(est - actual_s) / actual_s,
            "same_config": mine in (plan.get("fingerprint"), chosen.get("fingerprint"))
            or any(a.get("fingerprint") == mine for a in plan.get("adjustments", [])),
            "phases": {k: v for k, v in chosen.items() if k.endswith("_s")}}
