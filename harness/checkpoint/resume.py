"""Resume, in one place: the run calls `plan` before the Accelerator exists, `choose` once it exists (before
`prepare()`), and `restore` after `prepare()`, which returns the loop state.

- `plan(cfg, world)`: the checkpoint a resume would most likely continue from (`newest_target`: the named folder or
  the newest complete one), its harness_state.json read once, and the config fitted to this attempt's number of
  processes (harness/checkpoint/layout.py's `fit`: the accumulation and DeepSpeed's batch settings follow it);
- `choose(plan, accelerator, ...)`: the checkpoint verified and agreed by every process (`resolve_resume`), refused
  when it lies past the schedule, was written under another engine or weights dtype, or on other training data
  (harness/checkpoint/datafiles.py; train.resume_changed_data=true: the new data from a new epoch) or another model
  (harness/checkpoint/settings.py: data.max_len counts as data; rl's settings are taken, said and recorded); a ZeRO
  checkpoint of another process count is set up to load through its universal view (harness/checkpoint/universal.py);
- `restore(start, ...)`: the accelerate state loaded (`load_resumable`: with train.resume=auto a checkpoint that
  fails to load is passed over for an older one) and the loop state, its data position carried over to this layout;
  a fresh start's loop state at step 0.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from harness.config.modes import facts
from harness.checkpoint import datafiles, settings
from harness.checkpoint.layout import (Resize, carry_over, check_same_engine, check_same_weights, fit,
                                       layout_of, needs_universal, rl_questions, saved_layout)
from harness.checkpoint.manifest import MARKER, STATE_FILE, Verification, verify_checkpoint
from harness.checkpoint.store import checkpoints_root, is_complete, list_checkpoints, step_of
from harness.checkpoint.universal import load_universal, repair_universal_load, universal_view
from harness.config import NO_RESUME
from harness.distributed.collectives import all_gather, on_main
from harness.errors import ConfigError, DataError, HarnessError, one_line
from harness.files import human_bytes
from harness.state import LoopState



@dataclass(frozen=True)
class Plan:
    """Before the Accelerator: the likely resume target, its loop state (read once) and the config fitted to this
    attempt's number of processes."""

    cfg: object
    resize: Optional[Resize]
    target: Optional[Path]
    saved: Optional[dict]


@dataclass(frozen=True)
class Start:
    """Once the Accelerator exists: the verified checkpoint to resume from (None: a fresh start)."""

    plan: Plan
    path: Optional[Path]
    saved: Optional[dict]
    universal: bool  # a ZeRO checkpoint of another process count: loaded through its universal view
    incomplete: list  # incomplete checkpoint folders passed over
    data_files: dict = field(default_factory=dict)  # this run's training files' fingerprints (datafiles.py)
    data_changes: list = field(default_factory=list)  # how they differ from the checkpoint's (resume_changed_data)
    settings: dict = field(default_factory=dict)  # this run's compared settings (checkpoint/settings.py)
    changed: dict = field(default_factory=dict)  # those that differ from the checkpoint's: {key: (old, new)}
    zero_stage: Optional[int] = None  # DeepSpeed's ZeRO stage of this run (None: no DeepSpeed)

    @property
    def notes(self) -> list[str]:
        """The warnings the start line is followed by."""
        return [f"[harness] warning: {p} is an incomplete checkpoint (no {MARKER} marker): not resumed from"
                for p in self.incomplete]


@dataclass(frozen=True)
class Resumed:
    """After prepare(): the loop state, the checkpoint it came from and the layout change (None: the same)."""

    state: LoopState
    path: Optional[Path]
    resize: Optional[Resize]
    changes: dict = field(default_factory=dict)  # settings the resume took from this config: {key: {from, to, ...}}


def plan(cfg, world: int) -> Plan:
    """Before the Accelerator exists (every process the same; nothing is verified yet: the loop state is only read)."""
    target, saved = newest_target(cfg.train)
    if target is None:
        return Plan(cfg, None, target, saved)
    questions = rl_questions(cfg.loss, cfg.rl)
    train, resize = fit(cfg.train, cfg.loss.mode, cfg.loss.gather_negatives, target, saved_layout(saved, questions),
                        world, questions)
    return Plan(cfg if train is cfg.train else replace(cfg, train=train), resize, target, saved)


def choose(p: Plan, accelerator, out: Path, zero_stage: Optional[int], weights: str) -> Start:
    """The checkpoint to resume from, verified and agreed by every process (before prepare(): a ZeRO checkpoint of
    another process count sets DeepSpeed's `checkpoint.load_universal`)."""
    cfg = p.cfg
    path, incomplete = resolve_resume(out, None if cfg.train.overwrite else cfg.train.resume, accelerator)
    saved = (p.saved if path == p.target else read_state(path)) if path is not None else None
    if path is not None and cfg.train.max_steps > 0:  # (with epochs: `restore`, once the schedule is known)
        past_the_schedule(path, saved, cfg.train.max_steps)
    universal = False
    if path is not None:
        check_same_start(path, saved, cfg.train.seed, cfg.model.name_or_path is None or cfg.model.random_init,
                         cfg.loss)
        before = saved_layout(saved)
        check_same_weights(path, before, weights)
        check_same_engine(path, before, zero_stage)
        universal = needs_universal(before, accelerator.num_processes, zero_stage)
    if universal:
        load_universal(accelerator)
    files = on_main(accelerator, lambda: datafiles.fingerprints(cfg.data, cfg.loss.mode, cfg.rft, cfg.rl))  # (128 KiB a file)
    changes = datafiles.compare(saved["data_files"], files) if path is not None and saved and \
        saved.get("data_files") else []
    now = settings.current(cfg.model, cfg.data, cfg.loss.mode, {"rl": cfg.rl, "rft": cfg.rft})
    changed = settings.compare((saved or {}).get("settings") or {}, now) if path is not None else {}
    settings.check_model(path, changed)
    changes += settings.data_changes(changed)
    if changes and not cfg.train.resume_changed_data:
        how = (" (a stream resumes on files changed only beyond what it had read of them)" if cfg.data.streaming else
               ", set train.resume_changed_data=true to train the new data from the start of a new epoch")
        raise DataError(f"the training data changed since {path} was written ({'; '.join(changes)}): its data "
                        f"position counts rows of the old data; put the old data back{how}, or train it in another "
                        f"train.output_dir")
    return Start(p, path, saved, universal, incomplete, files, changes, now, changed, zero_stage)


def restore(start: Start, accelerator, weights: str, epoch_rows: dict, total_steps: int, say: Callable[[str], None],
            scheduler=None) -> Resumed:
    """After prepare(): the loop state to train from, a checkpoint's (its weights, optimizer, schedule and RNG
    loaded on every process, its data position in this attempt's layout, this config's optim.lr: `new_peak_lr`) or
    step 0's. `weights`: the trained parameters' dtype once prepared; `epoch_rows`: rows an epoch per training
    stream, in stream order (the first defines epochs); the config is the run's (`start.plan.cfg`)."""
    cfg = start.plan.cfg
    t, zero_stage, streams = cfg.train, start.zero_stage, tuple(epoch_rows)
    quantized, gather_negatives, peak_lr = cfg.model.quantization != "none", cfg.loss.gather_negatives, cfg.optim.lr
    questions = rl_questions(start.plan.cfg.loss, start.plan.cfg.rl)  # loss.mode=rl: rl.questions_per_step
    layout = layout_of(t, accelerator.num_processes, zero_stage, weights, questions)
    if start.path is None:
        return Resumed(LoopState(streams={n: {"epoch": 0, "batches": 0} for n in streams}, layout=layout.as_dict(),
                                 data_files=start.data_files, seed=t.seed, settings=start.settings), None, None)
    if t.max_steps <= 0:
        past_the_schedule(start.path, start.saved, total_steps)
    path, saved = load_resumable(accelerator, Path(t.output_dir), start.path, t.resume == "auto",
                                 quantized, universal=start.universal,
                                 known={start.path: start.saved})
    if start.data_changes:  # train.resume_changed_data=true: the new data from the start of a new epoch
        saved = {**saved, "streams": {n: {"epoch": int(p["epoch"]) + bool(p.get("samples") or p["batches"]),
                                          "batches": 0, "samples": 0} for n, p in saved["streams"].items()}}
    state = LoopState.from_saved(saved)
    state.data_files, state.settings = start.data_files, start.settings
    # accelerate's micro-step counter (load_state restores the saved attempt's) decides which micro-step ends an
    # accumulation (step % train.grad_accum == 0): count it in this attempt's layout, or a resume with another
    # accumulation (1 -> 2 at step 3: counter 3) steps the optimizer after the first micro-batch of each step
    accelerator.step = state.step * t.grad_accum
    # another number of processes (or split of the batch): the data position in rows, the batch's new split
    state.streams, resize, moved = carry_over(path, saved, layout, streams, epoch_rows, start.universal,
                                             gather_negatives)
    state.layout = layout.as_dict()
    say(f"[harness] resumed from {path}: step {state.step}, data position {state.streams}{moved}")
    changes = {}
    if start.data_changes:
        epoch = state.streams[streams[0]]["epoch"]
        changes["data"] = {"changed": start.data_changes, "from_epoch": epoch, "from_step": state.step + 1}
        say(f"[harness] the training data changed since {path} ({'; '.join(start.data_changes)}); "
            f"train.resume_changed_data=true: the new data from the start of epoch {epoch}, from step "
            f"{state.step + 1} (weights, optimizer and schedule continue)")
    changes.update(settings.taken(start.changed, path, state.step + 1, say))  # rl's: taken, said, recorded
    lr = new_peak_lr(scheduler, peak_lr) if scheduler is not None else None
    if lr is not None:
        changes["optim.lr"] = {"from": lr[0], "to": lr[1], "from_step": state.step + 1}
        say(f"[harness] optim.lr changed since {path}: {lr[0]:g} -> {lr[1]:g}, applied from step {state.step + 1} "
            f"(the schedule's warm-up and decay act on the new peak)")
    return Resumed(state, path, resize, changes)


def new_peak_lr(scheduler, lr: float) -> Optional[tuple[float, float]]:
    """A resumed schedule takes this config's optim.lr as its peak: the checkpoint's scheduler and optimizer state
    (loaded) carry the old one, which would go on without a word while config.yaml records the new value. Returns
    (old, new) when it changed, else None. The param groups' current lr becomes new peak x the schedule's multiplier
    at the resumed step (the one the next update uses); the next schedule steps follow from the new peak."""
    old = list(scheduler.base_lrs)
    if all(abs(b - lr) <= 1e-12 * max(abs(b), abs(lr)) for b in old):
        return None
    scheduler.base_lrs = [lr] * len(old)
    for group, multiplier in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * multiplier(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]
    return old[0], lr


def check_same_start(path: Path, saved: Optional[dict], seed: int, random_start: bool, loss) -> None:
    """A dpo / ipo run on a random-init model is refused another train.seed on resume: its reference log-probs are
    those of the model it started from, which the seed made (harness/preference.py computes them before the
    checkpoint is loaded, or reads them back), while the weights continue the checkpoint's run. Elsewhere the seed
    does not choose the model: a pretrained start is the same whatever the seed. `seed`: train.seed; random_start:
    the model is a random init (no model.name_or_path, or model.random_init); `loss`: cfg.loss."""
    was = (saved or {}).get("seed")
    if (was is None or was == seed or not random_start or facts(loss.mode).gen_rows != "pairs"
            or loss.preference not in ("dpo", "ipo")):
        return
    raise ConfigError(f"config key 'train.seed': the run to resume ({path}) started from the random model of "
                      f"train.seed={was}, which is its loss.preference={loss.preference} reference; with "
                      f"{seed} the reference would be another model's while the weights continue the run: "
                      f"rerun with train.seed={was}, or start over with train.overwrite=true")


def past_the_schedule(path: Path, saved: Optional[dict], total_steps: int) -> None:
    """A checkpoint past the last step the config plans (train.max_steps lowered on an interrupted run) is refused:
    resuming would export its weights as a run of fewer steps."""
    try:
        step = int(saved["step"])
    except (ValueError, TypeError, KeyError):
        return  # load_checkpoint says what is wrong with it
    if step > total_steps:
        raise ConfigError(f"config key 'train.max_steps': the run to resume is at step {step} ({path}), past "
                          f"the {total_steps} steps this config plans; rerun with the run's own train.max_steps (>= "
                          f"{step}), or start over with train.overwrite=true")


def read_state(path: Path) -> Optional[dict]:
    try:
        state = json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def newest_target(t) -> tuple[Optional[Path], Optional[dict]]:
    """The checkpoint a resume would most likely continue from (before verification, which may pass it over for an
    older one of the same run) and its loop state: the named folder, or the newest complete one with a readable loop
    state (train.resume=auto); (None, None) for a fresh start. `t`: cfg.train."""
    if t.overwrite or t.resume in NO_RESUME:
        return None, None
    if t.resume != "auto":
        path = Path(t.resume)
        return (path, read_state(path)) if (path / STATE_FILE).is_file() else (None, None)
    complete, _ = list_checkpoints(t.output_dir)
    for _, path in reversed(complete):
        state = read_state(path)
        if state is not None:
            return path, state
    return None, None


def checkpoint_stage(output_dir) -> Optional[int]:
    """The ZeRO stage of the newest complete checkpoint in `output_dir` (0: DDP / plain), None when there is none:
    what launch/train.sh --zero auto keeps on resume."""
    for _, path in reversed(list_checkpoints(output_dir)[0]):
        layout = saved_layout(read_state(path))
        if layout is not None:
            return layout.zero_stage or 0
    return None


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

    def candidates() -> tuple[list[Path], list[Path], bool]:
        complete, incomplete = list_checkpoints(output_dir)
        if resume in NO_RESUME:
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

    paths, incomplete, explicit = on_main(accelerator, candidates)
    failed: list[Verification] = []
    for path in paths:
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


def load_checkpoint(accelerator, path: Path, quantized: bool = False, universal: bool = False,
                    saved: Optional[dict] = None) -> dict:
    """Restore the accelerate state (every rank) and return the loop state saved with it (`saved`: as already read
    by `plan`). A checkpoint that cannot be loaded (unverifiable and damaged, or written for another model) is a
    one-line HarnessError.

    `quantized` (QLoRA): the frozen base is loaded quantized from model.name_or_path again, and its quantization
    state entries (absmax, quant_map, ...) in the checkpoint do not load as parameters: the model is loaded
    non-strictly, after checking that the checkpoint holds every trainable parameter (adapters, added tokens).

    `universal`: a DeepSpeed checkpoint of another process count or ZeRO stage, loaded through its universal view
    (harness/checkpoint/universal.py)."""
    try:
        kwargs = {}
        if quantized:
            from safetensors import safe_open

            files = sorted(path.glob("model*.safetensors"))
            names = set()
            for f in files:
                with safe_open(str(f), "pt") as st:
                    names.update(st.keys())
            unwrapped = accelerator.unwrap_model(accelerator._models[0], keep_torch_compile=False)
            lacking = [n for n, p in unwrapped.named_parameters() if p.requires_grad and n not in names]
            if not files or lacking:
                raise RuntimeError(f"the checkpoint lacks trainable parameters, e.g. "
                                   f"{(lacking or ['model*.safetensors'])[0]}")
            kwargs["strict"] = False
        if universal:
            with universal_view(accelerator, path) as view, repair_universal_load(accelerator):
                accelerator.load_state(str(view), **kwargs)
        else:
            accelerator.load_state(str(path), **kwargs)
        return saved if saved is not None else json.loads((path / STATE_FILE).read_text())
    except Exception as e:  # noqa: BLE001 - a damaged file or a user mistake, reported on one line
        error = HarnessError(f"could not load checkpoint {path} ({one_line(e, 400)}); resume from another "
                             f"one with train.resume=<folder>, or check that the config matches the run that wrote it")
        error.cause = one_line(e, 400)
        raise error from e


def load_resumable(accelerator, output_dir: str | Path, path: Path, auto: bool, quantized: bool = False,
                   universal: bool = False, known: Optional[dict] = None) -> tuple[Path, dict]:
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
            saved = load_checkpoint(accelerator, path, quantized, universal, (known or {}).get(path))
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
        path, _ = resolve_resume(output_dir, "auto", accelerator, older_than=step_of(path))
        if path is None:
            raise HarnessError(f"no checkpoint in {checkpoints_root(output_dir)} loads ({'; '.join(failed)}): move the "
                               f"damaged folders away to start afresh, check that the config matches the run that "
                               f"wrote them, or use another train.output_dir")
