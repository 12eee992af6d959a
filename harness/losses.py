"""Loss functions: pure tensor code, testable without accelerate.

Generative loss with per-token averaging over the whole optimizer step
--------------------------------------------------------------------
A step sees `accum` micro-batches on each of `world` processes. The loss we want is

    L = (sum of token losses over every micro-batch of every process) / N,   N = trained tokens in the step.

Each micro-batch therefore back-propagates `token_loss_sum * world * accum / N`: accelerate divides the loss by
`accum` (DeepSpeed does the same inside its engine) and DDP/ZeRO average gradients over `world` processes, so the
accumulated gradient is exactly dL. Averaging each micro-batch by its own token count instead would weight the
tokens of short micro-batches more, and the result would change with how the batch is split.

    python -m pytest tests/test_losses.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harness import IGNORE_INDEX


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token cross-entropies, number of trained tokens); computed in fp32.

    logits: [batch, seq, vocab] for positions 0..seq-1; labels: [batch, seq] with IGNORE_INDEX where untrained.
    Position t predicts labels[t + 1] (the shift happens here).
    """
    shift_logits = logits[:, :-1, :].reshape(-1, logits.size(-1)).float()
    shift_labels = labels[:, 1:].reshape(-1)
    total = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    count = (shift_labels != IGNORE_INDEX).sum()
    return total, count


def shifted_token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """token_loss_sum with the targets already shifted (position t predicts targets[t]: a sequence-parallel shard)."""
    flat = targets.reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), flat, ignore_index=IGNORE_INDEX,
                            reduction="sum")
    return total, (flat != IGNORE_INDEX).sum()


def trained_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of positions that contribute to the generative loss (after the shift)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def step_scale(world_size: int, accum: int, global_tokens: torch.Tensor | int) -> torch.Tensor | float:
    """Factor that turns a micro-batch's loss sum into its share of the step's per-token mean (see docstring)."""
    return world_size * accum / global_tokens


def mixed_scale(count: torch.Tensor | int) -> torch.Tensor | float:
    """`loss.gen_averaging=mixed`: each micro-batch back-propagates its own token mean (sum / its count); DDP and
    accumulation then average those means (GritLM's 'mixed' weighting). A tensor count stays on its device."""
    if isinstance(count, torch.Tensor):
        return 1.0 / count.clamp(min=1)
    return 1.0 / max(int(count), 1)


# ----------------------------------------------------------------------------------------------- embeddings
#
# Contrastive loss across processes
# ---------------------------------
# With loss.gather_negatives, every process gathers the queries and passages of all processes (its own tensors put
# back in their slot so they keep their graph) and computes the *same* global loss L over the global batch. Backward
# on a process then yields only the part of dL/dθ that flows through its own embeddings; the sum over processes is
# the full dL/dθ. DDP and ZeRO *average* gradients over the W processes, so each process back-propagates W * L: the
# update is then exactly that of one process holding the whole batch, whatever the split. (GritLM's reference code
# omits the factor and so scales the embedding gradient by 1/W.)


def pool(hidden: torch.Tensor, pool_mask: torch.Tensor, method: str) -> torch.Tensor:
    """L2-normalised fp32 embeddings [B, H] from hidden states [B, S, H] over the positions where pool_mask is 1
    (text tokens; instruction and padding excluded). weightedmean weights the k-th pooled token by k (GritLM)."""
    h = hidden.float()
    m = pool_mask.to(h.dtype)
    if method == "mean":
        emb = (h * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True).clamp(min=1)
    elif method == "weightedmean":
        w = m.cumsum(1) * m
        emb = (h * w.unsqueeze(-1)).sum(1) / w.sum(1, keepdim=True).clamp(min=1)
    elif method == "lasttoken":
        pos = torch.arange(m.size(1), device=m.device).expand_as(m)
        last = (pos * m).argmax(1)
        emb = h[torch.arange(h.size(0), device=h.device), last]
    else:
        raise ValueError(f"unknown pooling {method!r}")
    return F.normalize(emb, dim=-1)


def contrastive_loss(q: torch.Tensor, p: torch.Tensor, temperature: float) -> torch.Tensor:
    """InfoNCE over cosine similarities / temperature, in fp32. q: [B, H]; p: [B * G, H] where rows b*G..b*G+G-1
    are query b's positive (first) and hard negatives; every other row is an in-batch negative for b."""
    group = p.size(0) // q.size(0)
    scores = q.float() @ p.float().T / temperature
    labels = torch.arange(q.size(0), device=q.device) * group
    return F.cross_entropy(scores, labels)


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate `x` from every process in rank order; the local slot is `x` itself, so gradients flow into it.
    Every process must pass the same shape."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.detach().contiguous())
    parts[dist.get_rank()] = x
    return torch.cat(parts)


# ----------------------------------------------------------------------------------------------- preference pairs
#
# The losses of TRL's DPOTrainer (sigmoid, ipo), CPOTrainer (simpo) and ORPOTrainer (odds ratio), on the sequence
# log-probabilities of the completions (sums over their tokens; `*_len` their token counts). Each returns per-pair
# losses and the rewards TRL logs; the objective averages the losses over the pairs of the whole step.


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (branch at -ln 2)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def preference_loss(loss, chosen: torch.Tensor, rejected: torch.Tensor, chosen_len: torch.Tensor,
                    rejected_len: torch.Tensor, ref_chosen: torch.Tensor | None = None,
                    ref_rejected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair loss [n], chosen rewards [n], rejected rewards [n]), in fp32. `loss`: cfg.loss (its preference,
    beta, label_smoothing, simpo_gamma).

    dpo:   -(1-ls) logsigmoid(beta d) - ls logsigmoid(-beta d), d = (chosen - ref_chosen) - (rejected - ref_rejected)
           (ls = 0: TRL's sigmoid loss; ls > 0: conservative DPO); rewards beta (logp - ref_logp)
    ipo:   (d_c / len_c - d_r / len_r - 1 / (2 beta))^2 on the log-ratios averaged per token (TRL's ipo)
    simpo: as dpo on the per-token averages without reference, minus the margin gamma / beta; rewards beta avg
    orpo:  -beta logsigmoid(log odds(chosen) - log odds(rejected)) on the per-token averages (the NLL term on the
           chosen completion is added by the caller); rewards beta avg"""
    kind, beta, label_smoothing, simpo_gamma = loss.preference, loss.beta, loss.label_smoothing, loss.simpo_gamma
    chosen, rejected = chosen.float(), rejected.float()
    if kind in ("dpo", "ipo"):
        if ref_chosen is None or ref_rejected is None:
            raise ValueError(f"{kind} needs the reference model's log-probs")
        c, r = chosen - ref_chosen.float(), rejected - ref_rejected.float()
        if kind == "ipo":
            delta = c / chosen_len.clamp(min=1) - r / rejected_len.clamp(min=1)
            losses = (delta - 1 / (2 * beta)) ** 2
        else:
            losses = _smoothed(beta * (c - r), label_smoothing)
        return losses, beta * c.detach(), beta * r.detach()
    c, r = chosen / chosen_len.clamp(min=1), rejected / rejected_len.clamp(min=1)
    if kind == "simpo":
        losses = _smoothed(beta * (c - r - simpo_gamma / beta), label_smoothing)
    elif kind == "orpo":
        log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
        losses = -beta * F.logsigmoid(log_odds)
    else:
        raise ValueError(f"unknown preference loss {kind!r}")
    return losses, beta * c.detach(), beta * r.detach()


def _smoothed(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing
