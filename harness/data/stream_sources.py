"""data.streaming's sources: one entry of data.train_files read record by record from a position that a checkpoint
keeps (harness/data/streaming.py builds the stream on them; docs/streaming.md).

    JSON lines (.jsonl, .jsonl.gz, .json)  our line reader from a byte offset (gzip: the uncompressed offset, which
                                           gzip reaches by decompressing): `file:line` as the cached path names it
    .json holding one JSON array           the cached reader (the whole file), resumed by skipping records
    Parquet / CSV / TSV / Arrow files      datasets' streaming IterableDataset (`file:row N`), resumed with .skip
    save_to_disk folders                   the memory-mapped data set from row N
    hub data sets                          datasets.load_dataset(..., streaming=True), resumed with .skip

A position is {unit (file) index, records read in it, line and byte offset (JSON lines), format of the unit, passes
over the source}: small, and the same on every process. Records come out validated by the cached path's own
`formats` code (format detected per file from its first record, `columns` applied): canonical rows
{segments, tools, origin}.
"""

from __future__ import annotations

import gzip
import os
import zlib
from typing import Iterator, Optional

from harness.data import formats, sources
from harness.data.readers import (LABELS, Source, _dataset_records, _drop_nulls, _first_char, _quiet_datasets, _reason,
                                  json_line, read_jsonl)
from harness.errors import DataError

START = {"unit": 0, "record": 0, "line": 0, "offset": 0, "format": None, "passes": 0}


def _jsonl_from(path: str, offset: int, lineno: int) -> Iterator[tuple[str, dict, int, int]]:
    """(origin, object, line, byte offset after it) of a JSON lines file (plain or gzip) from byte `offset`, the
    line before it being `lineno`."""
    try:
        with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as fh:
            fh.seek(offset)
            while True:
                raw = fh.readline()
                if not raw:
                    return
                lineno += 1
                obj = json_line(raw, path, lineno)
                if obj is not None:
                    yield f"{path}:{lineno}", obj, lineno, fh.tell()
    except (OSError, EOFError, zlib.error) as e:
        what = "damaged or not gzip data" if path.endswith(".gz") else "cannot read the file"
        raise DataError(f"{path}:{lineno + 1}: {what} ({getattr(e, 'strerror', None) or e})") from None


def _skipped(records: Iterator[tuple[str, dict]], n: int) -> Iterator[tuple[str, dict, int, int]]:
    for k, (origin, obj) in enumerate(records):
        if k >= n:
            yield origin, obj, 0, 0


class SourceCursor:
    """One source of a data list, read record by record; `pos` is where it stands (START at the beginning)."""

    def __init__(self, source: Source, what: str, cache_dir: Optional[str]):
        self.source, self.what, self.cache_dir = source, what, cache_dir
        self.kind, where = sources.locate(source, what)
        self.units = where if self.kind == "files" else [where]
        self.pos = dict(START)
        self._open_units: Optional[Iterator] = None
        self._saved = None  # a save_to_disk folder's data set, opened once

    @property
    def name(self) -> str:
        return self.source.name

    def size(self) -> Optional[int]:
        """Records of one pass when known without reading them (Parquet metadata, a saved data set, a hub split's
        recorded size), else None (JSON lines, CSV: counted only by reading)."""
        if self.kind == "saved":
            return len(self._dataset())
        if self.kind == "hub":
            ds = sources.load_hub_dataset(self.source, self.what, self.cache_dir, streaming=True)
            split = (ds.info.splits or {}).get(self.source.split or "train")
            return getattr(split, "num_examples", None) or None
        if all(sources.file_type(f) == "parquet" for f in self.units):
            import pyarrow.parquet as pq

            return sum(pq.read_metadata(f).num_rows for f in self.units)
        return None

    def _dataset(self):
        if self._saved is None:
            self._saved = sources.load_saved_dataset(self.source, self.what)
        return self._saved

    def _records(self) -> Iterator[tuple[str, dict, int, int]]:
        """The current unit's records from the position on."""
        unit, n = self.units[self.pos["unit"]], self.pos["record"]
        if self.kind == "saved":
            ds = self._dataset()
            prefix = f"{self.source.path}[{self.source.split or 'train'}]"
            return ((f"{prefix}:row {n + k + 1}", obj, 0, 0) for k, (_, obj) in
                    enumerate(_dataset_records(ds.select(range(n, len(ds))), prefix)))
        if self.kind == "hub":
            ds = sources.load_hub_dataset(self.source, self.what, self.cache_dir, streaming=True).skip(n)
            prefix = f"{self.source.path}[{self.source.split or 'train'}]"
            return ((f"{prefix}:row {n + k + 1}", obj, 0, 0) for k, (_, obj) in enumerate(_dataset_records(ds, prefix)))
        ftype = sources.file_type(unit) or "json"
        if ftype == "json":
            if not unit.lower().endswith((".jsonl", ".jsonl.gz")) and _array_file(unit):
                return _skipped(((f"{unit}:{k}", o) for k, o in read_jsonl(unit)), n)
            return _jsonl_from(unit, self.pos["offset"], self.pos["line"])
        return _file_rows(unit, ftype, n, self.cache_dir)

    def next(self) -> Optional[dict]:
        """The next canonical row {segments, tools, origin} of this pass, or None at its end."""
        while self.pos["unit"] < len(self.units):
            if self._open_units is None:
                self._open_units = self._records()
            item = next(self._open_units, None)
            if item is None:
                if self.pos["record"] == 0:
                    raise DataError(f"{self.units[self.pos['unit']]}: file is empty (no records) ({self.what})")
                self.pos.update(unit=self.pos["unit"] + 1, record=0, line=0, offset=0, format=None)
                self._open_units = None
                continue
            origin, obj, line, offset = item
            obj = formats.apply_columns(obj, self.source.columns, origin)
            if self.pos["record"] == 0:
                named = sources.Unit(str(self.units[self.pos["unit"]]), lambda: iter(()))
                self.pos["format"] = sources._unit_format(named, obj, self.source, "generative", self.what)
            self.pos.update(record=self.pos["record"] + 1, line=line, offset=offset)
            return formats.generative_row(obj, self.pos["format"], origin)
        return None

    def new_pass(self) -> None:
        """Back to the source's first record (a weighted mix reads a source again when it ends)."""
        self.pos = {**START, "passes": self.pos["passes"] + 1}
        self._open_units = None

    def state(self) -> dict:
        return dict(self.pos)

    def restore(self, pos: dict) -> None:
        self.pos = {**START, **pos}
        self._open_units = None


def _array_file(path: str) -> bool:
    return _first_char(path) == "["


def _file_rows(path: str, ftype: str, start: int, cache_dir: Optional[str]) -> Iterator[tuple[str, dict, int, int]]:
    """A Parquet / CSV / TSV / Arrow file through datasets' streaming reader, from record `start` on."""
    datasets = _quiet_datasets()
    if os.path.getsize(path) == 0:
        raise DataError(f"{path}: file is empty (no records)")
    builder, kwargs = {"tsv": ("csv", {"sep": "\t"})}.get(ftype, (ftype, {}))
    try:
        ds = datasets.load_dataset(builder, data_files=[os.path.abspath(path)], split="train", streaming=True,
                                   cache_dir=cache_dir, **kwargs).skip(start)
        rows = iter(ds)
        k = start
        while True:
            row = next(rows, None)
            if row is None:
                return
            k += 1
            yield f"{path}:row {k}", {key: _drop_nulls(v) for key, v in row.items()}, 0, 0
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - any reader failure is the file's problem, told on one line
        raise DataError(f"{path}: cannot read as {LABELS[ftype]}: {_reason(e)}") from None

