"""Generative training data: sources -> validated canonical rows -> tokenized samples -> padded batches.

Where rows come from is harness.data.sources (files, folders, save_to_disk folders, hub ids; one-line `file:line` /
`file:row N` errors); record layouts are harness.data.formats:
    text       {"text": "..."}                                   loss on every token
    messages   {"messages": [{"role": system|user|assistant|tool, "content", "tool_calls"?...}], "tools"?}
    sharegpt   {"conversations": [{"from": human|gpt|system|function_call|observation, "value"}]}
    alpaca     {"instruction", "input"?, "output", "system"?, "history"?}
    gritlm     {"text": [user, assistant, ...]}
all become rows {segments: [{role, content, extra}], tools, origin}; loss on assistant turns only (text: all).
Nothing is dropped silently: samples that lose all their trainable tokens to truncation are counted and reported.
Tokenization is a batched, cached `map` over the rows' Arrow dataset.

Chat layout: the run's chat template (data.chat_template, harness.data.chat): the tokenizer's own (Qwen's ChatML,
Llama-3's headers, ...) or, for a tokenizer without one, GritLM's format (the markers are special tokens, see
harness.model.CHAT_MARKERS):
    <s><|system|>\\n{system}\\n<|user|>\\n{user}\\n<|assistant|>\\n{assistant}</s><|user|>\\n...
The token ids are exactly `tokenizer.apply_chat_template(messages)`'s; the loss covers every assistant turn's
content and what the template closes it with (`</s>`, `<|im_end|>`, `<|eot_id|>`).

    harness data-stats data/sample/gen.jsonl     # validate files and print token-length statistics
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness import IGNORE_INDEX  # labels the loss skips
from harness.data import sources
from harness.errors import DataError
from harness.data import chat


# ----------------------------------------------------------------------------------------------- rows


def load_generative_rows(entries: list, cache_dir: str | None = None, what: str = "data.train_files"):
    """Validate the sources and return a `datasets.Dataset` of rows {segments: [{role, content, extra}], tools,
    origin}: the concatenation of each source's `harness.data.sources.load_source_rows`."""
    return sources.load_rows(entries, "generative", cache_dir, what)


# ----------------------------------------------------------------------------------------------- tokenization


def tokenize_generative(batch: dict, tokenizer, max_len: int, template: str | None = None) -> dict:
    """Batched `map` function: rows -> input_ids, labels (IGNORE_INDEX outside the trained spans), length, truncated.
    Conversations go through the chat template (`template`, default the tokenizer's, else the GritLM layout):
    see harness.data.chat."""
    template = template or chat.own_template(tokenizer) or chat.GRITLM_TEMPLATE
    return chat.tokenize_conversations(batch, tokenizer, max_len, template)


def tokenize_dataset(rows, tokenizer, max_len: int):
    """Tokenize rows (cached by datasets next to the rows' Arrow files); returns (dataset, stats). Samples left
    with no trained token are removed and counted in stats['dropped_no_labels'] (the other stats describe the
    kept samples). The chat template is one of the map's fn_kwargs: another template, another cache entry."""
    template = chat.own_template(tokenizer) or chat.GRITLM_TEMPLATE
    ds = rows.map(
        tokenize_generative,
        batched=True,
        batch_size=1000,
        fn_kwargs={"tokenizer": tokenizer, "max_len": max_len, "template": template},
        remove_columns=[c for c in ("segments", "tools") if c in rows.column_names],
        desc="tokenize",
    )
    has_labels = [any(x != IGNORE_INDEX for x in lab[1:]) for lab in ds["labels"]]
    dropped = [o for o, keep in zip(ds["origin"], has_labels) if not keep]
    if dropped:
        ds = ds.select([i for i, keep in enumerate(has_labels) if keep])
    if len(ds) == 0:
        raise DataError(f"no sample has a trained token left after truncation to data.max_len={max_len} "
                        f"(first: {dropped[0]})")
    lengths = sorted(ds["length"])
    stats = {
        "samples": len(ds),
        "tokens": int(sum(lengths)),
        "mean_len": sum(lengths) / len(lengths),
        "max_len": lengths[-1],
        "p50_len": lengths[len(lengths) // 2],
        "p95_len": lengths[min(len(lengths) - 1, int(0.95 * len(lengths)))],
        "truncated": int(sum(ds["truncated"])),
        "dropped_no_labels": len(dropped),
        "dropped_examples": dropped[:5],
    }
    return ds.remove_columns(["truncated", "origin"]), stats


# ----------------------------------------------------------------------------------------------- batching


@dataclass(frozen=True)
class Widths:
    """The padded width of a micro-batch from its longest row: the longest row itself rounded up to `multiple`, or,
    with `buckets` > 0, the smallest of `buckets` evenly spaced widths up to `cap` that holds it (a bounded set of
    shapes for torch.compile: see harness/speed/compiling.py). Rows longer than `cap` keep their own width."""
    multiple: int = 1
    buckets: int = 0
    cap: int = 0

    def __call__(self, longest: int) -> int:
        if self.buckets and self.cap and longest <= self.cap:
            step = -(-self.cap // self.buckets)
            step = -(-step // self.multiple) * self.multiple
            return min(self.cap, -(-longest // step) * step)
        return -(-longest // self.multiple) * self.multiple


class GenerativeCollator:
    """Right-pads input_ids/labels to the longest sample in the micro-batch (optionally to a multiple of 8, or up to
    a width bucket: `Widths`)."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 1, widths: Widths | None = None):
        self.pad_token_id = pad_token_id
        self.widths = widths or Widths(pad_to_multiple_of)

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        width = self.widths(max(len(s["input_ids"]) for s in samples))
        n = len(samples)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, s in enumerate(samples):
            k = len(s["input_ids"])
            input_ids[i, :k] = torch.tensor(s["input_ids"])
            labels[i, :k] = torch.tensor(s["labels"])
            mask[i, :k] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def model_inputs(batch: dict) -> dict:
    """The keyword arguments a generative batch passes to the model: a padding mask (and a vision-language batch's
    images), or (packed rows) per-document position ids without a mask."""
    if "position_ids" in batch:
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    # a vision-language batch: the images, and what the model computes its 3-D (mRoPE) positions from
    images = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids") if k in batch}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], **images}


def real_tokens(batch: dict) -> torch.Tensor:
    """Non-padding tokens of a batch (generative, packed, or an embedding side {input_ids, attention_mask}), as a
    0-d tensor on the batch's device: the training loop sums these without waiting for the GPU."""
    return (batch["token_mask"] if "token_mask" in batch else batch["attention_mask"]).sum()


# ----------------------------------------------------------------------------------------------- packing


def auto_max_len(lengths: list[int], percentile: float, multiple: int = 8) -> int:
    """The `percentile` of the full (untruncated) sample lengths, rounded up to a multiple of 8."""
    ordered = sorted(lengths)
    k = min(len(ordered) - 1, max(0, math.ceil(percentile / 100 * len(ordered)) - 1))
    return -(-ordered[k] // multiple) * multiple


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: sample indices grouped into rows of at most `capacity` tokens, longest first, each
    sample into the row with the least room that still fits it. Deterministic."""
    import bisect

    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row index), sorted
    for i in order:
        k = bisect.bisect_left(free, (lengths[i], -1))
        if k < len(free):
            room, r = free.pop(k)
        else:
            room, r = capacity, len(rows)
            rows.append([])
        rows[r].append(i)
        if room - lengths[i] > 0:
            bisect.insort(free, (room - lengths[i], r))
    return [sorted(r) for r in rows]


def pack_dataset(ds, max_len: int):
    """Tokenized samples -> packed rows of input_ids, labels and per-document position_ids (0.. restarting at each
    document). With position_ids and no attention mask, transformers' masking builds a block-diagonal causal mask
    (no attention across documents); flash-attention backends use the same ids as varlen boundaries."""
    import datasets

    rows = pack_rows(list(ds["length"]), max_len)
    ids, labels = ds["input_ids"], ds["labels"]
    out = {"input_ids": [], "labels": [], "position_ids": [], "length": []}
    for row in rows:
        out["input_ids"].append([t for i in row for t in ids[i]])
        out["labels"].append([t for i in row for t in labels[i]])
        out["position_ids"].append([p for i in row for p in range(len(ids[i]))])
        out["length"].append(sum(len(ids[i]) for i in row))
    return datasets.Dataset.from_dict(out)


class PackedCollator:
    """Packed rows -> input_ids, labels, position_ids (no attention_mask: documents are separated by their position
    ids). Row tails are padded with pad tokens that form their own "document" (positions 0..k, labels ignored)."""

    def __init__(self, pad_token_id: int, width: int):
        self.pad_token_id, self.width = pad_token_id, width

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        n, w = len(samples), self.width
        input_ids = torch.full((n, w), self.pad_token_id, dtype=torch.long)
        labels = torch.full((n, w), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.arange(w).repeat(n, 1)
        real = torch.zeros((n, w), dtype=torch.long)
        for i, s in enumerate(samples):
            k = len(s["input_ids"])
            input_ids[i, :k] = torch.tensor(s["input_ids"])
            labels[i, :k] = torch.tensor(s["labels"])
            position_ids[i, :k] = torch.tensor(s["position_ids"])
            position_ids[i, k:] = torch.arange(w - k)
            real[i, :k] = 1
        # token_mask: real tokens, for throughput and padding statistics (not passed to the model)
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "token_mask": real}


# ----------------------------------------------------------------------------------------------- embedding data
#
# Records: {"query": str | [instruction, str], "pos": [str | [instruction, str], ...], "neg": [...]}
# Each text is embedded as GritLM embeds it (gritlm.GritLM.encode, docs/gritlm.md): the string {prefix}{text}, with
# prefix data.emb_instruction_template (with the instruction) or data.emb_plain_template, tokenized in one call with
# the tokenizer's own special tokens; the first instr_len tokens (the prefix alone, tokenized the same way) are not
# pooled.


def load_embedding_rows(entries: list, need_negatives: int, cache_dir: str | None = None,
                        what: str = "data.emb_train_files"):
    """Validate embedding sources into a `datasets.Dataset` of {query, pos, neg, origin} (texts as {instruction,
    text}); `need_negatives` > 0 requires hard negatives."""
    return sources.load_rows(entries, "embedding", cache_dir, what, need_negatives)


# Names the embedding tokenization rule in datasets' cache key; change it whenever tokenize_embed_texts changes what it
# returns, or caches written by an earlier version are read back.
EMBED_TOKENIZATION = "gritlm-joint-1"


@dataclass(frozen=True)
class EmbedFormat:
    instruction_template: str = "<|user|>\n{instruction}\n<|embed|>\n"
    plain_template: str = "<|embed|>\n"
    append_eos: bool = False  # lasttoken pooling pools the eos


def tokenize_embed_texts(texts: list[dict], tokenizer, max_len: int, fmt: EmbedFormat,
                         origins: list[str] | None = None) -> tuple[list, list, int]:
    """[{instruction, text}] -> (input_ids, instr_lens, truncated count), the way gritlm.GritLM.encode tokenizes
    (its `instruction` argument is our prefix): prefix + text tokenized in one call with the tokenizer's own special
    tokens (a BOS only where the tokenizer adds one; a SentencePiece tokenizer's prefix space at the start of the
    prefix, none before the text), cut to max_len tokens by the tokenizer's truncation (the text's end goes);
    instr_len = the token count of the prefix tokenized alone in the same way (GritLM's count of the positions not
    pooled). With fmt.append_eos (lasttoken pooling) the eos follows, within max_len. `origins` (file:line per text)
    name the record in errors."""
    prefixes = [fmt.instruction_template.format(instruction=t["instruction"]) if t["instruction"]
                else fmt.plain_template for t in texts]
    unique = sorted(set(prefixes))
    head_len = dict(zip(unique, map(len, tokenizer(unique)["input_ids"])))
    joined = [p + t["text"] for p, t in zip(prefixes, texts)]
    eos = [tokenizer.eos_token_id] if fmt.append_eos else []
    limit = max_len - len(eos)
    ids, instr, truncated = [], [], 0
    for k, full in enumerate(tokenizer(joined)["input_ids"]):
        head = head_len[prefixes[k]]
        if head >= limit:
            where = f"{origins[k]}: " if origins else ""
            raise DataError(f"{where}instruction {texts[k]['instruction'][:40]!r} takes {head} tokens "
                            f"with its template: no room for the text within {max_len} tokens (raise "
                            f"data.query_max_len / data.passage_max_len)")
        if len(full) > limit:  # the tokenizer's own truncation keeps the special tokens it adds (an eos at the end)
            truncated += 1
            full = tokenizer(joined[k], truncation=True, max_length=limit)["input_ids"]
        ids.append(full + eos)
        instr.append(head)
    return ids, instr, truncated


def tokenize_embedding(batch: dict, tokenizer, query_max_len: int, passage_max_len: int, fmt: EmbedFormat,
                       rule: str = "") -> dict:
    """Batched `map` function for embedding rows: token ids and instruction lengths of query, pos and neg. `rule`
    (EMBED_TOKENIZATION) only keys datasets' cache: it fingerprints this function by its name, not its code."""
    q_ids, q_instr, _ = tokenize_embed_texts(batch["query"], tokenizer, query_max_len, fmt, batch["origin"])
    out = {"q_ids": q_ids, "q_instr": q_instr}
    for key in ("pos", "neg"):
        flat = [t for texts in batch[key] for t in texts]
        where = [o for o, texts in zip(batch["origin"], batch[key]) for _ in texts]
        ids, instr, _ = tokenize_embed_texts(flat, tokenizer, passage_max_len, fmt, where) if flat else ([], [], 0)
        out[f"{key}_ids"], out[f"{key}_instr"], k = [], [], 0
        for texts in batch[key]:
            out[f"{key}_ids"].append(ids[k: k + len(texts)])
            out[f"{key}_instr"].append(instr[k: k + len(texts)])
            k += len(texts)
    return out


def tokenize_embedding_dataset(rows, tokenizer, query_max_len: int, passage_max_len: int, fmt: EmbedFormat):
    ds = rows.map(tokenize_embedding, batched=True, batch_size=1000, remove_columns=["query", "pos", "neg"],
                  fn_kwargs={"tokenizer": tokenizer, "query_max_len": query_max_len,
                             "passage_max_len": passage_max_len, "fmt": fmt, "rule": EMBED_TOKENIZATION})
    q_len = [len(x) for x in ds["q_ids"]]
    p_len = [len(x) for col in ("pos_ids", "neg_ids") for group in ds[col] for x in group]
    stats = {"samples": len(ds), "mean_query_len": sum(q_len) / len(q_len),
             "mean_passage_len": sum(p_len) / max(1, len(p_len)),
             "query_at_max_len": sum(n >= query_max_len for n in q_len),
             "passage_at_max_len": sum(n >= passage_max_len for n in p_len), **sources.embedding_instructions(rows)}
    return ds.remove_columns(["origin"]), stats


class EmbeddingGroups(torch.utils.data.Dataset):
    """Training view of tokenized embedding rows: item i = its query, one positive and group_size-1 hard negatives,
    sampled from a generator seeded by (seed, epoch, i). accelerate's prepared DataLoader calls set_epoch, so every
    process and a resumed run draw the same groups."""

    def __init__(self, ds, group_size: int, seed: int):
        self.ds, self.group_size, self.seed, self.epoch = ds, group_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        import random

        row = self.ds[i]
        rng = random.Random(f"{self.seed}/{self.epoch}/{i}")
        p = rng.randrange(len(row["pos_ids"]))
        n_neg = self.group_size - 1
        negs = list(range(len(row["neg_ids"])))
        chosen = rng.sample(negs, n_neg) if len(negs) >= n_neg else [rng.choice(negs) for _ in range(n_neg)]
        passages = [(row["pos_ids"][p], row["pos_instr"][p])] + [(row["neg_ids"][j], row["neg_instr"][j]) for j in chosen]
        return {"query": (row["q_ids"], row["q_instr"]), "passages": passages}


class LengthGroupedSampler(torch.utils.data.Sampler):
    """Shuffled order in which neighbouring samples have similar lengths: a seeded permutation is cut into
    mega-batches of `group` samples, each sorted by length (longest first). Consecutive micro-batches (which
    accelerate deals to the processes in turn) then need little padding. `set_epoch` reshuffles."""

    def __init__(self, lengths: list[int], group: int, seed: int):
        self.lengths, self.group, self.seed, self.epoch = list(lengths), max(1, group), seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        for i in range(0, len(order), self.group):
            yield from sorted(order[i:i + self.group], key=lambda j: -self.lengths[j])


def pad_embed(items: list[tuple[list[int], int]], pad_id: int, widths: Widths | None = None) -> dict[str, torch.Tensor]:
    """[(ids, instr_len)] -> input_ids, attention_mask (1 on tokens), pool_mask (1 on text tokens only); padded to
    the longest item, or up to its width bucket (`Widths`)."""
    width = (widths or Widths())(max(len(ids) for ids, _ in items))
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(items), width), dtype=torch.long)
    pool = torch.zeros((len(items), width), dtype=torch.long)
    for i, (ids, instr) in enumerate(items):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attn[i, : len(ids)] = 1
        pool[i, instr: len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attn, "pool_mask": pool}


class EmbeddingCollator:
    """Groups -> {"query": padded queries [B, Lq], "passage": padded passages [B * group_size, Lp]} where the
    passages of query b are rows b*G .. b*G+G-1, the positive first."""

    def __init__(self, pad_token_id: int, query_widths: Widths | None = None, passage_widths: Widths | None = None):
        self.pad, self.query_widths, self.passage_widths = pad_token_id, query_widths, passage_widths

    def __call__(self, groups: list[dict]) -> dict:
        return {"query": pad_embed([g["query"] for g in groups], self.pad, self.query_widths),
                "passage": pad_embed([p for g in groups for p in g["passages"]], self.pad, self.passage_widths)}


def retrieval_eval_set(rows, tokenizer, query_max_len: int, passage_max_len: int, fmt: EmbedFormat) -> dict:
    """Held-out retrieval: every query ranks the corpus of all distinct pos+neg passages of the file.
    Returns tokenized queries, corpus and, per query, the corpus indices of its positives."""
    corpus: dict[tuple[str, str], int] = {}
    positives = []
    for row in rows:
        for t in row["pos"] + row["neg"]:
            corpus.setdefault((t["instruction"], t["text"]), len(corpus))
        positives.append(sorted({corpus[(t["instruction"], t["text"])] for t in row["pos"]}))
    texts = [{"instruction": k[0], "text": k[1]} for k in corpus]
    q_ids, q_instr, _ = tokenize_embed_texts([r["query"] for r in rows], tokenizer, query_max_len, fmt)
    c_ids, c_instr, _ = tokenize_embed_texts(texts, tokenizer, passage_max_len, fmt)
    return {"queries": list(zip(q_ids, q_instr)), "corpus": list(zip(c_ids, c_instr)), "positives": positives}
