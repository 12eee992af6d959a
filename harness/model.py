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
    return apply_lora(model, cfg)


# ----------------------------------------------------------------------------------------------- LoRA


def apply_lora(model, cfg: ModelConfig):
    """With `model.lora.enabled`, wrap the model in a peft LoRA model: base weights frozen, adapters trainable
    (works under DDP and ZeRO-1/2/3: the adapters are ordinary parameters). Otherwise the model unchanged."""
    from harness.config import lora_config

    lc = lora_config(cfg)
    if not lc.enabled:
        return model
    from peft import LoraConfig, get_peft_model

    targets = lc.target_modules
    try:
        peft_cfg = LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=targets,
                              task_type="CAUSAL_LM")
        return get_peft_model(model, peft_cfg)
    except ValueError as e:
        raise ConfigError(f"config key 'model.lora.target_modules': {str(e).splitlines()[0]}")


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def merged_copy(peft_model, state_dict: dict):
    """A plain transformers model equal to `peft_model` with its adapters merged into the base weights, rebuilt from
    the full `state_dict` (gathered from every rank under ZeRO-3) on a fresh copy of the architecture."""
    from peft import get_peft_model

    from harness.distributed import without_zero3_init

    base_cfg = peft_model.get_base_model().config
    with without_zero3_init():  # a merge on one rank must not enter the collective zero.Init
        fresh = AutoModelForCausalLM.from_config(base_cfg, dtype=torch.float32)
    fresh.resize_token_embeddings(base_cfg.vocab_size)
    adapter = get_peft_model(fresh, peft_model.peft_config["default"])
    missing, unexpected = adapter.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=False)
    tied = set(getattr(fresh, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if not any(k.endswith(t) for t in tied) and "lm_head" not in k]
    if missing or unexpected:
        raise RuntimeError(f"merging LoRA: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return adapter.merge_and_unload()



def count_parameters(model: torch.nn.Module) -> int:
    """Total parameters, also under ZeRO-3 where each rank holds a shard (`ds_numel` is the full size)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


# ----------------------------------------------------------------------------------------------- embedding passes
#
# Bidirectional attention without copied modeling files: the model families below build their attention mask with
# transformers' masking_utils, which passes a 4-D mask through unchanged. An embedding pass hands them a 4-D
# additive mask that hides only padding keys, so every token sees every other token; generation passes keep the
# usual 2-D padding mask and stay causal. Verified by tests/test_model.py for each family listed.
BIDIRECTIONAL_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
BIDIRECTIONAL_KERNELS = ("sdpa", "eager")


def check_embedding_support(model_type: str, attn_implementation: str, attention: str) -> None:
    if attention != "bidirectional":
        return
    if model_type not in BIDIRECTIONAL_FAMILIES:
        raise ConfigError(
            f"config key 'model.embed_attention': bidirectional attention is not available for model type "
            f"'{model_type}' (supported: {', '.join(BIDIRECTIONAL_FAMILIES)}); use model.embed_attention=causal"
        )
    if attn_implementation not in BIDIRECTIONAL_KERNELS:
        raise ConfigError(
            f"config key 'model.attn_implementation': bidirectional embedding passes need sdpa or eager, "
            f"got {attn_implementation}"
        )


def bidirectional_mask(attention_mask: torch.Tensor, attn_implementation: str) -> torch.Tensor:
    """[B, S] padding mask -> [B, 1, S, S] mask that hides only padding keys: boolean (True = attend) for sdpa,
    additive fp32 (0 or the minimum) for eager attention."""
    keys = attention_mask[:, None, None, :].to(torch.bool).expand(-1, 1, attention_mask.size(1), -1)
    if attn_implementation == "sdpa":
        return keys
    return torch.zeros(keys.shape, device=keys.device).masked_fill(~keys, torch.finfo(torch.float32).min)


def embed(model, batch: dict, pooling: str, bidirectional: bool) -> torch.Tensor:
    """Normalised fp32 embeddings of a padded batch {input_ids, attention_mask, pool_mask}. Goes through the
    (possibly DDP/DeepSpeed-wrapped) model's own forward; logits only for the last position (cheap)."""
    from harness.losses import pool

    mask = batch["attention_mask"]
    if bidirectional:
        impl = getattr(_config_of(model), "_attn_implementation", "sdpa")
        mask = bidirectional_mask(mask, impl)
    out = model(input_ids=batch["input_ids"], attention_mask=mask, output_hidden_states=True, logits_to_keep=1,
                use_cache=False)
    return pool(out.hidden_states[-1], batch["pool_mask"], pooling)


def _config_of(model):
    """The HF config of a model, through DDP (.module) or DeepSpeed (.module) wrappers."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return model.config
