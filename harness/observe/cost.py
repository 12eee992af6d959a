"""What a run costs: `train.price_per_hour` per machine or per GPU (`train.price_unit`), so far and projected.

Pure functions, no torch: the loop calls `run_cost` at every log line (progress line, metrics.jsonl) and at the end
(report.json["cost"]); the planner calls `plan_cost` for the plan and each adjustment it proposes.

    python -c "from harness.observe.cost import hourly_rate; print(hourly_rate(2.0, 'gpu', n_gpus=8))"   # 16.0

Amounts are in the currency of `train.price_per_hour` (no symbol is printed). With price_per_hour 0 (the default)
nothing is priced and these functions return None.
"""

from __future__ import annotations

import os
from typing import Optional


def hourly_rate(price_per_hour: float, price_unit: str, n_gpus: int, n_machines: int = 1) -> Optional[float]:
    """Price of one hour of the whole run: per machine x machines, or per GPU x GPUs. n_gpus is the number of
    devices the run uses (one process per GPU; on a CPU run, the processes). None when no price is set."""
    if not price_per_hour:
        return None
    if price_unit == "gpu":
        return price_per_hour * max(1, n_gpus)
    if price_unit == "machine":
        return price_per_hour * max(1, n_machines)
    raise ValueError(f"price_unit must be 'machine' or 'gpu', got {price_unit!r}")


def run_cost(elapsed_s: float, eta_s: Optional[float], price_per_hour: float, price_unit: str, n_gpus: int,
             n_machines: int = 1) -> Optional[dict]:
    """Cost so far after `elapsed_s` seconds of machine time, and projected for the whole run when `eta_s` (seconds
    still to go) is known: {"so_far", "projected", "rate_per_hour", "price_per_hour", "price_unit", "gpus",
    "machines"}. None when no price is set."""
    rate = hourly_rate(price_per_hour, price_unit, n_gpus, n_machines)
    if rate is None:
        return None
    so_far = rate * elapsed_s / 3600
    projected = so_far + rate * eta_s / 3600 if eta_s is not None else None
    return {"so_far": so_far, "projected": projected, "rate_per_hour": rate, "price_per_hour": price_per_hour,
            "price_unit": price_unit, "gpus": n_gpus, "machines": n_machines}


def plan_cost(hours: float, t, n_gpus: int, n_machines: int = 1) -> Optional[float]:
    """Cost of `hours` of wall time for a run with train section `t` (cfg.train: price_per_hour, price_unit) on
    `n_gpus` GPUs over `n_machines` machines; None when no price is set.

    For `harness plan`: call it with the plan's estimated hours, and again with each adjustment's hours, e.g.
    `plan_cost(3.5, cfg.train, n_gpus=8)` -> 3.5 * 8 * price for price_unit gpu, 3.5 * price for price_unit machine;
    `format_cost(plan_cost(...))` gives the printable amount ("" when None)."""
    rate = hourly_rate(t.price_per_hour, t.price_unit, n_gpus, n_machines)
    return None if rate is None else rate * hours


def format_cost(amount: Optional[float]) -> str:
    """2 decimals, or 4 below 1 (a CPU test run costs fractions of a cent); '' for None."""
    if amount is None:
        return ""
    return f"{amount:.2f}" if abs(amount) >= 1 else f"{amount:.4f}"


def progress_text(cost: Optional[dict]) -> str:
    """' cost 0.0123 (projected 0.0456)' for the console log line; '' when nothing is priced."""
    if not cost:
        return ""
    projected = f" (projected {format_cost(cost['projected'])})" if cost.get("projected") is not None else ""
    return f" cost {format_cost(cost['so_far'])}{projected}"


def of_run(t, world: int, elapsed_s: float, eta_s: Optional[float]) -> Optional[dict]:
    """`run_cost` for a run with train section `t` (cfg.train: price_per_hour, price_unit) on `world` processes (one
    per GPU); machines = world / processes per machine (LOCAL_WORLD_SIZE, set by the launcher; 1 machine without
    it)."""
    machines = max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", world) or world))
    return run_cost(elapsed_s, eta_s, t.price_per_hour, t.price_unit, world, machines)


def fields(cost: Optional[dict]) -> dict:
    """The metrics.jsonl fields: cost (so far) and cost_projected; {} when nothing is priced."""
    if not cost:
        return {}
    return {"cost": cost["so_far"], "cost_projected": cost["projected"]}
