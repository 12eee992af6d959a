"""Resuming on another number of processes: the global batch, the data position and the optimizer state carry over.

A checkpoint records the layout it was written with (`layout_of`: processes, micro-batches, accumulation, ZeRO stage).
When a run resumes under another number of processes (8 GPUs became 4, 2 became 1):

- the batch: `fit_to_world` (before the Accelerator exists) keeps the run's global batch (micro-batch x accumulation x
  processes, for each data stream) by choosing `train.grad_accum`, and where it must a smaller micro-batch (never a
  larger one than the config's: memory); where no combination keeps it, a one-line ConfigError names the process
  counts that would, and how to change the batch knowingly (`train.global_batch_size`);
- the data: `positions` turns each stream's saved position (micro-batches per process) into rows of the epoch
  consumed by all processes together, then into micro-batches per process of the new layout (accelerate's seedable
  sampler orders the rows the same way for any process count);
- the optimizer: DDP and plain checkpoints hold the full state (accelerate loads it under any process count);
  DeepSpeed ZeRO's partitioned state is converted by DeepSpeed's own `ds_to_universal` into a universal checkpoint
  (`universal_view`, a staging folder beside the checkpoint, removed after loading) and loaded with DeepSpeed's
  `checkpoint.load_universal` (`load_universal`), which repartitions it for the new process count (and ZeRO stage).

The checkpoint itself is never changed: the next save is written in the new layout.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from harness.checkpoint.manifest import STATE_FILE
from harness.errors import ConfigError, HarnessError, one_line

DS_TAG = "pytorch_model"  # the folder accelerate's save_state gives DeepSpeed's engine inside a checkpoint
STAGING = ".resharded"  # <output_dir>/.resharded/step-N: a checkpoint's universal view while it is loaded


@dataclass(frozen=True)
class Layout:
    """How a run divides its global batch: micro-batch sizes (generative rows, embedding queries) x accumulation x
    processes, and the ZeRO stage (None: DDP or one plain process)."""

    processes: int
    micro_batch_size: int
    emb_micro_batch_size: int
    grad_accum: int
    zero_stage: Optional[int] = None
    weights: Optional[str] = None  # the trained parameters' dtype (train.weights): fp32, bf16, fp16; None: unrecorded

    def micro(self, stream: str) -> int:
        return self.emb_micro_batch_size if stream == "emb" else self.micro_batch_size

    def global_batch(self, stream: str) -> int:
        return self.micro(stream) * self.grad_accum * self.processes

    def as_dict(self) -> dict:
        return {"processes": self.processes, "micro_batch_size": self.micro_batch_size,
                "emb_micro_batch_size": self.emb_micro_batch_size, "grad_accum": self.grad_accum,
                "zero_stage": self.zero_stage, "weights": self.weights}


def streams_of(loss_mode: str) -> tuple[str, ...]:
    return {"generative": ("gen",), "embedding": ("emb",)}.get(loss_mode, ("emb", "gen"))


def layout_of(cfg, processes: int, zero_stage: Optional[int] = None, weights: Optional[str] = None) -> Layout:
    t = cfg.train
    return Layout(processes, t.micro_batch_size, t.emb_micro_batch_size, t.grad_accum, zero_stage, weights)


def saved_layout(path: Path, saved: Optional[dict], assumed: Layout) -> Optional[Layout]:
    """The layout checkpoint `path` was written with (its loop state's `layout`). Checkpoints of an older harness
    have none: their process count is that of their RNG files, the rest as `assumed` (the config's)."""
    if saved and saved.get("layout"):
        return Layout(**saved["layout"])
    ranks = len(list(Path(path).glob("random_states_*.pkl")))
    return replace(assumed, processes=ranks) if ranks else None


def read_state(path: Path) -> Optional[dict]:
    try:
        state = json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def newest_target(cfg) -> Optional[Path]:
    """The checkpoint a resume would most likely continue from (before verification, which may pass it over for an
    older one of the same run): the named folder, or the newest complete one (train.resume=auto)."""
    from harness.checkpoint.store import list_checkpoints

    t = cfg.train
    if t.overwrite or t.resume in (None, "none", "null", ""):
        return None
    if t.resume != "auto":
        return Path(t.resume) if (Path(t.resume) / STATE_FILE).is_file() else None
    complete, _ = list_checkpoints(t.output_dir)
    for _, path in reversed(complete):
        if read_state(path) is not None:
            return path
    return None


def checkpoint_stage(output_dir) -> Optional[int]:
    """The ZeRO stage of the newest complete checkpoint in `output_dir` (0: DDP / plain), None when there is none or
    it does not say (an older harness's DeepSpeed checkpoint): what launch/train.sh --zero auto keeps on resume."""
    from harness.checkpoint.store import list_checkpoints

    for _, path in reversed(list_checkpoints(output_dir)[0]):
        state = read_state(path)
        if state is None:
            continue
        if state.get("layout"):
            return state["layout"].get("zero_stage") or 0
        return None if (path / DS_TAG).is_dir() else 0
    return None


@dataclass
class Resize:
    """A resume under another layout: what the checkpoint was written with and what this attempt runs."""

    checkpoint: Path
    before: Layout
    after: Layout
    streams: tuple

    def describe(self) -> str:
        b, a = self.before, self.after
        parts = [f"{b.processes} -> {a.processes} process(es)" if b.processes != a.processes else
                 f"{a.processes} process(es)"]
        if b.grad_accum != a.grad_accum:
            parts.append(f"train.grad_accum {b.grad_accum} -> {a.grad_accum}")
        for s in self.streams:
            key = "train.emb_micro_batch_size" if s == "emb" else "train.micro_batch_size"
            if b.micro(s) != a.micro(s):
                parts.append(f"{key} {b.micro(s)} -> {a.micro(s)}")
        kept = [f"{a.global_batch(s)} {'queries' if s == 'emb' else 'sequences'}" for s in self.streams]
        same = all(a.global_batch(s) == b.global_batch(s) for s in self.streams)
        # another process count changes the batch only through train.global_batch_size; the same count through the
        # config's micro-batch sizes and accumulation (named above)
        why = ", train.global_batch_size" if b.processes != a.processes else ""
        parts.append(f"global batch {' + '.join(kept)} " + ("kept" if same else
                     "(was " + " + ".join(str(b.global_batch(s)) for s in self.streams) + f"{why})"))
        return ", ".join(parts)

    def as_dict(self) -> dict:
        return {"checkpoint": str(self.checkpoint), "before": self.before.as_dict(), "after": self.after.as_dict(),
                "global_batch": {s: [self.before.global_batch(s), self.after.global_batch(s)] for s in self.streams}}


def fit_to_world(cfg, world: int):
    """(cfg, Resize or None) for an attempt of `world` processes: when the checkpoint to resume from was written by
    another number of processes, a config whose train.grad_accum (and where it must, micro-batch sizes) keep the
    checkpoint's global batch (train.global_batch_size, when set, is the batch asked for instead). Called before
    the Accelerator exists (every process the same; nothing is verified yet: the checkpoint's loop state is only
    read). train.micro_batch_size=auto chooses its own split of train.global_batch_size."""
    path = newest_target(cfg)
    if path is None or cfg.train.micro_batch_size == "auto":
        return cfg, None
    before = saved_layout(path, read_state(path), layout_of(cfg, world))
    if before is None or before.processes == world:
        return cfg, None
    streams = streams_of(cfg.loss.mode)
    t = cfg.train
    targets = {s: before.global_batch(s) for s in streams}
    if t.global_batch_size and "gen" in streams:
        targets["gen"] = t.global_batch_size
    caps = {"gen": t.micro_batch_size, "emb": t.emb_micro_batch_size}
    accum = choose_accum(targets, caps, world)
    if accum is None:
        raise ConfigError(refusal(path, before, targets, caps, world))
    micro = {s: targets[s] // (accum * world) for s in streams}
    train = replace(t, grad_accum=accum, micro_batch_size=micro.get("gen", t.micro_batch_size),
                    emb_micro_batch_size=micro.get("emb", t.emb_micro_batch_size))
    cfg = replace(cfg, train=train)
    return cfg, Resize(path, before, layout_of(cfg, world), streams)


def choose_accum(targets: dict, caps: dict, world: int) -> Optional[int]:
    """The fewest accumulation steps for which every stream's global batch splits into whole micro-batches no larger
    than the config's (the largest micro-batches that are known to fit), or None."""
    if any(g % world for g in targets.values()):
        return None
    per_process = {s: g // world for s, g in targets.items()}
    most = max(per_process.values())
    for accum in range(1, most + 1):
        if all(n % accum == 0 and n // accum <= caps[s] for s, n in per_process.items()):
            return accum
    return None


def refusal(path: Path, before: Layout, targets: dict, caps: dict, world: int) -> str:
    streams = tuple(targets)
    counts = [p for p in range(1, 2 * max(world, before.processes) + 1)
              if choose_accum(targets, caps, p) is not None]
    batch = " + ".join(f"{targets[s]} {'queries' if s == 'emb' else 'sequences'}" for s in streams)
    g = targets.get("gen", next(iter(targets.values())))
    near = sorted({max(world, g // world * world), (g // world + 1) * world})
    return (f"config key 'train.grad_accum': the run's global batch of {batch} per step ({path.name}: "
            f"{' / '.join(str(before.micro(s)) for s in streams)} x accumulation {before.grad_accum} x "
            f"{before.processes} process(es)) cannot be kept on {world} process(es) (no whole micro-batch of at most "
            f"{' / '.join(str(caps[s]) for s in streams)} x accumulation x {world} makes it); resume on "
            f"{', '.join(map(str, counts)) or 'the original number of'} process(es), or change the global batch "
            f"knowingly with train.global_batch_size (e.g. {' or '.join(map(str, near))})")


# ----------------------------------------------------------------------------------------------- the data position


def positions(saved_streams: dict, before: Optional[Layout], after: Layout, sizes: dict) -> tuple[dict, list[str]]:
    """Each stream's position {"epoch", "batches"} in the layout `after`, from the one saved under `before`: rows of
    the epoch consumed by all processes together (`samples`, saved with the position; older checkpoints:
    micro-batches x micro-batch x processes), as micro-batches per process of `after`. sizes: rows (or packed rows)
    an epoch per stream. Returns (positions, notes): a note where the rows do not divide into the new micro-batches
    (an epoch that began inside an optimizer step): the remainder is read again."""
    out, notes = {}, []
    for name, pos in saved_streams.items():
        if before is None or (before.micro(name) == after.micro(name) and before.processes == after.processes):
            out[name] = {"epoch": int(pos["epoch"]), "batches": int(pos["batches"])}
            continue
        rows = rows_read(pos, before, name, sizes[name])
        if rows >= sizes[name]:
            out[name] = {"epoch": pos["epoch"] + 1, "batches": 0}
            continue
        per_round = after.micro(name) * after.processes
        out[name] = {"epoch": pos["epoch"], "batches": rows // per_round}
        if rows % per_round:
            notes.append(f"{name}: the last {rows % per_round} of the {rows} rows read in epoch {pos['epoch']} do not "
                         f"fill a round of {after.processes} x {after.micro(name)}: they are read again")
    return out, notes


def carry_over(path: Path, saved: dict, after: Layout, streams: tuple, sizes: dict, universal: bool,
               assumed: Layout) -> tuple[dict, Optional[Resize], str]:
    """After loading checkpoint `path` (loop state `saved`) into the layout `after`: (each stream's position in
    `after`, the Resize when the layout changed (else None), what the resume line adds). assumed: the layout of a
    checkpoint that records none (an older harness): the config's before `fit_to_world`."""
    before = saved_layout(path, saved, assumed)
    moved, notes = positions(saved["streams"], before, after, sizes)
    if before is None or (before.processes, before.grad_accum) == (after.processes, after.grad_accum) and all(
            before.micro(s) == after.micro(s) for s in streams):
        return moved, None, ""
    resize = Resize(path, before, after, streams)
    rows = ", ".join(f"{n} {rows_read(saved['streams'][n], before, n, sizes[n])} rows of epoch "
                     f"{saved['streams'][n]['epoch']}" for n in streams)
    optimizer = ("ZeRO optimizer state repartitioned through a universal checkpoint (deepspeed ds_to_universal)"
                 if universal else "optimizer state loaded whole")
    line = (f"; layout changed: {resize.describe()}; data position by rows read ({rows}); {optimizer}"
            + "".join(f"; note: {n}" for n in notes))
    return moved, resize, line


def rows_read(pos: dict, layout: Layout, name: str, size: int) -> int:
    """Rows of the epoch all processes have read at stream position `pos` (its `samples`, or for a checkpoint of an
    older harness micro-batches x micro-batch x processes of `layout`), at most the epoch's `size`."""
    return min(int(pos.get("samples", pos["batches"] * layout.micro(name) * layout.processes)), size)


def samples_read(streams: dict, layout: Layout, sizes: dict) -> dict:
    """The positions with `samples`: rows of the epoch consumed by all processes (what `positions` converts)."""
    return {n: {**p, "samples": rows_read({"batches": p["batches"]}, layout, n, sizes[n])} for n, p in streams.items()}


# ----------------------------------------------------------------------------------------------- ZeRO's optimizer


def needs_universal(before: Optional[Layout], processes: int, zero_stage: Optional[int]) -> bool:
    """A DeepSpeed checkpoint loaded by another number of processes: its partitioned optimizer state goes through a
    universal checkpoint."""
    return zero_stage is not None and before is not None and before.processes != processes


def check_same_engine(path: Path, before: Optional[Layout], zero_stage: Optional[int]) -> None:
    """A checkpoint resumes under the engine and ZeRO stage it was written with (any process count): DDP / plain
    checkpoints (full model and optimizer state) and DeepSpeed ones (the engine's partitioned files) do not load into
    each other, and DeepSpeed 0.19's universal loader does not move ZeRO-3 state to stage 1 or 2 (measured: an
    AssertionError in its loader). One line naming the stage to launch with."""
    if before is None:
        return
    written: object = None  # None: DDP / plain; a stage; "DeepSpeed": an older harness's, stage unrecorded
    if (Path(path) / DS_TAG).is_dir():
        written = before.zero_stage if before.zero_stage is not None else "DeepSpeed"
    if written == zero_stage or (written == "DeepSpeed" and zero_stage is not None):
        return

    def name(stage) -> str:
        return ("DDP / one process without DeepSpeed" if stage is None else
                "DeepSpeed" if stage == "DeepSpeed" else f"DeepSpeed ZeRO-{stage}")

    flag = 0 if written is None else "N" if written == "DeepSpeed" else written
    raise ConfigError(f"config key 'train.resume': {path} was written under {name(written)} and this launch runs "
                      f"{name(zero_stage)}: resume under the stage it was written with (launch/train.sh --zero {flag} "
                      f"or its accelerate config), on any number of processes")


def check_same_weights(path: Path, before: Optional[Layout], weights: str) -> None:
    """A checkpoint resumes with the weights dtype it was trained with (train.weights): DeepSpeed's bf16 mode and its
    torch_autocast keep the optimizer state in different files (`bf16_zero_pp_rank_*` vs `zero_pp_rank_*`) and
    formats. Checkpoints of an older harness record no dtype: a DeepSpeed one with bf16 files had bf16 weights."""
    written = before.weights if before is not None else None
    if written is None and any((Path(path) / DS_TAG).glob("bf16_*optim_states.pt")):
        written = "bf16"
    if written not in ("fp32", "bf16") or weights not in ("fp32", "bf16") or written == weights:
        return
    raise ConfigError(f"config key 'train.weights': {path} was trained with {written} weights and this run has "
                      f"{weights} weights (their optimizer states differ): resume with train.weights={written}")


def load_universal(accelerator) -> None:
    """Before prepare(): DeepSpeed's engine loads universal checkpoints (`checkpoint.load_universal`)."""
    from harness.distributed import deepspeed_config

    deepspeed_config(accelerator).setdefault("checkpoint", {})["load_universal"] = True


@contextlib.contextmanager
def universal_view(accelerator, path: Path):
    """A folder accelerate's load_state reads like checkpoint `path`, with DeepSpeed's partitioned files converted by
    `deepspeed.checkpoint.ds_to_universal` (on the main process; the others wait) and the other files linked.
    Removed afterwards, whatever happens; the checkpoint is not touched."""
    from harness.distributed import all_gather, is_main

    path = Path(path)
    view = path.parent.parent / STAGING / path.name
    error = None
    if is_main(accelerator):
        try:
            convert(path, view)
        except Exception as e:  # noqa: BLE001 - one line on every process below
            shutil.rmtree(view, ignore_errors=True)
            error = one_line(e, 300)
    errors = [e for e in all_gather(accelerator, error) if e is not None]
    if errors:
        raise HarnessError(f"could not convert {path} to a universal checkpoint for another process count "
                           f"({errors[0]}); resume with the process count it was written with")
    try:
        yield view
    finally:
        accelerator.wait_for_everyone()
        if is_main(accelerator):
            shutil.rmtree(view, ignore_errors=True)
            with contextlib.suppress(OSError):
                view.parent.rmdir()


@contextlib.contextmanager
def repair_universal_load(accelerator):
    """Around a universal load, two fixes of DeepSpeed 0.19's ZeRO-3 universal loader
    (`load_hp_checkpoint_state_from_checkpoint_dir_stage3`), each measured as a weight difference after resuming:
    - it copies the first parameter group's settings to every group, which puts the matrices' weight decay on norms
      and biases: each group gets its own settings back (the learning rate is the schedule's);
    - it gives every parameter sub-group the same `step` tensor, which AdamW increments in place once per sub-group:
      the second sub-group's bias correction then runs a step ahead. Each state gets its own copy."""
    keep = ("params", "lr", "initial_lr", "step")
    groups = [g for opt in accelerator._optimizers for g in opt.param_groups]
    before = [{k: v for k, v in g.items() if k not in keep} for g in groups]
    yield
    for g, settings in zip(groups, before):
        g.update(settings)
    for opt in accelerator._optimizers:
        for state in opt.state.values():
            if hasattr(state.get("step"), "clone"):
                state["step"] = state["step"].clone()


def convert(path: Path, view: Path) -> None:
    """Checkpoint `path` -> `view`: DeepSpeed's ds_to_universal on its engine folder, every other file linked."""
    from harness.checkpoint.manifest import checkpoint_size
    from harness.files import free_bytes, human_bytes

    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    need, free = checkpoint_size(path / DS_TAG), free_bytes(view)
    if free < need:
        raise HarnessError(f"not enough disk space in {view.parent}: about {human_bytes(need)} needed, "
                           f"{human_bytes(free)} free")
    for item in path.iterdir():
        if item.name != DS_TAG:
            os.symlink(item.resolve(), view / item.name, target_is_directory=item.is_dir())
    # DeepSpeed's converter in a process of its own: its worker pool forks, which a training process (threads of
    # its own) must not do
    workers = str(max(1, min(4, os.cpu_count() or 1)))
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(path / DS_TAG),
           "--output_folder", str(view / DS_TAG), "--num_extract_workers", workers, "--num_merge_workers", "1",
           "--inject_missing_state"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
        raise HarnessError(f"ds_to_universal exited {done.returncode}: {lines[-1] if lines else 'no output'}")
