"""Bytes per parameter of the model states (harness zero-plan's arithmetic, harness/tools/zero_plan.py): weights,
gradients and optimizer states by ZeRO option and weights' dtype, host memory under offload, a frozen base's storage,
and the plan's lines that write them out (`state_lines`).
"""

from __future__ import annotations

from harness.config import Config, lora_config
from harness.tools.sizing import GIB, ModelShape

# bytes per parameter of a frozen base Linear weight quantized by bitsandbytes (harness.lora.quantization_kwargs):
# nf4 with double quantisation: 4 bits + an 8-bit absmax per block of 64 + an fp32 constant per 256 blocks;
# LLM.int8: 1 byte (its fp32 scale per output row is left out)
QUANT_BYTES = {"4bit": 0.5 + 1 / 64 + 4 / (64 * 256), "8bit": 1.0}


def frozen_bytes(shape: ModelShape, quantization: str, w: float) -> float:
    """Bytes of the frozen base: quantized Linear weights at QUANT_BYTES, everything else at w bytes."""
    if quantization == "none":
        return shape.frozen * w
    return shape.linear_params * QUANT_BYTES[quantization] + (shape.frozen - shape.linear_params) * w


def weight_bytes(option: str, weights: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states) bytes per trained parameter for one option. `weights` is what the run's
    parameters are stored in (harness.distributed.zero.planned_weights under DeepSpeed): fp32 (autocast over fp32 weights;
    DeepSpeed's torch_autocast) 4 + 4 + Adam 8; 16-bit (DeepSpeed's bf16 / fp16 modes) 2 + 2 + fp32 master 4 + Adam 8.
    Stage 0 is plain DDP, except with bf16 weights (train.weights=bf16 runs DeepSpeed without ZeRO)."""
    half = weights == "bf16" if option == "0" else weights in ("bf16", "fp16")
    return (2, 2, 12) if half else (4, 4, 8)


def host_bytes(w: int) -> int:
    """Host bytes per trained parameter under ZeRO-3 offload: the weights, fp32 gradients 4 and Adam 8, plus the fp32
    master copy 4 when the weights are 16-bit."""
    return w + 4 + 8 + (4 if w == 2 else 0)


def states_text(w: int) -> str:
    return (f"{'16-bit' if w == 2 else 'fp32'} weights {w} + grads {w} + "
            + ("fp32 master 4 + Adam m 4 + v 4" if w == 2 else "Adam m 4 + v 4"))


def state_lines(cfg: Config, shape: ModelShape, world: int, weights: str) -> list[str]:
    """The model-state arithmetic lines: 16 B/param for a full fine-tune; LoRA/QLoRA: trainable vs frozen.
    `weights`: the parameters' dtype under DeepSpeed (train.weights; stage 0 is DDP in fp32 unless it is bf16)."""
    w, w0 = weight_bytes("1", weights)[0], weight_bytes("0", weights)[0]
    zero0 = "stage 0 (DeepSpeed without ZeRO, train.weights=bf16)" if w0 == 2 else "stage 0 (DDP)"
    if shape.trainable is None:
        return [
            f"model states, 16 B/param: {states_text(w)} (train.weights={cfg.train.weights})"
            + f"; {zero0}: {states_text(w0)}" + (f" + gradient buckets {w0}" if world > 1 else ""),
            f"partitioned over N={world}: stage 1 optimizer states ({16 - 2 * w}), stage 2 + gradients ({w}), "
            f"stage 3 + weights ({w}); ZeRO-3 working set = 2 x {max(shape.layer_params, shape.embed_params):,} "
            f"(largest layer or embedding) x {w} B",
        ]
    q = cfg.model.quantization
    lc = lora_config(cfg.model)
    T, F = shape.trainable, shape.frozen
    targets = lc.target_modules if isinstance(lc.target_modules, str) else ",".join(lc.target_modules)
    out = [f"{'QLoRA' if q != 'none' else 'LoRA'} (r={lc.r}, target_modules={targets}): trainable T = {T:,} "
           f"(adapters r x (in + out) per targeted Linear, plus added token rows), frozen base F = {F:,}"]
    out.append(f"trainable states, 16 B/param of T: {states_text(w)} (train.weights={cfg.train.weights}); {zero0}: "
               f"{states_text(w0)}" + (f" + gradient buckets {w0}" if world > 1 else "")
               + f" = {16 * T / GIB:.2f} GiB unpartitioned")
    if q == "none":
        out.append(f"frozen base (no gradients, no optimizer states): F x {w} B = {F * w / GIB:.2f} GiB under DeepSpeed "
                   f"(stage 0: F x {w0} B = {F * w0 / GIB:.2f} GiB), partitioned over N={world} only under ZeRO-3")
    else:
        qb = QUANT_BYTES[q]
        what = ("nf4 + double quantisation: 0.5 + 1/64 (8-bit absmax per 64) + 4/16384 (fp32 per 256 blocks)"
                if q == "4bit" else "LLM.int8: 1 (row scales left out)")
        rest = F - shape.linear_params
        out.append(f"frozen base, {q}: Linear weights {shape.linear_params:,} x {qb:.4f} B ({what}) = "
                   f"{shape.linear_params * qb / GIB:.2f} GiB + the rest (embeddings, head, norms) {rest:,} x {w} B = "
                   f"{rest * w / GIB:.2f} GiB (stage 0: x {w0} = {rest * w0 / GIB:.2f} GiB); not partitioned; "
                   f"ZeRO-3 not supported with quantization")
    out.append(f"partitioned over N={world}: stage 1 optimizer states of T, stage 2 + gradients of T, stage 3 + "
               f"weights (frozen base too); ZeRO-3 working set = 2 x {max(shape.layer_params, shape.embed_params):,} "
               f"(largest layer or embedding) x {w} B")
    return out
