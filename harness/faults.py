"""Fault injection for the end-to-end tests (issue 17: nothing lost under damage). Read from the environment once;
with neither variable set nothing here does anything.

    HARNESS_FAULT_NAN=3,5.1/1,*   the loss of optimizer step 3 (every micro-step, every process), of step 5's
                                  micro-step 1 on process 1 only, or of every step (*) is multiplied by NaN before
                                  its backward pass: a poisoned batch
    HARNESS_FAULT_DROP=3          the loop reads optimizer step 3's batches and trains on none of them (no forward,
                                  no backward, no update, no schedule step): the reference run for an update that is
                                  never applied
    HARNESS_TRACE_ROWS=<folder>   every process appends to <folder>/rows-<rank>.jsonl, per optimizer step, a digest
                                  of each row it reads (non-padding tokens): which rows each step trained on, to be
                                  counted across attempts (tests/test_elastic.py)
    HARNESS_FAULT_SIGNAL_AT=lock  the process sends itself SIGTERM as soon as its run lock file exists, before the
                                  lock's holder is written (tests/test_runlock.py: a stop in that instant)
    HARNESS_FAULT_PAUSE=4         the loop waits (300 s) before it reads optimizer step 4's batches: a test's kill -9
                                  lands after the checkpoint of step 3 and before anything of step 4, however fast
                                  the steps are (tests/test_rl.py)
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
_TRACE = os.environ.get("HARNESS_TRACE_ROWS")
_SIGNAL_AT = os.environ.get("HARNESS_FAULT_SIGNAL_AT")
_PAUSE = {int(s) for s in os.environ.get("HARNESS_FAULT_PAUSE", "").split(",") if s.strip()}


def signal_at(place: str) -> None:
    """HARNESS_FAULT_SIGNAL_AT=place: SIGTERM to this process here."""
    if _SIGNAL_AT == place:
        import signal

        os.kill(os.getpid(), signal.SIGTERM)


def pause(step: int) -> None:
    """HARNESS_FAULT_PAUSE names optimizer step `step` (1-based): wait here, before the step reads its batches."""
    if step in _PAUSE:
        import time

        time.sleep(300)


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


def trace_rows(step: int, rank: int, batches: dict) -> None:
    """HARNESS_TRACE_ROWS: record the rows of optimizer step `step`'s micro-batches ({stream: [batch, ...]})."""
    if not _TRACE:
        return
    import hashlib
    import json
    from pathlib import Path

    def digests(batch) -> list[str]:
        part = batch["query"] if "query" in batch else batch
        mask = part.get("token_mask", part.get("attention_mask"))  # (token_mask: a stand-in has none, loaders.py)
        rows = part["input_ids"] if mask is None else [ids[m.bool()] for ids, m in zip(part["input_ids"], mask)
                                                       if m.any()]
        return [hashlib.sha1(ids.cpu().numpy().tobytes()).hexdigest()[:16] for ids in rows]

    line = {"step": step, **{n: [d for b in bs if b is not None for d in digests(b)] for n, bs in batches.items()}}
    with open(Path(_TRACE) / f"rows-{rank}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
