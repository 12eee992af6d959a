"""A DeepSpeed ZeRO checkpoint loaded by another number of processes: DeepSpeed's own `ds_to_universal` converts its
partitioned optimizer state into a universal checkpoint (`universal_view`, a staging folder beside the checkpoint,
removed after loading), which DeepSpeed's `checkpoint.load_universal` (`load_universal`) repartitions for the new
process count. The checkpoint itself is never changed. Called by harness/checkpoint/resume.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from harness.checkpoint.manifest import checkpoint_size
from harness.distributed.collectives import all_gather, is_main
from harness.distributed.zero import deepspeed_config
from harness.errors import HarnessError, one_line
from harness.files import free_bytes, human_bytes

DS_TAG = "pytorch_model"  # the folder accelerate's save_state gives DeepSpeed's engine inside a checkpoint
STAGING = ".resharded"  # <output_dir>/.resharded/step-N: a checkpoint's universal view while it is loaded


def load_universal(accelerator) -> None:
    """Before prepare(): DeepSpeed's engine loads universal checkpoints (`checkpoint.load_universal`)."""
    deepspeed_config(accelerator).setdefault("checkpoint", {})["load_universal"] = True


@contextlib.contextmanager
def universal_view(accelerator, path: Path):
    """A folder accelerate's load_state reads like checkpoint `path`, with DeepSpeed's partitioned files converted by
    `deepspeed.checkpoint.ds_to_universal` (on the main process; the others wait) and the other files linked.
    Removed afterwards, whatever happens; the checkpoint is not touched."""
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
