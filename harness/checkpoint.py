"""Saving: the final HF-format export (atomic) and the run report.

    <output_dir>/final/   model (safetensors) + tokenizer, loadable with AutoModelForCausalLM / AutoTokenizer

Writes go to a temporary sibling folder that is renamed into place only when complete, so a crash never leaves a
half-written export behind under the final name.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


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


def export_final(accelerator, model, tokenizer, dest: str | Path) -> Path:
    """Save the unwrapped model (weights gathered from every rank) and tokenizer in HF format to `dest`.

    Call on every process: under DeepSpeed ZeRO-3 gathering the weights is a collective operation.
    """
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    state_dict = accelerator.get_state_dict(model)  # collective: every rank takes part
    if accelerator.is_main_process:
        if tmp.exists():
            shutil.rmtree(tmp)
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _replace_dir(tmp, dest)
    accelerator.wait_for_everyone()
    return dest


def write_json(path: str | Path, obj: dict) -> None:
    """Write JSON atomically (temporary file + rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)
