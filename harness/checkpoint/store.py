"""Saving checkpoints: full training checkpoints, listing, rotation, disk room, `Checkpointer` (resuming them:
harness/checkpoint/resume.py).

    <output_dir>/checkpoints/step-N/   accelerate save_state (model, optimizer, scheduler, RNG of every rank, sampler)
                                       + harness_state.json (step, epoch, data position, elapsed time, ...)
                                       + COMPLETE, written last: a folder without it is never resumed from

Checkpoints prove themselves (harness/checkpoint/manifest.py): COMPLETE is a manifest of what was written, and
train.resume=auto (resume.py) falls back to the newest checkpoint that verifies, with a warning naming what was
wrong.

Disk space: a save first compares the free space of the checkpoints folder with the size of the newest checkpoint
(`make_room`); a write that fails for lack of space (ENOSPC), on a quota (EDQUOT) or a file-size limit (EFBIG:
torch.save drops the errno, harness/files.py's `write_cause` finds it again) is a one-line HarnessError on every
process, naming the steps kept; its partial folder (never marked complete) removed.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

from harness.checkpoint.layout import Layout, samples_read
from harness.checkpoint.manifest import (MARKER, STATE_FILE, build_manifest, checkpoint_size,
                                        has_manifest, verify_checkpoint, write_marker)
from harness.distributed.collectives import all_gather, is_main, num_processes, on_main
from harness.errors import HarnessError, one_line
from harness.files import disk_full, free_bytes, human_bytes, lost_errno, write_cause, write_json


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / STATE_FILE).is_file()


def step_of(path: Path) -> int:
    return int(path.name[5:])


def list_checkpoints(output_dir: str | Path) -> tuple[list[tuple[int, Path]], list[Path]]:
    """(complete checkpoints as (step, path) oldest first, incomplete folders). Complete means marked complete;
    whether the files are intact is `verify_checkpoint`'s business."""
    root = checkpoints_root(output_dir)
    complete, incomplete = [], []
    if root.is_dir():
        for p in root.iterdir():
            if not (p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()):
                continue
            (complete.append((step_of(p), p)) if is_complete(p) else incomplete.append(p))
    return sorted(complete), sorted(incomplete)


def save_checkpoint(accelerator, output_dir: str | Path, loop_state: dict, keep: int,
                    kept: Optional[Path] = None) -> Path:
    """Write checkpoints/step-N on every rank (collective), then the loop state, then the COMPLETE marker: the manifest
    of every file, read back from disk (the hashing split between the processes), written last and atomically.
    `kept`: a checkpoint that rotation leaves beyond `keep` (train.keep_best: the best evaluation's).

    Before writing, `make_room` checks the free space (and may remove what rotation would remove anyway). A write that
    fails on any process (e.g. ENOSPC) ends in the same HarnessError on every process: the partial folder, which
    never got a marker, is removed and the older checkpoints are untouched. (Under DeepSpeed a rank that fails inside
    DeepSpeed's own collective save can leave the others waiting there; the launcher then stops them.)"""
    root = checkpoints_root(output_dir)
    path = root / f"step-{loop_state['step']}"

    def prepare() -> None:
        if path.exists():
            shutil.rmtree(path)  # a leftover of a crash at this same step: never mix two saves in one folder
        root.mkdir(parents=True, exist_ok=True)
        make_room(output_dir, path, keep, say=accelerator.print, kept=kept)

    on_main(accelerator, prepare)
    failure = None
    try:
        accelerator.save_state(str(path))
        if accelerator.is_main_process:
            write_json(path / STATE_FILE, loop_state)
    except Exception as e:  # noqa: BLE001 - sorted out in _agree
        failure = e
    _agree(accelerator, failure, path)
    failure, manifest = None, None
    try:
        manifest = build_manifest(path, accelerator)
    except OSError as e:
        failure = e
    _agree(accelerator, failure, path)

    def finish() -> None:
        try:
            write_marker(path, manifest)
        except OSError as e:
            (path / (MARKER + ".tmp")).unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)
            raise HarnessError(_write_failure(e, path)) from e
        rotate(output_dir, keep, protect=path, kept=kept)

    on_main(accelerator, finish)
    return path


def _write_failure(exc: BaseException, path: Path) -> str:
    """The one-line message for a checkpoint write that failed with `exc` (the partial folder is being removed)."""
    root = path.parent
    complete = [p for _, p in list_checkpoints(root.parent)[0] if p != path]
    kept = (f"steps 1-{step_of(complete[-1])} are kept ({complete[-1].name}, the newest complete checkpoint: a resume "
            f"continues after it)" if complete else "no step is kept (no complete checkpoint yet)")
    if not disk_full(exc, root):
        return (f"could not write checkpoint {path} ({write_cause(exc, root)}); the partial folder is removed "
                f"(never marked complete); {kept}")
    need = (f"about {human_bytes(checkpoint_size(complete[-1]))} needed (the size of {complete[-1].name}), "
            if complete else "")
    try:
        free = human_bytes(free_bytes(root))
    except OSError:
        free = "unknown"
    return (f"disk full while writing checkpoint {path.name} in {root} ({one_line(exc)}): {need}{free} "
            f"free; the partial folder is removed (never marked complete), older checkpoints are intact: free some "
            f"space, then continue with train.resume=auto")


def _agree(accelerator, failure: Optional[BaseException], path: Path) -> None:
    """After a collective write step: nothing when it worked everywhere; else every process stops (one all-gather):
    the main process removes the partial folder, a process whose failure was a bug re-raises it (traceback), the
    others raise a one-line HarnessError."""
    mine = None
    if failure is not None:
        bug = not (isinstance(failure, OSError) or lost_errno(failure) or disk_full(failure, path.parent))
        mine = (bug, _write_failure(failure, path) if not bug else one_line(failure))
    everyone = all_gather(accelerator, mine)
    failed = [(rank, f) for rank, f in enumerate(everyone) if f is not None]
    if not failed:
        return
    if is_main(accelerator):
        shutil.rmtree(path, ignore_errors=True)
    if mine is not None and mine[0]:
        raise failure
    rank, (bug, message) = next(((r, f) for r, f in failed if not f[0]), failed[0])
    if bug:
        message = f"process {rank} failed while writing checkpoint {path} ({message}); see its traceback"
    elif num_processes(accelerator) > 1 and mine is None:
        message = f"process {rank}: {message}"
    raise HarnessError(message)


def make_room(output_dir: str | Path, path: Path, keep: int, say: Callable = print,
              kept: Optional[Path] = None) -> None:
    """Before writing checkpoint `path`: make sure the checkpoints folder has free space for one the size of the
    newest complete checkpoint (nothing to compare with before the first), else raise a one-line HarnessError naming
    the folder, the space needed and the space free, with nothing deleted but garbage.

    When space is short, what would be deleted right after this save anyway goes first: incomplete folders older than
    the newest complete checkpoint (never resumed from), then the complete checkpoints that rotation would delete
    (beyond the newest `keep`), the latter only while the checkpoint this run continues from (the newest one older
    than `path`) stays and verifies now (so a crash during this save still finds a verified checkpoint). That trades
    the spare older checkpoint during the save for not needing room for keep + 1 checkpoints; it happens only when
    space is short, is announced, and never removes the checkpoint continued from (so with keep=1 nothing goes
    early but extras older than it)."""
    root = checkpoints_root(output_dir)
    complete, incomplete = list_checkpoints(output_dir)
    if not complete:
        return
    newest = complete[-1][1]
    need, free = checkpoint_size(newest), free_bytes(root)
    if free >= need:
        return
    removed = []  # folder names
    for p in incomplete:  # stale partial folders: rotation would delete them after this save
        if step_of(p) < complete[-1][0] and p != path:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(f"the partial {p.name}")
    free = free_bytes(root)
    older = [(s, p) for s, p in complete if s < step_of(path)]
    if free < need and keep > 0 and older:
        anchor = older[-1][1]
        after = sorted([*complete, (step_of(path), path)])
        doomed = [p for s, p in after[:-keep] if s < step_of(anchor) and not _same(p, kept)]  # beyond the limit
        reclaim = sum(checkpoint_size(p) for p in doomed)
        if doomed and free + reclaim >= need:
            check = verify_checkpoint(anchor)
            if check.ok and not check.legacy:
                for p in doomed:
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p.name)
                # (the estimate can be off when files changed since they were recorded: the check below decides)
                free = free_bytes(root)
    if removed and free >= need:
        say(f"[harness] warning: little disk space in {root}: removed {', '.join(removed)} before writing "
            f"{path.name} instead of after it (now {human_bytes(free)} free, about {human_bytes(need)} needed)")
        return
    if free < need:
        raise HarnessError(
            f"not enough disk space for checkpoint {path.name} in {root}: about {human_bytes(need)} needed (the size "
            f"of {newest.name}), {human_bytes(free)} free; older checkpoints are intact"
            + (f" (removed only {', '.join(removed)})" if removed else "")
            + (": free some space or lower train.save_total_limit" if len(complete) > 1 else
               ": free some space (the checkpoint continued from stays until the new one is complete: room for two "
               "is needed, whatever train.save_total_limit)") + ", then continue with train.resume=auto")


def _same(path: Path, other: Optional[Path]) -> bool:
    return other is not None and path.name == Path(other).name


def rotate(output_dir: str | Path, keep: int, protect: Optional[Path] = None, kept: Optional[Path] = None) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep` (0: keep all) and incomplete folders older than the
    newest complete one; returns what was deleted. Never deleted: `protect` (the checkpoint just written, which is
    not always the newest: a resume that fell back past a damaged checkpoint leaves that newer folder until the run
    overwrites it), `kept` (train.keep_best: the best evaluation's checkpoint), and, when none of the kept
    checkpoints has a manifest, the newest one that has (a verifiable checkpoint is never given up for unverifiable
    ones of an older harness)."""
    complete, incomplete = list_checkpoints(output_dir)
    doomed = [p for _, p in complete[:-keep]] if keep > 0 else []
    doomed = [p for p in doomed if not _same(p, protect) and not _same(p, kept)]
    kept = [p for _, p in complete if p not in doomed]
    if doomed and not any(has_manifest(p) for p in kept):
        spare = next((p for p in reversed(doomed) if has_manifest(p)), None)
        if spare is not None:
            doomed.remove(spare)
    if complete:
        newest = complete[-1][0]
        doomed += [p for p in incomplete if step_of(p) < newest]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


class Checkpointer:
    """Decides when a checkpoint is due and writes it: every `train.save_every_steps` steps, when
    `train.save_every_minutes` have passed (a fact every process agrees on, see harness/stopping.py), and when the
    attempt stops early. Knows what its last save cost (the time window keeps room for one more). The data position
    is saved with `samples` (rows of the epoch read by all processes in the loop state's `layout`: what a resume
    under another layout converts; epoch_rows: rows an epoch per stream). train.keep_best (`best`, the run's
    stopping.BestMetric, and `export_best`, which writes best/): a step whose evaluation is the new best is due, its
    checkpoint is exported to best/ and kept beyond train.save_total_limit while it is the best; `resumed_at`: the
    step resumed from (an export of it that was cut short is redone: `redo_best`)."""

    def __init__(self, accelerator, output_dir: Path, every_steps: int, every_minutes: float, keep: int,
                 say: Callable[[str], None], on_saved: Callable[[float], None], epoch_rows: Optional[dict] = None,
                 best=None, export_best: Optional[Callable[[], Path]] = None, resumed_at: int = 0):
        self.accelerator, self.output_dir, self.keep, self.say, self.on_saved = accelerator, output_dir, keep, say, on_saved
        self.epoch_rows, self.best, self.export_best = epoch_rows, best, export_best
        self.every_steps, self.every_minutes = every_steps, every_minutes
        self.last_save = time.time()
        self.last_step: Optional[int] = None  # the step of this attempt's latest checkpoint
        self.cost_s = 10.0  # until the first save measures it
        self.redo_best(resumed_at)  # (collective) a resume at the best's step whose best/ export was cut short

    def minutes_due(self) -> bool:
        """train.save_every_minutes have passed since the last save (or the loop's start), by this process's clock."""
        return self.every_minutes > 0 and time.time() - self.last_save >= 60 * self.every_minutes

    def due(self, step: int, forced: bool) -> bool:
        return forced or bool(self.every_steps and step % self.every_steps == 0) or self._new_best(step)

    def _new_best(self, step: int) -> bool:
        return self.export_best is not None and self.best.step == step

    def kept(self) -> Optional[Path]:
        """The checkpoint that rotation keeps beyond train.save_total_limit: the best evaluation's (keep_best)."""
        return self.folder(self.best.step) if self.export_best is not None and self.best.step else None

    def folder(self, step: int) -> Path:
        """Where the checkpoint of `step` is (or would be) written."""
        return checkpoints_root(self.output_dir) / f"step-{step}"

    def newest(self) -> Optional[Path]:
        """The newest complete checkpoint in the output folder (any attempt's), or None."""
        complete, _ = list_checkpoints(self.output_dir)
        return complete[-1][1] if complete else None

    def write(self, loop_state: dict) -> Path:
        """Write a checkpoint of `loop_state` (collective), outside the cadence: nothing is timed or announced."""
        if self.epoch_rows is not None:
            layout = Layout(**loop_state["layout"])
            loop_state = {**loop_state, "streams": samples_read(loop_state["streams"], layout, self.epoch_rows)}
        return save_checkpoint(self.accelerator, self.output_dir, loop_state, self.keep, self.kept())

    def save(self, loop_state: dict) -> Path:
        t = time.time()
        path = self.write(loop_state)
        self.last_save, self.last_step = time.time(), loop_state["step"]
        self.cost_s = self.last_save - t  # the checkpoint's own (the stop decision keeps room for one more)
        self.say(f"[harness] checkpoint: {path} ({self.cost_s:.1f}s)")
        if self._new_best(loop_state["step"]):  # the same weights, exported
            self.say(f"[harness] best {self.best.metric} {self.best.value:.4f} at step {self.best.step}: "
                     f"{self._export_best()}")
        self.on_saved(time.time() - t)  # the checkpoint and its best/ export: out of the training clock
        return path

    def _export_best(self) -> Path:
        """best/ written, then the step it holds (BEST_STEP): what `redo_best` compares on resume."""
        dest = self.export_best()
        on_main(self.accelerator, lambda: write_json(dest / BEST_STEP, {"step": self.best.step}))
        return dest

    def redo_best(self, step: int) -> None:
        """On resume at `step` (collective): where that step's checkpoint is the best evaluation's and best/ does not
        hold it (the export was cut by a kill -9 or a full disk: the checkpoint was complete before it), best/ is
        written again from these weights, the checkpoint's: the save and its export are one transaction."""
        if not step or not self._new_best(step):
            return
        held = on_main(self.accelerator, lambda: _best_step(self.output_dir / "best"))
        if held != step:
            self.say(f"[harness] best/ holds {'no model' if held is None else f'step {held}'}, not step {step}'s, the "
                     f"best (its export was cut short): exported again")
            self.say(f"[harness] best {self.best.metric} {self.best.value:.4f} at step {step}: {self._export_best()}")


BEST_STEP = "best_step.json"  # in best/: the step whose model it holds


def _best_step(best: Path) -> Optional[int]:
    try:
        return int(json.loads((best / BEST_STEP).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
