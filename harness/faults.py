"""Fault injection for the end-to-end tests (issue 17: nothing lost under damage). Read from the environment once;
with neither variable set nothing here does anything.

    HARNESS_FAULT_NAN=3,5.1/1,*   the loss of optimizer step 3 (every micro-step, every process), of step 5's
                                  micro-step 1 on process 1 only, or of every step (*) is multiplied by NaN before
                                  its backward pass: a poisoned batch
    HARNESS_FAULT_DROP=3          the loop reads optimizer step 3's batches and trains on none of them (no forward,
                                  no backward, no update, no schedule step): the reference run for an update that is
                                  never applied
"""

from __future__ import annotations

import os
from typing import Optional


def _parse(spec: str) -> list[tuple[Optional[int], Optional[int], Optional[int]]]:
    """'3,5.1/1,*' -> [(3, None, None), (5, 1, 1), (None, None, None)]: (step, micro-step, rank), None = any."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, _, rank = item.partition("/")
        step, _, micro = where.partition(".")
        out.append((None if step == "*" else int(step), int(micro) if micro else None, int(rank) if rank else None))
    return out


_NAN = _parse(os.environ.get("HARNESS_FAULT_NAN", ""))
_DROP = {int(s) for s in os.environ.get("HARNESS_FAULT_DROP", "").split(",") if s.strip()}


def _matches(rule, step: int, micro: int, rank: int) -> bool:
    return all(want is None or want == have for want, have in zip(rule, (step, micro, rank)))


def poison(loss, step: int, micro: int, rank: int):
    """`loss`, or `loss * NaN` where HARNESS_FAULT_NAN names this (step, micro-step, process)."""
    if any(_matches(rule, step, micro, rank) for rule in _NAN):
        return loss * float("nan")
    return loss


def dropped(step: int) -> bool:
    """Whether HARNESS_FAULT_DROP names optimizer step `step` (1-based)."""
    return step in _DROP
