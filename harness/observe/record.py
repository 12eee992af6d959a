"""`RunRecord`: facts about a run that only its report states (report.json, the log line's cost and utilisation), kept
apart from the objects the loop works with (`build.Job`). Built by harness/build.py; read only by harness/observe/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class RunRecord:
    t_start: float  # this process's run() start (time.time()): the report's wall time and cost count from it
    env: dict  # hardware.environment_report()
    tf32: bool
    sampler: Optional[Any]  # monitor.UtilisationSampler (GPU/CPU utilisation), None when off
    parameters: int = 0  # the model's parameters
    held: tuple = ()  # parameter elements held by each rank
    peak_flops: Optional[float] = None  # all processes together; None where unknown (CPU)
    resize: Optional[Any] = None  # checkpoint.layout.Resize: resumed under another layout (None: the same)
    resume_changes: Optional[dict] = None  # settings a resume took from the new config: {key: {from, to, ...}}
