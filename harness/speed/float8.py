"""Float8 training (`train.precision=fp8`) through torchao.

The run computes in bf16 (autocast over fp32 weights, or bf16 weights with train.weights=bf16, exactly as
train.precision=bf16), and the Linear layers of the model's repeated blocks (attention and MLP projections) run their
three matmuls (output, input gradient, weight gradient) in float8 through torchao's `Float8Linear`: dynamic
per-tensor scaling (torchao's `tensorwise` recipe, its fastest: e4m3 forward, e5m2 gradients), the casts fused into
the regional compile's block graphs. The embeddings, the output head and the norms stay in bf16 (torchtitan and
torchao do the same: the head's logits are the most sensitive to rounding), as does any Linear whose sizes are not
multiples of 16 (the hardware's requirement).

Where it runs: a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell: L4, L40S, RTX 4090, H100,
H200, B200). Elsewhere one line says so. On a CPU, torchao's emulation (the same casts and scales, the matmul in
high precision) runs the code path for tests when HARNESS_FP8_EMULATE=1: it is slower than bf16, never a speed-up.

    accelerate launch harness/train.py --config configs/gpu-1b.yaml train.precision=fp8

Composes with DDP and DeepSpeed ZeRO 1-3 (the converted layers keep their Parameters, which DeepSpeed partitions and
gathers as before) and with LoRA (the frozen base projections run in float8, the adapters in bf16). QLoRA's 4/8-bit
base is refused (its Linears are bitsandbytes', not float8's).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

from harness.errors import ConfigError

EMULATE_ENV = "HARNESS_FP8_EMULATE"  # the CPU tests' switch: torchao's emulated float8 matmuls
MIN_CAPABILITY = (8, 9)


def emulated() -> bool:
    return not torch.cuda.is_available()


def check_fp8(quantization: str = "none") -> None:
    """One line (ConfigError) when this machine or this run cannot train in float8."""
    if quantization != "none":
        raise ConfigError(f"config key 'train.precision': fp8 converts the model's full-precision Linear layers; "
                          f"model.quantization={quantization} (QLoRA) keeps them in bitsandbytes' "
                          f"{quantization}: use train.precision=bf16 with QLoRA")
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("config key 'train.precision': fp8 trains through torchao, which is not installed: "
                          "pip install 'torchao>=0.18.0' (or harness[fp8])")
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        if cap < MIN_CAPABILITY:
            raise ConfigError(f"config key 'train.precision': fp8 needs a GPU with float8 tensor cores (compute "
                              f"capability 8.9+: H100, H200, L40S, L4, RTX 4090); {torch.cuda.get_device_name()} is "
                              f"{cap[0]}.{cap[1]}: use train.precision=bf16")
    elif os.environ.get(EMULATE_ENV) != "1":
        raise ConfigError(f"config key 'train.precision': fp8 needs a GPU with float8 tensor cores (H100, H200, L40S, "
                          f"RTX 4090); this machine has none (on a CPU only torchao's emulation runs it, for tests: "
                          f"{EMULATE_ENV}=1): use train.precision=bf16 or fp32")


def block_classes(model) -> tuple[type, ...]:
    """The classes of the model's repeated blocks (transformers' `_no_split_modules`, as the regional compile uses)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return tuple({type(m) for m in model.modules() if type(m).__name__ in names})


def convertible(module: torch.nn.Module) -> bool:
    """A plain Linear whose sizes float8's matmul takes (both multiples of 16)."""
    if type(module) is not torch.nn.Linear:
        return False
    out_features, in_features = module.weight.shape if module.weight.dim() == 2 else (0, 0)
    # ZeRO-3 partitions leave an empty weight: its shape is in ds_shape
    out_features, in_features = getattr(module.weight, "ds_shape", (out_features, in_features))
    return out_features % 16 == 0 and in_features % 16 == 0 and out_features > 0


def convert_blocks(model, emulate: Optional[bool] = None) -> tuple[int, int]:
    """Swap the Linear layers inside the model's repeated blocks for torchao's Float8Linear, in place: after LoRA's
    wrap (its frozen base layers are converted, its adapters not), before accelerate/DeepSpeed prepare the model.
    Returns (converted, left in bf16 for their sizes)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    blocks = block_classes(model)
    if not blocks:
        raise ConfigError(f"config key 'train.precision': fp8 converts the Linear layers of the model's repeated "
                          f"blocks; {type(model).__name__} names none (_no_split_modules): use train.precision=bf16")
    inside: dict[int, bool] = {}
    for block in (m for m in model.modules() if isinstance(m, blocks)):
        for name, sub in block.named_modules():
            if type(sub) is torch.nn.Linear and "lora_" not in name:  # LoRA's adapters stay in bf16 (small, trained)
                inside[id(sub)] = convertible(sub)
    converted = sum(inside.values())
    if converted == 0:
        raise ConfigError("config key 'train.precision': fp8 found no Linear layer in the model's blocks whose sizes "
                          "are multiples of 16: use train.precision=bf16")
    config = Float8LinearConfig(emulate=emulated() if emulate is None else emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: inside.get(id(m), False))
    return converted, len(inside) - converted


def describe(converted: int, skipped: int) -> str:
    how = "torchao emulating float8 on the CPU: tests only, slower than bf16" if emulated() else "torchao, tensorwise scaling"
    rest = f"; {skipped} left in bf16 (sizes not multiples of 16)" if skipped else ""
    return (f"[harness] fp8: {converted} Linear layers of the blocks in float8 ({how}); embeddings, head and norms in "
            f"bf16{rest}")
