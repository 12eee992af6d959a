"""The optimizer and the learning-rate schedule.

AdamW with weight decay on matrices only; the schedule is a multiplier of the peak `optim.lr`: linear warm-up over
`optim.warmup_steps` (or `optim.warmup_ratio` of the run), then cosine, linear or constant down to
`optim.min_lr_ratio`. The loop steps the schedule once per optimizer step (not prepared by accelerate: see
docs/architecture.md).
"""

from __future__ import annotations

import math

import torch

from harness.config import OptimConfig


def build_optimizer(model: torch.nn.Module, o: OptimConfig, offload: bool = False) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on biases and norm weights); fused on CUDA; DeepSpeed's
    CPU Adam (AdamW mode) when ZeRO offloads the optimizer to the CPU."""
    params = [p for p in model.parameters() if p.requires_grad]
    is_matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in params]  # ds_shape: full shape under ZeRO-3
    decay = [p for p, m in zip(params, is_matrix) if m]
    no_decay = [p for p, m in zip(params, is_matrix) if not m]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]  # LoRA adapters are all matrices; ZeRO-3 drops empty groups
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=torch.cuda.is_available())


def lr_lambda(o: OptimConfig, total_steps: int):
    """Multiplier of the peak lr after `step` optimizer steps: linear warmup, then cosine / linear / constant."""
    warmup = o.warmup_steps if o.warmup_steps > 0 else int(o.warmup_ratio * total_steps)

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if o.scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if o.scheduler == "cosine" else 1 - progress
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * decay

    return fn


def build_scheduler(optimizer: torch.optim.Optimizer, o: OptimConfig, total_steps: int):
    """LambdaLR over `lr_lambda`, on the raw optimizer's param groups (which DeepSpeed's ZeRO optimizers keep using)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(o, total_steps))
