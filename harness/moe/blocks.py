"""The MoE blocks of a trained model under data parallelism (docs/moe.md): every block a ZeRO-3 leaf, and where a
family's experts are separate modules, every expert in every backward pass.

ZeRO-3 gathers a module's parameters when that module runs. Where the experts are separate modules (transformers
4's Qwen3-MoE and Mixtral, remote-code DeepSeek) a block calls only the experts its tokens reach, so a rank that
routes no token to an expert would skip that expert's gather while the others run it (DeepSpeed#7461, ms-swift#5400,
LLaMA-Factory#9222). `register_zero3_leaves` marks each block a ZeRO-3 leaf before deepspeed.initialize: its
parameters (router, experts, shared experts, their LoRA adapters) are gathered whole when it starts. transformers 5's
fused 3-D experts are one module, gathered whole already; their blocks are registered all the same (DeepSpeed 0.19
registers Qwen3-MoE's, Qwen2-MoE's and Mixtral's by its own default list; this takes every family's).

A separate expert no token reached also has no gradient on that rank. DDP then waits for it (its reducer expects
every trainable parameter), ZeRO-1/2 fill their gradient buckets with another set of tensors than the other ranks
(a collective mismatch, or one expert's gradient summed with another's), ZeRO-3 gives it zeros in its flat
buffers, and a single process's AdamW skips it (no weight decay, no step of its moments). `tie_separate_experts`
gives every such expert a gradient of exactly zero in every training pass (`_ZeroTie`, as harness.model's
_ZeroGradTie does for an untied head in the embedding passes), landing in one order on every rank, so every backend
steps every expert and N processes equal one. Fused experts need none: the 3-D tensors take part in every pass.
"""

from __future__ import annotations

import torch

from harness.moe.router import experts_of


def moe_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of the model's MoE blocks: the outermost modules holding a child module named `experts`
    (transformers' name in every family: a fused experts module, or an nn.ModuleList / ModuleDict of expert MLPs;
    peft's wrappers keep it), in the model's order."""
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if found and (found[-1][0] == "" or name.startswith(found[-1][0] + ".")):
            continue  # inside a block already found (its experts, a nested `experts`)
        if isinstance(module._modules.get("experts"), torch.nn.Module):
            found.append((name, module))
    return found


def _separate(block: torch.nn.Module) -> bool:
    return isinstance(block.experts, (torch.nn.ModuleList, torch.nn.ModuleDict))


def register_zero3_leaves(model: torch.nn.Module) -> str | None:
    """Mark every MoE block of `model` (any wrapper: peft's, the plain module) as a ZeRO-3 leaf with DeepSpeed's
    set_z3_leaf_modules (by class: each instance of the blocks' classes); called before deepspeed.initialize, which
    installs its gather hooks on the leaves and not inside them. Returns the run's line: the blocks registered, a
    warning for a mixture of experts whose blocks it cannot find, or None for a dense model."""
    blocks = moe_blocks(model)
    if not blocks:
        if experts_of(getattr(model, "config", None))[0]:
            return ("[harness] warning: ZeRO-3 with a mixture of experts whose blocks hold no module named `experts`: "
                    "none registered as a ZeRO-3 leaf (a rank that routes no token to an expert may wait on the "
                    "others); name the block's class in ds_config's zero_optimization.leaf_module.classes")
        return None
    from deepspeed.utils import set_z3_leaf_modules

    classes = list(dict.fromkeys(type(m) for _, m in blocks))
    set_z3_leaf_modules(model, classes)
    kinds = sorted({"separate" if _separate(m) else "fused" for _, m in blocks})
    return (f"[harness] ZeRO-3: {len(blocks)} MoE blocks ({', '.join(c.__name__ for c in classes)}, "
            f"{' and '.join(kinds)} experts) registered as leaves: each gathered whole when it starts, whichever "
            f"experts a rank's tokens reach")


class _ZeroTie(torch.autograd.Function):
    """z unchanged in the forward (never reading `param`'s values); in the backward z's gradient passes through and
    `param` gets a gradient of zeros, which adds nothing where the expert ran and is its whole gradient where it
    did not."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        ctx.meta = (param.shape, param.dtype, param.device)
        return z.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.meta
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def _tie_hook(params: list):
    def hook(module, args, kwargs):
        if not torch.is_grad_enabled():  # evaluation, generation, a frozen reference: nothing to tie
            return None
        x = args[0] if args else kwargs.get("hidden_states")
        if not torch.is_tensor(x):
            return None
        z = x.new_zeros(())
        for p in params:  # a chain, one node a parameter: their gradients land one after the other, in this order
            z = _ZeroTie.apply(z, p)
        x = x + z
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    return hook


def tie_separate_experts(model: torch.nn.Module) -> str | None:
    """Where the MoE blocks hold separate expert modules: a forward pre-hook on each that adds to its input a zero
    tied to each of its experts' trainable parameters (`_ZeroTie`, chained) in training passes. The ties' backward
    runs after the whole block's (at its input), so every expert's gradient is complete there, in the same order on
    every rank whatever the routing: ZeRO-1/2 fill their gradient buckets in the order gradients land, and a rank
    whose experts landed in another order would reduce one expert's gradient with another's (measured: a wrong
    step 2 under ZeRO-2 with the ties at the block's output, a collective mismatch without them). Not under ZeRO-3,
    whose leaf blocks (`register_zero3_leaves`) take zeros for a skipped expert by themselves. Returns the run's
    line, or None (fused experts, a dense model). Costs one small autograd node per expert parameter and pass."""
    tied = 0
    for _, block in moe_blocks(model):
        params = [p for p in block.experts.parameters() if p.requires_grad] if _separate(block) else []
        if params:
            block.register_forward_pre_hook(_tie_hook(params), with_kwargs=True)
            tied += 1
    if not tied:
        return None
    return (f"[harness] MoE: {tied} blocks of separate expert modules: every expert takes part in each training "
            f"pass (a gradient of zeros where no token reached it), so DDP, ZeRO-1/2 and one process step the same "
            f"experts in the same order")
