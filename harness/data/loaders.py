"""Data sets -> DataLoaders for the configured loss mode, and the endless stream of micro-batches the loop reads.

    generative / unified: data.train_files -> validated, tokenized (cached) rows -> packed or padded batches
                          (`gen`), data.eval_files -> `gen_eval`
    embedding / unified:  data.emb_train_files -> query / positive / negatives groups (`emb`, optionally grouped by
                          length), data.emb_eval_files -> the held-out retrieval set (`emb_eval`)

Rank 0 validates and tokenizes first; the other processes read its cache (`collectives.main_first`: a data error
found by rank 0 stops every process, printed once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from harness import IGNORE_INDEX
from harness.config import DataConfig, TrainConfig
from harness.config.modes import ModeFacts
from harness.data import mixing, sources
from harness.data import samples as data_lib
from harness.distributed.collectives import main_first
from harness.config.profiles import resolve_pin_memory
from harness.config.profiles import embed_buckets
from harness.data import chat, pairs, streaming, vision

STREAMS = {"generative": ("train_files", "eval_files"), "embedding": ("emb_train_files", "emb_eval_files"),
           "preference": ("train_files", "eval_files")}


def training_rows(d: DataConfig, seed: int, kind: str, say=lambda *a: None):
    """One stream's training rows, its sources mixed by weight (harness.data.mixing), and the rows data.eval_split held
    out of them (None without a split). The same on every process and on resume (seeded by `seed`, train.seed)."""
    key, eval_key = STREAMS[kind]
    what = f"data.{key}"
    need_negatives = d.train_group_size - 1 if kind == "embedding" else 0
    srcs = sources.parse_sources(getattr(d, key), what)
    parts = [sources.load_source_rows(s, kind, d.cache_dir, need_negatives, what) for s in srcs]
    held = None
    if d.eval_split is not None and not getattr(d, eval_key):
        parts, held = mixing.hold_out(parts, d.eval_split, seed, what)
        say(f"[harness] data.eval_split={d.eval_split}: {len(held)} of {len(held) + sum(map(len, parts))} records "
            f"of {what} held out for evaluation")
    rows, shares = mixing.mix(parts, [s.name for s in srcs], [s.weight for s in srcs], seed)
    if any(s.weight is not None for s in srcs):
        say(f"[harness] {what} mixed by weight, {len(rows)} samples an epoch:\n{mixing.describe(shares)}")
    return rows, held


def resolve_max_len(d: DataConfig, rows, tokenizer, say) -> int:
    """data.max_len, or for `auto` the data's length percentile (what is truncated is reported)."""

    if d.max_len != "auto":
        return d.max_len
    full, _ = data_lib.tokenize_dataset(rows, tokenizer, 1 << 30)
    lengths = list(full["length"])
    max_len = data_lib.auto_max_len(lengths, d.max_len_percentile)
    cut = sum(max(0, n - max_len) for n in lengths)
    say(f"[harness] data.max_len=auto: p{d.max_len_percentile:g} of {len(lengths)} sample lengths -> "
        f"{max_len}; {sum(n > max_len for n in lengths)} samples truncated, {cut} tokens "
        f"({100 * cut / sum(lengths):.2f}%) cut")
    return max_len


@dataclass
class RunData:
    """What `build_loaders` made for the loss mode; the loaders are not prepared yet."""

    gen: Any = None  # generative training DataLoader (packed or padded batches), or None
    emb: Any = None  # embedding training DataLoader (query / positive / negatives groups), or None
    gen_eval: Any = None  # generative eval DataLoader (never prepared: evaluate_generative shards it), or None
    emb_eval: Optional[dict] = None  # the held-out retrieval set (queries, corpus, positives), or None
    stats: dict = field(default_factory=dict)  # "generative" / "embedding": token-length statistics
    emb_widths: Optional[tuple] = None  # (query, passage) Widths of data.embed_length_buckets, or None (unbucketed)
    source: Any = None  # what a mode's own stream reads (harness.modes.own_stream; rl: the task), or None
    processor: Any = None  # a vision-language model's processor (saved with every export), or None

    @property
    def streams(self) -> tuple[str, ...]:
        """The training streams' names; the first defines epochs (the embedding data in unified mode)."""
        return tuple(n for n in ("emb", "gen") if self.loader(n) is not None)

    def loader(self, stream: str):
        return {"emb": self.emb, "gen": self.gen}[stream]


def build_loaders(d: DataConfig, t: TrainConfig, mode: ModeFacts, pooling: str, accelerator, tokenizer,
                  processor=None) -> RunData:
    """Validated, tokenized data sets and their loaders (not yet prepared) for the loss mode `mode` (its facts; `d`:
    cfg.data, `t`: cfg.train, pooling: model.pooling); `processor`: a vision-language model's (its records, images and
    batches: harness.data.vision). No data.train_files in a mode that reads sequences: it trains on a stream of its
    own (distill.prompts), data.eval_files is still read."""
    from torch.utils.data import DataLoader

    cuda = torch.cuda.is_available()
    out = RunData(processor=processor)
    common = dict(num_workers=d.num_workers, pin_memory=resolve_pin_memory(d.pin_memory, cuda))
    if d.num_workers > 0:
        common.update(prefetch_factor=d.prefetch_factor, persistent_workers=d.persistent_workers)
    with main_first(accelerator):  # rank 0 validates and tokenizes; the others read its cache (or get its error)
        if processor is not None:  # images: harness.data.vision's records and collator, padded rows
            out.gen, out.gen_eval, out.stats["generative"] = vision_loaders(d, t, processor, common)
        elif mode.gen_rows == "sequences" and d.streaming:  # read, tokenized and packed as training goes
            out.gen, out.gen_eval, out.stats["generative"] = streamed_loaders(d, t, accelerator, tokenizer, common)
        elif mode.gen_rows == "sequences":
            rows, held = training_rows(d, t.seed, "generative", accelerator.print) if d.train_files else (None, None)
            if d.eval_files and held is None:
                held = data_lib.load_generative_rows(d.eval_files, d.cache_dir, "data.eval_files")
            max_len = resolve_max_len(d, rows if rows is not None else held, tokenizer, accelerator.print) \
                if rows is not None or held is not None else d.max_len
            padded = data_lib.GenerativeCollator(tokenizer.pad_token_id,
                                                 widths=data_lib.Widths(8 if cuda else 1, d.pad_buckets, max_len))
            if rows is not None:
                ds, st = data_lib.tokenize_dataset(rows, tokenizer, max_len)
                out.stats["generative"] = st
                if d.packing:
                    ds = data_lib.pack_dataset(ds, max_len)
                    st["packed_rows"] = len(ds)
                    st["packing_fill"] = sum(ds["length"]) / (len(ds) * max_len)
                collate = data_lib.PackedCollator(tokenizer.pad_token_id, max_len) if d.packing else padded
                out.gen = DataLoader(ds, batch_size=t.micro_batch_size, shuffle=d.shuffle, collate_fn=collate,
                                     **common)
            if held is not None:
                ds, _ = data_lib.tokenize_dataset(held, tokenizer, max_len)
                out.gen_eval = DataLoader(ds, batch_size=t.micro_batch_size, shuffle=False,
                                          collate_fn=padded, **common)
        if mode.gen_rows == "pairs":
            out.gen, out.gen_eval, out.stats["preference"] = preference_loaders(d, t, accelerator, tokenizer, common)
        if mode.embeds:
            fmt = data_lib.EmbedFormat(d.emb_instruction_template, d.emb_plain_template,
                                       append_eos=pooling == "lasttoken")
            rows, held = training_rows(d, t.seed, "embedding", accelerator.print)
            ds, out.stats["embedding"] = data_lib.tokenize_embedding_dataset(
                rows, tokenizer, d.query_max_len, d.passage_max_len, fmt)
            groups = data_lib.EmbeddingGroups(ds, d.train_group_size, t.seed)
            order = {"shuffle": d.shuffle}
            if d.group_by_length:  # queries + their longest passages of similar length batched together
                lengths = [len(q) + max(map(len, p)) for q, p in zip(ds["q_ids"], ds["pos_ids"])]
                order = {"sampler": data_lib.LengthGroupedSampler(lengths, length_group(t, accelerator.num_processes),
                                                                  t.seed)}
            widths = (data_lib.Widths(1, d.pad_buckets, d.query_max_len),
                      data_lib.Widths(1, d.pad_buckets, d.passage_max_len))
            out.emb_widths = embedding_buckets(d, mode.name, accelerator, ds)
            out.emb = DataLoader(groups, batch_size=t.emb_micro_batch_size,
                                 collate_fn=data_lib.EmbeddingCollator(tokenizer.pad_token_id,
                                                                       *(out.emb_widths or widths)), **order, **common)
            if d.emb_eval_files or held is not None:
                rows = held if held is not None else data_lib.load_embedding_rows(d.emb_eval_files, 0, d.cache_dir,
                                                                                  "data.emb_eval_files")
                out.emb_eval = data_lib.retrieval_eval_set(rows, tokenizer, d.query_max_len, d.passage_max_len,
                                                           fmt)
    return out


def vision_loaders(d: DataConfig, t: TrainConfig, processor, common: dict):
    """A vision-language run's (training loader, eval loader or None, stats): padded rows of ids and images."""
    from torch.utils.data import DataLoader

    collate = vision.VisionCollator(processor)
    ds, stats = vision.vision_dataset(d.train_files, processor, d.max_len, "data.train_files")
    train = DataLoader(ds, batch_size=t.micro_batch_size, shuffle=d.shuffle, collate_fn=collate, **common)
    evaluation = None
    if d.eval_files:
        held, _ = vision.vision_dataset(d.eval_files, processor, d.max_len, "data.eval_files")
        evaluation = DataLoader(held, batch_size=t.micro_batch_size, shuffle=False, collate_fn=collate, **common)
    return train, evaluation, stats


def streamed_loaders(d: DataConfig, t: TrainConfig, accelerator, tokenizer, common: dict):
    """data.streaming: (the training StreamLoader, the cached eval loader or None, stats) (`d`: cfg.data, `t`:
    cfg.train). The stream is read by every data-parallel process (harness.data.streaming)."""
    from torch.utils.data import DataLoader

    cuda = torch.cuda.is_available()
    padded = data_lib.GenerativeCollator(tokenizer.pad_token_id,
                                         widths=data_lib.Widths(8 if cuda else 1, d.pad_buckets, d.max_len))
    collate = data_lib.PackedCollator(tokenizer.pad_token_id, d.max_len) if d.packing else padded
    train = streaming.build_stream(d, t, accelerator, tokenizer, d.max_len, collate, accelerator.num_processes,
                                   accelerator.process_index)
    size = train.epoch_size()
    streaming.needs_max_steps(size, t.max_steps, d.packing)
    accelerator.print(f"[harness] data.streaming: {len(train.stream.cursors)} source(s), "
                      f"{'an epoch of ' + str(size) + ' samples' if size else 'epoch size unknown'}, shuffle buffer "
                      f"{train.stream.capacity if d.shuffle else 0} records{', packed' if d.packing else ''}")
    evaluation = None
    if d.eval_files:
        rows = data_lib.load_generative_rows(d.eval_files, d.cache_dir, "data.eval_files")
        ds, _ = data_lib.tokenize_dataset(rows, tokenizer, d.max_len)
        evaluation = DataLoader(ds, batch_size=t.micro_batch_size, shuffle=False, collate_fn=padded, **common)
    return train, evaluation, {"streamed_sources": len(train.stream.cursors), "epoch_samples": size or "unknown"}


def epoch_size(loader) -> int:
    """Rows (packed rows, query groups) an epoch of a training loader; a stream of unknown size counts as endless
    (its schedule is train.max_steps)."""
    if hasattr(loader, "epoch_size"):
        return loader.epoch_size() or 1 << 62
    return len(loader.dataset)


@dataclass(frozen=True)
class FixedWidths:
    """The padded width of an embedding batch from its longest text: the smallest of `sizes` that holds it (a text
    longer than all keeps its own width). A collator's `widths` (harness.data.samples.pad_embed)."""
    sizes: tuple

    def __call__(self, longest: int) -> int:
        return next((w for w in self.sizes if w >= longest), longest)


def embed_widths(max_len: int, buckets: int, longest: int, multiple: int = 8) -> FixedWidths:
    """One embedding side's widths (data.embed_length_buckets): `buckets` widths doubling up to the side's max length
    (max_len / 2^(buckets-1), ..., max_len / 2, max_len), each rounded up to `multiple`, and none above the first that
    holds the data's longest text (`longest`): a width no batch can need is not compiled. Doubling keeps a batch's
    padding under half of its positions wherever its longest text is over the smallest width."""
    sizes = sorted({min(max_len, -(-max(1, max_len >> k) // multiple) * multiple) for k in range(buckets)})
    need = next((i for i, w in enumerate(sizes) if w >= min(longest, max_len)), len(sizes) - 1)
    return FixedWidths(tuple(sizes[:need + 1]))


def embedding_buckets(d: DataConfig, mode: str, accelerator, ds) -> Optional[tuple]:
    """(query, passage) fixed widths of data.embed_length_buckets (`embed_widths`) when the run compiles, else
    None (`d`: cfg.data, `mode`: loss.mode). ds: the tokenized embedding rows (their longest texts bound the widths)."""
    compiled = accelerator.state.dynamo_plugin.backend.value != "NO"
    deepspeed = getattr(accelerator.state, "deepspeed_plugin", None) is not None
    n = embed_buckets(d, mode, "regional" if compiled else "none", deepspeed)
    if not n:
        return None
    longest_passage = max((len(x) for col in ("pos_ids", "neg_ids") for group in ds[col] for x in group), default=0)
    return (embed_widths(d.query_max_len, n, max(map(len, ds["q_ids"]), default=0)),
            embed_widths(d.passage_max_len, n, longest_passage))


def preference_loaders(d: DataConfig, t: TrainConfig, accelerator, tokenizer, common: dict):
    """(training loader, eval loader or None, stats) of preference pairs (harness.data.pairs): each batch holds its
    micro-batch's chosen sequences, then its rejected ones (`d`: cfg.data, `t`: cfg.train)."""
    from torch.utils.data import DataLoader

    template = chat.resolve_template(tokenizer, d.chat_template)
    rows, held = training_rows(d, t.seed, "preference", accelerator.print)
    max_len = d.max_len if d.max_len != "auto" else 1 << 20
    ds, stats = pairs.tokenize_pair_dataset(rows, tokenizer, max_len, template)
    widths = data_lib.Widths(8 if torch.cuda.is_available() else 1, d.pad_buckets, max_len)
    train = DataLoader(ds, batch_size=t.micro_batch_size, shuffle=d.shuffle,
                       collate_fn=pairs.PairCollator(tokenizer.pad_token_id, widths), **common)
    evaluation = None
    if d.eval_files or held is not None:
        rows = held if held is not None else sources.load_rows(d.eval_files, "preference", d.cache_dir,
                                                               "data.eval_files")
        eval_ds, _ = pairs.tokenize_pair_dataset(rows, tokenizer, max_len, template)
        evaluation = DataLoader(eval_ds, batch_size=t.micro_batch_size, shuffle=False,
                                collate_fn=pairs.PairCollator(tokenizer.pad_token_id, widths), **common)
    return train, evaluation, stats


def length_group(t: TrainConfig, world: int) -> int:
    """data.group_by_length's mega-batch: 32 global embedding batches' worth of queries. It depends on the global
    batch only, which a resume on another number of processes keeps, so the order of an epoch stays the same
    (`t`: cfg.train)."""
    return 32 * t.emb_micro_batch_size * t.grad_accum * world


def micro_batches(accelerator, loader, pos: dict):
    """Endless stream of micro-batches across epochs; pos = {"epoch", "batches"} is kept current. A resumed epoch
    skips the micro-batches it has already seen (same seeded order and groups: exactly the same data). Generative
    and pair batches come without the rows accelerate pads an epoch's last round with (`real_rows`)."""
    if hasattr(loader, "batches"):  # data.streaming: the stream keeps its own position (and checkpoints it)
        yield from loader.batches(pos)
        return
    real = real_rows(loader)
    while True:
        loader.set_epoch(pos["epoch"])
        if hasattr(loader.dataset, "set_epoch"):  # accelerate does not forward it when the sampler has one
            loader.dataset.set_epoch(pos["epoch"])
        skip = pos["batches"]
        for batch in (accelerator.skip_first_batches(loader, skip) if skip else loader):
            if real is not None and isinstance(batch, dict) and "labels" in batch:  # (rl: a tensor of question ids)
                batch = without_padding(batch, real(pos["batches"]))
            pos["batches"] += 1
            yield batch
        pos["epoch"] += 1
        pos["batches"] = 0


def real_rows(loader):
    """i -> how many rows of this process's i-th batch of an epoch are the data's, or None when every row is.

    Under several processes accelerate (even_batches) gives every process as many full batches: the epoch's last
    round is filled up with rows from the epoch's start, which the epoch has already trained on. Process r's i-th
    batch is the epoch's batch i * W + r (BatchSamplerShard deals them in turn); its real rows are the data's left
    from row (i * W + r) * b on, at most b (the first ones: the filling is appended)."""
    from accelerate.data_loader import BatchSamplerShard

    shard = getattr(loader, "batch_sampler", None)
    if not isinstance(shard, BatchSamplerShard) or shard.num_processes == 1 or shard.split_batches \
            or not shard.even_batches or shard.drop_last or shard.batch_size is None:
        return None
    n, b, world, rank = len(loader.dataset), shard.batch_size, shard.num_processes, shard.process_index
    return lambda i: max(0, min(b, n - (i * world + rank) * b))


def without_padding(batch: dict, k: int) -> dict:
    """A generative or pair batch without its rows past the first `k` (a pair batch: its first k pairs, chosen and
    rejected). k = 0 (a batch of filling only): a stand-in that takes part in the step's forward and backward
    passes (every process runs as many: DDP, ZeRO) and adds nothing: one row (pair) whose labels are ignored, its
    token_mask zero (no token counted) and, for pairs, no pair_index (no pair counted: preference.pair_terms)."""
    pairs = batch.get("pair_index")
    n = batch["input_ids"].shape[0] // 2 if pairs is not None else batch["input_ids"].shape[0]
    if k >= n:
        return batch
    keep = max(k, 1)
    rows = torch.cat([torch.arange(keep), torch.arange(n, n + keep)]) if pairs is not None else None

    def cut(v):  # rows (a pair batch's: chosen, then rejected) are 2n long, per-pair tensors (pair_index) n
        if not torch.is_tensor(v) or v.dim() == 0:
            return v
        if rows is not None and v.shape[0] == 2 * n:
            return v[rows]
        return v[:keep] if v.shape[0] == n else v

    out = {key: cut(v) for key, v in batch.items() if key not in ("pixel_values", "image_grid_thw")}
    if "image_grid_thw" in batch:  # a vision-language batch's images: per image, not per row
        out.update(vision.images_of_rows(batch, keep))
    if k == 0:
        out["labels"] = torch.full_like(out["labels"], IGNORE_INDEX)
        out["token_mask"] = torch.zeros_like(out["input_ids"])
        if pairs is not None:
            out["pair_index"] = out["pair_index"][:0]
    return out


# ----------------------------------------------------------------------------------------------- the schedule


def schedule_steps(items: int, micro_batch: int, world: int, accum: int, max_steps: int, epochs: float) -> dict:
    """The loop's schedule: micro-batches per epoch on each process (what one process gets of a prepared loader
    over `items` samples or packed rows), optimizer steps per epoch and in all (max_steps wins when > 0)."""
    micro_per_epoch = math.ceil(math.ceil(items / micro_batch) / world)
    steps_per_epoch = max(1, micro_per_epoch // accum)
    total = max_steps if max_steps > 0 else epoch_steps(micro_per_epoch, accum, epochs)
    return {"micro_per_epoch": micro_per_epoch, "steps_per_epoch": steps_per_epoch, "total_steps": total}


def epoch_steps(micro_per_epoch: int, accum: int, epochs: float) -> int:
    """Optimizer steps of `epochs` epochs (the loop's rule when train.max_steps is -1)."""
    return max(1, math.ceil(epochs * micro_per_epoch / accum))


def longest_micro_batch(data: RunData) -> int:
    """The most positions one generative micro-batch (training or evaluation) can have: batch size x the longest
    row (packed rows: the packing width); 0 without generative data."""
    most = 0
    for loader in (data.gen, data.gen_eval):
        if loader is None:
            continue
        width = (getattr(loader.collate_fn, "width", None) or getattr(loader, "max_len", None)
                 or max(loader.dataset["length"], default=0))
        most = max(most, loader.batch_size * width)
    return most
