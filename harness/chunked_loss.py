"""The chunked generative loss, in one place (loss.chunked_ce): the output head and the next-token loss in one pass
over chunks of positions, so that the [B, T, V] logits never exist.

- `resolve_chunked_ce` (the build): whether a run uses it and how many positions per chunk (`chunked_ce_asked`: the
  config's part, which harness zero-plan sizes with too);
- `ChunkedHeadLoss` (the objective and the evaluation): inside the model's own forward, the output head returns the
  loss sum instead of logits (`output_head` finds the head and refuses heads whose logits are transformed after it);
- `chunked_token_loss_sum`: the pure tensor function (the gradients computed in the forward, chunk by chunk).
"""

from __future__ import annotations

import torch

from harness.config import LossConfig
from harness.config.derived import AUTO_MIN_LOGITS_BYTES, LOGIT_TRANSFORMS, chunked_ce_asked  # noqa: F401 - (light: the plans' too)
from harness import IGNORE_INDEX
from harness.errors import ConfigError
from harness.lora import is_peft
from harness.model import unwrap

def resolve_chunked_ce(loss: LossConfig, compile_mode: str, model, positions: int, say=print) -> int | None:
    """loss.chunked_ce -> positions per chunk for the generative loss, or None for the full logits.

    positions: the most positions one generative micro-batch can have (micro-batch size x longest row; 0 without
    generative data, then always None). auto: on when positions x vocab x 4 bytes >= AUTO_MIN_LOGITS_BYTES (256 MiB),
    unless train.compile=full or the model's head is refused by `output_head` (then a one-line note).
    true with a refused head: a ConfigError. The result depends only on the config and the model, so every process
    decides the same. `compile_mode`: train.compile."""
    setting = loss.chunked_ce
    if not chunked_ce_asked(loss, compile_mode, positions, _vocab_size(model) if setting == "auto" else None):
        return None
    try:
        output_head(model)
    except ConfigError as e:
        reason = str(e).removeprefix("chunked loss: ")
        if setting is True:
            raise ConfigError(f"config key 'loss.chunked_ce': true, but the model's output head is not supported: "
                              f"{reason}; use loss.chunked_ce=false") from None
        say(f"[harness] note: loss.chunked_ce=auto stays off (full logits): {reason}")
        return None
    return loss.chunked_ce_size


def _vocab_size(model) -> int | None:
    """Rows of the output head (out_features: also right under ZeRO-3, where the weight is a 0-size shard)."""
    inner = unwrap(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    return getattr(head, "out_features", None)


# ----------------------------------------------------------------------------------------------- chunked output head
#
# chunked_token_loss_sum (below) takes the final hidden states and the output head's weight. ChunkedHeadLoss
# gets them from the model's own forward: for its duration the output head returns the loss sum instead of logits,
# so the forward still goes through the DDP / DeepSpeed wrapper (gradient-sync preparation, ZeRO-3 gathering of the
# head's weight while it runs, ZeRO-3's backward hooks on its output), and no [B, T, V] tensor is ever built.

# Config attributes by which some families transform the head's output after it (Cohere multiplies by logit_scale,
# Granite divides by logits_scaling, HyperCLOVA X multiplies by it, ...): refused, their meanings differ by family.
def output_head(model) -> tuple[torch.nn.Linear, float | None, object]:
    """(output head, final-logit softcap or None, HF config) of a causal LM, through DDP/DeepSpeed/compile wrappers
    and peft (the head of the base model; tied to the input embedding or not, the same Parameter either way).

    peft's trainable tokens on the head (the rows of tokens added to the vocabulary, trained apart under LoRA:
    harness.lora.apply_lora's trainable_token_indices, tied head or not) are taken: the returned module is then
    the one peft put in lm_head's place, and `head_params` gives its weight with those rows merged in, as peft's own
    forward does.
    Refused with a ConfigError: a head that is not a plain nn.Linear (peft LoRA or modules_to_save on lm_head) and a
    config that scales the logits after the head (LOGIT_TRANSFORMS). Gemma-2-style final_logit_softcapping is
    handled (returned, and applied inside the chunked loss)."""
    inner = unwrap(model)
    base = inner.get_base_model() if is_peft(inner) else inner
    head = base.get_output_embeddings()
    if head is None:
        raise ConfigError(f"chunked loss: {type(base).__name__} has no output embeddings (not a causal LM?)")
    layer = _token_layer(head)
    if layer is not None:
        if not isinstance(layer.base_layer, torch.nn.Linear) or layer.base_layer.bias is not None:
            raise ConfigError(f"chunked loss: peft's trainable tokens wrap a {type(layer.base_layer).__name__} head"
                              f"{' with a bias' if isinstance(layer.base_layer, torch.nn.Linear) else ''}; the "
                              f"chunked loss takes them on a plain Linear without bias")
    elif not isinstance(head, torch.nn.Linear):
        raise ConfigError(f"chunked loss: the output head is a {type(head).__name__}, not a plain Linear (a LoRA "
                          f"adapter or modules_to_save on lm_head?); the chunked loss needs its weight as is")
    config = base.config
    configs = [config]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        configs.append(text)
    for cfg in configs:
        for attr in LOGIT_TRANSFORMS:
            value = getattr(cfg, attr, None)
            if value is not None and value != 1:
                raise ConfigError(f"chunked loss: {getattr(cfg, 'model_type', '?')} config sets {attr}={value}, a "
                                  f"transform of the logits after the head that the chunked loss does not apply")
    if text is not config and getattr(text, "final_logit_softcapping", None) is not None:
        raise ConfigError("chunked loss: final_logit_softcapping in a nested text config is not supported")
    return head, getattr(config, "final_logit_softcapping", None), config


def _token_layer(head):
    """peft's TrainableTokensLayer behind the output head (inside the TrainableTokensWrapper peft puts in place of
    lm_head, or the head itself), else None."""
    layer = getattr(head, "token_adapter", head)
    return layer if type(layer).__name__ == "TrainableTokensLayer" and hasattr(layer, "get_merged_weights") else None


def head_params(head) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) the output head multiplies by: a plain Linear's own, or under peft's trainable tokens the base
    weight with the trained rows of the active adapter put in (peft's get_merged_weights: a differentiable copy, as
    in its forward), the base weight where the adapter is off (disable_adapter: a DPO reference pass) or merged;
    no bias there (output_head refuses a biased head under trainable tokens)."""
    layer = _token_layer(head)
    if layer is None:
        return head.weight, head.bias
    active = [a for a in layer.active_adapters if a in layer.token_indices]
    if layer.disable_adapters or layer.merged or not active:
        return layer.base_layer.weight, None
    return layer.get_merged_weights(active), None


class ChunkedHeadLoss:
    """While active, `model`'s output head returns the chunked next-token loss sum (a 0-d fp32 tensor) in place of
    the logits; run the model's forward (through its wrappers) with logits_to_keep=0 and without `labels`, then
    `result(out)` gives (total, count) as token_loss_sum(out.logits, labels) would, and total back-propagates
    like it::

        with ChunkedHeadLoss(model, batch["labels"], chunk_size=1024) as head_loss:
            out = model(**model_inputs(batch), use_cache=False)
        total, count = head_loss.result(out)

    The head must be called exactly once, on all positions; `result` checks that the model returned the head's
    output unchanged (a family that transforms it after the head is refused there, whatever its config says). With
    final_logit_softcapping the config value is set to None for the duration, and the cap applied in the loss."""

    def __init__(self, model, labels: torch.Tensor, chunk_size: int = 1024, skip_ignored: bool = False,
                 shifted: bool = False):
        self.model, self.labels, self.chunk_size, self.skip_ignored = model, labels, chunk_size, skip_ignored
        self.shifted = shifted  # labels already shifted (sequence parallelism's shift_labels): position t predicts t
        self.count = self.returned = None
        self.calls = 0

    def __enter__(self) -> "ChunkedHeadLoss":
        self.head, self.softcap, self.config = output_head(self.model)
        self.head.forward = self._forward  # nn.Module.__call__ runs hooks around self.forward: ZeRO-3's included
        self._hook = self.head.register_forward_hook(self._record)
        if self.softcap is not None:
            self.config.final_logit_softcapping = None
        return self

    def __exit__(self, *exc) -> None:
        del self.head.forward
        self._hook.remove()
        if self.softcap is not None:
            self.config.final_logit_softcapping = self.softcap

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("ChunkedHeadLoss: the output head was called more than once in one forward")
        if hidden.shape[:2] != self.labels.shape:
            raise RuntimeError(f"ChunkedHeadLoss: the head got hidden states {tuple(hidden.shape)} for labels "
                               f"{tuple(self.labels.shape)}; call the model with logits_to_keep=0")
        weight, bias = head_params(self.head)
        total, self.count = chunked_token_loss_sum(hidden, weight, self.labels, bias,
                                                   self.chunk_size, softcap=self.softcap,
                                                   skip_ignored=self.skip_ignored, shifted=self.shifted)
        return total

    def _record(self, module, args, output) -> None:
        self.returned = output  # after the hooks registered before ours (ZeRO-3 wraps the output in its own Function)

    def result(self, out) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, trained tokens) from the model's output."""
        if self.returned is None:
            raise RuntimeError("ChunkedHeadLoss: the output head was not called")
        logits = out.logits if hasattr(out, "logits") else out[0]
        # Not an identity check: ZeRO-3 replaces every module's output tensors (the head's, then the model's, in
        # the returned ModelOutput) with detached views through its backward-hook Functions. Those share the storage;
        # a transform of the logits (scale, softcap, cast) would not.
        if not (torch.is_tensor(logits) and logits.shape == self.returned.shape and logits.dtype == self.returned.dtype
                and logits.data_ptr() == self.returned.data_ptr()):
            raise RuntimeError(f"ChunkedHeadLoss: {type(unwrap(self.model)).__name__} transforms the output head's "
                               f"result before returning it; the chunked loss does not support this model")
        return logits, self.count


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
    shifted: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_loss_sum(hidden @ weight.T + bias, labels)` without building the [B, T, V] logits.

    hidden: [B, T, H] final hidden states (after the final norm); weight: [V, H] (the output head's weight, tied to
    the input embedding or not); bias: [V] or None; labels: [B, T] with IGNORE_INDEX where untrained. Position t
    predicts labels[t + 1], as in token_loss_sum. Returns (sum of the per-token losses, fp32 0-d tensor; number of
    trained tokens, int64 0-d tensor), the same as token_loss_sum.

    shifted: labels are the targets already (position t predicts labels[b, t]; sequence parallelism's shards).
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
    if shifted:  # labels[b, t] is position t's target already (a sequence-parallel shard)
        count, targets = (labels != IGNORE_INDEX).sum(), labels.reshape(-1)
    else:
        count = (labels[:, 1:] != IGNORE_INDEX).sum()
        # Row b*T + t of the flattened hidden states predicts labels[b, t + 1]; the last position of a row predicts
        # nothing.
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


def hand_over(ctx, grad_total: torch.Tensor, name: str) -> tuple:
    """The backward of a loss whose gradients (hidden, weight, bias) its forward computed and kept on ctx.grads (each
    None where not needed), ctx.dtypes the weight's and bias's: those gradients scaled by the loss's incoming
    gradient, handed over once (a second backward through the same graph is an error)."""
    if ctx.grads is None:
        raise RuntimeError(f"{name}: backward ran twice through the same graph; the gradients are computed in the "
                           f"forward and handed over once (retain_graph is not supported)")
    grad_h, grad_w, grad_b = ctx.grads
    ctx.grads = None
    scale = grad_total.detach()
    if grad_h is not None:
        grad_h.mul_(scale)
    if grad_w is not None:
        grad_w = grad_w.mul_(scale).to(ctx.dtypes[0])
    if grad_b is not None:
        grad_b = grad_b.mul_(scale).to(ctx.dtypes[1])
    return grad_h, grad_w, grad_b


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
        return (*hand_over(ctx, grad_total, "chunked_token_loss_sum"), None, None, None, None)
