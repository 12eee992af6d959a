"""`harness plan`'s pure arithmetic (harness/tools/planner.py): evaluations and saves in a schedule, the time estimate
from a calibration, the padded positions and work of an epoch, and the largest schedule that fits a window.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Optional

from harness.errors import HarnessError
from harness.data.samples import pack_rows
from harness.observe.metrics import flops_per_token


# ----------------------------------------------------------------------------------------------- pure arithmetic


def count_evals(total_steps: int, eval_every: int, eval_at_start: bool, has_eval: bool) -> int:
    """Evaluations the loop runs: step 0 (fresh run), every eval_every steps before the last, and the last."""
    if not has_eval:
        return 0
    periodic = (total_steps - 1) // eval_every if eval_every else 0
    return int(eval_at_start) + periodic + 1


def count_saves(total_steps: int, save_every_steps: int, train_s: float, save_every_minutes: float) -> int:
    """Checkpoints written: on the step schedule, by the clock (approximately, every save_every_minutes), and the
    last step's when the schedule does not land on it (a finished run checkpoints its end, harness/train.py)."""
    by_steps = total_steps // save_every_steps if save_every_steps else 0
    by_clock = int(train_s // (60 * save_every_minutes)) if save_every_minutes > 0 else 0
    last = 0 if save_every_steps and total_steps % save_every_steps == 0 else 1
    return by_steps + by_clock + last


@dataclass
class Calibration:
    """Measured costs of this config on this hardware (seconds)."""

    s_per_step: float  # steady state, per optimizer step
    warmup_extra_s: float  # the first steps' time beyond s_per_step each (compilation, warm-up)
    startup_s: float  # process start -> first step (imports, data, model, prepare, resume)
    eval_s: float  # one evaluation
    save_s: float  # one checkpoint
    export_s: float  # final export and report
    optimizer_s_per_step: float  # clip + optimizer step + zero_grad, part of s_per_step
    world_size: int = 1
    source: str = ""
    # loss.mode=rl: a generation batch's seconds (part of s_per_step: gen_s_per_batch / steps_per_generation a step),
    # every steps_per_generation (rl.iterations) steps; and the training passes' seconds per step (part of s_per_step)
    gen_s_per_batch: float = 0.0
    steps_per_generation: int = 1
    rl_train_s_per_step: float = 0.0


def estimate(steps: int, cal: Calibration, evals: int, save_every_steps: int = 0, save_every_minutes: float = 0.0,
             work_ratio: float = 1.0, opt_steps_ratio: float = 1.0) -> dict:
    """Seconds per phase and in total for a run of `steps` optimizer steps.

    work_ratio scales the compute per step (another max_len or packing); opt_steps_ratio scales the optimizer cost
    per step (unchanged unless accumulation changes what a step holds). loss.mode=rl: the steps without generation,
    plus ceil(steps / rl.iterations) generation batches (the first step of each makes one)."""
    gen_share = cal.gen_s_per_batch / cal.steps_per_generation
    compute = cal.s_per_step - cal.optimizer_s_per_step - gen_share
    per_step = compute * work_ratio + cal.optimizer_s_per_step * opt_steps_ratio
    generations = math.ceil(steps / cal.steps_per_generation) if cal.gen_s_per_batch else 0
    train = steps * per_step + generations * cal.gen_s_per_batch
    saves = count_saves(steps, save_every_steps, train, save_every_minutes)
    phases = {
        "startup_s": cal.startup_s,
        "warmup_extra_s": cal.warmup_extra_s,
        "train_s": train,
        "eval_s": evals * cal.eval_s,
        "checkpoint_s": saves * cal.save_s,
        "export_s": cal.export_s,
    }
    return {"steps": steps, "s_per_step": per_step, "optimizer_s_per_step": cal.optimizer_s_per_step * opt_steps_ratio,
            "generations": generations, "generation_s": generations * cal.gen_s_per_batch, "evals": evals, "checkpoints": saves, **phases, "total_s": sum(phases.values())}


def padded_positions(lengths: list[int], micro_batch: int, seed: int) -> int:
    """Token positions processed in one epoch without packing: each shuffled micro-batch is padded to its longest
    sample (the loop's collator). The shuffle is seeded; the count barely depends on the order."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    return sum(max(lengths[i] for i in order[k:k + micro_batch]) * len(order[k:k + micro_batch])
               for k in range(0, len(order), micro_batch))


def epoch_work(lengths: list[int], max_len: int, packing: bool, micro_batch: int, seed: int,
               flop_dims: tuple[int, int, int]) -> dict:
    """Items (samples or packed rows), processed positions and model FLOPs of one epoch of generative data whose
    full sample lengths are `lengths`, truncated to max_len. flop_dims = (matmul params, layers, hidden)."""
    cut = [min(n, max_len) for n in lengths]
    if packing:
        rows = pack_rows(cut, max_len)
        items, positions, width = len(rows), len(rows) * max_len, max_len
    else:
        items = len(cut)
        positions = padded_positions(cut, micro_batch, seed)
        width = max(1, positions // max(1, math.ceil(items / micro_batch) * micro_batch))  # mean padded width
    n, layers, hidden = flop_dims
    return {"items": items, "positions": positions, "tokens": sum(cut),
            "flops": positions * flops_per_token(n, layers, hidden, width)}


def fits(total_s: float, window_s: float) -> bool:
    return total_s <= window_s


def largest_fitting(lo: int, hi: int, total_for: Callable[[int], float], window_s: float) -> Optional[int]:
    """The largest integer x in [lo, hi] with total_for(x) <= window_s (total_for grows with x); None if not even lo
    fits. Bisection."""
    if total_for(lo) > window_s:
        return None
    if total_for(hi) <= window_s:
        return hi
    while hi - lo > 1:  # total_for(lo) fits, total_for(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total_for(mid) <= window_s else (lo, mid)
    return lo


def steady_rate(records: list[dict], settle: int) -> tuple[float, float]:
    """(steady seconds per step after `settle`, extra seconds of the first `settle` steps) from metrics records
    that carry step and elapsed_s; elapsed_s at step `settle` and at the last record."""
    timed = {r["step"]: r["elapsed_s"] for r in records if "elapsed_s" in r and "loss" in r}
    last = max(timed)
    if settle not in timed or last <= settle:
        raise HarnessError(f"calibration logged steps {sorted(timed)}: need step {settle} and a later one")
    s = (timed[last] - timed[settle]) / (last - settle)
    return s, max(0.0, timed[settle] - settle * s)
