"""loss.mode=distill's tensor work (docs/distill.md): the student's divergence from the teacher per completion token,
computed through both output heads in chunks of positions, so that neither model's [tokens, vocabulary] logits exist.

- `token_divergence`: the per-token terms on logits (the full form; TRL's conventions): `jsd` is TRL's
  generalized_jsd_loss before its reduction (beta 0: KL(teacher || student), 1: KL(student || teacher), between:
  beta KL(teacher || m) + (1 - beta) KL(student || m), m = beta teacher + (1 - beta) student, both at
  `temperature`); `sampled_kl` is log p_student(x) - log p_teacher(x) on the token x drawn, as an advantage (its
  value times log p_student(x), the value detached: the policy gradient of the reverse KL).
- `divergence_sum`: the loss sum over a batch's completion positions from full logits (the reference form);
- `chunked_divergence`: the same from the final hidden states and both heads' weights, chunk by chunk, the student's
  gradients computed in the forward (chunked_loss.py's design: nothing to gather again in the backward);
- `DivergenceHead`: inside the student's own forward (through its DDP / DeepSpeed wrappers), its output head returns
  that sum; `teacher_hidden`: the teacher's final hidden states, its head not run.

    python -c "from harness.distill.loss import chunked_divergence; help(chunked_divergence)"
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness import IGNORE_INDEX
from harness.chunked_loss import ChunkedHeadLoss, hand_over, head_params, output_head
from harness.distributed.zero import gathered


def _up(z: torch.Tensor) -> torch.Tensor:
    """At least fp32 (fp64 stays fp64: the tests' exact references)."""
    return z.to(torch.promote_types(z.dtype, torch.float32))


def _capped(z: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def token_divergence(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float,
                     kind: str = "jsd", targets: torch.Tensor | None = None) -> torch.Tensor:
    """[N] per-token loss terms from [N, V] logits (fp32), as module docstring says; `targets` [N]: the tokens drawn
    (sampled_kl)."""
    s = F.log_softmax(_up(student) / temperature, dim=-1)
    t = F.log_softmax(_up(teacher) / temperature, dim=-1)
    if kind == "sampled_kl":
        picked_s = s.gather(1, targets.unsqueeze(1)).squeeze(1)
        picked_t = t.gather(1, targets.unsqueeze(1)).squeeze(1)
        return (picked_s - picked_t).detach() * picked_s
    if beta == 0:
        return F.kl_div(s, t, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(t, s, reduction="none", log_target=True).sum(-1)
    b = torch.tensor(beta, dtype=s.dtype, device=s.device)
    mixture = torch.logsumexp(torch.stack([s + torch.log1p(-b), t + torch.log(b)]), dim=0)
    return (b * F.kl_div(mixture, t, reduction="none", log_target=True)
            + (1 - b) * F.kl_div(mixture, s, reduction="none", log_target=True)).sum(-1)


def _figures(student: torch.Tensor, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of KL(student || teacher) at temperature 1, top-1 agreements) of [N, V] logits: the log line's figures."""
    s, t = F.log_softmax(_up(student), -1), F.log_softmax(_up(teacher), -1)
    reverse = (s.exp() * (s - t)).sum()
    return reverse, (student.argmax(-1) == teacher.argmax(-1)).sum()


def _next(labels: torch.Tensor) -> torch.Tensor:
    """[B * T] flat targets: position t predicts labels[t + 1] (IGNORE_INDEX at each row's last position)."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return targets.reshape(-1)


def divergence_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, beta: float,
                   temperature: float, kind: str = "jsd") -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum over the positions that predict a trained label, their count) from [B, T, V] logits: the full form
    that `chunked_divergence` equals."""
    targets = _next(labels)
    valid = targets != IGNORE_INDEX
    s = student_logits.reshape(-1, student_logits.shape[-1])[valid]
    t = teacher_logits.reshape(-1, teacher_logits.shape[-1])[valid]
    return token_divergence(s, t, beta, temperature, kind, targets[valid]).sum(), valid.sum()


@dataclass(frozen=True)
class Divergence:
    """What the loss compares: distill.beta, distill.temperature, distill.loss (jsd | sampled_kl)."""

    beta: float = 0.5
    temperature: float = 1.0
    kind: str = "jsd"


def chunked_divergence(student: tuple, teacher: tuple, labels: torch.Tensor, div: Divergence,
                       chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`divergence_sum(hidden @ weight.T + bias, teacher_hidden @ teacher_weight.T + teacher_bias, labels, ...)`
    without either [B, T, V] tensor, `student` = (hidden, weight, bias, softcap), `teacher` = (teacher_hidden,
    teacher_weight, teacher_bias, teacher_softcap) (softcap: Gemma-2's final-logit softcapping, or None): (loss sum, fp32 0-d, differentiable in hidden / weight / bias; positions counted;
    the reverse KL sum and the top-1 agreements at temperature 1, no gradient). hidden [B, T, H] (the student's final
    hidden states), teacher_hidden [B, T, H'] (the teacher's: its width may differ, the vocabulary may not); only the
    positions that predict a trained label are projected (one host sync for their index), `chunk_size` at a time."""
    hidden, weight, bias, softcap = student
    teacher_hidden, teacher_weight, teacher_bias, teacher_softcap = teacher
    if hidden.shape[:2] != labels.shape or teacher_hidden.shape[:2] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)}, teacher_hidden {tuple(teacher_hidden.shape)} and labels "
                         f"{tuple(labels.shape)} must share [B, T]")
    if weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"the student's vocabulary ({weight.shape[0]}) differs from the teacher's "
                         f"({teacher_weight.shape[0]})")
    targets = _next(labels)
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    flat = hidden.reshape(-1, hidden.shape[-1])[rows]
    flat_t = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])[rows].detach()
    settings = (int(chunk_size), float(div.beta), float(div.temperature), div.kind, softcap, teacher_softcap)
    teacher = (flat_t, teacher_weight.detach(), None if teacher_bias is None else teacher_bias.detach())
    inputs = (flat, weight) if bias is None else (flat, weight, bias)
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        total, reverse, agree = _ChunkedDivergence.apply(flat, weight, bias, teacher, targets[rows], settings)
    else:
        total, reverse, agree, _ = _chunks(flat, weight, bias, teacher, targets[rows], settings, False)
    return total, rows.new_tensor(rows.numel()), reverse, agree


def _chunks(flat, weight, bias, teacher, targets, settings, grads: bool):
    """(loss sum, reverse KL sum, agreements, (grad_hidden, grad_weight, grad_bias) or None) over chunks of rows."""
    chunk_size, beta, temperature, kind, softcap, teacher_softcap = settings
    flat_t, weight_t, bias_t = teacher
    device = flat.device
    acc = torch.promote_types(flat.dtype, torch.float32)
    total = torch.zeros((), dtype=acc, device=device)
    reverse = torch.zeros((), dtype=acc, device=device)
    agree = torch.zeros((), dtype=torch.long, device=device)
    grad_h = torch.zeros_like(flat) if grads else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=device) if grads else None
    grad_b = torch.zeros(weight.shape[0], dtype=acc, device=device) if grads and bias is not None else None
    for start in range(0, flat.shape[0], chunk_size):
        stop = min(start + chunk_size, flat.shape[0])
        h = flat[start:stop].detach()
        with torch.no_grad():
            zt = _capped(_up(F.linear(flat_t[start:stop], weight_t, bias_t)), teacher_softcap)
            raw = _up(F.linear(h, weight, bias))
        with torch.enable_grad():
            leaf = raw.requires_grad_(grads)
            z = _capped(leaf, softcap)
            per = token_divergence(z, zt, beta, temperature, kind, targets[start:stop])
            chunk = per.sum()
        if grads:
            (g,) = torch.autograd.grad(chunk, leaf)
            grad_h[start:stop] = (g.to(weight.dtype) @ weight).to(flat.dtype)
            grad_w += g.T @ h.to(g.dtype)
            if grad_b is not None:
                grad_b += g.sum(0)
        total += chunk.detach()
        with torch.no_grad():
            r, a = _figures(z.detach(), zt)
        reverse += r
        agree += a
        del raw, z, zt, per
    return total, reverse, agree, (grad_h, grad_w, grad_b) if grads else None


class _ChunkedDivergence(torch.autograd.Function):
    """See chunked_divergence: the student's gradients are computed in the forward, the backward scales them."""

    @staticmethod
    def forward(ctx, flat, weight, bias, teacher, targets, settings):
        total, reverse, agree, grads = _chunks(flat, weight, bias, teacher, targets, settings, True)
        ctx.grads, ctx.dtypes = grads, (weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(reverse, agree)
        return total, reverse, agree

    @staticmethod
    def backward(ctx, grad_total, *_):
        return (*hand_over(ctx, grad_total, "chunked_divergence"), None, None, None)


class DivergenceHead(ChunkedHeadLoss):
    """While active, the student's output head returns `chunked_divergence`'s loss sum against `teacher` (its
    (hidden states, head weight, bias, softcap), from `teacher_hidden`); run the student's forward as for
    ChunkedHeadLoss, then `result(out)` gives (loss sum, positions) and `figures` (reverse KL sum, agreements).
    `vocab`: the first rows of both heads that the loss reads, where their padding differs (None: all)."""

    def __init__(self, model, labels, teacher: tuple, div: Divergence, chunk_size: int = 1024,
                 vocab: int | None = None):
        super().__init__(model, labels, chunk_size=chunk_size)
        self.teacher, self.div = teacher, div
        self.vocab = vocab  # the heads' first rows both read (heads padded differently), or None: all
        self.figures = None

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1 or hidden.shape[:2] != self.labels.shape:
            raise RuntimeError("DivergenceHead: the output head must run once, on every position")
        weight, bias = head_params(self.head)
        t_hidden, t_weight, t_bias, t_softcap = self.teacher
        with gathered([t_weight, t_bias]):  # a ZeRO-3 teacher's head: whole for the loss, partitioned again after
            if self.vocab is not None:  # (sliced once whole: a partitioned weight's slice is empty)
                weight, t_weight = weight[:self.vocab], t_weight[:self.vocab]
                bias, t_bias = (None if x is None else x[:self.vocab] for x in (bias, t_bias))
            total, self.count, reverse, agree = chunked_divergence(
                (hidden, weight, bias, self.softcap), (t_hidden, t_weight, t_bias, t_softcap), self.labels, self.div,
                self.chunk_size)
        self.figures = (reverse, agree)
        return total


@torch.no_grad()
def teacher_hidden(teacher, inputs: dict) -> tuple:
    """(final hidden states [B, T, H'], head weight, head bias, final-logit softcap) of the teacher on `inputs`: its
    forward with the output head passed through (the head's weight is used chunk by chunk in the student's loss)."""
    head, softcap, config = output_head(teacher)
    head.forward = lambda h: h  # nn.Module.__call__ still runs the head's hooks
    if softcap is not None:
        config.final_logit_softcapping = None
    try:
        out = teacher(**inputs, use_cache=False)
    finally:
        del head.forward
        if softcap is not None:
            config.final_logit_softcapping = softcap
    weight, bias = head_params(head)
    return out.logits, weight, bias, softcap
