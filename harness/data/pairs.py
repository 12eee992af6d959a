"""Preference pairs (loss.mode=preference): TRL's preference formats -> tokenized pairs -> padded pair batches.

Records (TRL's layouts; `format: preference`, detected from the `chosen` and `rejected` columns):
    explicit prompt, text           {"prompt": str, "chosen": str, "rejected": str}
    explicit prompt, conversational {"prompt": [messages], "chosen": [assistant messages], "rejected": [...]}
    implicit prompt                 {"chosen": str | [messages], "rejected": str | [messages]}: the prompt is the
                                    leading messages both share (text: the common prefix of the two strings)

Canonical row: {"prompt", "chosen", "rejected": [segments], "tools", "origin"}; text forms are one segment of role
"text". A conversation goes through the chat template: prompt = the prompt messages rendered with the generation
prompt, completion = the rest of the rendered prompt + chosen (or rejected) conversation. Plain text: bos + prompt,
completion + eos. The loss (the sequence log-probability) is on the completion tokens only.

A bad record (no chosen, chosen equal to rejected, an empty completion, a completion truncated to nothing) is one
DataError naming file:line; no pair is dropped.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from harness import IGNORE_INDEX
from harness.data.formats import preference_record  # noqa: F401 - the record layouts, re-exported
from harness.errors import DataError
from harness.data import chat
from harness.data.samples import Widths


# ----------------------------------------------------------------------------------------------- tokenization


def _render(tokenizer, template: str, segments: list[dict], origin: str, **kw) -> str:
    return chat._render(tokenizer, template, chat.conversation(segments), None, origin, **kw)


def pair_texts(tokenizer, template: str, row: dict) -> tuple[str, str, str, bool]:
    """(prompt text, chosen completion text, rejected completion text, plain) of a canonical row."""
    prompt, origin = row["prompt"], row["origin"]
    if row["chosen"][0]["role"] == "text":
        return (prompt[0]["content"] if prompt else ""), row["chosen"][0]["content"], row["rejected"][0]["content"], True
    head = _render(tokenizer, template, prompt, origin, add_generation_prompt=True) if prompt else ""
    sides = []
    for name in ("chosen", "rejected"):
        full = _render(tokenizer, template, prompt + row[name], origin)
        if not full.startswith(head):
            raise DataError(f"{origin}: the chat template renders the prompt differently once the {name} answer "
                            f"follows; no stable completion to score")
        sides.append(full[len(head):])
    return head, sides[0], sides[1], False


def tokenize_pairs(batch: dict, tokenizer, max_len: int, template: str) -> dict:
    """Batched `map` function: canonical pair rows -> {chosen,rejected}_{ids,labels}, length (the longer side),
    truncated (either side cut at max_len). Labels are the completion's ids (IGNORE_INDEX on the prompt)."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    out: dict[str, list] = {k: [] for k in ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels",
                                            "length", "truncated", "prompt_len")}
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    for row in rows:
        prompt, chosen, rejected, plain = pair_texts(tokenizer, template, row)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
        if plain and bos is not None:
            p_ids = [bos] + p_ids
        cut = False
        for name, text in (("chosen", chosen), ("rejected", rejected)):
            c_ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([eos] if plain and eos is not None else [])
            if not c_ids:
                raise DataError(f"{row['origin']}: field '{name}': the completion has no tokens")
            ids = (p_ids + c_ids)[:max_len]
            if len(ids) <= len(p_ids):
                raise DataError(f"{row['origin']}: field '{name}': truncated to nothing (the prompt alone has "
                                f"{len(p_ids)} tokens, data.max_len={max_len}); raise data.max_len or shorten the "
                                f"prompt")
            cut = cut or len(p_ids) + len(c_ids) > max_len
            out[f"{name}_ids"].append(ids)
            out[f"{name}_labels"].append([IGNORE_INDEX] * len(p_ids) + ids[len(p_ids):])
        out["length"].append(max(len(out["chosen_ids"][-1]), len(out["rejected_ids"][-1])))
        out["truncated"].append(cut)
        out["prompt_len"].append(len(p_ids))
    return out


def tokenize_pair_dataset(rows, tokenizer, max_len: int, template: str):
    """(tokenized pairs with an `index` column, stats: pairs, lengths, truncation)."""
    ds = rows.map(tokenize_pairs, batched=True, batch_size=256, remove_columns=rows.column_names,
                  fn_kwargs={"tokenizer": tokenizer, "max_len": max_len, "template": template},
                  desc="tokenizing pairs", num_proc=None if len(rows) < 5000 else min(8, os.cpu_count() or 1))
    ds = ds.add_column("index", list(range(len(ds))))
    return ds, pair_stats(ds)


def pair_stats(ds) -> dict:
    lengths = list(ds["length"]) or [0]
    return {"pairs": len(ds), "mean_len": sum(lengths) / len(lengths), "max_len": max(lengths),
            "mean_prompt_len": sum(ds["prompt_len"]) / max(len(ds), 1), "truncated": int(sum(ds["truncated"]))}


# ----------------------------------------------------------------------------------------------- batches


class PairCollator:
    """Pairs -> one batch of 2n rows, the n chosen sequences first, then the n rejected ones (one forward pass);
    `pair_index` [n] numbers the pairs in their data set, and with `reference` set (a [pairs, 2] tensor of the
    reference model's log-probs, `reference_logps`) `ref_logps` [2n] comes with them."""

    def __init__(self, pad_token_id: int, widths=None):
        self.pad_token_id, self.widths = pad_token_id, widths or Widths(1)
        self.reference: Any = None

    def __call__(self, pairs: list[dict]) -> dict[str, torch.Tensor]:
        seqs = [(p["chosen_ids"], p["chosen_labels"]) for p in pairs] + \
               [(p["rejected_ids"], p["rejected_labels"]) for p in pairs]
        width = self.widths(max(len(ids) for ids, _ in seqs))
        n = len(seqs)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, (ids, lab) in enumerate(seqs):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            labels[i, :len(ids)] = torch.tensor(lab)
            mask[i, :len(ids)] = 1
        index = torch.tensor([p["index"] for p in pairs], dtype=torch.long)
        batch = {"input_ids": input_ids, "labels": labels, "attention_mask": mask, "pair_index": index}
        if self.reference is not None:
            ref = self.reference[index]
            batch["ref_logps"] = torch.cat([ref[:, 0], ref[:, 1]])
        return batch
