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

IGNORE_INDEX = -100


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
