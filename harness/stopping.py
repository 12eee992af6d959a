"""When a training attempt stops before its planned last step, and why.

    signal        SIGTERM/SIGINT (a preemptible machine going away): checkpoint, exit 0, resume later
    time_budget   train.time_budget_hours leaves room only for a last checkpoint and the final export
    stop_at_step  train.stop_at_step reached: checkpoint, exit 0 (planned pauses, tests)
    nonfinite     too many non-finite gradients in a row (train.max_nonfinite_skips): the last good state is saved
    write_failed  a metrics record could not be written (a full disk): a checkpoint where there is room, one line
    early_stopping  train.early_stopping.patience evaluations in a row did not improve on the best: checkpoint and
                  the final export (the run is finished)

A training process started by a launcher (accelerate launch, torchrun, deepspeed: LOCAL_RANK is set) watches the
launcher: torch's launcher starts its workers in process sessions of their own, so a `kill -9` of the launcher (or
of its process group) would leave them training unsupervised. `watch_launcher()` asks Linux to send SIGTERM when the
launcher dies (prctl PR_SET_PDEATHSIG), and every step also checks that the parent is still the launcher (any OS):
a dead launcher is a stop signal like SIGTERM (finish the step, agree, checkpoint, exit 0).

Every process must take the same decision at the same step, so the facts that can differ between processes (a
signal seen by one rank, each rank's clock) are agreed by one all-reduce per step (`StopDecision.agree`); the
decision itself is the pure function `stop_reason`.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

SIGNAL, TIME_BUDGET, STOP_AT_STEP, NONFINITE = "signal", "time_budget", "stop_at_step", "nonfinite"
WRITE_FAILED = "write_failed"  # metrics.jsonl could not be written (a full disk): checkpoint if possible, one line
EARLY_STOPPING = "early_stopping"  # the evaluations stopped improving (train.early_stopping): checkpoint, export
EARLY_WITHOUT_EXPORT = (SIGNAL, STOP_AT_STEP)  # the attempt ends with a checkpoint only; a later one continues


@dataclass(frozen=True)
class StopFlags:
    """The facts of one step that every process agrees on (the maximum over processes)."""

    signal: bool = False  # a stop signal was received
    save_due: bool = False  # train.save_every_minutes have passed since the last checkpoint
    window_closing: bool = False  # the time budget leaves room only for a last save and the export
    write_failed: bool = False  # the main process could not write a metrics record (a full disk)


def stop_reason(flags: StopFlags, step: int, stop_at: int, total_steps: int, nonfinite: bool,
                patience_spent: bool = False) -> Optional[str]:
    """Why the attempt stops after `step`, or None to go on (the planned last step ends the loop by itself). Early
    stopping comes before a signal: the run is finished, and a pause saved with the patience spent would resume
    for one more step."""
    if nonfinite:
        return NONFINITE
    if flags.write_failed:
        return WRITE_FAILED
    if patience_spent:
        return EARLY_STOPPING
    if flags.signal:
        return SIGNAL
    if flags.window_closing:
        return TIME_BUDGET
    if step == stop_at < total_steps:
        return STOP_AT_STEP
    return None


class BestMetric:
    """The run's evaluations ranked by one metric (train.early_stopping.metric, `higher`: its direction): the best
    value and its step, and `bad`, the evaluations since that did not beat it by more than `min_delta`. `patience`
    of them in a row (> 0) spend the patience: the run stops (train.early_stopping). Evaluations after step 0 count
    (the step-0 baseline is the untrained model). `saved`: LoopState.best, the state a checkpoint holds, so that a
    resumed run stops where the uninterrupted one would. Every process sees the same evaluation results (reduced
    over processes), so every process takes the same decision without a collective."""

    def __init__(self, metric: str, higher: bool, patience: int, min_delta: float, saved: Optional[dict] = None):
        self.metric, self.higher, self.patience, self.min_delta = metric, higher, patience, min_delta
        self.changed = [f"{k} {saved[k]} -> {now}" for k, now in (("metric", metric), ("patience", patience),
                                                                    ("min_delta", min_delta))
                        if saved and k in saved and saved[k] != now]  # said by the run (train.early_stopping.*)
        saved = saved if saved and saved.get("metric") == metric else {}
        self.value: Optional[float] = saved.get("value")
        self.step: Optional[int] = saved.get("step")
        self.bad: int = saved.get("bad", 0)

    def observe(self, step: int, results: dict) -> bool:
        """After the evaluation of `step`: whether it is the new best (the patience count starts again)."""
        value = results.get(self.metric)
        if step == 0 or value is None or not math.isfinite(value):
            return False
        gain = (value - self.value if self.higher else self.value - value) if self.value is not None else math.inf
        if gain > self.min_delta:
            self.value, self.step, self.bad = float(value), step, 0
            return True
        self.bad += 1
        return False

    @property
    def spent(self) -> bool:
        return self.patience > 0 and self.bad >= self.patience

    def state(self) -> dict:
        return {"metric": self.metric, "value": self.value, "step": self.step, "bad": self.bad,
                "patience": self.patience, "min_delta": self.min_delta}

    def describe(self) -> str:
        return (f"{self.metric} did not improve on {self.value:.4f} (step {self.step}) by more than {self.min_delta} "
                f"in {self.bad} evaluations")

    def report(self, best_dir) -> dict:
        """report.json's `best`: the metric, its best value and step, the evaluations since; `dir`: best/ (keep_best)."""
        kept = {k: v for k, v in self.state().items() if k not in ("patience", "min_delta")}
        return {**kept, "dir": str(best_dir) if best_dir is not None and self.step is not None else None}


class StopDecision:
    """The per-step stop decision of a run: signal handling, the time window, train.stop_at_step and the
    evaluations' patience (`best`: train.early_stopping, None without it)."""

    def __init__(self, accelerator, stop_at: int, total_steps: int, deadline: Optional[float],
                 best: Optional[BestMetric] = None):
        self.accelerator, self.stop_at, self.total_steps, self.deadline = accelerator, stop_at, total_steps, deadline
        self.best = best
        self.signals = StopSignals()
        if best is not None and best.changed and accelerator.is_main_process:  # a resume with other keys
            print(f"[harness] train.early_stopping changed since the checkpoint: {', '.join(best.changed)}; applied "
                  f"from here ({best.bad} evaluation(s) without improvement so far"
                  f"{', the patience is spent: the run stops now' if best.spent else ''})", flush=True)

    def agree(self, save_due: bool, step_s: float, save_cost_s: float, write_failed: bool = False) -> StopFlags:
        """This process's facts, agreed with every other process (collective). The window is closing when two
        more steps, two saves and 15 s would not fit before the deadline."""
        closing = self.deadline is not None and time.time() + 2 * step_s + 2 * save_cost_s + 15 >= self.deadline
        local = torch.tensor([self.signals.poll() is not None, save_due, closing, write_failed], dtype=torch.float32,
                             device=self.accelerator.device)
        return StopFlags(*(bool(v) for v in self.accelerator.reduce(local, "max").tolist()))

    def reason(self, flags: StopFlags, step: int, nonfinite: bool) -> Optional[str]:
        return stop_reason(flags, step, self.stop_at, self.total_steps, nonfinite, self.patience_spent())

    def patience_spent(self) -> bool:
        """train.early_stopping's patience is spent (also when a run resumes from the checkpoint of that step)."""
        return self.best is not None and self.best.spent

    def close(self) -> None:
        self.signals.restore()


def finite(grad_norm) -> bool:
    """Whether an optimizer step's gradient norm is finite (None: clipping was off, nothing to check)."""
    return grad_norm is None or math.isfinite(float(grad_norm))


class NonfiniteGuard:
    """Counts optimizer steps whose gradient norm (or, under DeepSpeed, loss) is not finite. Such a step's update is
    skipped (the loop does not apply it; under DeepSpeed no backward pass ran, or the engine skipped it itself) up to
    `max_skips` in a row. The run stops at once when DeepSpeed applied a non-finite update (`applied`: the state is
    bad) or when a skip left gradients accumulated in ZeRO's buffers (`stranded`: the state is good)."""

    def __init__(self, max_skips: int, is_deepspeed: bool, say: Callable[[str], None]):
        self.max_skips, self.is_deepspeed, self.say = max_skips, is_deepspeed, say
        self.in_a_row = 0
        self.applied = self.stranded = False

    def must_stop(self, step: int, grad_norm, skipped: bool, stranded: bool = False) -> bool:
        """After optimizer step `step`: warn about a non-finite one; True when the run must stop. A step with a
        finite norm is not counted, even where the optimizer skipped it (fp16 loss scaling)."""
        if finite(grad_norm) and not stranded:
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        self.applied, self.stranded = not skipped, stranded
        what = ("DeepSpeed already applied it" if self.applied else
                "update skipped; under DeepSpeed after accumulated micro-steps the run stops here" if stranded else
                f"update skipped ({self.in_a_row} in a row, at most {self.max_skips})")
        self.say(f"[harness] warning: step {step}: {'loss' if stranded else 'gradient norm'} is not finite "
                 f"({float(grad_norm)}); {what}")
        return self.applied or stranded or self.in_a_row > self.max_skips


_launcher_pid: Optional[int] = None  # the parent process that started this worker (watch_launcher)
# read at import, before harness.distributed.processes fills in LOCAL_RANK for a single-process DeepSpeed run
_UNDER_LAUNCHER = "LOCAL_RANK" in os.environ

PR_SET_PDEATHSIG = 1


def watch_launcher() -> Optional[int]:
    """In a process started by a launcher (LOCAL_RANK set by torchrun / accelerate launch / deepspeed): SIGTERM to
    this process when the launcher dies (Linux), and remember the launcher's pid for `launcher_gone`. Returns the
    launcher's pid, or None (not under a launcher)."""
    global _launcher_pid
    if not _UNDER_LAUNCHER or os.getppid() == 1:
        return None
    _launcher_pid = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the per-step parent check still works
            pass
        if os.getppid() != _launcher_pid:  # died before the prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return _launcher_pid


def launcher_gone() -> bool:
    """True when this process was started by a launcher that has since died (it has another parent now)."""
    return _launcher_pid is not None and os.getppid() != _launcher_pid


def exit_now(code: int) -> None:
    """End the process after a finished `main()`: the atexit handlers run and stdout/stderr are flushed, but the
    interpreter's teardown of torch, DeepSpeed and transformers (2-4 s measured on a loaded 2-core CPU box, in native
    code) is skipped, so a launcher and a stop signal's sender see the exit as soon as the checkpoint is written.
    Everything the run wrote is closed by then (the run's ExitStack)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


@contextlib.contextmanager
def stop_handlers(handler: Callable):
    """`handler` for SIGTERM and SIGINT inside, the previous handlers back after (the one handler swap: the loop's
    StopSignals, the set-up's lock, train.main). Outside the main thread (an embedding application) signals are left
    alone."""
    previous = swap_handlers(handler)
    try:
        yield
    finally:
        put_back(previous)


def swap_handlers(handler: Callable) -> dict:
    """Install `handler` for SIGTERM and SIGINT; returns the previous handlers, for `put_back`."""
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals alone
            pass
    return previous


def put_back(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


READ_STOP_S = 5.0  # a stop signal pending this long while a process still reads for its step ends the run there
_LIVE: list = []  # the StopSignals handling this process's loop


def stop_while_reading() -> None:
    """Called by a data stream that reads on without giving a row (records skipped for having no trained token): a
    stop signal pending READ_STOP_S or more ends the run there, as a signal outside the loop does (nothing was trained
    since the last checkpoint; the next attempt reads from its position again), instead of after a step that may
    never come."""
    for stop in _LIVE:
        if stop.received is not None and stop._clock() - stop.at >= READ_STOP_S:
            raise StoppedOutsideTheLoop(stop.received)


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
        self._orphan_said = False
        self._previous = {}
        self.install()

    def install(self) -> None:
        """Handle SIGTERM / SIGINT (again, after `restore`)."""
        self._previous = swap_handlers(self._handle)
        _LIVE[:] = [self]

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            if self._clock() - self.at < self.grace_s:
                return
            os._exit(128 + signum)
        self.received, self.at = signum, self._clock()
        print(f"[harness] signal {signum} received: finishing this step, then checkpoint and exit "
              f"(send it again to stop at once)", flush=True)

    def poll(self) -> Optional[int]:
        """The stop signal received, if any; a launcher that died counts as SIGTERM (also where no PDEATHSIG
        exists, or one was missed). (PR_SET_PDEATHSIG may fire twice, as the launcher's threads end: the grace
        period takes the second as the same request.)"""
        if launcher_gone() and not self._orphan_said:
            self._orphan_said = True
            print(f"[harness] the launcher (pid {_launcher_pid}) is gone: this process stops by itself after this "
                  f"step, with a checkpoint", flush=True)
            if self.received is None:
                self.received, self.at = signal.SIGTERM, self._clock()
        return self.received

    def restore(self) -> None:
        """Put the previous handlers back (idempotent)."""
        put_back(self._previous)
        self._previous = {}
        if self in _LIVE:
            _LIVE.remove(self)


class StoppedOutsideTheLoop(BaseException):
    """A stop signal during the set-up (before the loop's own handling, StopSignals, starts), the export after it, or
    while a step's data is still being read READ_STOP_S after it came (stop_while_reading):
    the run ends at once through its ExitStack (the output folder's lock released) with one line; what the last
    checkpoint holds is kept. (BaseException: no `except Exception` on the way takes it for an error.)"""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def stop_outside_the_loop(signum, frame):
    raise StoppedOutsideTheLoop(signum)
