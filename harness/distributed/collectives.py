"""The collectives every part of the run calls, with or without an Accelerator (accelerator=None: tests, tools, one
process): `on_main` (a function run on the main process, its result or its one-line error on every process),
`agreed` (a function run on every process, the error of any raised on all),
`main_first` (a block run by the main process first, then by the others, its error raised on every process),
`broadcast`, `all_gather`, `spread` (work divided by size). They know nothing of the run's config.

Under several processes the main process reads the folders and decides, and the others receive what it found (a shared
filesystem is assumed, as for accelerate's own checkpoints).
"""

from __future__ import annotations

import contextlib
from typing import Callable

from harness.errors import HarnessError, one_line


def num_processes(accelerator) -> int:
    return 1 if accelerator is None else accelerator.num_processes


def is_main(accelerator) -> bool:
    return accelerator is None or accelerator.is_main_process


def broadcast(accelerator, obj):
    if num_processes(accelerator) == 1:
        return obj
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([obj], from_process=0)[0]


def all_gather(accelerator, obj) -> list:
    if num_processes(accelerator) == 1:
        return [obj]
    from accelerate.utils import gather_object

    return gather_object([obj])


def on_main(accelerator, fn: Callable):
    """fn() on the main process only; every process returns its result or raises the HarnessError it raised (one
    broadcast), so an error there never leaves the other processes waiting in a collective. Any other exception keeps
    its traceback on the main process; the others stop with a one-line error."""
    outcome = None
    if is_main(accelerator):
        try:
            outcome = ("ok", fn())
        except HarnessError as e:
            outcome = ("error", type(e), str(e))
        except Exception as e:
            broadcast(accelerator, ("bug", one_line(e)))
            raise
    return _received(broadcast(accelerator, outcome))[1]


def agreed(accelerator, fn: Callable):
    """fn() on every process; a HarnessError raised on any process is raised on every one (one all-gather of the
    outcomes; the lowest rank's), so that the main process prints it (config/preflight.py's `report`) instead of the
    others dying in their next collective with gloo's `Connection closed by peer` traceback."""
    result, error = None, None
    try:
        result = fn()
    except HarnessError as e:
        error = (type(e), str(e))
    errors = [e for e in all_gather(accelerator, error) if e is not None]
    if errors:
        raise errors[0][0](errors[0][1])
    return result


@contextlib.contextmanager
def main_first(accelerator):
    """The block runs on the main process first (it validates the data and writes the caches), then on the others
    (which read them): accelerate's `main_process_first`, except that an error in the main process's block is raised
    on every process (one broadcast) instead of leaving the others waiting at a barrier the main process never
    reaches (they died there with gloo's `Connection closed by peer` traceback). The others do not run the block
    then: a HarnessError is printed once, by the main process (config/preflight.py's `report`); any other exception
    keeps its traceback on the main process, the others stop with a one-line error."""
    if num_processes(accelerator) == 1:
        yield
        return
    if is_main(accelerator):
        try:
            yield
        except HarnessError as e:
            broadcast(accelerator, ("error", type(e), str(e)))
            raise
        except Exception as e:
            broadcast(accelerator, ("bug", one_line(e)))
            raise
        broadcast(accelerator, ("ok",))
        return
    _received(broadcast(accelerator, None))
    yield


def _received(outcome: tuple) -> tuple:
    """The main process's outcome on every process: ("ok", ...) returned; its HarnessError raised again here; any
    other exception (its traceback stays on the main process) as a one-line error."""
    if outcome[0] == "error":
        raise outcome[1](outcome[2])
    if outcome[0] == "bug":
        raise HarnessError(f"the main process failed ({outcome[1]}); see its traceback")
    return outcome


def share_by_size(items: list[tuple[str, int]], world: int) -> list[list[str]]:
    """Split (name, size) items into `world` lists of about equal total size: largest first, each to the least loaded
    (the same split on every process for the same items)."""
    loads, shares = [0] * world, [[] for _ in range(world)]
    for name, size in sorted(items, key=lambda x: (-x[1], x[0])):
        r = loads.index(min(loads))
        loads[r] += size + 1
        shares[r].append(name)
    return shares


def spread(accelerator, items: list[tuple[str, int]], fn: Callable) -> dict:
    """{name: fn(name)} for every (name, size) in `items`, which must be the same list on every process. Under several
    processes each reads its share (`share_by_size`) and every process receives all the results (one all-gather)."""
    world = num_processes(accelerator)
    if world == 1:
        return {name: fn(name) for name, _ in items}
    mine = share_by_size(items, world)[accelerator.process_index]
    merged: dict = {}
    for part in all_gather(accelerator, {name: fn(name) for name in mine}):
        merged.update(part)
    return merged
