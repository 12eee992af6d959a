"""Completions as training rows, and their per-token log-probs through the output head in chunks.

A completion is one row: its prompt's tokens, then the completion's (EOS included when it ended there), right-padded;
`labels` are IGNORE_INDEX on the prompt and the padding. Per-token tensors (log-probs, old and reference log-probs,
the mask) are [rows, width - 1]: position t holds log p(token t + 1 | ..t), as harness.preference.token_logps gives.

    python -c "from harness.rl.batch import rows; help(rows)"
"""

from __future__ import annotations

import itertools

import torch

from harness.chunked_loss import ChunkedHeadLoss, head_params
from harness import IGNORE_INDEX
from harness.data.samples import model_inputs, pack_rows
from harness.preference import SequenceLogps, next_labels, scored_positions, token_logps


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


def two_rows(groups: list[list[int]]) -> list[list[int]]:
    """The packed rows, a row of padding added to a lone one: a pass of one row (a micro-batch of one question's
    answers, or of the one answer Rollouts.trained keeps from flat questions) has a batch dimension of 1, for which
    torch.compile specializes and compiles the blocks again (0/1 specialization: measured, 1 recompile after step 1
    in 45 GRPO steps of the RL benchmark with train.compile=regional)."""
    return groups + [[]] if len(groups) == 1 else groups


def padding_free(batch: dict, pad_id: int) -> dict:
    """The rows of `batch` (`rows`, with its `scored`) packed without padding, for the forward pass only: answers
    placed whole into rows no wider than the batch's (best-fit decreasing, data.packing's `pack_rows`), each with
    position ids from 0 (transformers builds a block-diagonal causal mask from them when no attention mask is given:
    no answer attends to another), a row's tail its own document of pad tokens. Returns `packed_input_ids`,
    `packed_position_ids`, `packed_scored` (the packed flat index of each of `scored`'s positions, in scored's order:
    completion_logps maps the log-probs back to the [rows, width] layout the loss reads), `packed_targets` (the token
    each of them is scored on) and `packed_tokens` (the real tokens the pass runs: the log line's tokens and
    padding_share)."""
    mask = batch["attention_mask"]
    n_rows, width = mask.shape
    lengths = mask.sum(1).tolist()
    groups = two_rows(pack_rows(lengths, width))
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
    ids[to[real]] = batch["input_ids"].reshape(-1)[real]
    scored = batch["scored"]
    return {"packed_input_ids": ids.view(len(groups), cap), "packed_position_ids": positions,
            "packed_scored": to[scored], "packed_targets": next_labels(batch["labels"]).reshape(-1)[scored],
            "packed_tokens": torch.tensor(sum(lengths))}


def shared_prompts(batch: dict, prompt_lens: list[int], answers: list[int], pad_id: int) -> dict:
    """The rows of `batch` (`rows`, with its `scored`; question q, whose prompt has prompt_lens[q] tokens, is answered
    by the next answers[q] rows) for a forward pass that runs each prompt once for several of its answers: a unit is
    a prompt followed by answers of it, up to twice the batch's width in all (prompt + answers; a question's answers
    that do not fit start another unit with the prompt again), units packed into rows (best-fit decreasing).
    An answer's tokens have the position ids its own row would give them (prompt length on) and attend to its prompt
    and to itself only: `packed_unit` and `packed_answer` ([rows, width] ids) from which `answer_mask` builds the
    [rows, 1, width, width] boolean mask on the device (given to the model as a custom 4D mask: sdpa attention).
    Its first token is predicted at the prompt's last position, which the answers of the unit share: each
    position is scored on `packed_targets` (the labels it predicts, one entry per scored position, in `scored`'s
    order: the shared position once per answer), the gradients through it summed, as the answers' own rows would.
    `packed_tokens`: the real tokens the pass runs (a prompt once a unit), the log line's tokens and padding_share."""
    mask, ids = batch["attention_mask"], batch["input_ids"]
    n_rows, width = mask.shape
    lengths, cap = mask.sum(1).tolist(), 2 * width
    units: list[tuple[int, list[int]]] = []  # (question, its answers' rows)
    starts = [0, *itertools.accumulate(answers)]  # question q's rows: starts[q] .. starts[q + 1] - 1
    for q, p in enumerate(prompt_lens):
        unit, size = [], p
        for i in range(starts[q], starts[q + 1]):
            if unit and size + lengths[i] - p > cap:
                units.append((q, unit))
                unit, size = [], p
            unit.append(i)
            size += lengths[i] - p
        units.append((q, unit))
    sizes = [prompt_lens[q] + sum(lengths[i] - prompt_lens[q] for i in u) for q, u in units]
    groups = two_rows(pack_rows(sizes, cap))
    n_packed = len(groups)
    width_p = max(sum(sizes[k] for k in g) for g in groups)
    flat = torch.full((n_packed * width_p,), pad_id, dtype=torch.long)
    positions = torch.zeros((n_packed, width_p), dtype=torch.long)
    unit_of = torch.full((n_packed, width_p), -1, dtype=torch.long)
    answer_of = torch.full((n_packed, width_p), -1, dtype=torch.long)  # -1: a prompt's (or the tail's) token
    to = torch.full((n_rows * width,), -1, dtype=torch.long)  # logical predicting position -> packed position
    for r, group_ in enumerate(groups):
        at = 0
        for k in group_:
            (q, unit), p, start = units[k], prompt_lens[units[k][0]], r * width_p
            flat[start + at:start + at + p] = ids[unit[0], :p]
            positions[r, at:at + p] = torch.arange(p)
            unit_of[r, at:at + sizes[k]] = k
            last_prompt = start + at + p - 1
            at += p
            for i in unit:
                c = lengths[i] - p
                flat[start + at:start + at + c] = ids[i, p:p + c]
                positions[r, at:at + c] = torch.arange(p, p + c)
                answer_of[r, at:at + c] = i
                if c:
                    to[i * width + p - 1] = last_prompt
                    to[i * width + p:i * width + p + c - 1] = torch.arange(start + at, start + at + c - 1)
                at += c
        unit_of[r, at:] = len(units) + r  # the tail: pad tokens, a unit of their own
        positions[r, at:] = torch.arange(width_p - at)
    scored = batch["scored"]
    return {"packed_input_ids": flat.view(n_packed, width_p), "packed_position_ids": positions,
            "packed_unit": unit_of, "packed_answer": answer_of, "packed_scored": to[scored],
            "packed_targets": next_labels(batch["labels"]).reshape(-1)[scored],
            "packed_tokens": torch.tensor(sum(sizes))}


def answer_mask(unit: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """[rows, 1, width, width] boolean attention mask of shared_prompts' rows, built where the ids are (on the
    device: the [rows, width] ids travel, not the mask): a token attends, causally, to the tokens of its unit that
    are a prompt's (answer -1) or of its own answer."""
    same_unit = unit[:, None, :] == unit[:, :, None]  # [rows, query, key]
    seen = (answer[:, None, :] == -1) | (answer[:, None, :] == answer[:, :, None])
    causal = torch.ones(unit.shape[1], unit.shape[1], dtype=torch.bool, device=unit.device).tril()
    return (same_unit & seen & causal)[:, None]


def completion_mask(batch: dict) -> torch.Tensor:
    """[rows, width - 1]: 1 where position t predicts a completion token."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).long()


class TemperedLogps(SequenceLogps):
    """SequenceLogps of the logits divided by the sampling temperature (TRL scores completions that way)."""

    def __init__(self, model, labels, chunk_size: int, temperature: float, scored=None, targets=None) -> None:
        super().__init__(model, labels, chunk_size=chunk_size)
        self.temperature, self.scored, self.targets = temperature, scored, targets

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1 or hidden.shape[:2] != self.labels.shape:
            raise RuntimeError("TemperedLogps: the output head must run once, on every position")
        weight, bias = head_params(self.head)
        t = self.temperature
        return token_logps(hidden, weight / t, self.labels, None if bias is None else bias / t, self.chunk_size,
                           self.softcap, self.scored, self.targets)


def completion_logps(model, batch: dict, chunk_size: int, temperature: float = 1.0) -> torch.Tensor:
    """[rows, width - 1] fp32 log-probs of each next token (0 off the completions), in one forward pass; with
    gradients when grad is enabled. The output head runs on the completion positions only (`scored`: the batch's,
    made with it on the host, or computed here)."""
    scored = batch.get("scored")
    if scored is None:
        scored = scored_positions(batch["labels"])
    if "packed_input_ids" in batch:  # rl.rows packed or shared_prompts: the packed rows' pass, mapped back
        inputs = {"input_ids": batch["packed_input_ids"], "position_ids": batch["packed_position_ids"]}
        if "packed_unit" in batch:  # shared_prompts: each prompt once for its unit's answers
            inputs["attention_mask"] = answer_mask(batch["packed_unit"], batch["packed_answer"])
        shape = batch["packed_input_ids"]  # (for the head's shape check only: the targets are given)
        with TemperedLogps(model, shape, chunk_size, temperature, batch["packed_scored"],
                           batch["packed_targets"]) as head:
            out = model(**inputs, use_cache=False)
        picked = ChunkedHeadLoss.result(head, out)[0].view(-1)
        labels = batch["labels"]
        return picked.new_zeros(labels.numel()).index_copy(0, scored, picked).view(labels.shape)[:, :-1]
    with TemperedLogps(model, batch["labels"], chunk_size, temperature, scored) as head:
        out = model(**model_inputs(batch), use_cache=False)
    per_token, _ = ChunkedHeadLoss.result(head, out)  # the [rows, width] log-probs, checked as the model's output
    return per_token[:, :-1]
