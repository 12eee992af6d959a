"""LoRA and QLoRA through peft and bitsandbytes: the quantized base's load arguments, the LoRA wrap (with the rows
the resize added trained as peft's trainable tokens), and the merge of a trained adapter into a plain model for final/.
harness.model.build_model calls them; harness.checkpoint.export and harness.chunked_loss read the wrapped model."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from harness.config import ModelConfig
from harness.errors import ConfigError
from harness.config import lora_config
from harness.distributed.zero import without_zero3_init
from harness import moe

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def quantization_kwargs(quantization: str, precision: str) -> dict:
    """from_pretrained kwargs that load the base quantized by bitsandbytes on this process's device. One-line
    ConfigError when bitsandbytes is not installed."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"config key 'model.quantization': {quantization} needs bitsandbytes, which is not "
                          f"installed: pip install 'harness[qlora]' (or bitsandbytes>=0.50.0)")
    from transformers import BitsAndBytesConfig

    if quantization == "4bit":
        qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=COMPUTE_DTYPES[precision])
    else:
        qc = BitsAndBytesConfig(load_in_8bit=True)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return {"quantization_config": qc, "device_map": {"": device}}


def keep_4bit_training_layout(model) -> None:
    """bitsandbytes 0.50 repacks a 4-bit layer's weight in place for its AVX512-BF16 CPU kernel (absmax in bf16) the
    first time the layer runs in eval mode without gradients: an evaluation pass or the RL engine's generation. The
    training passes after it then ran the repacked weight (a 64 x 64 layer's outputs 7e-3 off), and small layers
    failed to repack ("shape '[32, 0]' is invalid"). Turned off here, every pass runs the layout training uses,
    whatever the CPU's instruction set (tests/test_qlora.py)."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False


def is_quantized(model) -> bool:
    base = model.get_base_model() if is_peft(model) else model
    return getattr(base, "hf_quantizer", None) is not None or getattr(base, "is_loaded_in_4bit", False) or \
        getattr(base, "is_loaded_in_8bit", False)


# ----------------------------------------------------------------------------------------------- LoRA


def apply_lora(model, cfg: ModelConfig, added_tokens: list[int] | None = None, exclude: str | None = None):
    """With `model.lora.enabled`, wrap the model in a peft LoRA model: base weights frozen, adapters trainable
    (works under DDP and ZeRO-1/2/3: the adapters are ordinary parameters). Otherwise the model unchanged.

    `added_tokens`: the rows the resize added to the base's vocabulary: the tokens the tokenizer added (the chat
    markers) and the padding up to a multiple of 64, randomly drawn by every resize (a user's too). They are trained
    through peft's `trainable_token_indices` and saved with the adapter (`trainable_tokens_delta`, those rows alone),
    so that base + adapter is the trained model for every id. A tied head follows the embedding; an untied one too.
    `exclude`: a regex of module names never adapted (a vision-language model's vision tower)."""
    lc = lora_config(cfg)
    if not lc.enabled:
        return model
    from peft import LoraConfig, get_peft_model

    refuse_trainable_tokens_without_cuda(added_tokens)
    targets = lc.target_modules
    try:
        peft_cfg = LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=targets,
                              exclude_modules=exclude, task_type="CAUSAL_LM",
                              trainable_token_indices=_token_targets(model, added_tokens),
                              target_parameters=moe.expert_targets(model) if lc.experts else None)  # MoE experts
        return get_peft_model(model, peft_cfg)
    except ValueError as e:
        raise ConfigError(f"config key 'model.lora.target_modules': {str(e).splitlines()[0]}")


def refuse_trainable_tokens_without_cuda(added: list[int] | None) -> None:
    """peft (0.21) gathers the added rows of a ZeRO-3 partitioned embedding onto a CUDA device whatever the run's
    device (TrainableTokensLayer._collect_token_weights: "only CUDA is implemented"), so LoRA with added tokens under
    ZeRO-3 on a machine without CUDA would stop in a raw "Torch not compiled with CUDA enabled" traceback on every
    rank: one line instead, with what does run."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if added and is_deepspeed_zero3_enabled() and not torch.cuda.is_available():
        raise ConfigError(
            f"config key 'model.lora.enabled': LoRA on a base whose tokenizer lacks the run's chat markers "
            f"({len(added)} new embedding rows, trained through peft's trainable tokens) under ZeRO-3 needs a CUDA "
            f"GPU: peft initialises those rows on CUDA only; without one use ZeRO-2 (train.deepspeed=zero2 or "
            f"accelerate_configs/zero2.yaml) or a base whose tokenizer has the markers")


def _token_targets(model, added: list[int] | None):
    """peft's trainable_token_indices for the added rows: a list (the input embedding; a tied head follows it) or,
    with an untied head, {input embedding module: rows, output head module: rows}. None when nothing was added."""
    if not added:
        return None
    inputs, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or head.weight is inputs.weight:
        return list(added)
    names = {id(m): n for n, m in model.named_modules()}
    return {names[id(inputs)]: list(added), names[id(head)]: list(added)}


def uses_trainable_tokens(peft_model) -> bool:
    return any(getattr(c, "trainable_token_indices", None) for c in peft_model.peft_config.values())


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def merged_copy(peft_model, state_dict: dict, merge: bool = True):
    """A plain transformers model equal to `peft_model` with its adapters merged into the base weights, rebuilt from
    the full `state_dict` (gathered from every rank under ZeRO-3) on a fresh copy of the architecture. merge=False:
    the base alone, the adapters left out (the base a random-init run's adapter applies to)."""
    from peft import get_peft_model

    base_cfg = peft_model.get_base_model().config
    peft_cfg = peft_model.peft_config["default"]
    if is_quantized(peft_model):
        # QLoRA: the adapters go into the base's original full-precision weights, loaded again unquantized (the
        # quantized ones in `state_dict` are packed); every other tensor (embeddings, norms, head) is taken from
        # `state_dict` as trained. The merged model differs from the trained one by the quantization error.
        fresh = AutoModelForCausalLM.from_pretrained(peft_cfg.base_model_name_or_path, dtype=torch.float32)
        fresh.resize_token_embeddings(base_cfg.vocab_size)
        adapter = get_peft_model(fresh, peft_cfg)
        shapes = {k: v.shape for k, v in adapter.state_dict().items()}
        state_dict = {k: v for k, v in state_dict.items() if k in shapes and v.shape == shapes[k] and v.is_floating_point()}
        adapter.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=False)
        missing = [k for k in ("lora_", "trainable_tokens_delta") if any(k in n for n in shapes)
                   and not any(k in n for n in state_dict)]
        if missing:
            raise RuntimeError(f"merging QLoRA: no {missing[0]} tensors in the trained state dict")
        return adapter.merge_and_unload()
    with without_zero3_init():  # a merge on one rank must not enter the collective zero.Init
        # the base's own class (a causal LM, or a vision-language model's image-text-to-text class)
        fresh = type(peft_model.get_base_model())._from_config(base_cfg, dtype=torch.float32)
    fresh.resize_token_embeddings(base_cfg.get_text_config().vocab_size)  # (a vision-language model: its text's)
    adapter = get_peft_model(fresh, peft_cfg)
    missing, unexpected = adapter.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=False)
    tied = set(getattr(fresh, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if not any(k.endswith(t) for t in tied) and "lm_head" not in k]
    if missing or unexpected:
        raise RuntimeError(f"merging LoRA: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return adapter.merge_and_unload() if merge else adapter.unload()
