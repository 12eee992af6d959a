"""What a mixture of experts computes per token: the routed experts' parameters and the active ones (top-k of E),
for MFU, the run summary's FLOPs and the plans (docs/moe.md)."""

from __future__ import annotations

import torch

from harness.errors import ConfigError
from harness.config.derived import mlp_width  # noqa: F401 - (light: the plans' too)
from harness.moe.router import ROUTER_NAMES, base_model, experts_of


def expert_params(model) -> tuple[int, int]:
    """(parameters of the routed experts, of which active per token) of a transformers MoE model: the experts'
    weights (3-D fused tensors or per-expert modules under `experts`) times top-k / E. ZeRO-3: full sizes."""
    n, k = experts_of(getattr(base_model(model), "config", None))
    if not n:
        return 0, 0
    total = sum(getattr(p, "ds_numel", p.numel()) for name, p in base_model(model).named_parameters()
                if _routed(name))  # their adapters (model.lora.experts) with them
    return total, total * k // n


def active_matmul_params(model, linear: int) -> int:
    """The matmul weights one token goes through, from `linear` (every nn.Linear's in x out:
    observe.metrics.matmul_params): a dense model's `linear` as it is; a mixture of experts' with its routed experts
    at top-k / E (their nn.Linear modules, or transformers 5's 3-D tensors, which no nn.Linear holds) and its
    routers' weights where they are no nn.Linear. The shared experts, attention and the head count whole."""
    lm = base_model(model)
    n, k = experts_of(getattr(lm, "config", None))
    if not n:
        return linear
    in_linear, fused, routers = 0, 0, 0
    linear_weights = set()
    for name, module in lm.named_modules():
        if isinstance(module, torch.nn.Linear):
            linear_weights.update(id(p) for p in module.parameters(recurse=False))
            if _routed(name):
                in_linear += module.in_features * module.out_features
    for name, p in lm.named_parameters():
        if id(p) in linear_weights or "lora_" in name or p.dim() < 2:
            continue
        size = getattr(p, "ds_numel", p.numel())
        if _routed(name):
            fused += size
        elif name.rsplit(".", 2)[-2] in ROUTER_NAMES:
            routers += size
    return linear - in_linear + (in_linear + fused) * k // n + routers


def _routed(name: str) -> bool:
    return ".experts." in f".{name}." and "shared" not in name


def expert_targets(model) -> list[str]:
    """model.lora.experts: peft's `target_parameters` for the routed experts' fused 3-D weights (transformers 5:
    `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`), as `experts.<name>` suffixes. A dense model, or experts as
    separate nn.Linear modules (reached by model.lora.target_modules), is refused in one line."""
    names = sorted({"experts." + name.rsplit(".", 1)[-1] for name, p in base_model(model).named_parameters()
                    if _routed(name) and p.dim() == 3})
    if not names:
        raise ConfigError("config key 'model.lora.experts': the model has no fused 3-D expert weights (a dense model, "
                          "or experts as separate Linear modules: name them in model.lora.target_modules)")
    return names
