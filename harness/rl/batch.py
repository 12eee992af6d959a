"""Completions as training rows, and their per-token log-probs through the output head in chunks.

A completion is one row: its prompt's tokens, then the completion's (EOS included when it ended there), right-padded;
`labels` are IGNORE_INDEX on the prompt and the padding. Per-token tensors (log-probs, old and reference log-probs,
the mask) are [rows, width - 1]: position t holds log p(token t + 1 | ..t), as harness.preference.token_logps gives.

    python -c "from harness.rl.batch import rows; help(rows)"
"""

from __future__ import annotations

import torch

from harness.chunked_loss import ChunkedHeadLoss, head_params
from harness import IGNORE_INDEX
from harness.data.samples import model_inputs
from harness.preference import SequenceLogps, scored_positions, token_logps


def rows(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> dict:
    """{input_ids, attention_mask, labels} of prompt + completion rows, right-padded to the longest."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    labels = torch.full((len(prompts), width), IGNORE_INDEX, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c, dtype=torch.long)
        mask[i, :n] = 1
        labels[i, len(p):n] = torch.tensor(c, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def completion_mask(batch: dict) -> torch.Tensor:
    """[rows, width - 1]: 1 where position t predicts a completion token."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).long()


class TemperedLogps(SequenceLogps):
    """SequenceLogps of the logits divided by the sampling temperature (TRL scores completions that way)."""

    def __init__(self, model, labels, chunk_size: int, temperature: float, scored=None) -> None:
        super().__init__(model, labels, chunk_size=chunk_size)
        self.temperature, self.scored = temperature, scored

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1 or hidden.shape[:2] != self.labels.shape:
            raise RuntimeError("TemperedLogps: the output head must run once, on every position")
        weight, bias = head_params(self.head)
        t = self.temperature
        return token_logps(hidden, weight / t, self.labels, None if bias is None else bias / t, self.chunk_size,
                           self.softcap, self.scored)


def completion_logps(model, batch: dict, chunk_size: int, temperature: float = 1.0) -> torch.Tensor:
    """[rows, width - 1] fp32 log-probs of each next token (0 off the completions), in one forward pass; with
    gradients when grad is enabled. The output head runs on the completion positions only (`scored`: the batch's,
    made with it on the host, or computed here)."""
    scored = batch.get("scored")
    if scored is None:
        scored = scored_positions(batch["labels"])
    with TemperedLogps(model, batch["labels"], chunk_size, temperature, scored) as head:
        out = model(**model_inputs(batch), use_cache=False)
    per_token, _ = ChunkedHeadLoss.result(head, out)  # the [rows, width] log-probs, checked as the model's output
    return per_token[:, :-1]
