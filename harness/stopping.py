"""When a training attempt stops before its planned last step, and why.

    signal        SIGTERM/SIGINT (a preemptible machine going away): checkpoint, exit 0, resume later
    time_budget   train.time_budget_hours leaves room only for a last checkpoint and the final export
    stop_at_step  train.stop_at_step reached: checkpoint, exit 0 (planned pauses, tests)
    nonfinite     too many non-finite gradients in a row (train.max_nonfinite_skips): the last good state is saved

Every process must take the same decision at the same step, so the facts that can differ between processes (a
signal seen by one rank, each rank's clock) are agreed by one all-reduce per step (`StopDecision.agree`); the
decision itself is the pure function `stop_reason`.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

SIGNAL, TIME_BUDGET, STOP_AT_STEP, NONFINITE = "signal", "time_budget", "stop_at_step", "nonfinite"
EARLY_WITHOUT_EXPORT = (SIGNAL, STOP_AT_STEP)  # the attempt ends with a checkpoint only; a later one continues


@dataclass(frozen=True)
class StopFlags:
    """The facts of one step that every process agrees on (the maximum over processes)."""

    signal: bool = False  # a stop signal was received
    save_due: bool = False  # train.save_every_minutes have passed since the last checkpoint
    window_closing: bool = False  # the time budget leaves room only for a last save and the export


def stop_reason(flags: StopFlags, step: int, stop_at: int, total_steps: int, nonfinite: bool) -> Optional[str]:
    """Why the attempt stops after `step`, or None to go on (the planned last step ends the loop by itself)."""
    if nonfinite:
        return NONFINITE
    if flags.signal:
        return SIGNAL
    if flags.window_closing:
        return TIME_BUDGET
    if step == stop_at < total_steps:
        return STOP_AT_STEP
    return None


class StopDecision:
    """The per-step stop decision of a run: signal handling, the time window and train.stop_at_step."""

    def __init__(self, accelerator, stop_at: int, total_steps: int, deadline: Optional[float]):
        self.accelerator, self.stop_at, self.total_steps, self.deadline = accelerator, stop_at, total_steps, deadline
        self.signals = StopSignals()

    def agree(self, save_due: bool, step_s: float, save_cost_s: float) -> StopFlags:
        """This process's facts, agreed with every other process (collective). The window is closing when two
        more steps, two saves and 15 s would not fit before the deadline."""
        closing = self.deadline is not None and time.time() + 2 * step_s + 2 * save_cost_s + 15 >= self.deadline
        local = torch.tensor([self.signals.received is not None, save_due, closing], dtype=torch.float32,
                             device=self.accelerator.device)
        return StopFlags(*(bool(v) for v in self.accelerator.reduce(local, "max").tolist()))

    def reason(self, flags: StopFlags, step: int, nonfinite: bool) -> Optional[str]:
        return stop_reason(flags, step, self.stop_at, self.total_steps, nonfinite)

    def close(self) -> None:
        self.signals.restore()


class NonfiniteGuard:
    """Counts optimizer steps whose gradient norm is not finite. Outside DeepSpeed such a step is skipped (the loop
    does not apply it) up to `max_skips` in a row; DeepSpeed has applied it already, so the run stops at once."""

    def __init__(self, max_skips: int, is_deepspeed: bool, say: Callable[[str], None]):
        self.max_skips, self.is_deepspeed, self.say = max_skips, is_deepspeed, say
        self.in_a_row = 0

    def must_stop(self, step: int, grad_norm) -> bool:
        """After optimizer step `step`: warn about a non-finite gradient; True when the run must stop."""
        if grad_norm is None or math.isfinite(float(grad_norm)):
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        self.say(f"[harness] warning: step {step}: gradient norm is {float(grad_norm)}; "
                 + ("DeepSpeed already applied it" if self.is_deepspeed else
                    f"update skipped ({self.in_a_row} in a row, at most {self.max_skips})"))
        return self.is_deepspeed or self.in_a_row > self.max_skips


class StopSignals:
    """SIGTERM / SIGINT handling for preemptible machines. The first signal only sets a flag: the loop finishes the
    optimizer step in flight, every rank agrees (an all-reduce of the flag), a checkpoint is written and the process
    exits 0. A second signal stops at once (exit 128 + signal number), for a person who really means it; one that
    comes within `grace_s` of the first is the same request (launchers such as torchrun forward the SIGTERM they got
    to workers that already received it from the process group)."""

    def __init__(self, grace_s: float = 2.0) -> None:
        self._clock, self.grace_s = time.monotonic, grace_s
        self.received: Optional[int] = None
        self.at = 0.0
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. an embedding application): leave signals alone
                pass

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            if self._clock() - self.at < self.grace_s:
                return
            os._exit(128 + signum)
        self.received, self.at = signum, self._clock()
        print(f"[harness] signal {signum} received: finishing this step, then checkpoint and exit "
              f"(send it again to stop at once)", flush=True)

    def restore(self) -> None:
        """Put the previous handlers back (idempotent)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
