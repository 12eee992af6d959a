"""Bytes per parameter of the model states (harness zero-plan's arithmetic, harness/tools/zero_plan.py): weights,
gradients and optimizer states by ZeRO option and weights' dtype, host memory under offload, a frozen base's storage.
"""

from __future__ import annotations

from harness.tools.sizing import ModelShape

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
