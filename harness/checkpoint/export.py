"""The final export: the unwrapped model (weights gathered from every rank) and the tokenizer in HF format.

    <output_dir>/final/   model (safetensors) + tokenizer, loadable with AutoModelForCausalLM / AutoTokenizer;
                          with LoRA: the adapter (peft) + tokenizer, and final/merged/ the merged model;
                          an embedding or unified run: also a sentence-transformers model (checkpoint/st_export.py);
                          a vision-language model: its processor (tokenizer, image processor, chat template), for
                          AutoModelForImageTextToText / AutoProcessor

It is written to a temporary sibling folder and renamed into place, so a crash never leaves a half-written export
under the final name; the free space is compared with the size of the previous export (or of the weights) first.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from harness.checkpoint.manifest import folder_size
from harness.distributed.collectives import on_main
from harness.errors import HarnessError, one_line
from harness.files import disk_full, free_bytes, human_bytes, replace_dir
from harness.lora import is_peft, merged_copy, uses_trainable_tokens
from harness.checkpoint.st_export import write_sentence_transformers
from harness.checkpoint.adapter_tokens import trim_padding_rows


def export_final(accelerator, model, tokenizer, dest: str | Path, extra: Optional[dict] = None,
                 random_base: bool = False, processor=None) -> Path:
    """Save the unwrapped model (weights gathered from every rank) and tokenizer in HF format to `dest`.

    Call on every process: under DeepSpeed ZeRO-3 gathering the weights is a collective operation. Before writing,
    the free space is compared with the size of the previous export (or, for the first, of the weights); too little,
    or a disk that fills up while writing: a HarnessError on every process, the previous export and the checkpoints
    untouched. random_base: the model was built with random weights (no folder or hub id holds its base): a LoRA
    export also writes the base to dest/base/, which its adapter_config.json names. processor: a vision-language
    model's, saved in place of the tokenizer (the tokenizer, the image processor, the chat template).
    """
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    state_dict = accelerator.get_state_dict(model)  # collective: every rank takes part

    def write() -> None:
        if tmp.exists():
            shutil.rmtree(tmp)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_dir():
            need, what = folder_size(dest), f"the size of the previous export {dest.name}/"
        else:
            tensors = {(t.data_ptr(), t.numel() * t.element_size()) for t in state_dict.values()
                       if hasattr(t, "element_size")}  # tied weights (one tensor under two names) are saved once
            need, what = sum(n for _, n in tensors), "the size of the weights"
        free = free_bytes(dest.parent)
        if free < need:
            raise HarnessError(f"not enough disk space for the {what_export(dest)} in {dest.parent}: about {human_bytes(need)} "
                               f"needed ({what}), {human_bytes(free)} free; the checkpoints are intact: free some "
                               f"space, then run again with train.resume=auto")
        try:
            _write_export(accelerator, model, processor or tokenizer, state_dict, tmp, extra,
                          dest if random_base else None)
        except Exception as e:
            full = disk_full(e, dest.parent)
            shutil.rmtree(tmp, ignore_errors=True)
            if not full:
                raise
            raise HarnessError(f"disk full while writing the {what_export(dest)} to {dest.parent} ({one_line(e)}): about "
                               f"{human_bytes(need)} needed ({what}), {human_bytes(free_bytes(dest.parent))} free after "
                               f"removing the partial {tmp.name}/; the checkpoints are intact: free some space, then "
                               f"run again with train.resume=auto") from e
        replace_dir(tmp, dest)

    on_main(accelerator, write)  # also where every rank waits for the main process
    return dest


def what_export(dest: Path) -> str:
    """The export's name in its messages: the final export (final/), or the best/ export of train.keep_best."""
    return "final export" if dest.name == "final" else f"{dest.name}/ export"


def base_reference(base: Path, cwd: Optional[Path] = None) -> str:
    """What adapter_config.json names a random base by: peft's AutoPeftModelForCausalLM passes the stored value
    straight to from_pretrained, which resolves a relative path from the loader's current folder (not the adapter's).
    No one value loads from every folder, so: the path relative to the folder the run was started from when the
    run folder lies under it (runs/x/final/base: a copied project or run folder loads from the matching folder of the
    copy), else the absolute path. From any folder: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
    final/base), final), or final/merged/ (docs/run-folder.md)."""
    here = (cwd or Path.cwd()).resolve()
    full = base.resolve()
    return full.relative_to(here).as_posix() if full.is_relative_to(here) else str(full)


def adapter_base(final: str | Path) -> str:
    """The base an adapter folder loads on, from wherever the folder was copied: the name adapter_config.json stores
    where it loads from the current folder (a hub id, a folder that is there), else the folder's own base/ (a
    random-init base, written beside the adapter: base_reference's relative path read from the adapter instead of
    the current folder). harness's loaders take this; peft's AutoPeftModelForCausalLM takes the stored name as is."""
    final = Path(final)
    name = json.loads((final / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    own = final / "base"
    return str(own) if not (name and Path(name).is_dir()) and (own / "config.json").is_file() else name


def _write_export(accelerator, model, preprocessing, state_dict: dict, tmp: Path, extra: Optional[dict],
                  random_base_dest: Optional[Path] = None) -> None:
    """`preprocessing`: the tokenizer, or a vision-language model's processor (which holds the tokenizer)."""
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    kwargs = {}
    if is_peft(unwrapped) and uses_trainable_tokens(unwrapped):
        # the added tokens' rows are in the adapter (trainable_tokens_delta); peft would otherwise also save the
        # whole resized embedding matrices because the vocabulary grew
        kwargs["save_embedding_layers"] = False
    unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True, **kwargs)
    preprocessing.save_pretrained(tmp)
    if kwargs:  # the vocabulary's padding rows out of the adapter: peft's AutoPeft loader resizes to len(tokenizer)
        trim_padding_rows(tmp, len(getattr(preprocessing, "tokenizer", preprocessing)))
    for name, obj in (extra or {}).items():  # small JSON side files, e.g. harness.json
        (tmp / name).write_text(json.dumps(obj, indent=2))

    if is_peft(unwrapped):  # LoRA: final/ holds the adapter, final/merged/ the model with the adapter merged in
        merged_copy(unwrapped, state_dict).save_pretrained(tmp / "merged", safe_serialization=True)
        preprocessing.save_pretrained(tmp / "merged")
        if random_base_dest is not None:  # a random base exists nowhere else: final/base/, named by the adapter
            merged_copy(unwrapped, state_dict, merge=False).save_pretrained(tmp / "base", safe_serialization=True)
            preprocessing.save_pretrained(tmp / "base")
            adapter_config = json.loads((tmp / "adapter_config.json").read_text())
            adapter_config["base_model_name_or_path"] = base_reference(Path(random_base_dest) / "base")
            (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
        for name, obj in (extra or {}).items():
            (tmp / "merged" / name).write_text(json.dumps(obj, indent=2))

    write_sentence_transformers(tmp, (extra or {}).get("harness.json"))
