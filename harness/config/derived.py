"""What the run derives from a recipe and a model's transformers config, computed without torch: the run and the
plans (harness zero-plan sizes a model from its config.json alone, harness/tools/config_shape.py) share these.

- `chunked_ce_asked`: the config's part of the chunked loss decision (harness.chunked_loss.resolve_chunked_ce);
- `planned_weights`: the parameters' dtype under DeepSpeed (harness.build, the ZeRO plan);
- `attention_heads`, `check_heads`: a config's heads and their fit with train.sequence_parallel;
- `experts_of`, `mlp_width`: a mixture of experts' expert counts and the MLP width a token's activations see.

Each reads a config by attribute (a transformers config, or any namespace of its keys)."""

from __future__ import annotations

from harness.errors import ConfigError

# loss.chunked_ce=auto turns the chunked loss on from this size of a micro-batch's fp32 logits (see resolve_chunked_ce)
AUTO_MIN_LOGITS_BYTES = 256 * 2**20
# config keys that scale the logits after the head: the chunked loss refuses them (harness.chunked_loss.output_head)
LOGIT_TRANSFORMS = ("logit_scale", "logits_scaling", "output_multiplier", "lm_head_multiplier")

# The families' names for the per-token expert count and the expert count (transformers' configs).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")


def chunked_ce_asked(loss, compile_mode: str, positions: int, vocab: int | None) -> bool:
    """The config's part of `resolve_chunked_ce` (the head is checked apart; harness.tools.zero_plan plans with this
    too): off with loss.chunked_ce=false or no generative positions; auto: on when positions x vocab x 4 bytes >=
    AUTO_MIN_LOGITS_BYTES and train.compile (`compile_mode`) is not full (vocab None: unknown, off). `loss`:
    cfg.loss."""
    setting = loss.chunked_ce
    if setting is False or positions <= 0:
        return False
    if setting == "auto":
        return compile_mode != "full" and vocab is not None and positions * vocab * 4 >= AUTO_MIN_LOGITS_BYTES
    return True


def planned_weights(precision: str, weights: str, deepspeed: bool) -> str:
    """The dtype the trained parameters will have: train.weights in bf16 runs, fp16 under DeepSpeed's fp16 mode,
    otherwise fp32 (autocast over fp32 weights)."""
    if precision == "bf16":
        return weights
    return "fp16" if precision == "fp16" and deepspeed else "fp32"


def attention_heads(config) -> tuple:
    """(query heads, key/value heads, head size) of a transformers config; a family without grouped key/value heads
    (gpt_neox, gpt2: no num_key_value_heads) has as many as query heads, one without head_dim hidden_size / heads.
    Also the RFT engine's key/value cache shape (harness.rft.engine)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    hidden = getattr(text, "hidden_size", None)
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if hidden and heads else None)
    return heads, kv, head_dim


def check_heads(size: int, config) -> None:
    """N divides the model's attention heads (Ulysses gives each process 1/N of them)."""
    heads, kv, _ = attention_heads(config)
    if size > 1 and heads and heads % size:
        raise ConfigError(f"config key 'train.sequence_parallel': {size} does not divide the model's {heads} "
                          f"attention heads; use a divisor of {heads}")
    if size > 1 and kv and kv % size and size % kv:
        raise ConfigError(f"config key 'train.sequence_parallel': {size} and the model's {kv} key/value heads do "
                          f"not divide one another; use a divisor or a multiple of {kv}")


def _first(config, keys, default=0):
    for k in keys:
        v = getattr(config, k, None)
        if isinstance(v, int) and v > 0:
            return v
    return default


def experts_of(config) -> tuple[int, int]:
    """(experts per MoE layer, experts per token) of a transformers config; (0, 0) for a dense model."""
    n = _first(config, EXPERT_COUNT_KEYS)
    return (n, _first(config, TOP_K_KEYS, 1)) if n > 1 else (0, 0)


def mlp_width(config, default: int) -> int:
    """The MLP width a token's activations see, for the memory arithmetic: a mixture of experts' top-k experts' widths
    (moe_intermediate_size, else intermediate_size: the expert's own) plus its shared experts'; a dense model's
    intermediate_size (`default` without one)."""
    n, k = experts_of(config)
    dense = getattr(config, "intermediate_size", None) or default
    if not n:
        return dense
    expert = getattr(config, "moe_intermediate_size", None) or dense
    shared = getattr(config, "shared_expert_intermediate_size", None) or 0
    return k * expert + shared
