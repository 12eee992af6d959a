"""Mixture-of-experts models (docs/moe.md). router.py: the router's auxiliary loss as the model's own forward adds
it (RouterLoss), the experts' load, the router frozen, the experts' kernel; accounting.py: the active parameters
per token (MFU, the run summary's FLOPs, the plans); blocks.py: the MoE blocks as ZeRO-3 leaves, and separate
experts in every backward pass."""

from harness.moe.accounting import active_matmul_params, expert_params, expert_targets, mlp_width
from harness.moe.router import (RouterLoss, base_model, expert_load, experts_kwargs, experts_of, freeze_router, is_moe,
                                router_coef, router_figures)
from harness.moe.blocks import moe_blocks, register_zero3_leaves, tie_separate_experts

__all__ = ["RouterLoss", "active_matmul_params", "base_model", "expert_load", "expert_params", "expert_targets", "experts_kwargs", "experts_of", "freeze_router", "is_moe", "mlp_width",
           "moe_blocks", "register_zero3_leaves", "router_coef", "router_figures", "tie_separate_experts"]
