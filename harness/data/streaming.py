"""data.streaming: generative training data read, checked, chat-templated, tokenized and packed as training goes,
with the stream's whole state in every checkpoint (docs/streaming.md).

    sources (harness/data/stream_sources.py: a cursor each)
      -> mixing: unweighted, the sources one after the other (an epoch ends with the last); weighted, each record's
         source drawn by weight from a seeded generator (a source read again from its start when it ends)
      -> the shuffle buffer (data.shuffle_buffer records, seeded by train.seed and the epoch): a record leaves from a
         random slot and the next record read takes its place; an epoch's end empties it in random order
      -> tokenized by the cached path's own function (samples.tokenize_generative: chat template, assistant labels)
      -> packed (data.packing) by the cached path's best-fit (samples.pack_rows) over a window of PACK_WINDOW rows'
         worth of samples
      -> rows, counted from 0: the global sample index

The stream is global: every process runs the same pipeline over every source and keeps its slice of each global
micro-round (process r of W takes rows [r * b, (r + 1) * b) of the round's W * b), the way accelerate deals a cached
loader's batches. A step reads grad_accum rounds, so a step's rows depend on the global batch only: a checkpoint
taken after step s holds the stream after s * global batch rows, and a resume on another process count with the
global batch kept reads the same rows. The state (`GlobalStream.state`: each source's position, the buffer's records,
the tokenized samples waiting to be packed, the packed rows not yet read, both generators) is registered with
accelerate's checkpointing (`StreamLoader.state_dict`). The pipeline runs in the training process, lazily: no row is
read ahead of the one the loop asks for, so the state at a checkpoint is the one of the rows trained.
"""

from __future__ import annotations

import copy
from collections import deque
from typing import Callable, Optional

import numpy as np

from harness import IGNORE_INDEX, stopping
from harness.data import chat, sources
from harness.data.samples import pack_rows, tokenize_generative
from harness.data.stream_sources import SourceCursor
from harness.errors import ConfigError, DataError
from harness.files import prefix_fingerprint

PACK_WINDOW = 32  # rows' worth of tokens that packing places at a time (best-fit over the window)
CHUNK = 64  # records tokenized in one call (the fast tokenizers' batching)
SAID_SKIPS = 10  # records skipped for having no trained token that are named one by one (then at 100, 1,000, ...)
_MIX, _SHUFFLE = 0x6D6978, 0x736866  # stream tags, as harness.data.mixing's


class GlobalStream:
    """The rows of the whole run, in order, from `cursors` (SourceCursor per source). `tokenize`: canonical rows
    (columns) -> tokenized columns; `pack_len`: the packed row width (None: one sample a row)."""

    def __init__(self, cursors: list[SourceCursor], weights: list, seed: int, buffer: int,
                 tokenize: Callable[[dict], dict], pack_len: Optional[int], say: Callable[[str], None] = print):
        if any(w is not None for w in weights) and any(w is None for w in weights):
            missing = next(c.name for c, w in zip(cursors, weights) if w is None)
            raise ConfigError(f"data source {missing!r} has no weight while others have one: give every source of "
                              f"the list a weight, or none")
        self.cursors, self.seed, self.capacity = cursors, seed, max(0, buffer)
        self.weights = None if weights[0] is None else np.asarray(weights, dtype=np.float64) / sum(weights)
        self.tokenize, self.pack_len, self.say = tokenize, pack_len, say
        self.epoch, self.current, self.drained, self.rows, self.dropped = 0, 0, False, 0, 0
        self.mix_rng = np.random.default_rng([seed, _MIX])
        self.shuffle_rng = np.random.default_rng([seed, _SHUFFLE, 0])
        self.buffer: list[dict] = []  # canonical rows waiting in the shuffle buffer
        self.pending: list[dict] = []  # tokenized samples waiting for a packing window
        self.ready: deque = deque()  # rows made and not yet read
        self.barren = [0] * len(cursors)  # each source's passes begun since the last sample kept (`_fill`)

    # ---- sizes
    def epoch_size(self) -> Optional[int]:
        """Rows an epoch when known before reading: unpacked samples of sources whose size is recorded (Parquet,
        saved data sets, hub splits); None otherwise (JSON lines; packed rows, whose count depends on the lengths)."""
        if self.pack_len is not None:
            return None
        if not hasattr(self, "_size"):  # asked once (a hub split's size is a request)
            sizes = [c.size() for c in self.cursors]
            self._size = None if any(s is None for s in sizes) else sum(sizes)
        return self._size

    # ---- records: mixing and the shuffle buffer
    def _read(self) -> Optional[dict]:
        """The next record of the mix, or None at the end of an (unweighted) epoch."""
        if self.weights is None:
            while self.current < len(self.cursors):
                row = self.cursors[self.current].next()
                if row is not None:
                    return row
                self.current += 1
            return None
        s = int(self.mix_rng.choice(len(self.cursors), p=self.weights))
        row = self.cursors[s].next()
        if row is None:
            self.cursors[s].new_pass()
            self.barren[s] += 1
            row = self.cursors[s].next()
        return row

    def _record(self) -> dict:
        """The next record out of the shuffle buffer; an epoch's end starts the next epoch."""
        while True:
            while len(self.buffer) < max(1, self.capacity) and not self.drained:
                row = self._read()
                if row is None:
                    self.drained = True
                    break
                self.buffer.append(row)
            if self.buffer:
                if self.capacity == 0:
                    return self.buffer.pop()
                j = int(self.shuffle_rng.integers(len(self.buffer)))
                out = self.buffer[j]
                nxt = None if self.drained else self._read()
                if nxt is None:
                    self.drained = True
                    self.buffer[j] = self.buffer[-1]
                    self.buffer.pop()
                else:
                    self.buffer[j] = nxt
                return out
            self._new_epoch()

    def _new_epoch(self) -> None:
        self.epoch, self.current, self.drained = self.epoch + 1, 0, False
        for c in self.cursors:
            c.new_pass()
        self.barren = [n + 1 for n in self.barren]
        self.shuffle_rng = np.random.default_rng([self.seed, _SHUFFLE, self.epoch])

    # ---- samples: tokenized, then packed
    def _fill(self) -> None:
        """Tokenize the next CHUNK records; rows are ready once a sample (unpacked) or a window (packed) is."""
        rows = [self._record() for _ in range(CHUNK)]
        cols = {k: [r[k] for r in rows] for k in ("segments", "tools", "origin")}
        out = self.tokenize(cols)
        for i, origin in enumerate(cols["origin"]):
            if not any(x != IGNORE_INDEX for x in out["labels"][i][1:]):  # as tokenize_dataset: nothing to train
                self.dropped += 1
                if self.dropped <= SAID_SKIPS or str(self.dropped).strip("0") == "1":  # 1..10, 100, 1000, ...
                    self.say(f"[harness] data.streaming: {origin} has no trained token left after truncation: "
                             f"skipped ({self.dropped} so far)")
                continue
            self.barren = [0] * len(self.cursors)
            self.pending.append({"input_ids": out["input_ids"][i], "labels": out["labels"][i]})
        if min(self.barren) >= 2:  # a whole pass of every source read after the last sample kept, all skipped
            raise DataError(f"data.train_files: a whole epoch of the stream gave no sample with a trained token "
                            f"({self.dropped} records skipped, each cut to data.max_len before its first trained "
                            f"token): raise data.max_len or shorten the prompts")
        if self.pack_len is None:
            self.ready.extend(self.pending)
            self.pending = []
        elif sum(len(s["input_ids"]) for s in self.pending) >= PACK_WINDOW * self.pack_len:
            self.ready.extend(pack(self.pending, self.pack_len))
            self.pending = []

    def next(self) -> dict:
        """The next row (global sample index `self.rows`)."""
        while not self.ready:
            stopping.stop_while_reading()  # records skipped on and on: a stop signal still ends the run
            self._fill()
        self.rows += 1
        return self.ready.popleft()

    # ---- checkpointed state
    def state(self) -> dict:
        return {"epoch": self.epoch, "current": self.current, "drained": self.drained, "rows": self.rows,
                "dropped": self.dropped, "sources": [c.state() for c in self.cursors],
                "mix_rng": self.mix_rng.bit_generator.state, "shuffle_rng": self.shuffle_rng.bit_generator.state,
                "buffer": copy.deepcopy(self.buffer), "pending": copy.deepcopy(self.pending),
                "ready": copy.deepcopy(list(self.ready))}

    def restore(self, state: dict) -> None:
        if len(state["sources"]) != len(self.cursors):
            raise ConfigError(f"data.train_files: the checkpoint's stream read {len(state['sources'])} sources, this "
                              f"config lists {len(self.cursors)}: resume with the same sources")
        self.epoch, self.current, self.drained = state["epoch"], state["current"], state["drained"]
        self.rows, self.dropped = state["rows"], state["dropped"]
        for c, pos in zip(self.cursors, state["sources"]):
            c.restore(pos)
        self.mix_rng.bit_generator.state = state["mix_rng"]
        self.shuffle_rng.bit_generator.state = state["shuffle_rng"]
        self.buffer, self.pending = list(state["buffer"]), list(state["pending"])
        self.ready = deque(state["ready"])


def pack(samples: list[dict], width: int) -> list[dict]:
    """Tokenized samples -> packed rows (samples.pack_rows' best-fit; per-document position ids), as pack_dataset."""
    out = []
    for row in pack_rows([len(s["input_ids"]) for s in samples], width):
        out.append({"input_ids": [t for i in row for t in samples[i]["input_ids"]],
                    "labels": [t for i in row for t in samples[i]["labels"]],
                    "position_ids": [p for i in row for p in range(len(samples[i]["input_ids"]))]})
    return out


class StreamLoader:
    """This process's micro-batches of a GlobalStream: its slice of each global round of `world` x `micro_batch`
    rows, collated and on `device`. Registered for checkpointing (state_dict / load_state_dict: the stream's)."""

    def __init__(self, stream: GlobalStream, micro_batch: int, world: int, rank: int, collate_fn, max_len: int,
                 device=None):
        self.stream, self.batch_size, self.world, self.rank = stream, micro_batch, world, rank
        self.collate_fn, self.max_len, self.device = collate_fn, max_len, device
        self.dataset = None  # (no map-style data set: see epoch_size)

    def epoch_size(self) -> Optional[int]:
        return self.stream.epoch_size()

    def batches(self, pos: dict):
        """Endless micro-batches; pos = {"epoch", "batches"} follows the stream's epoch (batches: read in it)."""
        b = self.batch_size
        while True:
            rows = [self.stream.next() for _ in range(self.world * b)]
            if self.stream.epoch != pos["epoch"]:
                pos["epoch"], pos["batches"] = self.stream.epoch, 0
            batch = self.collate_fn(rows[self.rank * b:(self.rank + 1) * b])
            pos["batches"] += 1
            yield batch if self.device is None else {k: v.to(self.device) for k, v in batch.items()}

    def state_dict(self) -> dict:
        return self.stream.state()

    def load_state_dict(self, state: dict) -> None:
        self.stream.restore(state)


def mark_read(data_files: dict, loaders: dict) -> dict:
    """The training files' fingerprints (`data_files`, harness/checkpoint/datafiles.py) with what the streams have
    read of each plain JSON lines file they are in: {"read": {"bytes": offset, "ends": prefix_fingerprint}}, the
    part of the file a resume depends on (it seeks to the offset; the records read are in the stream's state). A
    file a stream is not in (read whole this pass, or not reached) is read again only from its start: 0 bytes."""
    offsets = {}
    for loader in loaders.values():
        if is_stream(loader):
            for c in loader.stream.cursors:
                if c.kind == "files":
                    for i, unit in enumerate(c.units):
                        if str(unit).lower().endswith(".jsonl"):  # (gzip: an offset of the uncompressed text)
                            here = c.pos["offset"] if i == c.pos["unit"] else 0
                            offsets[str(unit)] = max(offsets.get(str(unit), 0), here)
    out = {}
    for key, files in data_files.items():
        out[key] = [[p, {**fp, "read": {"bytes": offsets[p], "ends": prefix_fingerprint(p, offsets[p])}}]
                    if p in offsets and isinstance(fp, dict) and "size" in fp else [p, fp] for p, fp in files]
    return out


def is_stream(loader) -> bool:
    return isinstance(loader, StreamLoader)


def build_stream(d, t, accelerator, tokenizer, max_len: int, collate, dp_world: int, dp_rank: int) -> StreamLoader:
    """data.train_files as a StreamLoader (`d`: cfg.data, `t`: cfg.train)."""
    template = chat.own_template(tokenizer) or chat.GRITLM_TEMPLATE
    srcs = sources.parse_sources(d.train_files, "data.train_files")
    if not srcs:
        raise ConfigError("data.train_files: no data given")
    cursors = [SourceCursor(s, "data.train_files", d.cache_dir) for s in srcs]
    stream = GlobalStream(cursors, [s.weight for s in srcs], t.seed, d.shuffle_buffer if d.shuffle else 0,
                          lambda cols: tokenize_generative(cols, tokenizer, max_len, template),
                          max_len if d.packing else None, accelerator.print)
    return StreamLoader(stream, t.micro_batch_size, dp_world, dp_rank, collate, max_len, accelerator.device)


def needs_max_steps(size: Optional[int], max_steps: int, packing: bool) -> None:
    """An epoch of unknown size cannot be counted: train.max_steps must say how long to train (one line)."""
    if size is None and max_steps <= 0:
        why = ("packed rows are counted only by packing them" if packing else
               "JSON lines (and CSV) are counted only by reading them")
        raise ConfigError(f"config key 'train.max_steps': data.streaming does not know the size of an epoch ({why}): "
                          f"set train.max_steps to the number of optimizer steps to train")

