"""Saving and resuming: full training checkpoints, rotation, the resume target, loading, `Checkpointer`.

    <output_dir>/checkpoints/step-N/   accelerate save_state (model, optimizer, scheduler, RNG of every rank, sampler)
                                       + harness_state.json (step, epoch, data position, elapsed time, ...)
                                       + COMPLETE, written last: a folder without it is never resumed from

Checkpoints prove themselves (harness/checkpoint/manifest.py): COMPLETE is a manifest of what was written, and
train.resume=auto falls back to the newest checkpoint that verifies, with a warning naming what was wrong.

Disk space: a save first compares the free space of the checkpoints folder with the size of the newest checkpoint
(`make_room`); a write that fails for lack of space (ENOSPC) is a one-line HarnessError on every process, its partial
folder (never marked complete) removed.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

from harness.checkpoint.manifest import (MARKER, STATE_FILE, Verification, build_manifest, checkpoint_size,
                                        has_manifest, verify_checkpoint, write_marker)
from harness.distributed import all_gather, is_main, num_processes, on_main
from harness.errors import ConfigError, HarnessError, one_line
from harness.files import disk_full, free_bytes, human_bytes, write_json


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / STATE_FILE).is_file()


def _step(path: Path) -> int:
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
            (complete.append((_step(p), p)) if is_complete(p) else incomplete.append(p))
    return sorted(complete), sorted(incomplete)


def save_checkpoint(accelerator, output_dir: str | Path, loop_state: dict, keep: int) -> Path:
    """Write checkpoints/step-N on every rank (collective), then the loop state, then the COMPLETE marker: the manifest
    of every file, read back from disk (the hashing split between the processes), written last and atomically.

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
        make_room(output_dir, path, keep, say=accelerator.print)

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
        rotate(output_dir, keep, protect=path)

    on_main(accelerator, finish)
    return path


def _write_failure(exc: BaseException, path: Path) -> str:
    """The one-line message for a checkpoint write that failed with `exc` (the partial folder is being removed)."""
    root = path.parent
    if not disk_full(exc, root):
        return (f"could not write checkpoint {path} ({one_line(exc)}); the partial folder is removed "
                f"(never marked complete), older checkpoints are intact")
    complete = [p for _, p in list_checkpoints(root.parent)[0] if p != path]
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
        bug = not (isinstance(failure, OSError) or disk_full(failure, path.parent))
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


def make_room(output_dir: str | Path, path: Path, keep: int, say: Callable = print) -> None:
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
        if _step(p) < complete[-1][0] and p != path:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(f"the partial {p.name}")
    free = free_bytes(root)
    older = [(s, p) for s, p in complete if s < _step(path)]
    if free < need and keep > 0 and older:
        anchor = older[-1][1]
        after = sorted([*complete, (_step(path), path)])
        doomed = [p for s, p in after[:-keep] if s < _step(anchor)]  # beyond the limit once `path` exists
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
            + ": free some space or lower train.save_total_limit, then continue with train.resume=auto")


def rotate(output_dir: str | Path, keep: int, protect: Optional[Path] = None) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep` (0: keep all) and incomplete folders older than the
    newest complete one; returns what was deleted. Never deleted: `protect` (the checkpoint just written, which is
    not always the newest: a resume that fell back past a damaged checkpoint leaves that newer folder until the run
    overwrites it), and, when none of the kept checkpoints has a manifest, the newest one that has (a verifiable
    checkpoint is never given up for unverifiable ones of an older harness)."""
    complete, incomplete = list_checkpoints(output_dir)
    doomed = [p for _, p in complete[:-keep]] if keep > 0 else []
    if protect is not None:
        doomed = [p for p in doomed if p.name != Path(protect).name]
    kept = [p for _, p in complete if p not in doomed]
    if doomed and not any(has_manifest(p) for p in kept):
        spare = next((p for p in reversed(doomed) if has_manifest(p)), None)
        if spare is not None:
            doomed.remove(spare)
    if complete:
        newest = complete[-1][0]
        doomed += [p for p in incomplete if _step(p) < newest]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def resolve_resume(output_dir: str | Path, resume: Optional[str], accelerator=None,
                   older_than: Optional[int] = None) -> tuple[Optional[Path], list[Path]]:
    """The checkpoint to resume from (None: start fresh) and the incomplete folders that were passed over.

    resume: "auto" (the newest complete checkpoint that verifies, if any), a checkpoint folder (which must verify), or
    None/"none" (fresh start; refused when output_dir already holds complete checkpoints, so that a restart never
    overwrites a run by accident).

    Every candidate is checked with `verify_checkpoint` (sizes, then checksums). auto: a checkpoint that fails is
    passed over with a one-line warning naming what was wrong, and the next older one is tried; when checkpoints
    exist but none verifies: a one-line HarnessError. An explicit folder that fails: a one-line ConfigError. A
    checkpoint written by an older harness (marker without checksums) is accepted unverified, with a note.

    accelerator: pass it when it exists (it must, under several processes): the main process lists the folders and
    reads the markers, the checksum work is split between the processes, and every process gets the same results,
    hence the same choice. Warnings are printed with accelerator.print (else print).

    older_than: (auto) only checkpoints of earlier steps: those from step `older_than` on failed to load
    (`load_resumable`)."""
    say = accelerator.print if accelerator is not None else print

    def plan() -> tuple[list[Path], list[Path], bool]:
        complete, incomplete = list_checkpoints(output_dir)
        if resume in (None, "none", "null", ""):
            if complete:
                raise ConfigError(
                    f"config key 'train.resume': {checkpoints_root(output_dir)} already holds checkpoints "
                    f"(newest step-{complete[-1][0]}); use train.resume=auto to continue or another train.output_dir"
                )
            return [], incomplete, False
        if resume == "auto":
            return [p for s, p in reversed(complete) if older_than is None or s < older_than], incomplete, False
        path = Path(resume)
        if not path.is_dir():
            raise ConfigError(f"config key 'train.resume': {path} is not a folder")
        if not is_complete(path):
            raise ConfigError(f"config key 'train.resume': {path} is not a complete checkpoint (no {MARKER} marker "
                              f"or {STATE_FILE})")
        return [path], incomplete, True

    candidates, incomplete, explicit = on_main(accelerator, plan)
    failed: list[Verification] = []
    for path in candidates:
        t0 = time.perf_counter()
        check = verify_checkpoint(path, accelerator)
        if check.ok:
            if check.legacy:
                say(f"[harness] note: {path} has no checksums (marker of an older harness): resumed from unverified")
            else:
                say(f"[harness] checkpoint {path} verified: {check.files} files, {human_bytes(check.size)} in "
                    f"{time.perf_counter() - t0:.1f}s")
            return path, incomplete
        if explicit:
            raise ConfigError(f"config key 'train.resume': {path} fails verification: {check.describe()}")
        say(f"[harness] warning: checkpoint {path} fails verification ({check.describe()}): not resumed from, "
            f"trying an older one")
        failed.append(check)
    if failed:
        raise HarnessError(
            f"no checkpoint in {checkpoints_root(output_dir)} verifies ("
            + "; ".join(f"{c.path.name}: {c.describe(limit=2)}" for c in failed)
            + "): move the damaged folders away to start afresh, or use another train.output_dir")
    return None, incomplete


def load_checkpoint(accelerator, path: Path, quantized: bool = False, universal: bool = False) -> dict:
    """Restore the accelerate state (every rank) and return the loop state saved with it. A checkpoint that cannot be
    loaded (unverifiable and damaged, or written for another model) is a one-line HarnessError.

    `quantized` (QLoRA): the frozen base is loaded quantized from model.name_or_path again, and its quantization
    state entries (absmax, quant_map, ...) in the checkpoint do not load as parameters: the model is loaded
    non-strictly, after checking that the checkpoint holds every trainable parameter (adapters, added tokens).

    `universal`: a DeepSpeed checkpoint of another process count or ZeRO stage, loaded through its universal view
    (harness.checkpoint.elastic)."""
    try:
        kwargs = {}
        if quantized:
            from safetensors import safe_open

            files = sorted(path.glob("model*.safetensors"))
            saved = set()
            for f in files:
                with safe_open(str(f), "pt") as st:
                    saved.update(st.keys())
            unwrapped = accelerator.unwrap_model(accelerator._models[0], keep_torch_compile=False)
            lacking = [n for n, p in unwrapped.named_parameters() if p.requires_grad and n not in saved]
            if not files or lacking:
                raise RuntimeError(f"the checkpoint lacks trainable parameters, e.g. {(lacking or ['model*.safetensors'])[0]}")
            kwargs["strict"] = False
        if universal:
            from harness.checkpoint.elastic import repair_universal_load, universal_view

            with universal_view(accelerator, path) as view, repair_universal_load(accelerator):
                accelerator.load_state(str(view), **kwargs)
        else:
            accelerator.load_state(str(path), **kwargs)
        return json.loads((path / STATE_FILE).read_text())
    except Exception as e:  # noqa: BLE001 - a damaged file or a user mistake, reported on one line
        error = HarnessError(f"could not load checkpoint {path} ({one_line(e, 400)}); resume from another "
                             f"one with train.resume=<folder>, or check that the config matches the run that wrote it")
        error.cause = one_line(e, 400)
        raise error from e


def load_resumable(accelerator, output_dir: str | Path, path: Path, auto: bool, quantized: bool = False,
                   universal: bool = False) -> tuple[Path, dict]:
    """Load checkpoint `path` on every process: (the checkpoint loaded, its loop state). With train.resume=auto a
    checkpoint that verified but fails to load on any process (a file it should not hold, written for another model)
    is passed over like one that fails verification: a warning, and the next older one that verifies is loaded (it
    restores every loaded part, so what the failed attempt loaded does not remain). Every process takes the same
    decision (one all-gather per attempt). A named checkpoint that fails, or none left: a one-line HarnessError."""
    say = accelerator.print if accelerator is not None else print
    failed: list[str] = []
    while True:
        error, saved = None, None
        try:
            saved = load_checkpoint(accelerator, path, quantized, universal)
        except HarnessError as e:
            error = (str(e), getattr(e, "cause", str(e)))
        errors = [e for e in all_gather(accelerator, error) if e is not None]
        if not errors:
            return path, saved
        if not auto:
            raise HarnessError(errors[0][0])
        cause = errors[0][1]
        say(f"[harness] warning: checkpoint {path} verifies but cannot be loaded ({cause}): not resumed from, "
            f"trying an older one")
        failed.append(f"{path.name}: {cause}")
        path, _ = resolve_resume(output_dir, "auto", accelerator, older_than=_step(path))
        if path is None:
            raise HarnessError(f"no checkpoint in {checkpoints_root(output_dir)} loads ({'; '.join(failed)}): move the "
                               f"damaged folders away to start afresh, check that the config matches the run that "
                               f"wrote them, or use another train.output_dir")


class Checkpointer:
    """Decides when a checkpoint is due and writes it: every `train.save_every_steps` steps, when
    `train.save_every_minutes` have passed (a fact every process agrees on, see harness/stopping.py), and when the
    attempt stops early. Knows what its last save cost (the time window keeps room for one more)."""

    def __init__(self, accelerator, output_dir: Path, every_steps: int, every_minutes: float, keep: int,
                 say: Callable[[str], None], on_saved: Callable[[float], None]):
        self.accelerator, self.output_dir, self.keep, self.say, self.on_saved = accelerator, output_dir, keep, say, on_saved
        self.every_steps, self.every_minutes = every_steps, every_minutes
        self.last_save = time.time()
        self.last_step: Optional[int] = None  # the step of this attempt's latest checkpoint
        self.cost_s = 10.0  # until the first save measures it

    def minutes_due(self) -> bool:
        """train.save_every_minutes have passed since the last save (or the loop's start), by this process's clock."""
        return self.every_minutes > 0 and time.time() - self.last_save >= 60 * self.every_minutes

    def due(self, step: int, forced: bool) -> bool:
        return forced or bool(self.every_steps and step % self.every_steps == 0)

    def save(self, loop_state: dict) -> Path:
        t = time.time()
        path = save_checkpoint(self.accelerator, self.output_dir, loop_state, self.keep)
        self.last_save, self.last_step = time.time(), loop_state["step"]
        self.cost_s = self.last_save - t
        self.on_saved(self.cost_s)
        self.say(f"[harness] checkpoint: {path} ({self.cost_s:.1f}s)")
        return path
