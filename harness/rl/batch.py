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
from harness.data.samples import model_inputs, pack_rows
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


def padding_free(batch: dict, pad_id: int) -> dict:
    """The rows of `batch` (`rows`, with its `scored`) packed without padding, for the forward pass only: answers
    placed whole into rows no wider than the batch's (best-fit decreasing, data.packing's `pack_rows`), each with
    position ids from 0 (transformers builds a block-diagonal causal mask from them when no attention mask is given:
    no answer attends to another), a row's tail its own document of pad tokens. Returns `packed_input_ids`,
    `packed_position_ids`, `packed_labels` and `packed_scored`: the packed flat index of each of `scored`'s positions,
    in scored's order (completion_logps maps the log-probs back to the [rows, width] layout the loss reads)."""
    mask = batch["attention_mask"]
    n_rows, width = mask.shape
    lengths = mask.sum(1).tolist()
    groups = pack_rows(lengths, width)
    cap = max(sum(lengths[i] for i in g) for g in groups)
    to = torch.full((n_rows * width,), -1, dtype=torch.long)  # logical flat position -> packed flat position
    positions = torch.arange(cap).repeat(len(groups), 1)
    for r, group in enumerate(groups):
        at = 0
        for i in group:
            n = lengths[i]
            to[i * width:i * width + n] = torch.arange(r * cap + at, r * cap + at + n)
            positions[r, at:at + n] = torch.arange(n)
            at += n
        positions[r, at:] = torch.arange(cap - at)
    real = mask.reshape(-1).bool()
    ids = torch.full((len(groups) * cap,), pad_id, dtype=torch.long)
    labels = torch.full((len(groups) * cap,), IGNORE_INDEX, dtype=torch.long)
    ids[to[real]] = batch["input_ids"].reshape(-1)[real]
    labels[to[real]] = batch["labels"].reshape(-1)[real]
    return {"packed_input_ids": ids.view(len(groups), cap), "packed_position_ids": positions,
            "packed_labels": labels.view(len(groups), cap), "packed_scored": to[batch["scored"]]}


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
    if "packed_input_ids" in batch:  # padding_free: the forward pass on the packed rows, mapped back
        with TemperedLogps(model, batch["packed_labels"], chunk_size, temperature, batch["packed_scored"]) as head:
            out = model(input_ids=batch["packed_input_ids"], position_ids=batch["packed_position_ids"],
                        use_cache=False)
        packed, _ = ChunkedHeadLoss.result(head, out)
        picked = packed.reshape(-1).index_select(0, batch["packed_scored"])
        labels = batch["labels"]
        return picked.new_zeros(labels.numel()).index_copy(0, scored, picked).view(labels.shape)[:, :-1]
    with TemperedLogps(model, batch["labels"], chunk_size, temperature, scored) as head:
        out = model(**model_inputs(batch), use_cache=False)
    per_token, _ = ChunkedHeadLoss.result(head, out)  # the [rows, width] log-probs, checked as the model's output
    return per_token[:, :-1]
