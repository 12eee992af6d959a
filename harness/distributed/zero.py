"""DeepSpeed ZeRO facts and fixes: the live DeepSpeed config, the ZeRO stage and offload targets, the parameters a
rank holds, train.weights in DeepSpeed's config, the stage-0 optimizer repair, and building a model outside
ZeRO-3's zero.Init. (The Accelerator and how DeepSpeed is chosen: harness/distributed/processes.py.)
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from harness.config.derived import planned_weights  # noqa: F401 - (the build imports it from here)
from harness.moe import register_zero3_leaves


def apply_weights(ds: dict, weights: str, mixed_precision: str) -> bool:
    """train.weights in the DeepSpeed config, in place, before prepare() (bf16 runs only; True when it changed).
    fp32: DeepSpeed's torch_autocast, the plain path's numerics (fp32 weights and gradients, optimizer on the
    weights, the forward under bf16 autocast); its bf16 mode off. bf16: DeepSpeed's bf16 mode (bf16 weights and
    gradients, fp32 master copies in the optimizer); torch_autocast off. Other torch_autocast keys of a user's
    config (lower_precision_safe_modules) are kept."""
    if mixed_precision != "bf16":
        return False
    autocast = dict(ds.get("torch_autocast") or {})
    if weights == "fp32":
        ds["bf16"] = {**(ds.get("bf16") or {}), "enabled": False}
        ds["torch_autocast"] = {**autocast, "enabled": True, "dtype": "bfloat16"}
    else:
        ds["bf16"] = {**(ds.get("bf16") or {}), "enabled": True}
        if autocast:
            ds["torch_autocast"] = {**autocast, "enabled": False}
    return True


def repair_stage0_optimizer(optimizer) -> bool:
    """DeepSpeed without ZeRO in bf16 / fp16 (train.weights=bf16 on the plain path, train.deepspeed=zero0) wraps the
    optimizer in its FP16_UnfusedOptimizer (FP16_Optimizer for its own fused Adam), which creates the state with one
    step on zero gradients when it starts (`initialize_optimizer_states`). That leaves torch's AdamW one step ahead,
    so its first real update is 0.74 x lr (step 2's bias correction), and decays the fp32 master copies once. Measured
    on the CPU: AdamW's step read 2 after one step, and zero0 trained 0.6% behind ZeRO-2 at step 2. Repaired after
    prepare(): the state is emptied (AdamW starts it at the first real step) and the masters are copied back from the
    16-bit weights they were made from, after which stage 0 trains exactly as ZeRO-2 does. True when repaired."""
    ds_opt = getattr(optimizer, "optimizer", None)  # accelerate's wrapper -> DeepSpeed's
    if type(ds_opt).__name__ not in ("FP16_UnfusedOptimizer", "FP16_Optimizer"):
        return False
    ds_opt.optimizer.state.clear()
    if hasattr(ds_opt, "fp32_groups_flat"):  # FP16_Optimizer: one flat master per group
        pairs = zip(ds_opt.fp32_groups_flat, ds_opt.fp16_groups_flat)
    else:
        pairs = ((a, b) for ga, gb in zip(ds_opt.fp32_groups, ds_opt.fp16_groups) for a, b in zip(ga, gb))
    with torch.no_grad():
        for master, weight in pairs:
            master.copy_(weight)
    return True


def deepspeed_config(accelerator) -> Optional[dict]:
    """The live DeepSpeed config dict (auto values filled at prepare), or None without DeepSpeed."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin.deepspeed_config if plugin is not None else None


def zero_info(accelerator) -> dict:
    """ZeRO stage and offload targets, for the report (stage None without DeepSpeed)."""
    ds = deepspeed_config(accelerator)
    if ds is None:
        return {"zero_stage": None, "offload_optimizer": None, "offload_param": None}
    z = ds.get("zero_optimization", {})
    device = lambda key: (z.get(key) or {}).get("device", "none")  # noqa: E731
    return {"zero_stage": z.get("stage", 0), "offload_optimizer": device("offload_optimizer"),
            "offload_param": device("offload_param")}


def parameters_held(model: torch.nn.Module) -> int:
    """Parameter elements stored on this rank: the local shard under ZeRO-3, everything otherwise."""
    return sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())


def model_init_context(accelerator, random_init: bool):
    """Context for building the model. Under ZeRO-3 transformers builds models inside `deepspeed.zero.Init`
    (partitioned as they are created), which initialises random weights differently from a plain build. For a
    random init we build outside it, so every ZeRO stage starts from the same weights for the same seed (switching
    stage changes memory, not results; the cost is one full copy in CPU memory per process while building);
    pretrained weights keep zero.Init's partitioned loading."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if random_init and plugin is not None and plugin.is_zero3_init_enabled():
        return without_zero3_init()
    return contextlib.nullcontext()


@contextlib.contextmanager
def without_zero3_init():
    """Build models outside `deepspeed.zero.Init`, which transformers enters while a ZeRO-3 config is registered with
    it: unregister the config for the build and put it back. (accelerate 1.15's
    zero3_init_context_manager(enable=False) re-registers the same config, so it does not switch zero.Init off.)"""
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:
        yield
        return
    registered = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = registered


def training_autocast(accelerator, model):
    """The autocast the training's forward runs under, for a caller of the unwrapped module: DeepSpeed's
    torch_autocast (which its engine enters in its own forward, bypassed by a generation), else accelerate's mixed
    precision (kept by a prepared model's forward, but entered only inside it: a generation engine that plans its
    cache before the forward must see it too)."""
    if hasattr(model, "torch_autocast_enabled"):  # a DeepSpeed engine
        from deepspeed.runtime.torch_autocast import autocast_if_enabled

        return autocast_if_enabled(model)
    return accelerator.autocast()


@contextlib.contextmanager
def gathered_for_generation(accelerator, model, zero_stage: int):
    """The plain module with all its weights, under the training's autocast (`training_autocast`): under ZeRO-3 the
    partitions gathered and DeepSpeed's forward hooks off while generating (trl.models.utils.
    unwrap_model_for_generation does the same), else the unwrapped model."""
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    if zero_stage != 3:
        with training_autocast(accelerator, model):
            yield unwrapped
        return
    import deepspeed

    offload = getattr(model.optimizer, "parameter_offload", model.optimizer)
    with training_autocast(accelerator, model), deepspeed.zero.GatheredParameters(list(unwrapped.parameters())):
        for p in unwrapped.parameters():
            p.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield unwrapped
        finally:
            coordinator = getattr(offload, "param_coordinator", None)
            if coordinator is not None and not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()
            offload._register_deepspeed_module(offload.module)


def partitioned_copy(accelerator, model, convert: Optional[Callable] = None) -> torch.nn.Module:
    """A frozen copy of a ZeRO-3 model as it is now, as a second DeepSpeed engine without an optimizer (TRL's
    prepare_deepspeed): each process keeps 1/N of its weights, gathered layer by layer in its forward passes as the
    trained model's are. Built from the trained engine's gathered weights (one full copy in this process's memory
    while building, as a generation holds), in the run's DeepSpeed config less its optimizer, schedule and
    optimizer offload. `convert(twin)`: what the build did to the model after building it (train.precision=fp8:
    its blocks' Linear layers to float8), done to the twin before it takes the weights."""
    import deepspeed

    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    with deepspeed.zero.GatheredParameters(list(unwrapped.parameters())):
        twin = frozen_twin(unwrapped, convert)
    return frozen_engine(accelerator, twin)


def frozen_engine(accelerator, module: torch.nn.Module) -> torch.nn.Module:
    """`module` (frozen) as a DeepSpeed engine without an optimizer, in the run's DeepSpeed config less its
    optimizer, schedule and optimizer offload: under ZeRO-3 each process keeps 1/N of its weights (partitioned here,
    or already, by zero.Init), gathered layer by layer in its forward passes; no gradient, no optimizer state."""
    import copy

    import deepspeed

    config = copy.deepcopy(deepspeed_config(accelerator))
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    config["zero_optimization"].pop("offload_optimizer", None)
    if config["zero_optimization"].get("stage") == 3:  # a MoE copy's blocks as the trained model's (docs/moe.md)
        register_zero3_leaves(module)
    engine, *_ = deepspeed.initialize(model=module.requires_grad_(False), config=config)
    engine.eval()  # (DeepSpeedEngine.eval returns None)
    return engine


def gathered(params: list):
    """Context in which ZeRO-3-partitioned parameters among `params` hold their full values (read only); others
    (None, plain tensors) as they are."""
    live = [p for p in params if p is not None and hasattr(p, "ds_id")]
    if not live:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(live)


def frozen_twin(model, convert: Optional[Callable] = None) -> torch.nn.Module:
    """A new model of `model`'s class and config holding its weights as they are now (gathered by the caller under
    ZeRO-3), without gradients; built outside ZeRO-3's partitioned init, then `convert(twin)` (the build's fp8
    conversion of a train.precision=fp8 model: its twin's blocks in float8 too, the same model), then loaded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    with without_zero3_init():
        twin = type(model)(model.config)
    if convert is not None:
        convert(twin)
    missing, unexpected = twin.load_state_dict({n: p.detach() for n, p in params.items()}, strict=False)
    named = dict(twin.named_parameters(remove_duplicate=False))
    if unexpected or any(n in named for n in missing):  # (missing buffers are the twin's own, built as the model's)
        raise RuntimeError(f"partitioned_copy: the copy's parameters differ from the model's (missing "
                           f"{[n for n in missing if n in named][:3]}, unexpected {unexpected[:3]})")
    return twin.requires_grad_(False)
