"""A recipe's `model.config` meeting a pretrained `model.name_or_path`: the pretrained shape wins.

Recipes carry a shape in `model.config` (a random-init model, and offline sizing in harness.tools.zero_plan). On a
pretrained model loaded with its weights, the keys that would change the weights' shapes are the checkpoint's: a
recipe value that differs is ignored and one line names the ignored keys (configs/default.yaml with
`model.name_or_path=Qwen/Qwen2.5-0.5B` trains Qwen's shape). Other keys (dropout, rope scaling, ...) still apply. With
`model.random_init=true` nothing is loaded, so every key applies.
"""

from __future__ import annotations

import os
import sys

# config keys whose value changes the shape or the number of a checkpoint's tensors (families' aliases included)
SHAPE_KEYS = frozenset({
    "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "vocab_size", "head_dim", "tie_word_embeddings", "max_position_embeddings", "moe_intermediate_size",
    "num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts", "shared_expert_intermediate_size",
    "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "d_model", "ffn_dim", "num_layers", "num_heads",
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "attention_bias",
    "mlp_bias", "model_type",
})


def pretrained_overrides(recipe: dict, pretrained) -> tuple[dict, list[str]]:
    """(the recipe's keys to apply to the `pretrained` transformers config, the shape keys ignored because the
    recipe's value differs from the checkpoint's). model_type is never applied (the checkpoint's own)."""
    keep, ignored = {}, []
    for key, value in recipe.items():
        if key == "model_type":
            continue
        if key in SHAPE_KEYS:
            if hasattr(pretrained, key) and getattr(pretrained, key) != value:
                ignored.append(key)
            continue
        keep[key] = value
    return keep, ignored


def say_ignored(name: str, ignored: list[str], pretrained) -> None:
    """One line on the main process naming the recipe's shape keys that the pretrained model overrides."""
    if ignored and os.environ.get("RANK", "0") == "0":
        theirs = ", ".join(f"{k}={getattr(pretrained, k)}" for k in ignored)
        print(f"[harness] model.config: {', '.join(ignored)} ignored: the pretrained model.name_or_path={name} keeps "
              f"its shape ({theirs}); set model.random_init=true to train the recipe's shape from scratch",
              file=sys.stderr, flush=True)


def pretrained_shape(cfg) -> dict:
    """model.config's keys (ModelConfig `cfg`) to apply to the pretrained model's config, saying which were ignored.
    model_type in model.config (recipes carry the shape for offline sizing, harness.tools.zero_plan) is the hub's own;
    with model.random_init every other key applies."""
    if cfg.random_init:
        return {k: v for k, v in cfg.config.items() if k != "model_type"}
    from transformers import AutoConfig

    theirs = AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    overrides, ignored = pretrained_overrides(cfg.config, theirs)
    say_ignored(cfg.name_or_path, ignored, theirs)
    return overrides
