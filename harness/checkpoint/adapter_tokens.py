"""The added tokens' rows of a LoRA adapter in final/, saved so that peft's one-line loader takes it.

Training resizes the base's vocabulary to the tokenizer with padding to a multiple of 64 (harness.model.build_model)
and trains every new row through peft's `trainable_token_indices`. peft's `AutoPeftModelForCausalLM.from_pretrained`
resizes the base to len(tokenizer) exactly (no padding), so indices of the padding rows would point past the
embedding (IndexError). The padding rows belong to no token the tokenizer can produce: the adapter keeps the rows of
the tokenizer's ids alone (`trim_padding_rows`), and base + adapter gives the trained model's logits for every id the
tokenizer has, loaded either way (AutoPeft, or a resize to len(tokenizer) and PeftModel.from_pretrained).

An adapter saved before this (padding rows included) is trimmed in place by
`python -c "from harness.checkpoint.adapter_tokens import trim_padding_rows; trim_padding_rows('runs/x/final')"`.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def padding_indices(folder: str | Path, n_tokens: int) -> list[int]:
    """The trainable token indices in `folder`'s adapter_config.json at or beyond `n_tokens` (sorted, unique)."""
    indices = json.loads((Path(folder) / CONFIG).read_text()).get("trainable_token_indices")
    lists = indices.values() if isinstance(indices, dict) else [indices or []]
    return sorted({i for rows in lists for i in rows if i >= n_tokens})


def trim_padding_rows(folder: str | Path, n_tokens: int | None = None) -> bool:
    """Drop the rows at or beyond `n_tokens` (default: len of the tokenizer saved in `folder`) from the adapter's
    trainable_token_indices and its trainable_tokens_delta tensors, in place. True when something was dropped."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    if n_tokens is None:
        from transformers import AutoTokenizer

        n_tokens = len(AutoTokenizer.from_pretrained(folder))
    config = json.loads((folder / CONFIG).read_text())
    indices = config.get("trainable_token_indices")
    if not indices or not padding_indices(folder, n_tokens):
        return False
    tensors = load_file(str(folder / WEIGHTS))
    deltas = [k for k in tensors if "trainable_tokens_delta" in k]
    if isinstance(indices, dict):  # {module name: rows}; a key's tensor names end with <module>.token_adapter...
        for module, rows in indices.items():
            keep = [j for j, i in enumerate(rows) if i < n_tokens]
            for k in deltas:
                if k.split(".token_adapter")[0].endswith(module):
                    tensors[k] = tensors[k][keep].contiguous()
            indices[module] = [rows[j] for j in keep]
    else:
        keep = [j for j, i in enumerate(indices) if i < n_tokens]
        for k in deltas:
            tensors[k] = tensors[k][keep].contiguous()
        config["trainable_token_indices"] = [indices[j] for j in keep]
    save_file({k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in tensors.items()},
              str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return True
