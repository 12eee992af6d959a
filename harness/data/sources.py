"""Where data comes from: data sources -> records -> validated canonical rows (a cached `datasets` Dataset).

An entry of data.train_files / eval_files / emb_train_files / emb_eval_files is a path (or hub id) string, or a
mapping {path, split, subset, format, weight, columns}. A path is
    a file       .jsonl / .jsonl.gz / .json.gz / .json (JSON lines or a JSON array of objects), .parquet, .csv,
                 .tsv, .arrow (any other name given explicitly is read as JSON lines)
    a folder     every such file in it, recursively, sorted (each read by its type), or a `save_to_disk` folder
                 (a DatasetDict gives `split`, default train)
    a hub id     `owner/name` or `name` when no such local path exists: datasets.load_dataset(path, subset, split)

JSON is read by our own line reader (gzip-aware): errors name `file:line` and records may differ in type from line
to line (pyarrow's JSON reader needs one schema and loses line numbers). Parquet, CSV, Arrow, saved folders and
the hub go through `datasets` (load_dataset / load_from_disk); their rows are `file:row N` (CSV errors add the
line). Every problem is one line (DataError, or ConfigError for the entry itself), never a traceback.

    load_source_rows(source, kind, cache_dir, need_negatives)   one source's validated rows
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from harness.data import formats
from harness.errors import ConfigError, DataError
from harness.data.readers import (Source, _csv_line, _dataset_records, _quiet_datasets, load_file_dataset,
                                  load_hub_dataset, load_saved_dataset, read_jsonl)
from harness.errors import HarnessError

SOURCE_KEYS = ("path", "split", "subset", "format", "weight", "columns")
SUFFIXES = {".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json", ".parquet": "parquet",
            ".csv": "csv", ".tsv": "tsv", ".arrow": "arrow"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


# ----------------------------------------------------------------------------------------------- entries


def parse_sources(entries: Any, what: str) -> list[Source]:
    """Config entries (strings or mappings) -> Sources; a wrong entry is a one-line ConfigError."""
    if isinstance(entries, (str, dict)):
        entries = [entries]
    return [_parse_entry(e, f"{what}[{i}]") for i, e in enumerate(entries or [])]


def _parse_entry(entry: Any, key: str) -> Source:
    if isinstance(entry, (str, Path)):
        return Source(path=str(entry))
    if not isinstance(entry, dict):
        raise ConfigError(f"config key '{key}': expected a path or a mapping with {', '.join(SOURCE_KEYS)}, "
                          f"got {entry!r}")
    for k in entry:
        if k not in SOURCE_KEYS:
            close = difflib.get_close_matches(str(k), SOURCE_KEYS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (keys: {', '.join(SOURCE_KEYS)})"
            raise ConfigError(f"config key '{key}': unknown key '{k}'{hint}")
    if not isinstance(entry.get("path"), str) or not entry["path"]:
        raise ConfigError(f"config key '{key}.path': required, a file, folder or hub data set id")
    for k in ("split", "subset"):
        if entry.get(k) is not None and not isinstance(entry[k], str):
            raise ConfigError(f"config key '{key}.{k}': expected a string, got {entry[k]!r}")
    fmt = entry.get("format")
    if fmt is not None and fmt not in formats.FORMATS:
        close = difflib.get_close_matches(str(fmt), formats.FORMATS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"config key '{key}.format': expected one of {', '.join(formats.FORMATS)}, got {fmt!r}{hint}")
    weight = entry.get("weight")
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0):
        raise ConfigError(f"config key '{key}.weight': must be a number > 0, got {weight!r}")
    columns = entry.get("columns") or {}
    if not isinstance(columns, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in columns.items()):
        raise ConfigError(f"config key '{key}.columns': expected a mapping {{field: column}} of strings, "
                          f"got {columns!r}")
    return Source(entry["path"], entry.get("split"), entry.get("subset"), fmt,
                  None if weight is None else float(weight), dict(columns))


# ----------------------------------------------------------------------------------------------- locating


def file_type(path: str) -> Optional[str]:
    name = path.lower()
    return next((t for s, t in sorted(SUFFIXES.items(), key=lambda x: -len(x[0])) if name.endswith(s)), None)


def is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or ((path / "state.json").is_file()
                                                      and (path / "dataset_info.json").is_file())


def expand_files(paths: list[str], what: str = "data.train_files") -> list[str]:
    """Files and folders (-> their data files, sorted) to a list of files; a missing path or a folder without data
    files is an error."""
    files: list[str] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = sorted(str(f) for f in path.rglob("*") if f.is_file() and file_type(f.name))
            if not found:
                raise DataError(f"{p}: folder has no data files (*.jsonl, *.json, *.jsonl.gz, *.parquet, *.csv, "
                                f"*.tsv, *.arrow) ({what})")
            files.extend(found)
        elif path.is_file():
            files.append(str(path))
        else:
            raise DataError(f"{p}: no such file or folder ({what}; relative paths are read from {os.getcwd()})")
    return files


def locate(source: Source, what: str) -> tuple[str, Any]:
    """("files", [file, ...]), ("saved", folder) or ("hub", id)."""
    p = Path(source.path)
    if p.is_dir() and is_saved_dataset(p):
        return "saved", str(p)
    if p.exists() or file_type(source.path) or not HUB_ID.match(source.path):
        return "files", expand_files([source.path], what)
    return "hub", source.path


# ----------------------------------------------------------------------------------------------- units


@dataclass
class Unit:
    """One file or data set of a source: its name, its (origin, record) pairs, and a hook that adds detail (the CSV
    line) to an error."""

    name: str
    records: Callable[[], Iterator[tuple[str, dict]]]
    explain: Callable[[DataError], DataError] = lambda e: e


def _csv_explain(path: str, sep: str) -> Callable[[DataError], DataError]:
    def explain(err: DataError) -> DataError:
        m = re.match(re.escape(path) + r":row (\d+): ", str(err))
        if not m:
            return err
        row = int(m.group(1))
        return DataError(f"{path}:row {row} (line {_csv_line(path, row, sep)}): {str(err)[m.end():]}")
    return explain


def _file_unit(path: str, cache_dir: Optional[str]) -> Unit:
    ftype = file_type(path) or "json"
    if ftype == "json":
        return Unit(path, lambda: ((f"{path}:{n}", obj) for n, obj in read_jsonl(path)))
    records = lambda: _dataset_records(load_file_dataset(path, ftype, cache_dir), path)  # noqa: E731
    if ftype in ("csv", "tsv"):
        return Unit(path, records, _csv_explain(path, "\t" if ftype == "tsv" else ","))
    return Unit(path, records)


def source_units(source: Source, what: str, cache_dir: Optional[str] = None) -> tuple[list[Unit], list]:
    """The source's units and the stamps that fingerprint them (files: path, size, mtime; data sets: the
    fingerprint datasets gives)."""
    kind, where = locate(source, what)
    if kind == "files":
        stamps = [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in where]
        return [_file_unit(f, cache_dir) for f in where], stamps
    if kind == "saved":
        ds = load_saved_dataset(source, what)
    else:
        ds = load_hub_dataset(source, what, cache_dir)
    prefix = f"{source.path}[{source.split or 'train'}]"
    return [Unit(source.name, lambda: _dataset_records(ds, prefix))], [ds._fingerprint]


# ----------------------------------------------------------------------------------------------- rows


def _unit_format(unit: Unit, first: dict, source: Source, kind: str, what: str) -> Optional[str]:
    """The unit's format (given, or detected from its first record); a format of the other kind is an error."""
    fmt = source.format or formats.detect_format(first)
    if fmt is not None and formats.kind_of(fmt) != kind:
        how = "given" if source.format else f"detected from the columns {', '.join(first)}"
        takes = {"generative": "generative data (text, messages, sharegpt, alpaca, gritlm)",
                 "embedding": "embedding data ({query, pos, neg})",
                 "preference": "preference pairs ({prompt?, chosen, rejected})"}[kind]
        raise DataError(f"{what}: {unit.name}: format '{fmt}' ({how}) is {formats.kind_of(fmt)} data; {what} takes "
                        f"{takes}")
    return fmt


def unit_rows(unit: Unit, source: Source, kind: str, what: str, need_negatives: int = 0) -> Iterator[dict]:
    """Canonical rows of one unit (generative {segments, tools, origin} or embedding {query, pos, neg, origin})."""
    fmt = None
    try:
        for i, (origin, obj) in enumerate(unit.records()):
            obj = formats.apply_columns(obj, source.columns, origin)
            if i == 0:
                fmt = _unit_format(unit, obj, source, kind, what)
            if kind == "embedding":
                yield formats.embedding_record(obj, origin, need_negatives)
            elif kind == "preference":
                yield formats.preference_record(obj, origin)
            else:
                yield formats.generative_row(obj, fmt, origin)
    except DataError as e:
        raise unit.explain(e) from None


def unit_formats(source: Source, what: str, cache_dir: Optional[str] = None) -> dict[str, Optional[str]]:
    """{unit name: format (given, or detected from its first record; None: not recognised)} - what `harness
    data-check` prints and how it tells generative from embedding sources."""
    out = {}
    for unit in source_units(source, what, cache_dir)[0]:
        try:
            origin, first = next(unit.records())
            out[unit.name] = source.format or formats.detect_format(
                formats.apply_columns(first, source.columns, origin))
        except DataError as e:
            raise unit.explain(e) from None
    return out


def _generate(source: Source, kind: str, what: str, need_negatives: int, cache_dir, stamps) -> Iterator[dict]:
    """Rows for datasets.Dataset.from_generator (`stamps` only feeds the cache fingerprint)."""
    for unit in source_units(source, what, cache_dir)[0]:
        yield from unit_rows(unit, source, kind, what, need_negatives)


def _unwrap(e: BaseException) -> BaseException:
    """datasets wraps errors raised inside a generator; find our HarnessError in the chain."""
    seen = e
    while seen is not None:
        if isinstance(seen, HarnessError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return e


def features(kind: str):
    """The Arrow features of canonical rows."""
    import datasets

    s = datasets.Value("string")
    if kind == "embedding":
        text = {"instruction": s, "text": s}
        return datasets.Features({"query": text, "pos": datasets.List(text), "neg": datasets.List(text), "origin": s})
    segments = datasets.List({"role": s, "content": s, "extra": s})
    if kind == "preference":
        return datasets.Features({"prompt": segments, "chosen": segments, "rejected": segments, "origin": s})
    return datasets.Features({"segments": datasets.List({"role": s, "content": s, "extra": s}), "tools": s,
                              "origin": s})


def load_source_rows(source: Source, kind: str, cache_dir: Optional[str] = None, need_negatives: int = 0,
                     what: str = "data.train_files"):
    """One source's validated canonical rows as a cached `datasets.Dataset` (kind: generative or embedding),
    fingerprinted by the files' paths, sizes and modification times (data sets: their datasets fingerprint)."""
    datasets = _quiet_datasets()
    _, stamps = source_units(source, what, cache_dir)
    kwargs = {"source": source, "kind": kind, "what": what, "need_negatives": need_negatives,
              "cache_dir": cache_dir, "stamps": json.dumps(stamps)}  # a string: datasets shards list kwargs
    try:
        return datasets.Dataset.from_generator(_generate, gen_kwargs=kwargs, features=features(kind),
                                               cache_dir=cache_dir)
    except Exception as e:  # noqa: BLE001 - re-raised unless it wraps one of our one-line errors
        err = _unwrap(e)
        if err is not e:
            raise err from None
        raise


def load_rows(entries: list, kind: str, cache_dir: Optional[str] = None, what: str = "data.train_files",
              need_negatives: int = 0):
    """All sources of a data list, concatenated in order."""
    import datasets

    parts = [load_source_rows(s, kind, cache_dir, need_negatives, what) for s in parse_sources(entries, what)]
    if not parts:
        raise DataError(f"{what}: no data given")
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


# the most frequent instructions of the embedding training data a run exports as named prompts (harness.json
# "instructions"; final/'s config_sentence_transformers.json: `st.encode(texts, prompt_name=instruction)`)
MAX_NAMED_PROMPTS = 64


def embedding_instructions(rows, most: int = MAX_NAMED_PROMPTS) -> dict:
    """{"instructions": the `most` most frequent instructions of the queries and passages of embedding rows (most
    frequent first, then by text), "distinct_instructions": how many there are}, counted on the Arrow columns
    without building the rows in Python: over the table the rows select from (a source's rows once, before the
    mixing weights repeat some and before data.eval_split holds some out)."""
    import pyarrow.compute as pc

    counts: dict[str, int] = {}
    for column in ("query", "pos", "neg"):
        for chunk in rows.data.column(column).chunks:
            texts = chunk if column == "query" else pc.list_flatten(chunk)
            for item in pc.value_counts(pc.struct_field(texts, "instruction")).to_pylist():
                if item["values"]:
                    counts[item["values"]] = counts.get(item["values"], 0) + item["counts"]
    return {"instructions": sorted(counts, key=lambda k: (-counts[k], k))[:most], "distinct_instructions": len(counts)}
