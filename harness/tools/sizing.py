"""What the memory plan (harness/tools/zero_plan.py) sizes from a recipe: the model's shape, by arithmetic on its
config where that is enough (harness/tools/config_shape.py: no torch, under a second), else counted on the meta
device the way harness.model.build_model builds it, and the activation bytes of one micro-batch (the arithmetic is
written out in zero_plan's docstring and checked against the tensors torch saves in tests/test_memory.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from harness.config import Config, LossConfig, ModelConfig, lora_config
from harness.config.modes import facts
from harness.config.derived import attention_heads, check_heads, chunked_ce_asked
from harness.errors import ConfigError
from harness.config.checks import check_sequence_parallel
from harness.tools.config_shape import ModelShape, shape_from_config

GIB = 2**30


def model_shape(cfg: Config) -> ModelShape:
    """Parameter count and shape of the recipe's model (`shape_of`)."""
    return shape_of(cfg.model)


def shape_of(m: ModelConfig) -> ModelShape:
    """Parameter count and shape of the model `m` (a model section) describes: by arithmetic on its config
    (shape_from_config), else built on the meta device (meta_shape: another family, LoRA on the experts, ...)."""
    return shape_from_config(m) or meta_shape(m)


def meta_shape(m: ModelConfig) -> ModelShape:
    """Parameter count and shape of the model `m` describes, built on the meta device (nothing allocated)."""
    import torch

    from harness import moe  # lazy: start-up time (torch; zero-plan's arithmetic path loads none)
    from harness.model import build_model, load_tokenizer  # lazy: start-up time (torch and transformers)

    note = ""
    # quantization is left out: the meta model is built in full precision and bitsandbytes' bytes are counted per
    # Linear (plan); LoRA adapters are built as configured
    mc = dataclasses.replace(m, gradient_checkpointing=False, quantization="none",
                             random_init=m.name_or_path is not None)
    if m.name_or_path is not None and "model_type" in m.config and not Path(m.name_or_path).is_dir():
        # the recipe carries the architecture's shape: size it offline from model.config (no hub download), with the
        # bundled tokenizer (the hub tokenizer's added chat-marker rows, a few, are not counted)
        mc = dataclasses.replace(mc, name_or_path=None, random_init=False, tokenizer="bundled")
        note = (f"sizing offline from model.config ({m.config['model_type']} shape of {m.name_or_path}); the bundled "
                f"tokenizer stands in for the hub one")
    tok = load_tokenizer(mc)
    with torch.device("meta"):
        model = build_model(mc, tok)
    lora = lora_config(m).enabled
    head = model.get_output_embeddings()
    head = getattr(getattr(head, "token_adapter", None), "base_layer", head)  # (under peft's trainable tokens)
    head = getattr(head, "base_layer", head)  # (LoRA on the head: bitsandbytes leaves it unquantized all the same)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) if lora else None
    linear_params = sum(mod.weight.numel() for name, mod in model.named_modules()
                        if isinstance(mod, torch.nn.Linear) and mod is not head and not mod.weight.requires_grad
                        and "lora_" not in name) if lora else 0
    c = model.config
    c = getattr(c, "text_config", None) or c
    layers = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    blocks = max(layers, key=len) if layers else []
    layer_params = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    hidden = c.hidden_size
    heads = c.num_attention_heads
    experts = moe.expert_params(model)  # (routed experts' parameters, active per token)
    return ModelShape(
        params=sum(p.numel() for p in model.parameters()),
        hidden=hidden,
        intermediate=moe.mlp_width(c, 4 * hidden),  # a mixture of experts: its k experts' widths per token
        layers=c.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        vocab=model.get_input_embeddings().num_embeddings,
        model_type=c.model_type,
        layer_params=layer_params,
        embed_params=model.get_input_embeddings().weight.numel(),
        trainable=trainable,
        linear_params=linear_params,
        note=note,
        chunkable_head=_chunkable_head(model),
        head_dim=attention_heads(c)[2],
        active=sum(p.numel() for p in model.parameters()) - experts[0] + experts[1],
    )


def _chunkable_head(model) -> bool:
    """Whether the chunked loss can use this model's head (chunked_loss.output_head; LoRA's trainable tokens on the
    head of a base whose tokenizer gets the chat markers included)."""
    from harness.chunked_loss import output_head  # lazy: start-up time (torch)

    try:
        output_head(model)
    except ConfigError:
        return False
    return True


def chunked_ce_positions(loss: LossConfig, compile_mode: str, tokens: int, vocab: int) -> Optional[int]:
    """Positions per chunk when the run's generative loss goes through the head in chunks (chunked_loss.
    chunked_ce_asked, the run's own rule; the caller checks the head, `ModelShape.chunkable_head`), else None.
    `loss`: cfg.loss; compile_mode: train.compile."""
    return min(loss.chunked_ce_size, tokens) if chunked_ce_asked(loss, compile_mode, tokens, vocab) else None


def activation_terms(cfg: Config, shape: ModelShape, act_bytes: int) -> tuple[list[str], float]:
    """Activation bytes per GPU for one micro-batch, and the lines that explain them."""
    d, t, m = cfg.data, cfg.train, cfg.model
    seq = d.max_len if d.max_len != "auto" else None
    lines = []
    if seq is None:
        model_max = None
        try:
            model_max = int(cfg.model.config.get("max_position_embeddings", 0)) or None
        except (TypeError, ValueError):
            pass
        seq = model_max or 4096
        lines.append(f"data.max_len=auto: taking {seq} tokens (the model's maximum) as the upper bound")
    passes = []  # (name, tokens, sequence length, with logits)
    if facts(cfg.loss.mode).gen_rows == "sequences":
        sp = max(1, t.sequence_parallel)  # each process holds 1/N of every row's positions
        passes.append(("generative", t.micro_batch_size * seq // sp, seq, True))
        if sp > 1:
            lines.append(f"train.sequence_parallel={sp}: each GPU holds {seq} / {sp} = {seq // sp} positions of every "
                         f"row (activations per GPU divided by {sp})")
    if facts(cfg.loss.mode).embeds:
        texts = t.emb_micro_batch_size // cfg.loss.grad_cache_chunks
        tokens = texts * (d.query_max_len + d.train_group_size * d.passage_max_len)
        passes.append(("embedding", tokens, max(d.query_max_len, d.passage_max_len), False))
    h, hkv, i, L = shape.hidden, shape.kv_heads * (shape.hidden // shape.heads), shape.intermediate, shape.layers
    per_token_layer = 8 * h + act_bytes * (5 * h + 3 * hkv + 4 * i)
    lines.append(f"per layer and token: 8h + {act_bytes} x (5h + 3h_kv + 4i) = 8*{h} + {act_bytes} x (5*{h} + 3*{hkv} "
                 f"+ 4*{i}) = {per_token_layer:,} B")
    eager = m.attn_implementation == "eager"
    best, best_lines = 0.0, []
    for name, tokens, s, logits in passes:
        one_layer = tokens * per_token_layer + (tokens * shape.heads * s * 6 if eager else 0)
        pl = [f"{name} pass: {tokens:,} tokens per micro-batch"]
        if eager:
            pl.append(f"  eager attention scores: {tokens:,} x {shape.heads} heads x {s} x 6 B per layer")
        if m.gradient_checkpointing:
            kept = L * tokens * h * act_bytes
            total = kept + one_layer
            pl.append(f"  gradient checkpointing: layer inputs {L} x {tokens:,} x {h} x {act_bytes} B = {kept / GIB:.2f} GiB"
                      f" + one layer recomputed {one_layer / GIB:.2f} GiB")
        else:
            total = L * one_layer
            pl.append(f"  {L} layers x {one_layer / GIB:.2f} GiB = {total / GIB:.2f} GiB (no gradient checkpointing)")
        chunk = chunked_ce_positions(cfg.loss, t.compile, tokens, shape.vocab) if logits and shape.chunkable_head else None
        if chunk:
            lg = chunk * shape.vocab * 10
            total += lg
            pl.append(f"  logits: chunked (loss.chunked_ce={cfg.loss.chunked_ce}), one chunk at a time: {chunk:,} x "
                      f"{shape.vocab} x (2 + 4 + 4) B = {lg / GIB:.2f} GiB")
        elif logits:
            lg = tokens * shape.vocab * 10
            total += lg
            pl.append(f"  logits: {tokens:,} x {shape.vocab} x (2 + 4 + 4) B = {lg / GIB:.2f} GiB")
            if not shape.chunkable_head and chunked_ce_positions(cfg.loss, t.compile, tokens, shape.vocab):
                pl.append("  (full logits counted: the chunked loss cannot take this head: LoRA on lm_head, or logits "
                          "transformed after it)")
        pl.append(f"  activations: {total / GIB:.2f} GiB")
        if total >= best:
            best, best_lines = total, pl
    if len(passes) > 1:
        lines.append("unified mode: the passes back-propagate one after the other; the larger counts")
    return lines + best_lines, best


def with_overrides(cfg: Config, sequence_parallel: int, checkpointing: bool) -> Config:
    train = dataclasses.replace(cfg.train, sequence_parallel=sequence_parallel)
    model = dataclasses.replace(cfg.model, gradient_checkpointing=cfg.model.gradient_checkpointing or checkpointing)
    return dataclasses.replace(cfg, train=train, model=model)


def sp_sizes(cfg: Config, shape: ModelShape, gpus_per_node: int) -> list[int]:
    """The train.sequence_parallel sizes a run of this recipe could take on nodes of `gpus_per_node` GPUs, smallest
    first (harness zero-plan's proposals): a group stays on one node (the all-to-all inside attention), and the run's
    own refusals pass (harness.config.checks.check_sequence_parallel: objective, attention kernel, micro-batch;
    harness.distributed.sequence.check_heads: the heads). None where the recipe sets a size already."""
    from types import SimpleNamespace

    if cfg.train.sequence_parallel > 1 or cfg.data.max_len == "auto":
        return []
    heads = SimpleNamespace(num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads)
    sizes = []
    for n in (n for n in range(2, gpus_per_node + 1) if gpus_per_node % n == 0):
        try:
            check_sequence_parallel(with_overrides(cfg, n, False))
            check_heads(n, heads)
        except ConfigError:
            continue
        sizes.append(n)
    return sizes


def moe_line(shape: ModelShape) -> str:
    """zero-plan's model line, continued for a mixture of experts: both parameter counts (the memory counts P; a
    token's compute, MFU and FLOPs the active ones) and the MLP width the activations count."""
    if not shape.active or shape.active == shape.params:
        return ""
    return (f"; mixture of experts: total {shape.params / 1e9:.2f}B parameters (weights, gradients and states below), "
            f"active {shape.active / 1e9:.2f}B per token (A = {shape.active:,}: attention, embeddings, the head, "
            f"the routers and the top-k experts; compute and MFU), i = the k experts' widths per token")
