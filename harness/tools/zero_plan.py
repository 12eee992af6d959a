"""GPU memory per process for each ZeRO stage, and the lowest stage that fits (`launch/train.sh --zero auto`).

    python -m harness.tools.zero_plan configs/llama-7b.yaml --gpus 8 --gpu-mem-gb 80          # or: harness zero-plan ...
    python -m harness.tools.zero_plan configs/llama-70b.yaml --gpus 8 --nodes 2 --gpu-mem-gb 80 data.max_len=2048

The arithmetic, printed line by line (GiB = 2**30 bytes):

* Parameters P are counted from the recipe's model on the `meta` device (no weights are allocated), the same way
  harness.model.build_model builds it (tokenizer-sized embeddings included).
* Model states take 16 bytes per parameter. Under DeepSpeed (stages 1-3, bf16/fp16): 16-bit weights 2 + 16-bit
  gradients 2 + fp32 master weights 4 + Adam m 4 + Adam v 4. Partitioned over the N data-parallel processes:
  stage 1 the optimizer states (fp32 master + m + v = 12), stage 2 also the gradients (2), stage 3 also the
  weights (2). Stage 0 is plain DDP with fp32 weights 4 + fp32 gradients 4 + Adam 8 (autocast computes in bf16),
  none partitioned, plus DDP's gradient buckets (another 4 bytes) when N > 1.
* ZeRO-3 gathers the weights of the layer it computes and prefetches the next: 2 x the largest layer (or embedding)
  x 2 bytes. `3-offload` (accelerate_configs/zero3_offload.yaml) keeps weights and optimizer states in host memory:
  the GPU holds that working set, host memory holds 2 + 4 + 8 + 4 (fp32 gradients) = 18 bytes per parameter,
  spread over the nodes.
* Activations for one micro-batch of T = micro_batch_size x max_len tokens (embedding passes: queries and
  passages of one micro-batch, divided by loss.grad_cache_chunks; unified mode back-propagates one pass at a time,
  so the larger counts). What autograd keeps per layer and token in a Llama-style block with b-byte activations:
  the 2 RMSNorm inputs upcast to fp32 (2 x 4h) + b x [q/k/v input h + q, k, v (h + 2 h_kv) + rotated q, k
  (h + h_kv) + attention output h + MLP input h + gate, up, act(gate), act(gate)*up 4i] = 8h + b(5h + 3h_kv + 4i)
  bytes (checked against the tensors torch saves, tests/test_memory.py); eager attention adds the score matrix
  (a x seq values in 16 bits + fp32 softmax: 6 bytes). With gradient checkpointing only each layer's input (b x h)
  is kept, plus one layer's full set during its recomputation. Logits: T x vocab x 10 bytes (bf16 logits 2 + fp32
  log-softmax 4 kept, + the fp32 gradient 4 when backward starts); with the chunked loss (loss.chunked_ce, on under
  auto once the fp32 logits would pass 256 MiB) one chunk of loss.chunked_ce_size positions at a time instead.
* A fixed overhead per GPU for the CUDA context, NCCL and library workspaces (--overhead-gb, default 2 GiB), and
  a margin for the allocator's fragmentation (--margin, default 10% of the GPU).

LoRA / QLoRA (model.lora.enabled, model.quantization): the T trainable parameters (adapters r x (in + out) per
targeted Linear, counted on the meta model, plus added token rows) take the 16 bytes above, partitioned the same
way; the frozen base F takes only its storage: fp32 4 under DDP (stage 0), 16-bit 2 under DeepSpeed, and with
model.quantization its Linear weights (output head excepted) at 0.5 + 1/64 + 4/16384 = 0.516 B/param (4bit: nf4
with double quantisation) or 1 B/param (8bit), the rest (embeddings, head, norms) at the stage's weight bytes. The
frozen base is partitioned only under ZeRO-3, which refuses quantized weights (the rows say "not supported").
A recipe with a hub model.name_or_path and the architecture in model.config (with model_type) is sized offline from
model.config.

It prints the table and ends with one line `choice: zero0|zero1|zero2|zero3|zero3_offload|none`; exit status 0
when a stage fits, 3 when none does (the table says how many GPUs would be needed). When the recipe has no
activation checkpointing and needs CPU offload (or fits nowhere) but model.gradient_checkpointing=true makes stage
0-3 fit, a line `proposed: zeroN model.gradient_checkpointing=true` before the choice says so (exit 0);
launch/train.sh --zero auto takes the proposal and adds the override.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from harness.config import Config, load_config, lora_config
from harness.errors import HarnessError

GIB = 2**30
OPTIONS = ["0", "1", "2", "3", "3-offload"]
ACCELERATE_CONFIG = {"0": "multi_gpu", "1": "zero1", "2": "zero2", "3": "zero3", "3-offload": "zero3_offload"}


@dataclass
class ModelShape:
    params: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    model_type: str
    layer_params: int  # parameters of the largest decoder layer
    embed_params: int  # parameters of the input embedding
    trainable: Optional[int] = None  # LoRA: adapter (+ added token rows) parameters; None: full fine-tune, all of P
    linear_params: int = 0  # weights of the frozen base's Linear layers but the output head (what bitsandbytes
    # quantizes under model.quantization)
    note: str = ""  # how the shape was obtained when not from the recipe as is (offline sizing)
    chunkable_head: bool = True  # the chunked loss can take the output head (objective.resolve_chunked_ce)

    @property
    def frozen(self) -> int:
        return 0 if self.trainable is None else self.params - self.trainable


def model_shape(cfg: Config) -> ModelShape:
    """Parameter count and shape of the recipe's model, built on the meta device (nothing allocated)."""
    import torch

    from harness.model import build_model, load_tokenizer

    m = cfg.model
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
    return ModelShape(
        params=sum(p.numel() for p in model.parameters()),
        hidden=hidden,
        intermediate=getattr(c, "intermediate_size", 4 * hidden),
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
        chunkable_head=_chunkable_head(model, lora and mc.name_or_path is None and m.name_or_path is not None),
    )


def _chunkable_head(model, lora_offline: bool) -> bool:
    """Whether the chunked loss can use this model's head. Sized offline with LoRA, no: the hub tokenizer may add the
    chat markers, and LoRA then wraps the head's added rows (trainable_token_indices), which the chunked loss refuses
    (auto: full logits); the plan counts the full logits rather than promise memory the run may not get."""
    from harness.errors import ConfigError
    from harness.model import output_head

    if lora_offline:
        return False
    try:
        output_head(model)
    except ConfigError:
        return False
    return True


@dataclass
class Hardware:
    gpus_per_node: int
    gpu_mem_gb: float
    nodes: int = 1
    host_mem_gb: Optional[float] = None  # per node; None: not checked

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


def chunked_ce_positions(cfg: Config, tokens: int, vocab: int) -> Optional[int]:
    """Positions per chunk when the run's generative loss goes through the head in chunks (objective.
    chunked_ce_asked, the run's own rule; the caller checks the head, `ModelShape.chunkable_head`), else None."""
    from harness.objective import chunked_ce_asked

    return min(cfg.loss.chunked_ce_size, tokens) if chunked_ce_asked(cfg, tokens, vocab) else None


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
    if cfg.loss.mode in ("generative", "unified"):
        passes.append(("generative", t.micro_batch_size * seq, seq, True))
    if cfg.loss.mode in ("embedding", "unified"):
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
        chunk = chunked_ce_positions(cfg, tokens, shape.vocab) if logits and shape.chunkable_head else None
        if chunk:
            lg = chunk * shape.vocab * 10
            total += lg
            pl.append(f"  logits: chunked (loss.chunked_ce={cfg.loss.chunked_ce}), one chunk at a time: {chunk:,} x "
                      f"{shape.vocab} x (2 + 4 + 4) B = {lg / GIB:.2f} GiB")
        elif logits:
            lg = tokens * shape.vocab * 10
            total += lg
            pl.append(f"  logits: {tokens:,} x {shape.vocab} x (2 + 4 + 4) B = {lg / GIB:.2f} GiB")
            if not shape.chunkable_head and chunked_ce_positions(cfg, tokens, shape.vocab):
                pl.append("  (full logits counted: the chunked loss may not take this head; sized offline with LoRA, "
                          "the hub tokenizer may add chat markers whose rows LoRA trains through the head)")
        pl.append(f"  activations: {total / GIB:.2f} GiB")
        if total >= best:
            best, best_lines = total, pl
    if len(passes) > 1:
        lines.append("unified mode: the passes back-propagate one after the other; the larger counts")
    return lines + best_lines, best


@dataclass
class Row:
    option: str
    weights: float
    grads: float
    optim: float
    extra: float
    activations: float
    overhead: float
    host: float = 0.0
    supported: bool = True  # False: QLoRA under ZeRO-3 (bitsandbytes' weights cannot be partitioned)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optim + self.extra + self.activations + self.overhead


# bytes per parameter of a frozen base Linear weight quantized by bitsandbytes (harness.model.quantization_kwargs):
# nf4 with double quantisation: 4 bits + an 8-bit absmax per block of 64 + an fp32 constant per 256 blocks;
# LLM.int8: 1 byte (its fp32 scale per output row is left out)
QUANT_BYTES = {"4bit": 0.5 + 1 / 64 + 4 / (64 * 256), "8bit": 1.0}


def frozen_bytes(shape: ModelShape, quantization: str, w: float) -> float:
    """Bytes of the frozen base: quantized Linear weights at QUANT_BYTES, everything else at w bytes."""
    if quantization == "none":
        return shape.frozen * w
    return shape.linear_params * QUANT_BYTES[quantization] + (shape.frozen - shape.linear_params) * w


def state_row(option: str, shape: ModelShape, hw: Hardware, precision: str, activations: float,
              overhead: float, quantization: str = "none") -> Row:
    """Model-state bytes per GPU for one option (see the module docstring for the byte counts)."""
    if shape.trainable is not None:
        return lora_row(option, shape, hw, precision, activations, overhead, quantization)
    P, N = shape.params, hw.world
    half = precision != "fp32"
    if option == "0":
        return Row(option, 4 * P, 4 * P, 8 * P, 4 * P if N > 1 else 0, activations, overhead)
    w, g, o = (2, 2, 12) if half else (4, 4, 8)
    working = 2 * max(shape.layer_params, shape.embed_params) * w
    if option == "3-offload":
        host = (w + 4 + 8 + 4) * P * hw.gpus_per_node / N
        return Row(option, 0, 0, 0, working, activations, overhead, host=host)
    stage = int(option)
    return Row(option, w * P / (N if stage >= 3 else 1), g * P / (N if stage >= 2 else 1), o * P / N,
               working if stage == 3 else 0, activations, overhead)


def lora_row(option: str, shape: ModelShape, hw: Hardware, precision: str, activations: float, overhead: float,
             quantization: str) -> Row:
    """LoRA/QLoRA: optimizer states and gradients for the T trainable parameters only (16 B/param, partitioned like a
    full fine-tune); the frozen base at its storage bytes (fp32 4 under DDP, 16-bit 2 under DeepSpeed bf16, quantized
    Linears at QUANT_BYTES), partitioned only under ZeRO-3. QLoRA under ZeRO-3: not supported."""
    T, N = shape.trainable, hw.world
    half = precision != "fp32"
    if option == "0":
        return Row(option, frozen_bytes(shape, quantization, 4) + 4 * T, 4 * T, 8 * T, 4 * T if N > 1 else 0,
                   activations, overhead)
    if quantization != "none" and option in ("3", "3-offload"):
        return Row(option, 0, 0, 0, 0, activations, overhead, supported=False)
    w, g, o = (2, 2, 12) if half else (4, 4, 8)
    working = 2 * max(shape.layer_params, shape.embed_params) * w
    base = frozen_bytes(shape, quantization, w)
    if option == "3-offload":
        host = (base + (w + 4 + 8 + 4) * T) * hw.gpus_per_node / N
        return Row(option, 0, 0, 0, working, activations, overhead, host=host)
    stage = int(option)
    return Row(option, (base + w * T) / (N if stage >= 3 else 1), g * T / (N if stage >= 2 else 1), o * T / N,
               working if stage == 3 else 0, activations, overhead)


def _state_lines(cfg: Config, shape: ModelShape, hw: Hardware, w: int) -> list[str]:
    """The model-state arithmetic lines: 16 B/param for a full fine-tune; LoRA/QLoRA: trainable vs frozen."""
    if shape.trainable is None:
        return [
            f"model states, 16 B/param: {'bf16' if w == 2 else 'fp32'} weights {w} + grads {w} + "
            + ("fp32 master 4 + Adam m 4 + v 4" if w == 2 else "Adam m 4 + v 4")
            + "; stage 0 (DDP): fp32 weights 4 + grads 4 + Adam 8"
            + (" + DDP gradient buckets 4" if hw.world > 1 else ""),
            f"partitioned over N={hw.world}: stage 1 optimizer states ({16 - 2 * w}), stage 2 + gradients ({w}), "
            f"stage 3 + weights ({w}); ZeRO-3 working set = 2 x {max(shape.layer_params, shape.embed_params):,} "
            f"(largest layer or embedding) x {w} B",
        ]
    q = cfg.model.quantization
    lc = lora_config(cfg.model)
    T, F = shape.trainable, shape.frozen
    targets = lc.target_modules if isinstance(lc.target_modules, str) else ",".join(lc.target_modules)
    out = [f"{'QLoRA' if q != 'none' else 'LoRA'} (r={lc.r}, target_modules={targets}): trainable T = {T:,} "
           f"(adapters r x (in + out) per targeted Linear, plus added token rows), frozen base F = {F:,}"]
    out.append(f"trainable states, 16 B/param of T: {'bf16' if w == 2 else 'fp32'} weights {w} + grads {w} + "
               + ("fp32 master 4 + Adam m 4 + v 4" if w == 2 else "Adam m 4 + v 4")
               + "; stage 0 (DDP): fp32 4 + 4 + Adam 8" + (" + DDP gradient buckets 4" if hw.world > 1 else "")
               + f" = {16 * T / GIB:.2f} GiB unpartitioned")
    if q == "none":
        out.append(f"frozen base (no gradients, no optimizer states): F x {w} B = {F * w / GIB:.2f} GiB under DeepSpeed "
                   f"(stage 0: fp32 F x 4 B = {F * 4 / GIB:.2f} GiB), partitioned over N={hw.world} only under ZeRO-3")
    else:
        qb = QUANT_BYTES[q]
        what = ("nf4 + double quantisation: 0.5 + 1/64 (8-bit absmax per 64) + 4/16384 (fp32 per 256 blocks)"
                if q == "4bit" else "LLM.int8: 1 (row scales left out)")
        rest = F - shape.linear_params
        out.append(f"frozen base, {q}: Linear weights {shape.linear_params:,} x {qb:.4f} B ({what}) = "
                   f"{shape.linear_params * qb / GIB:.2f} GiB + the rest (embeddings, head, norms) {rest:,} x {w} B = "
                   f"{rest * w / GIB:.2f} GiB (stage 0: fp32 x 4 = {rest * 4 / GIB:.2f} GiB); not partitioned; "
                   f"ZeRO-3 not supported with quantization")
    out.append(f"partitioned over N={hw.world}: stage 1 optimizer states of T, stage 2 + gradients of T, stage 3 + "
               f"weights (frozen base too); ZeRO-3 working set = 2 x {max(shape.layer_params, shape.embed_params):,} "
               f"(largest layer or embedding) x {w} B")
    return out


def _table(cfg: Config, shape: ModelShape, hw: Hardware, w: int, precision: str, usable: float,
           overhead_gb: float) -> tuple[list[str], list[Row], Optional[str]]:
    """Activation lines, the table rows and the lowest option that fits."""
    out = [f"activations ({'16-bit' if w == 2 else 'fp32'}, micro-batch {cfg.train.micro_batch_size}, "
           f"max_len {cfg.data.max_len}, gradient checkpointing {'on' if cfg.model.gradient_checkpointing else 'off'}):"]
    act_lines, act = activation_terms(cfg, shape, w)
    out += [f"  {x}" for x in act_lines]
    out.append(f"fixed overhead per GPU (CUDA context, NCCL, workspaces): {overhead_gb:g} GiB; extra = DDP gradient "
               "buckets (stage 0) or the ZeRO-3 working set")
    rows = [state_row(o, shape, hw, precision, act, overhead_gb * GIB, cfg.model.quantization) for o in OPTIONS]
    out.append("")
    out.append(f"{'stage':<10}{'weights':>9}{'grads':>9}{'optim':>9}{'extra':>9}{'activ':>9}{'overhead':>9}"
               f"{'total':>9}  GiB per GPU")
    choice = None
    for r in rows:
        if not r.supported:
            out.append(f"{r.option:<10}{'':>54}  not supported (model.quantization={cfg.model.quantization}: "
                       "bitsandbytes' weights cannot be partitioned)")
            continue
        fits = r.total / GIB <= usable
        note = "fits" if fits else "too big"
        if r.option == "3-offload":
            host_ok = hw.host_mem_gb is None or r.host / GIB <= 0.9 * hw.host_mem_gb
            have = "not checked" if hw.host_mem_gb is None else f"of {hw.host_mem_gb:.0f} GiB"
            note += f"; host memory {r.host / GIB:.1f} GiB per node ({have})"
            fits = fits and host_ok
            if not host_ok:
                note += " too big"
        out.append(f"{r.option:<10}" + "".join(f"{x / GIB:>9.1f}" for x in
                   (r.weights, r.grads, r.optim, r.extra, r.activations, r.overhead, r.total)) + f"  {note}")
        if fits and choice is None:
            choice = r.option
    return out, rows, choice


@dataclass
class Plan:
    text: str
    choice: Optional[str]  # an OPTIONS entry, or None when nothing fits
    rows: list[Row]
    shape: ModelShape
    usable_gb: float
    # a stage 0-3 that fits with model.gradient_checkpointing=true when the recipe as given needs CPU offload or
    # fits nowhere (printed as `proposed: zeroN model.gradient_checkpointing=true`)
    proposal: Optional[str] = None


CHECKPOINTING = "model.gradient_checkpointing=true"


def plan(cfg: Config, hw: Hardware, margin: float = 0.10, overhead_gb: float = 2.0, source: str = "",
         shape: Optional[ModelShape] = None) -> Plan:
    shape = shape or model_shape(cfg)
    precision = "fp32" if cfg.train.precision == "fp32" else "bf16"
    w = 2 if precision == "bf16" else 4
    usable = hw.gpu_mem_gb * (1 - margin)
    size = f"{shape.params / 1e9:.2f}B" if shape.params >= 1e9 else f"{shape.params / 1e6:.1f}M"
    out = [
        f"zero-plan: {source or 'recipe'} on {hw.nodes} node(s) x {hw.gpus_per_node} GPU(s) of {hw.gpu_mem_gb:g} GiB "
        f"= {hw.world} data-parallel processes; usable per GPU {usable:.1f} GiB ({margin:.0%} margin)",
    ]
    if shape.note:
        out.append(shape.note)
    out += [
        f"model: {shape.model_type}, P = {shape.params:,} parameters ({size}): hidden h={shape.hidden}, "
        f"intermediate i={shape.intermediate}, {shape.layers} layers, {shape.heads} heads ({shape.kv_heads} kv), "
        f"vocab {shape.vocab}",
    ]
    out += _state_lines(cfg, shape, hw, w)
    table, rows, choice = _table(cfg, shape, hw, w, precision, usable, overhead_gb)
    out += table
    proposal: Optional[str] = None
    if choice not in OPTIONS[:4] and not cfg.model.gradient_checkpointing:
        # activation checkpointing costs a recomputation of the forward (about a third more compute); CPU offload
        # costs far more: propose it first when it makes a stage fit without offload
        ckpt = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, gradient_checkpointing=True))
        _, ck_rows, ck_choice = _table(ckpt, shape, hw, w, precision, usable, overhead_gb)
        if ck_choice in OPTIONS[:4]:
            r = ck_rows[OPTIONS.index(ck_choice)]
            proposal = ck_choice
            out.append(f"with activation checkpointing ({CHECKPOINTING}): activations {r.activations / GIB:.1f} GiB, "
                       f"stage {ck_choice} fits at {r.total / GIB:.1f} GiB per GPU (of {usable:.1f}), before "
                       + ("CPU offload" if choice == "3-offload" else "any stage fits without it"))
    if choice not in OPTIONS[:4]:
        room = usable - (rows[3].total - rows[3].weights - rows[3].grads - rows[3].optim) / GIB
        states = 16 * shape.params if shape.trainable is None else \
            16 * shape.trainable + frozen_bytes(shape, "none", w)
        need = math.ceil(states / GIB / room) if room > 0 and rows[3].supported else None
        out.append(("no stage fits" if choice is None else "ZeRO-3 without offload does not fit") + ": " + (
            f"it needs at least {need} GPUs of {hw.gpu_mem_gb:g} GiB ({math.ceil(need / hw.gpus_per_node)} nodes of "
            f"{hw.gpus_per_node}): " + ("16 x P" if shape.trainable is None else f"16 x T + {w} x F")
            + f" = {states / GIB:.1f} GiB over {room:.1f} GiB left per GPU"
            if need else "the activations alone exceed a GPU: lower train.micro_batch_size or data.max_len, or set "
            "model.gradient_checkpointing=true" if rows[3].supported else
            "quantized weights are not partitioned (no ZeRO-3): lower train.micro_batch_size or data.max_len, or use "
            "a larger GPU"))
    if choice is not None:
        name = "single_gpu" if choice == "0" and hw.world == 1 else ACCELERATE_CONFIG[choice]
        out.append(f"lowest stage that fits: {choice} -> accelerate_configs/{name}.yaml")
    if proposal is not None:
        name = "single_gpu" if proposal == "0" and hw.world == 1 else ACCELERATE_CONFIG[proposal]
        out.append(f"proposed: zero{proposal} {CHECKPOINTING} -> accelerate_configs/{name}.yaml (launch/train.sh "
                   f"--zero auto takes it unless model.gradient_checkpointing is given)")
    out.append(f"choice: {'zero' + choice.replace('-', '_') if choice else 'none'}")
    return Plan("\n".join(out), choice, rows, shape, usable, proposal)


def _host_mem_gb() -> Optional[float]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="harness zero-plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="run recipe (YAML)")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    p.add_argument("--gpus", type=int, default=None, help="GPUs per node (default: the GPUs torch sees)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpu-mem-gb", type=float, default=None, help="memory per GPU in GiB (default: GPU 0's)")
    p.add_argument("--host-mem-gb", type=float, default=None, help="host memory per node in GiB, for 3-offload "
                   "(default: this machine's)")
    p.add_argument("--margin", type=float, default=0.10, help="share of GPU memory kept free (default 0.10)")
    p.add_argument("--overhead-gb", type=float, default=2.0, help="fixed GiB per GPU for the CUDA context, NCCL, "
                   "workspaces (default 2)")
    args = p.parse_intermixed_args(argv)
    try:
        if args.gpus is None or args.gpu_mem_gb is None:
            import torch

            if not torch.cuda.is_available():
                raise HarnessError("no GPU visible: give --gpus N and --gpu-mem-gb G")
            args.gpus = args.gpus or torch.cuda.device_count()
            args.gpu_mem_gb = args.gpu_mem_gb or torch.cuda.get_device_properties(0).total_memory / GIB
        if args.gpus < 1 or args.nodes < 1 or args.gpu_mem_gb <= 0 or not 0 <= args.margin < 1:
            raise HarnessError("--gpus and --nodes must be >= 1, --gpu-mem-gb > 0, 0 <= --margin < 1")
        cfg = load_config(args.config, args.overrides)
        hw = Hardware(args.gpus, args.gpu_mem_gb, args.nodes,
                      args.host_mem_gb if args.host_mem_gb is not None else _host_mem_gb())
        result = plan(cfg, hw, args.margin, args.overhead_gb, source=args.config)
    except HarnessError as err:
        print(f"harness: error: {err}", file=sys.stderr)
        return err.exit_code
    print(result.text)
    return 0 if result.choice or result.proposal else 3


if __name__ == "__main__":
    sys.exit(main())
