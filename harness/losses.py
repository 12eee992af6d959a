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

from harness.data import IGNORE_INDEX


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


# ----------------------------------------------------------------------------------------------- chunked linear + CE
#
# The output head and the next-token loss in one pass over chunks of positions (issue 18). For a large vocabulary the
# logits are the biggest tensors of a step: Llama-3 (V = 128,256) on 8,192 tokens has 2.1 GB of bf16 logits,
# token_loss_sum's fp32 copy adds 4.2 GB and the backward another full-size gradient. Here only one chunk's logits
# (chunk_size x V) exist at a time.


def chunked_token_loss_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    *,
    softcap: float | None = None,
    skip_ignored: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_loss_sum(hidden @ weight.T + bias, labels)` without building the [B, T, V] logits.

    hidden: [B, T, H] final hidden states (after the final norm); weight: [V, H] (the output head's weight, tied to
    the input embedding or not); bias: [V] or None; labels: [B, T] with IGNORE_INDEX where untrained. Position t
    predicts labels[t + 1], as in token_loss_sum. Returns (sum of the per-token losses, fp32 0-d tensor; number of
    trained tokens, int64 0-d tensor), the same as token_loss_sum.

    softcap: Gemma-2-style final-logit softcapping, logits -> softcap * tanh(logits / softcap) (applied in fp32).
    skip_ignored: compute only the positions that have a target (one host sync for the index; worth it when many
    positions are ignored, e.g. long SFT prompts or padding). Without it every position is computed and the ignored
    ones masked out, with nothing that waits for the device.

    Compute dtype: the matmuls run in the dtype that F.linear(hidden, weight) would use here, the autocast dtype under
    autocast (weight cast once per call, like autocast's own weight cast), otherwise the common dtype of hidden and
    weight. Each chunk's logits are built in that dtype, upcast to fp32 for the softmax, used and freed.

    Gradients (torch.autograd.Function _ChunkedLinearCE): the forward computes, chunk by chunk, the loss *and* the
    gradients of the loss sum with respect to hidden, weight and bias; it keeps only those gradients (grad_hidden
    [B*T, H] in hidden's dtype, grad_weight [V, H] accumulated in fp32, grad_bias [V]) and the backward multiplies
    them by the incoming scalar grad_output (the W * A / N token-averaging scale, a loss weight, ...). This is
    Liger-kernel's "fused linear cross entropy" design, chosen over recomputing each chunk in the backward because:
      * compute: 3 matmuls of N x V x H (logits, grad_hidden, grad_weight) instead of 4 (the logits again);
      * memory: the same peak. The loss's backward is the first node of the backward pass, when every activation is
        still alive, and a recomputing backward must allocate the same grad_weight [V, H] and grad_hidden [N, H]
        there; the recompute design would save hidden instead of grad_hidden (same size);
      * the weight is not needed in the backward: its compute-dtype copy is freed at the end of the forward, and under
        ZeRO-3 nothing needs to be gathered for the backward of this op.
    Costs of the choice: gradients are computed in the forward whenever grad mode is on and an input requires grad
    (under torch.no_grad, or with nothing requiring grad, only the loss is computed), and the graph can be
    back-propagated once only (retain_graph=True and a second backward raise). Double backward is not supported.

    Peak extra memory: one chunk's logits (chunk_size x V: fp32, plus the compute-dtype logits and gradient under
    bf16/fp16, plus one more fp32 chunk with softcap), grad_hidden, grad_weight, and under a low-precision compute
    dtype one [V, H] weight copy and a per-chunk [V, H] partial weight gradient: nothing of size tokens x vocab.
    """
    if hidden.dim() != 3 or labels.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be [B, T, H] and labels [B, T]; got {tuple(hidden.shape)} and "
                         f"{tuple(labels.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(f"weight must be [V, {hidden.shape[2]}], got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    count = (labels[:, 1:] != IGNORE_INDEX).sum()
    # Row b*T + t of the flattened hidden states predicts labels[b, t + 1]; the last position of a row predicts nothing.
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    targets = targets.reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if skip_ignored:
        rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)
        flat, targets = flat[rows], targets[rows]
    cdtype = _compute_dtype(hidden, weight)
    inputs = (flat, weight) if bias is None else (flat, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        total = _ChunkedLinearCE.apply(flat, weight, bias, targets, int(chunk_size), softcap, cdtype)
    else:
        total, _, _, _ = _chunked_ce(flat, weight, bias, targets, int(chunk_size), softcap, cdtype, False, False, False)
    return total, count


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev) and hidden.is_floating_point():
        return torch.get_autocast_dtype(dev)
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden is {hidden.dtype} but weight is {weight.dtype} (outside autocast they must match, "
                        f"as for F.linear)")
    return hidden.dtype


def _chunked_ce(flat, weight, bias, targets, chunk_size, softcap, cdtype, need_h, need_w, need_b):
    """(loss sum, grad_hidden, grad_weight, grad_bias) of the unscaled loss sum; the gradients not asked for are None.
    flat: [N, H]; targets: [N] (IGNORE_INDEX: no loss, zero gradient)."""
    n, device = flat.shape[0], flat.device
    acc = torch.promote_types(weight.dtype, torch.float32)
    with torch.autocast(device.type, enabled=False):  # the casts below are explicit
        w = weight.to(cdtype)
        b = None if bias is None else bias.to(cdtype)
        total = torch.zeros((), dtype=torch.float32, device=device)
        grad_h = torch.empty(flat.shape, dtype=flat.dtype, device=device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.promote_types(bias.dtype, torch.float32),
                             device=device) if need_b else None
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            h = flat[start:stop].to(cdtype)
            logits = h @ w.T if b is None else torch.addmm(b, h, w.T)
            z = logits.float()  # the same tensor when the compute dtype is fp32: everything below is in place on it
            del logits
            tgt = targets[start:stop]
            valid = tgt != IGNORE_INDEX
            # An ignored row gathers column 0 and is masked out; any other out-of-range label fails in gather, as it
            # does in F.cross_entropy.
            safe = torch.where(valid, tgt, torch.zeros_like(tgt)).unsqueeze(1)
            dcap = None
            if softcap is not None:
                z.div_(softcap).tanh_()
                if need_h or need_w or need_b:
                    dcap = 1.0 - z * z  # d(softcap * tanh(x / softcap)) / dx
                z.mul_(softcap)
            picked = z.gather(1, safe).squeeze(1)
            peak = z.amax(dim=1, keepdim=True)
            z.sub_(peak).exp_()
            norm = z.sum(dim=1)
            row_loss = norm.log() + peak.squeeze(1) - picked  # logsumexp - logit of the target
            total += torch.where(valid, row_loss, torch.zeros_like(row_loss)).sum()
            if not (need_h or need_w or need_b):
                continue
            z.div_(norm.unsqueeze(1))  # softmax
            z.scatter_add_(1, safe, torch.full_like(picked, -1.0).unsqueeze(1))  # softmax - one_hot(target)
            z.masked_fill_(~valid.unsqueeze(1), 0.0)
            if dcap is not None:
                z.mul_(dcap)
                del dcap
            if need_b:
                grad_b += z.sum(dim=0)
            g = z.to(cdtype)
            if need_h:
                if grad_h.dtype == cdtype:
                    torch.mm(g, w, out=grad_h[start:stop])
                else:
                    grad_h[start:stop] = g @ w
            if need_w:
                if acc == cdtype:
                    grad_w.addmm_(g.T, h)
                else:
                    grad_w += g.T @ h
            del z, g
    return total, grad_h, grad_w, grad_b


class _ChunkedLinearCE(torch.autograd.Function):
    """See chunked_token_loss_sum: the gradients are computed in the forward, the backward only scales them."""

    @staticmethod
    def forward(ctx, flat, weight, bias, targets, chunk_size, softcap, cdtype):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        total, grad_h, grad_w, grad_b = _chunked_ce(flat, weight, bias, targets, chunk_size, softcap, cdtype,
                                                    need_h, need_w, need_b)
        # Kept on ctx (not save_for_backward): they are results, not inputs, and the backward hands them on as its
        # outputs, so autograd can take them over as .grad without a copy.
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if ctx.grads is None:
            raise RuntimeError("chunked_token_loss_sum: backward ran twice through the same graph; the gradients are "
                               "computed in the forward and handed over once (retain_graph is not supported)")
        grad_h, grad_w, grad_b = ctx.grads
        ctx.grads = None
        scale = grad_total.detach()
        if grad_h is not None:
            grad_h.mul_(scale)
        if grad_w is not None:
            grad_w = grad_w.mul_(scale).to(ctx.dtypes[0])
        if grad_b is not None:
            grad_b = grad_b.mul_(scale).to(ctx.dtypes[1])
        return grad_h, grad_w, grad_b, None, None, None, None
