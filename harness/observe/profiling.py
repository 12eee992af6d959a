"""`train.profile_steps`: torch.profiler over a few training steps once the run has settled.

Writes `<output_dir>/profile/` on the main process:
* `trace.json.gz`: the timeline (open it in https://ui.perfetto.dev or chrome://tracing);
* `ops.txt`: the operators that took the most time on the device (self time; on a CPU machine, CPU self time);
* `summary.json`: the window's wall time, device busy time, and device time by kind of kernel (matmul, attention,
  loss, optimizer, communication, other): where a step's time goes, and how much of it the device sat idle (on a
  CPU: the aten operators' own CPU time by kind).
The profiled steps start after the compile / warm-up steps (`timing.SETTLE_STEPS` + 5 after the loop starts); their
throughput is lower than the others' (the profiler's own cost), so the log lines in the window read low.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from harness.observe.timing import SETTLE_STEPS

START_AFTER = SETTLE_STEPS + 5  # steps done in this attempt before the window opens
KINDS = (  # first match wins; names lower-cased
    ("attention", ("flash", "fmha", "attention", "flex", "sdpa", "cudnn")),
    ("matmul", ("gemm", "matmul", "mm_", "sm90_xmma", "cutlass", "nvjet", "addmm", "bmm", "linear")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss", "logsumexp")),
    ("optimizer", ("adam", "foreach", "multi_tensor", "clip_grad")),
    ("communication", ("nccl", "allreduce", "all_reduce", "reduce_scatter", "allgather", "all_gather", "gloo")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, words in KINDS if any(w in low for w in words)), "other")


class StepProfiler:
    """Opens the profiler when `START_AFTER` steps of this attempt are done, closes it `steps` steps later and
    writes the files; decides for itself when it is due (`step_done` after every optimizer step)."""

    def __init__(self, steps: int, out: Path, start_step: int, active: bool, say: Callable[[str], None]):
        self.steps, self.dir, self.say = steps, out / "profile", say
        self.first = start_step + START_AFTER  # the window covers steps first+1 .. first+steps
        self.active = active and steps > 0
        self.prof: Optional[torch.profiler.profile] = None
        self.t0 = 0.0

    def step_done(self, step: int) -> None:
        if not self.active:
            return
        if step == self.first:
            cuda = torch.cuda.is_available()
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            self.prof = torch.profiler.profile(activities=acts)
            self._sync()
            self.prof.start()
            self.t0 = time.perf_counter()
        elif self.prof is not None and step == self.first + self.steps:
            self._sync()
            wall_us = (time.perf_counter() - self.t0) * 1e6
            self.prof.stop()
            self._write(wall_us)
            self.prof, self.active = None, False

    def close(self) -> None:
        """The run ended inside the window: drop it (a partial window would mislead)."""
        if self.prof is not None:
            self.prof.stop()
            self.prof = None

    @staticmethod
    def _sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _write(self, wall_us: float) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        cuda = torch.cuda.is_available()
        events = self.prof.key_averages()
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        (self.dir / "ops.txt").write_text(events.table(sort_by=sort, row_limit=40, max_name_column_width=90) + "\n")
        self.prof.export_chrome_trace(str(self.dir / "trace.json"))
        _gzip(self.dir / "trace.json")
        by_kind: dict[str, float] = {}
        for e in events:  # GPU: the kernels' device time; CPU: the aten operators' own CPU time
            if cuda:  # kernels only: not the annotations laid over them (Optimizer.step#AdamW.step, ProfilerStep#)
                kernel = e.device_type == torch.autograd.DeviceType.CUDA and "#" not in e.key
                t = e.self_device_time_total if kernel else 0.0
            else:
                t = e.self_cpu_time_total if e.key.startswith("aten::") else 0.0
            if t > 0:
                by_kind[kind_of(e.key)] = by_kind.get(kind_of(e.key), 0.0) + t
        busy = sum(by_kind.values())
        summary = {"steps": self.steps, "first_step": self.first + 1, "wall_ms_per_step": wall_us / self.steps / 1e3,
                   "device": torch.cuda.get_device_name() if cuda else "cpu",
                   "device_busy_ms_per_step": busy / self.steps / 1e3 if cuda else None,
                   "device_busy_share": busy / wall_us if cuda else None,
                   "device_ms_per_step_by_kind": {k: v / self.steps / 1e3 for k, v in
                                                  sorted(by_kind.items(), key=lambda kv: -kv[1])}}
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        share = f", device busy {100 * summary['device_busy_share']:.0f}% of it" if cuda else ""
        self.say(f"harness: profiled steps {self.first + 1}-{self.first + self.steps}: "
                 f"{summary['wall_ms_per_step']:.1f} ms a step{share}; {self.dir}/ops.txt, summary.json, trace.json.gz")


def _gzip(path: Path) -> None:
    import gzip
    import shutil

    with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
