"""Load or build the tokenizer and the model.

Three ways to get a model (config section `model`):
  * `name_or_path: <hub id or folder>`                  pretrained weights (offline if the files are local/cached)
  * `name_or_path: ... , random_init: true`             that architecture, random weights
  * `name_or_path: null, config: {model_type: llama, ...}`  a random model from a transformers config (the default
    job; vocab_size defaults to the tokenizer's size)

The chat markers used by harness.data (`<|user|>`, `<|assistant|>`, ...) are added to a tokenizer that lacks them
as special tokens, and the embedding matrix is resized to match.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from harness.config import ModelConfig
from harness.errors import ConfigError

BUNDLED_TOKENIZER = Path(__file__).parent / "assets" / "tokenizer"
CHAT_MARKERS = ["<|system|>", "<|user|>", "<|assistant|>", "<|embed|>"]


def _tokenizer_source(cfg: ModelConfig) -> str:
    src = cfg.tokenizer or cfg.name_or_path or "bundled"
    return str(BUNDLED_TOKENIZER) if src == "bundled" else src


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer, with a pad token and the chat markers guaranteed."""
    src = _tokenizer_source(cfg)
    try:
        tok = AutoTokenizer.from_pretrained(src, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config key 'model.tokenizer': cannot load tokenizer '{src}': {str(e).splitlines()[0]}")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    if tok.eos_token is None:
        raise ConfigError(f"config key 'model.tokenizer': tokenizer '{src}' has no eos token")
    missing = [m for m in CHAT_MARKERS if tok.convert_tokens_to_ids(m) in (None, tok.unk_token_id)]
    if missing:
        tok.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
    return tok


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype = torch.float32):
    """The causal LM in `dtype` (fp32 master weights for mixed precision), embeddings sized to the tokenizer."""
    common = dict(attn_implementation=cfg.attn_implementation, trust_remote_code=cfg.trust_remote_code)
    special = dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    try:
        if cfg.name_or_path is None:
            kwargs = {"vocab_size": len(tokenizer), **special, **cfg.config}
            model_type = kwargs.pop("model_type")
            mconf = AutoConfig.for_model(model_type, **kwargs)
            model = AutoModelForCausalLM.from_config(mconf, dtype=dtype, **common)
        else:
            mconf = AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code, **cfg.config)
            if cfg.random_init:
                model = AutoModelForCausalLM.from_config(mconf, dtype=dtype, **common)
            else:
                model = AutoModelForCausalLM.from_pretrained(cfg.name_or_path, config=mconf, dtype=dtype, **common)
    except (OSError, ValueError, KeyError) as e:
        what = cfg.name_or_path or cfg.config.get("model_type")
        raise ConfigError(f"config key 'model.name_or_path': cannot build model '{what}': {str(e).splitlines()[0]}")
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Total parameters, also under ZeRO-3 where each rank holds a shard (`ds_numel` is the full size)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
