"""Load or build the tokenizer and the model.

Three ways to get a model (config section `model`):
  * `name_or_path: <hub id or folder>`                  pretrained weights (offline if the files are local/cached)
  * `name_or_path: ... , random_init: true`             that architecture, random weights
  * `name_or_path: null, config: {model_type: llama, ...}`  a random model from a transformers config (the default
    job; vocab_size defaults to the tokenizer's size)

The chat markers used by harness.data.samples (`<|user|>`, `<|assistant|>`, ...) are added to a tokenizer that lacks them
as special tokens, and the embedding matrix is resized to match.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

import torch
from huggingface_hub import constants as hub_constants, snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer,
                          PreTrainedTokenizerBase)
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from harness.config import ModelConfig
from harness.config.modes import facts
from harness.errors import ConfigError
from harness.lora import apply_lora, keep_4bit_training_layout, quantization_kwargs
from harness.data.chat import CHAT_MARKERS, resolve_template, uses_markers
from harness.data import vision
from harness.losses import pool
from harness import moe
from harness.config.shape import pretrained_shape

BUNDLED_TOKENIZER = Path(__file__).parent / "assets" / "tokenizer"


def _tokenizer_source(cfg: ModelConfig) -> str:
    src = cfg.tokenizer or cfg.name_or_path or "bundled"
    return str(BUNDLED_TOKENIZER) if src == "bundled" else src


def source_problem(name: str) -> Optional[str]:
    """Why a model or tokenizer source cannot load, found before transformers tries, or None: a path that is not
    there (transformers would call it a malformed repo id), or a hub id missing from the local cache while the hub is
    out of reach (HF_HUB_OFFLINE set, or its host not resolvable: huggingface_hub would retry for 30-50 s first)."""
    if Path(name).exists():
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return missing_folder(name)
    try:
        snapshot_download(name, local_files_only=True)
        return None
    except LocalEntryNotFoundError:
        pass
    offline = hub_constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    host = urlparse(hub_constants.ENDPOINT).hostname or hub_constants.ENDPOINT
    proxied = any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"))
    if not offline:
        if proxied:  # the host may resolve behind the proxy only: leave it to the download
            return None
        try:
            socket.getaddrinfo(host, 443)
            return None  # reachable: transformers downloads it (or says the hub has no such repo)
        except OSError:
            pass
    why = "HF_HUB_OFFLINE is set" if offline else f"{host} cannot be reached (no network)"
    return (f"not a folder here and not in the local hub cache ({hub_constants.HF_HUB_CACHE}), and {why}: download it "
            f"where there is a network (hf download {name}, into that cache) or give a local folder")


def missing_folder(name: str) -> str:
    """The folder `name` that is not there, and how a run's export gets made."""
    made = ""
    if Path(name).name in ("final", "best", "merged"):
        run = Path(name).parent if Path(name).name != "merged" else Path(name).parent.parent
        recipe = recipe_writing(run)
        how = f"harness train {recipe}" if recipe else f"train the recipe with train.output_dir={run}"
        made = f"; a run's {Path(name).name}/ is written when its training ends: {how} first"
    return f"no such folder {name} (relative paths are read from {os.getcwd()}){made}"


def recipe_writing(run: Path) -> Optional[str]:
    """The recipe in ./configs/ whose train.output_dir is `run` (read as text: the first one, by name), or None."""
    line = re.compile(rf"^\s+output_dir:\s*['\"]?{re.escape(run.as_posix())}/?['\"]?\s*(#.*)?$", re.M)
    for recipe in sorted(Path("configs").glob("*.yaml")):
        try:
            if line.search(recipe.read_text()):
                return recipe.as_posix()
        except (OSError, UnicodeDecodeError):
            continue
    return None


def load_tokenizer(cfg: ModelConfig, chat_template: str = "auto",
                   markers: bool | None = True) -> PreTrainedTokenizerBase:
    """The tokenizer with a pad token and its chat template resolved from `chat_template` (data.chat_template) and
    set on it (so save_pretrained stores it). markers: add the GritLM chat markers as special tokens (True),
    never (False), or only when the chat layout uses them (None)."""
    src = _tokenizer_source(cfg)
    problem = source_problem(src)
    if problem and not cfg.tokenizer:  # the model's own tokenizer: the first thing read from model.name_or_path
        raise ConfigError(f"config key 'model.name_or_path': cannot load '{src}': {problem}")
    if problem:
        raise ConfigError(f"config key 'model.tokenizer': cannot load tokenizer '{src}': {problem}")
    try:
        tok = AutoTokenizer.from_pretrained(src, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        hint = (" (model.tokenizer is null, so the tokenizer is model.name_or_path's own: set model.tokenizer to a "
                "hub id, a folder, or 'bundled')" if not cfg.tokenizer and cfg.name_or_path else "")
        raise ConfigError(f"config key 'model.tokenizer': cannot load tokenizer '{src}': "
                          f"{str(e).splitlines()[0]}{hint}")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    if tok.eos_token is None:
        raise ConfigError(f"config key 'model.tokenizer': tokenizer '{src}' has no eos token")
    tok.chat_template = resolve_template(tok, chat_template, src)
    missing = [m for m in CHAT_MARKERS if tok.convert_tokens_to_ids(m) in (None, tok.unk_token_id)]
    if missing and (markers or (markers is None and uses_markers(tok.chat_template))):
        tok.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
    return tok


def load_run_tokenizer(m: ModelConfig, chat_template: str, loss_mode: str) -> PreTrainedTokenizerBase:
    """A run's tokenizer (`m`: cfg.model): data.chat_template resolved; the GritLM markers only where they are used
    (the GritLM chat layout, or the embedding templates of loss.mode embedding/unified)."""
    markers = True if facts(loss_mode).embeds else None
    return load_tokenizer(m, chat_template, markers=markers)


def _load(cfg: ModelConfig, mconf, dtype: torch.dtype, common: dict):
    auto_class = AutoModelForImageTextToText if is_vision_config(mconf) else AutoModelForCausalLM
    if cfg.name_or_path is None or cfg.random_init:
        return auto_class.from_config(mconf, dtype=dtype, **common)
    return auto_class.from_pretrained(cfg.name_or_path, config=mconf, dtype=dtype, **common)


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype = torch.float32,
                precision: str = "fp32", packed_causal: bool = False):
    """The causal LM in `dtype` (fp32 master weights for mixed precision), embeddings sized to the tokenizer.
    With model.quantization, the pretrained base is loaded quantized (bitsandbytes; computing in `precision`) and
    prepared for k-bit training (peft's prepare_model_for_kbit_training) before LoRA goes on top.
    `packed_causal`: every forward pass is causal over packed rows (generative training with data.packing), where
    model.attn_implementation=auto picks flex attention on a CUDA GPU (see `auto_attention`)."""
    auto = cfg.attn_implementation == "auto"
    common = dict(attn_implementation="sdpa" if auto else cfg.attn_implementation,
                  trust_remote_code=cfg.trust_remote_code)
    if cfg.quantization != "none":
        common.update(quantization_kwargs(cfg.quantization, precision))
    special = dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    try:
        if cfg.name_or_path is None:
            kwargs = {"vocab_size": len(tokenizer), **special, **cfg.config}
            model_type = kwargs.pop("model_type")
            if model_type in vision.QWEN_VL:  # the vision markers' ids: the tokenizer's
                kwargs = {**vision.token_ids(tokenizer), **kwargs}
            mconf = AutoConfig.for_model(model_type, **kwargs)
        else:
            problem = source_problem(cfg.name_or_path)
            if problem:
                raise ConfigError(f"config key 'model.name_or_path': cannot build model '{cfg.name_or_path}': "
                                  f"{problem}")
            overrides = pretrained_shape(cfg)
            mconf = AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code, **overrides)
        if auto:
            common["attn_implementation"] = auto_attention(mconf, packed_causal)
        common.update(moe.experts_kwargs(mconf, cfg.experts_implementation))  # MoE: the experts' kernel
        try:
            model = _load(cfg, mconf, dtype, common)
        except ValueError as e:  # experts that are separate modules (remote code): auto leaves them as they are
            if cfg.experts_implementation != "auto" or "support setting experts implementation" not in str(e):
                raise
            common.pop("experts_implementation")
            model = _load(cfg, mconf, dtype, common)
    except (OSError, ValueError, KeyError) as e:
        what = cfg.name_or_path or cfg.config.get("model_type")
        raise ConfigError(f"config key 'model.name_or_path': cannot build model '{what}': {str(e).splitlines()[0]}")
    base_vocab = model.get_input_embeddings().num_embeddings
    if base_vocab < len(tokenizer):  # (mean_resizing: the new rows from the old ones' statistics, none on the meta
        # device, where harness zero-plan counts the shape)
        meta = model.get_input_embeddings().weight.device.type == "meta"
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64, mean_resizing=not meta)
    text_config = model.config.get_text_config()  # a vision-language model: its language model's
    if getattr(text_config, "pad_token_id", None) is None:
        text_config.pad_token_id = tokenizer.pad_token_id
    if cfg.quantization != "none":
        from peft import prepare_model_for_kbit_training

        keep_4bit_training_layout(model)
        # norms and embeddings to fp32, inputs' gradients on; activation checkpointing as below (non-reentrant)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    added = list(range(base_vocab, model.get_input_embeddings().num_embeddings))  # new rows: added tokens, padding
    model = apply_lora(model, cfg, added_tokens=added,
                       exclude=VISION_MODULES if is_vision_config(model.config) and not cfg.train_vision else None)
    if is_vision_config(model.config):
        freeze_vision(model, cfg.train_vision, cfg.train_projector)
    if not cfg.train_router:  # MoE: model.train_router=false
        moe.freeze_router(model)
    return model.train()  # from_pretrained leaves it in eval mode


# vision-language models: the vision tower's modules and, within them, the projector's (parameter name parts)
VISION_MODULES = r".*(visual|vision_tower|vision_model)\..*"
PROJECTOR_PARTS = ("visual.merger.", "multi_modal_projector.")


def is_vision_config(mconf) -> bool:
    """Whether a transformers config is a vision-language model's (an image-text-to-text class)."""
    return mconf.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def freeze_vision(model, train_vision: bool, train_projector: bool) -> None:
    """model.train_vision=false: the vision tower's weights frozen; its projector as model.train_projector says."""
    tower = re.compile(VISION_MODULES)
    for name, p in model.named_parameters():
        if train_vision or not tower.match(name):
            continue
        if not (train_projector and any(part in name for part in PROJECTOR_PARTS)):
            p.requires_grad_(False)


def auto_attention(mconf, packed_causal: bool) -> str:
    """What model.attn_implementation=auto runs. Packed rows need a block-diagonal causal mask (no attention across
    documents). On a CUDA GPU, flex attention with a document BlockMask skips the masked-out blocks and ran that
    fastest (H100, docs/benchmarks.md: forward + backward 1.29 ms vs 2.07 ms for sdpa's cuDNN kernel with a boolean
    mask and 1.53 ms for flash varlen; end to end +20% tokens/s on the 1B recipe). Elsewhere sdpa (flex attention
    has no backward pass on CPUs; embedding passes need sdpa's bidirectional mask), else eager (one line says so)."""
    if packed_causal and torch.cuda.is_available() and supports_attention(mconf, "_supports_flex_attn"):
        print("harness: model.attn_implementation=auto: flex_attention (packed rows on a CUDA GPU)", flush=True)
        return "flex_attention"
    if supports_attention(mconf, "_supports_sdpa"):
        return "sdpa"
    print(f"harness: model.attn_implementation=auto: {mconf.model_type} does not support sdpa, using eager", flush=True)
    return "eager"


def supports_attention(mconf, flag: str, default: bool = True) -> bool:
    """Whether the causal-LM class of this config declares an attention kernel (`_supports_sdpa`,
    `_supports_flex_attn`). Unknown classes (remote code): `default` (their own error then says why)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(mconf)]
    except KeyError:
        return default
    return bool(getattr(cls, flag, default))


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
    (possibly DDP/DeepSpeed-wrapped) model's own forward; logits only for the last position (cheap).

    With an untied, trainable output head (tie_word_embeddings=false) and autograd on, the embeddings are tied to
    those logits by a zero gradient (`_ZeroGradTie`): the head then takes part in every backward pass with a
    gradient of exactly zero, as the distributed reducers expect of every trainable parameter (see the class)."""
    mask = batch["attention_mask"]
    if bidirectional:
        impl = getattr(unwrap(model).config, "_attn_implementation", "sdpa")
        mask = bidirectional_mask(mask, impl)
    with FinalHiddenState(model) as final:
        out = model(input_ids=batch["input_ids"], attention_mask=mask, logits_to_keep=1, use_cache=False)
    emb = pool(final.value, batch["pool_mask"], pooling)
    logits = getattr(out, "logits", None)
    if emb.requires_grad and logits is not None and logits.requires_grad and has_untied_trainable_head(model):
        emb = _ZeroGradTie.apply(emb, logits)
    return emb


class FinalHiddenState:
    """The decoder's last hidden state (after the final norm: what `hidden_states[-1]` holds) of one forward pass,
    taken by a forward hook on the decoder (`get_decoder()`, which runs eagerly under regional compile).

    Not `output_hidden_states=True`: that makes transformers install output-capturing hooks on every decoder layer
    and attention module, for every later forward too, and under regional compile each of those hooks reads a
    ContextVar that dynamo cannot trace: two graph breaks per decoder block in every pass (generative ones too), each
    an extra graph to compile and a break in the compiled code."""

    def __init__(self, model):
        inner = unwrap(model)
        base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # peft: the transformers model
        self.decoder = base.get_decoder()
        self.value: torch.Tensor | None = None
        self._handle = None

    def _hook(self, module, args, output):
        self.value = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    def __enter__(self) -> "FinalHiddenState":
        self._handle = self.decoder.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


class _ZeroGradTie(torch.autograd.Function):
    """x unchanged in the forward; in the backward, x's gradient passes through and `other` gets a gradient of
    zeros. Its forward never reads `other`'s values (a `0 * logits.sum()` term would turn an inf logit into NaN).

    Why: an embedding pass computes the last position's logits but no loss uses them. With a tied head that does
    not matter (lm_head.weight is the input embedding matrix, which every pass trains). With an untied head, lm_head
    would take no part in the embedding backward pass, and that pass is the micro-step's last, the one that reduces
    gradients across processes: DDP's reducer waits for a gradient of every trainable parameter, so lm_head's
    gradient is never averaged (in the unified mode each rank steps with its own generative gradient) and the next
    forward fails with "Expected to have finished reduction in the prior iteration". A zero gradient through the
    head's own forward marks it ready in DDP, fires ZeRO's gradient hooks (reduce / reduce-scatter) like any other
    parameter's, and adds exactly nothing to any gradient; the backward costs one [vocab x hidden] product of zeros
    per pass. Skipping the head instead (running only the decoder) would leave lm_head unused in that pass all the
    same, so DDP would need find_unused_parameters=True (a graph search every step) to cope.

    In the embedding mode lm_head's gradient is now zero rather than absent on every backend, so AdamW's decoupled
    weight decay applies to it everywhere (ZeRO's flat gradient buffers already gave it a zero gradient; a single
    process used to skip it), which keeps one process and N processes on the same update."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        ctx.other_meta = (other.shape, other.dtype, other.device)
        return x.clone()  # not a view: callers may modify the embeddings in place

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.other_meta
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def has_untied_trainable_head(model) -> bool:
    """Whether the output head has a trainable parameter that is not one of the input embeddings' (an untied
    lm_head, or adapters on it), through DDP / DeepSpeed / peft wrappers."""
    inner = unwrap(model)
    head, inputs = inner.get_output_embeddings(), inner.get_input_embeddings()
    if head is None:
        return False
    shared = {id(p) for p in inputs.parameters()} if inputs is not None else set()
    return any(p.requires_grad and id(p) not in shared for p in head.parameters())


_WRAPPERS = ("DistributedDataParallel", "DeepSpeedEngine", "PipelineEngine")


def unwrap(model):
    """The model inside DDP / DeepSpeed (.module) and torch.compile (._orig_mod) wrappers; a peft model stays."""
    while True:
        if type(model).__name__ in _WRAPPERS:
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model
