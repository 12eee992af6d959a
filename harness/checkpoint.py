"""Saving and resuming: full training checkpoints, rotation, the final HF-format export, the run report.

    <output_dir>/checkpoints/step-N/   accelerate save_state (model, optimizer, scheduler, RNG of every rank, sampler)
                                       + harness_state.json (step, epoch, data position, elapsed time, ...)
                                       + COMPLETE, written last: a folder without it is never resumed from
    <output_dir>/final/                model (safetensors) + tokenizer, loadable with AutoModelForCausalLM / AutoTokenizer;
                                       with LoRA: the adapter (peft) + tokenizer, and final/merged/ the merged model

The final export is written to a temporary sibling folder and renamed into place, so a crash never leaves a
half-written export under the final name.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

from harness.errors import ConfigError

MARKER = "COMPLETE"
STATE_FILE = "harness_state.json"


def _replace_dir(tmp: Path, dest: Path) -> None:
    """Move the finished `tmp` folder to `dest`, replacing an older `dest` (rename is atomic on one filesystem)."""
    old = dest.with_name(dest.name + ".old")
    if dest.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(dest, old)
    os.replace(tmp, dest)
    if old.exists():
        shutil.rmtree(old)


def export_final(accelerator, model, tokenizer, dest: str | Path, extra: Optional[dict] = None) -> Path:
    """Save the unwrapped model (weights gathered from every rank) and tokenizer in HF format to `dest`.

    Call on every process: under DeepSpeed ZeRO-3 gathering the weights is a collective operation.
    """
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    state_dict = accelerator.get_state_dict(model)  # collective: every rank takes part
    if accelerator.is_main_process:
        if tmp.exists():
            shutil.rmtree(tmp)
        unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name, obj in (extra or {}).items():  # small JSON side files, e.g. harness.json
            (tmp / name).write_text(json.dumps(obj, indent=2))
        from harness.model import is_peft, merged_copy

        if is_peft(unwrapped):  # LoRA: final/ holds the adapter, final/merged/ the model with the adapter merged in
            merged_copy(unwrapped, state_dict).save_pretrained(tmp / "merged", safe_serialization=True)
            tokenizer.save_pretrained(tmp / "merged")
            for name, obj in (extra or {}).items():
                (tmp / "merged" / name).write_text(json.dumps(obj, indent=2))
        _replace_dir(tmp, dest)
    accelerator.wait_for_everyone()
    return dest


def write_json(path: str | Path, obj: dict) -> None:
    """Write JSON atomically (temporary file + rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------- checkpoints


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / STATE_FILE).is_file()


def list_checkpoints(output_dir: str | Path) -> tuple[list[tuple[int, Path]], list[Path]]:
    """(complete checkpoints as (step, path) oldest first, incomplete folders)."""
    root = checkpoints_root(output_dir)
    complete, incomplete = [], []
    if root.is_dir():
        for p in root.iterdir():
            if not (p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()):
                continue
            (complete.append((int(p.name[5:]), p)) if is_complete(p) else incomplete.append(p))
    return sorted(complete), sorted(incomplete)


def save_checkpoint(accelerator, output_dir: str | Path, loop_state: dict, keep: int) -> Path:
    """Write checkpoints/step-N on every rank (collective), then the loop state, then the COMPLETE marker."""
    path = checkpoints_root(output_dir) / f"step-{loop_state['step']}"
    if accelerator.is_main_process and path.exists():
        shutil.rmtree(path)  # a leftover of a crash at this same step: never mix two saves in one folder
    accelerator.wait_for_everyone()
    accelerator.save_state(str(path))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_json(path / STATE_FILE, loop_state)
        with open(path / MARKER, "w") as fh:
            fh.write("complete\n")
            fh.flush()
            os.fsync(fh.fileno())
        rotate(output_dir, keep)
    accelerator.wait_for_everyone()
    return path


def rotate(output_dir: str | Path, keep: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep` (0: keep all) and incomplete folders older than the
    newest complete one; returns what was deleted."""
    complete, incomplete = list_checkpoints(output_dir)
    doomed = [p for _, p in complete[:-keep]] if keep > 0 else []
    if complete:
        newest = complete[-1][0]
        doomed += [p for p in incomplete if int(p.name[5:]) < newest]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def resolve_resume(output_dir: str | Path, resume: Optional[str]) -> tuple[Optional[Path], list[Path]]:
    """The checkpoint to resume from (None: start fresh) and the incomplete folders that were passed over.

    resume: "auto" (newest complete checkpoint, if any), a checkpoint folder, or None/"none" (fresh start; refused
    when output_dir already holds complete checkpoints, so that a restart never overwrites a run by accident).
    """
    complete, incomplete = list_checkpoints(output_dir)
    if resume in (None, "none", "null", ""):
        if complete:
            raise ConfigError(
                f"config key 'train.resume': {checkpoints_root(output_dir)} already holds checkpoints "
                f"(newest step-{complete[-1][0]}); use train.resume=auto to continue or another train.output_dir"
            )
        return None, incomplete
    if resume == "auto":
        return (complete[-1][1] if complete else None), incomplete
    path = Path(resume)
    if not path.is_dir():
        raise ConfigError(f"config key 'train.resume': {path} is not a folder")
    if not is_complete(path):
        raise ConfigError(f"config key 'train.resume': {path} is not a complete checkpoint (no {MARKER} marker or "
                          f"{STATE_FILE})")
    return path, incomplete


def load_checkpoint(accelerator, path: Path) -> dict:
    """Restore the accelerate state (every rank) and return the loop state saved with it."""
    accelerator.load_state(str(path))
    return json.loads((path / STATE_FILE).read_text())


class Checkpointer:
    """Decides when a checkpoint is due and writes it: every `train.save_every_steps` steps, when
    `train.save_every_minutes` have passed (a fact every process agrees on, see harness/stopping.py), and when the
    attempt stops early. Knows what its last save cost (the time window keeps room for one more)."""

    def __init__(self, accelerator, output_dir: Path, every_steps: int, every_minutes: float, keep: int,
                 say: Callable[[str], None], on_saved: Callable[[float], None]):
        self.accelerator, self.output_dir, self.keep, self.say, self.on_saved = accelerator, output_dir, keep, say, on_saved
        self.every_steps, self.every_minutes = every_steps, every_minutes
        self.last_save = time.time()
        self.cost_s = 10.0  # until the first save measures it

    def minutes_due(self) -> bool:
        """train.save_every_minutes have passed since the last save (or the loop's start), by this process's clock."""
        return self.every_minutes > 0 and time.time() - self.last_save >= 60 * self.every_minutes

    def due(self, step: int, forced: bool) -> bool:
        return forced or bool(self.every_steps and step % self.every_steps == 0)

    def save(self, loop_state: dict) -> Path:
        t = time.time()
        path = save_checkpoint(self.accelerator, self.output_dir, loop_state, self.keep)
        self.last_save = time.time()
        self.cost_s = self.last_save - t
        self.on_saved(self.cost_s)
        self.say(f"[harness] checkpoint: {path} ({self.cost_s:.1f}s)")
        return path
