"""Mixture-of-experts models (docs/moe.md): the router's auxiliary loss as the model's own forward adds it, the
experts' load, the router frozen or trained, and the active parameters per token (MFU, plans).

The auxiliary loss is not re-derived: the model's forward computes it (transformers' `load_balancing_loss_func` of
the family, over the rows its attention mask keeps) whenever `output_router_logits` is on. `RouterLoss` turns that
on for one training forward and reads `aux_loss` and `router_logits` off the causal LM's output with a forward hook,
so the loss path (full logits, the chunked head, packed rows) stays as it is:

    with RouterLoss(model, coef) as router:     # coef: model.router_aux_loss_coef
        out = model(**inputs)                 # any wrappers: DDP, DeepSpeed, peft, compile
    loss = ce + router.term                   # coef * aux_loss, with its gradient; router.aux, router.load: logged

    python -c "from harness import moe; help(moe)"
"""

from __future__ import annotations

import torch

from harness.config.derived import EXPERT_COUNT_KEYS, TOP_K_KEYS, experts_of  # noqa: F401 - (light: the plans' too)

CPU_EXPERTS = "grouped_mm"  # model.experts_implementation=auto without CUDA (docs/bench/moe-experts-cpu.json)
ROUTER_NAMES = ("gate", "router")  # the router module's name inside a MoE block (mlp.gate, mlp.router)


def base_model(model):
    """The transformers causal LM inside DDP / DeepSpeed / compile / peft wrappers."""
    while True:
        if type(model).__name__ in ("DistributedDataParallel", "DeepSpeedEngine"):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        elif hasattr(model, "get_base_model"):
            model = model.get_base_model()
        else:
            return model


def is_moe(config) -> bool:
    """A routed mixture of experts whose causal LM adds a router loss (`router_aux_loss_coef` in its config)."""
    return experts_of(config)[0] > 0 and hasattr(config, "router_aux_loss_coef")


def router_coef(config, override: float | None) -> float:
    """model.router_aux_loss_coef: the override, or (null) the model's own `router_aux_loss_coef`."""
    return float(config.router_aux_loss_coef if override is None else override)


def experts_kwargs(config, choice: str) -> dict:
    """model.experts_implementation as a from_pretrained / from_config argument: {} for a dense model; auto is
    grouped_mm on a CUDA GPU (torch's grouped matmul) and CPU_EXPERTS elsewhere (measured: docs/bench/)."""
    if not experts_of(config)[0]:
        return {}
    if choice == "auto":
        choice = "grouped_mm" if torch.cuda.is_available() else CPU_EXPERTS
    return {"experts_implementation": choice}


def freeze_router(model) -> int:
    """model.train_router=false: the routers' weights frozen (requires_grad off); returns the tensors frozen."""
    frozen = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ROUTER_NAMES and "mlp" in name:
            for p in module.parameters():  # its LoRA adapters too (peft wraps the router in place)
                p.requires_grad_(False)
                frozen += 1
    return frozen


def expert_load(router_logits, top_k: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The largest expert's share of the routed tokens (top-k assignments), averaged over the MoE layers: 1/E when
    the routing is balanced, 1/k when every token goes to the same k experts. `router_logits`: one [tokens, E]
    tensor per layer (the model's output); rows the attention mask drops are not counted, as in the aux loss."""
    shares = []
    for logits in router_logits:
        chosen = logits.detach().float().topk(top_k, dim=-1).indices  # softmax keeps the order: the same top-k
        weight = (torch.ones(chosen.shape[0], device=chosen.device) if attention_mask is None
                  else attention_mask.reshape(-1).to(chosen.device, torch.float32))
        counts = torch.zeros(logits.shape[-1], device=chosen.device).scatter_add_(
            0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        shares.append(counts.max() / counts.sum().clamp(min=1))
    return torch.stack(shares).mean()


class RouterLoss:
    """For the forward passes inside: the causal LM computes its router logits and aux loss (its
    `output_router_logits` on), and this keeps the last pass's `term` (coef * aux_loss, with its gradient),
    `aux` (aux_loss, detached) and `load` (expert_load). A dense model (or `on` false): nothing is changed and
    `term` is 0."""

    def __init__(self, model, coef: float | None, on: bool = True):
        self.lm = base_model(model)
        self.active = on and is_moe(self.lm.config)
        self.coef = router_coef(self.lm.config, coef) if self.active else 0.0
        self.term: torch.Tensor | float = 0.0
        self.aux: torch.Tensor | None = None
        self.load: torch.Tensor | None = None
        self._handle, self._before = None, None

    def _hook(self, module, args, kwargs, output) -> None:
        aux = getattr(output, "aux_loss", None)
        if not torch.is_tensor(aux):  # no router logits (e.g. a pass without MoE layers)
            return
        self.term = self.coef * aux if self.coef else 0.0 * aux
        self.aux = aux.detach()
        mask = kwargs.get("attention_mask")  # the rows the model's aux loss counts: the same ones
        self.load = expert_load(output.router_logits, experts_of(self.lm.config)[1],
                                mask if torch.is_tensor(mask) and mask.dim() == 2 else None)

    def sums(self) -> dict:
        """This pass's StepSums fields (aux_sum, aux_term_sum, load_sum, aux_micro); none for a dense model."""
        if self.aux is None:
            return {}
        return {"aux_sum": self.aux, "aux_term_sum": self.coef * self.aux, "load_sum": self.load, "aux_micro": 1}

    def __enter__(self) -> "RouterLoss":
        if self.active:
            self._before = self.lm.config.output_router_logits
            self.lm.config.output_router_logits = True
            self._handle = self.lm.register_forward_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self.lm.config.output_router_logits = self._before


def router_figures(sums: dict) -> tuple[float, dict]:
    """(the loss's router term, {aux_loss, expert_load}) of a log line from summed StepSums values: each the mean
    over the generative micro-batches of every process; (0.0, {}) for a dense model."""
    n = sums.get("aux_micro", 0)
    if not n:
        return 0.0, {}
    return sums["aux_term_sum"] / n, {"aux_loss": sums["aux_sum"] / n, "expert_load": sums["load_sum"] / n}
