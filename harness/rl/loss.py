"""GRPO's clipped policy loss as pure tensor code (loss.mode=rl, rl.algorithm=grpo; docs/rl.md).

    python -m pytest tests/test_rl.py -k trl

The per-token terms are TRL 1.16's GRPOTrainer._compute_loss: the ratio r = exp(logp - logp_old) per token
(`rl.importance_sampling: token`) or per completion from its mean log-ratio (`sequence`, GSPO), the clipped surrogate -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A), and with beta > 0
the k3 estimator of KL(policy || reference), exp(ref - logp) - (ref - logp) - 1, times the ratio (the correction for
samples drawn from the old policy: TRL's default use_bias_correction_kl=True), added times beta. The reductions
(`rl.loss_type`) are TRL's, taken over the optimizer step's whole batch of completions on every process:

    grpo     mean over completions of each completion's token mean
    bnpo     sum over tokens / tokens of the step
    dapo     sum over tokens / tokens of the step (TRL normalises by the generation batch's tokens: the same here,
             where a step is one generation batch)
    dr_grpo  sum over tokens / (completions x rft.max_new_tokens)

TRL normalises grpo, bnpo and dr_grpo per micro-batch and averages the micro-batches, so its loss changes with the
split into micro-batches and processes; here a micro-batch back-propagates its sums times a step-wide factor
(`step_factor`: W x A / the step's denominator, as the generative token averaging of harness/losses.py), so any split
gives the update of the whole batch in one piece, which is TRL's with one micro-batch of the whole batch (the test).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")


@dataclass(frozen=True)
class Grpo:
    """The loss's settings: rl.loss_type, rl.epsilon, rl.epsilon_high (None: epsilon), rl.beta,
    rl.importance_sampling (`level`) and rft.max_new_tokens (dr_grpo's denominator)."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    beta: float = 0.0
    level: str = "token"
    max_new_tokens: int = 0

    @classmethod
    def of(cls, rl, max_new_tokens: int) -> "Grpo":
        return cls(rl.loss_type, rl.epsilon, rl.epsilon_high, rl.beta, rl.importance_sampling, max_new_tokens)

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def per_token_terms(logps: torch.Tensor, old_logps: Optional[torch.Tensor], advantages: torch.Tensor, grpo: Grpo,
                    ref_logps: Optional[torch.Tensor] = None,
                    mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss [B, T], clipped [B, T] bool: the ratio outside the clip range on the advantage's side, KL
    [B, T] (zeros at beta 0)).

    logps, old_logps, ref_logps: [B, T] log-probs of the completion tokens under the policy (with gradient), the
    policy that sampled them (None: the policy itself, detached: the first update on fresh samples), the reference;
    advantages: [B]. grpo.level (rl.importance_sampling): `token`, a ratio per token, or `sequence` (GSPO, TRL's
    importance_sampling_level): one ratio per completion, exp of its mean log-ratio over `mask`'s tokens."""
    epsilon, epsilon_high, beta, level = grpo.epsilon, grpo.high, grpo.beta, grpo.level
    old = logps.detach() if old_logps is None else old_logps
    adv = advantages.unsqueeze(1)
    log_ratio = logps - old
    if level == "sequence":
        m = mask.to(logps.dtype)
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # [B, 1]
    elif level != "token":
        raise ValueError(f"unknown rl.importance_sampling {level!r} (token, sequence)")
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * adv, clipped_ratio * adv)
    clipped = (((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))).detach()  # TRL's
    kl = torch.zeros_like(loss)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("rl.beta > 0 needs the reference log-probs")
        diff = ref_logps - logps
        kl = (torch.exp(diff) - diff - 1) * ratio  # k3, importance-corrected (TRL's use_bias_correction_kl=True)
        loss = loss + beta * kl
    return loss.expand_as(logps), clipped.expand_as(logps), kl


def loss_sum(loss_type: str, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The micro-batch's numerator: for grpo the sum of its completions' token means, else the masked token sum."""
    mask = mask.to(per_token.dtype)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    if loss_type in ("bnpo", "dapo", "dr_grpo"):
        return (per_token * mask).sum()
    raise ValueError(f"unknown rl.loss_type {loss_type!r} ({', '.join(LOSS_TYPES)})")


def denominator(loss_type: str, completions, tokens, max_new_tokens: int):
    """The step's denominator: completions (grpo), tokens (bnpo, dapo), completions x max_new_tokens (dr_grpo)."""
    if loss_type == "grpo":
        return completions
    if loss_type in ("bnpo", "dapo"):
        return tokens
    return completions * max_new_tokens


def step_factor(world: int, accum: int, total) -> torch.Tensor | float:
    """What a micro-batch's loss_sum is multiplied by before its backward pass: W x A / the step's denominator (DDP and
    ZeRO average over W processes; the accumulation divides by A)."""
    if isinstance(total, torch.Tensor):
        return world * accum / total.clamp(min=1)
    return world * accum / max(total, 1)


def grpo_loss(logps: torch.Tensor, old_logps: Optional[torch.Tensor], advantages: torch.Tensor, mask: torch.Tensor,
              grpo: Grpo, ref_logps: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The loss of one whole batch of completions (one process, one micro-batch): loss_sum / denominator."""
    per_token, _, _ = per_token_terms(logps, old_logps, advantages, grpo, ref_logps, mask)
    total = denominator(grpo.loss_type, mask.shape[0], mask.sum(), grpo.max_new_tokens)
    return loss_sum(grpo.loss_type, per_token, mask) / (total.clamp(min=1) if isinstance(total, torch.Tensor)
                                                        else max(total, 1))


def nanstd(x: torch.Tensor, dim=None) -> torch.Tensor:
    """TRL's nanstd: the unbiased standard deviation of the values that are not NaN (NaN below two of them)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = var * torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = var.sqrt()
    return std.squeeze(dim) if dim is not None else std.squeeze()


def advantages(rewards: torch.Tensor, group: int, scale: str,
               batch_std: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, whether each group's rewards are all equal) of [G x group] rewards, grouped by question in order
    (TRL 1.16's sum_then_normalize): reward - its group's mean, divided by (std + 1e-4) with std the group's (scale
    group) or the batch's (batch; `batch_std`: the whole step's, over every process) or not divided (none). TRL's
    std is the unbiased one; a NaN reward (no reward function scored the answer) is left out of the mean and std and
    gets advantage 0."""
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, 1).repeat_interleave(group)
    group_std = nanstd(grouped, 1).repeat_interleave(group)
    flat = torch.isclose(group_std, torch.zeros_like(group_std))
    adv = rewards - mean
    if scale == "group":
        adv = adv / (group_std + 1e-4)
    elif scale == "batch":
        adv = adv / ((nanstd(rewards) if batch_std is None else batch_std) + 1e-4)
    elif scale != "none":
        raise ValueError(f"unknown rl.scale_rewards {scale!r} (group, batch, none)")
    return torch.nan_to_num(adv, nan=0.0), flat.view(-1, group)[:, 0]
