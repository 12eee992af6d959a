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

import csv
import difflib
import gzip
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from harness.data import formats
from harness.errors import ConfigError, DataError
from harness.files import json_beyond_limits

SOURCE_KEYS = ("path", "split", "subset", "format", "weight", "columns")
SUFFIXES = {".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json", ".parquet": "parquet",
            ".csv": "csv", ".tsv": "tsv", ".arrow": "arrow"}
LABELS = {"parquet": "Parquet", "csv": "CSV", "tsv": "TSV", "arrow": "Arrow"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass
class Source:
    """One entry of a data list. `weight` is carried for the mixing (None: not given)."""

    path: str
    split: Optional[str] = None
    subset: Optional[str] = None
    format: Optional[str] = None
    weight: Optional[float] = None
    columns: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        sel = ":".join(s for s in (self.subset, self.split) if s)
        return f"{self.path}[{sel}]" if sel else self.path


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


# ----------------------------------------------------------------------------------------------- JSON


def _raw_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of a plain or gzip file; a damaged file is a DataError."""
    lineno = 0
    try:
        with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as fh:
            for lineno, raw in enumerate(fh, 1):
                yield lineno, raw
    except (OSError, EOFError, zlib.error) as e:
        what = "damaged or not gzip data" if path.endswith(".gz") else "cannot read the file"
        raise DataError(f"{path}:{lineno + 1}: {what} ({getattr(e, 'strerror', None) or e})") from None


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); convert the "
                        f"file, e.g. iconv -f latin1 -t utf-8") from None


def _first_char(path: str) -> str:
    for _, raw in _raw_lines(path):
        if raw.strip():
            return raw.lstrip()[:1].decode("latin1")
    return ""


def read_jsonl(path: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each record of a JSON lines file (or, for a name not ending in .jsonl[.gz], a JSON
    array file); malformed JSON or an empty file raises DataError."""
    if not path.lower().endswith((".jsonl", ".jsonl.gz")) and _first_char(path) == "[":
        yield from _read_json_array(path)
        return
    n = 0
    for lineno, raw in _raw_lines(path):
        line = _decode(raw, f"{path}:{lineno}")
        if not line.strip():
            continue
        try:
            obj = json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: invalid JSON, column {e.colno}: {e.msg}") from None
        except (ValueError, RecursionError) as e:
            raise DataError(f"{path}:{lineno}: {json_beyond_limits(e)}") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        n += 1
        yield lineno, obj
    if n == 0:
        raise DataError(f"{path}: file is empty (no records)")


def _read_json_array(path: str) -> Iterator[tuple[int, dict]]:
    """A file holding one JSON array of objects, element by element with the line each starts on."""
    lines = [(lineno, raw) for lineno, raw in _raw_lines(path)]
    text = "".join(_decode(raw, f"{path}:{lineno}") for lineno, raw in lines)
    ws, dec = re.compile(r"\s*"), json.JSONDecoder()
    i, line, last, n = ws.match(text, text.index("[") + 1).end(), 1, 0, 0
    while not (n == 0 and text.startswith("]", i)):
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON, column {e.colno}: {e.msg}") from None
        except (ValueError, RecursionError) as e:
            raise DataError(f"{path}:{line + text.count(chr(10), last, i)}: {json_beyond_limits(e)}") from None
        line, last = line + text.count("\n", last, i), i
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{line}: expected a JSON object, got {type(obj).__name__}")
        n += 1
        yield line, obj
        i = ws.match(text, end).end()
        if text.startswith(",", i):
            i = ws.match(text, i + 1).end()
        elif text.startswith("]", i) and not text[i + 1:].strip():
            break
        else:
            at = line + text.count("\n", last, i)
            raise DataError(f"{path}:{at}: invalid JSON, column {i - text.rfind(chr(10), 0, i)}: expected ',' or "
                            f"']' after an array element")
    if n == 0:
        raise DataError(f"{path}: file is empty (no records)")


# ----------------------------------------------------------------------------------------------- datasets-backed


def _reason(e: BaseException) -> str:
    """The innermost cause's message, on one line."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:300]


def _quiet_datasets():
    import datasets

    datasets.disable_progress_bars()  # one-line errors stay one line; the run prints its own data summary
    datasets.logging.set_verbosity_error()
    return datasets


def load_file_dataset(path: str, ftype: str, cache_dir: Optional[str]):
    """A Parquet / CSV / TSV / Arrow file through datasets.load_dataset (cached as Arrow)."""
    datasets = _quiet_datasets()
    if os.path.getsize(path) == 0:
        raise DataError(f"{path}: file is empty (no records)")
    if ftype in ("csv", "tsv"):
        for lineno, raw in _raw_lines(path):
            _decode(raw, f"{path}:{lineno}")
    builder, kwargs = {"tsv": ("csv", {"sep": "\t"})}.get(ftype, (ftype, {}))
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its readers log the failure we report below
    try:
        ds = datasets.load_dataset(builder, data_files=[os.path.abspath(path)], split="train", cache_dir=cache_dir,
                                   **kwargs)
    except Exception as e:  # noqa: BLE001 - any reader failure is the file's problem, told on one line
        raise DataError(f"{path}: cannot read as {LABELS[ftype]}: {_reason(e)}") from None
    finally:
        datasets.logging.set_verbosity_error()
    if len(ds) == 0:
        raise DataError(f"{path}: file is empty (no records)")
    return ds


def _offline() -> bool:
    import datasets

    return bool(getattr(datasets.config, "HF_HUB_OFFLINE", False)) or any(
        os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE") for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def load_hub_dataset(source: Source, what: str, cache_dir: Optional[str]):
    """A hub data set via datasets.load_dataset(path, subset, split=split or "train"); one line if unavailable."""
    datasets = _quiet_datasets()
    split = source.split or "train"
    try:
        return datasets.load_dataset(source.path, source.subset, split=split, cache_dir=cache_dir)
    except Exception as e:  # noqa: BLE001 - offline, missing, private, no network: one line naming the id
        flag = next((k for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if os.environ.get(k)), "HF_HUB_OFFLINE")
        chain, seen = [], e
        while seen is not None:
            chain.append(type(seen).__name__)
            seen = seen.__cause__ or seen.__context__
        if _offline():
            why = f"offline ({flag}={os.environ.get(flag, '1')}) and not in the datasets cache"
        elif any("Connect" in c or "Timeout" in c for c in chain):
            why = f"no network ({_reason(e)})"
        else:
            why = _reason(e)
        raise ConfigError(
            f"{what}: hub data set '{source.path}' cannot be loaded: {why}; download it on a machine with internet "
            f"(datasets.load_dataset('{source.path}').save_to_disk(FOLDER), then give FOLDER), or give a local path "
            f"(no local file or folder '{source.path}' in {os.getcwd()})") from None


def load_saved_dataset(source: Source, what: str):
    """A `save_to_disk` folder; a DatasetDict gives `split` (default train)."""
    datasets = _quiet_datasets()
    try:
        ds = datasets.load_from_disk(source.path)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{source.path}: cannot read the saved data set: {_reason(e)}") from None
    if isinstance(ds, datasets.DatasetDict):
        split = source.split or "train"
        if split not in ds:
            raise DataError(f"{source.path}: no split '{split}' (splits: {', '.join(ds)}; set split: in {what})")
        ds = ds[split]
    if len(ds) == 0:
        raise DataError(f"{source.path}: data set is empty (no records)")
    return ds


def _drop_nulls(value: Any) -> Any:
    """Arrow fills the keys one row lacks with null; drop them so that rows read like the JSON they came from."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _dataset_records(ds, prefix: str) -> Iterator[tuple[str, dict]]:
    for i, row in enumerate(ds):
        yield f"{prefix}:row {i + 1}", {k: _drop_nulls(v) for k, v in row.items()}  # a null field stays (named)


def _csv_line(path: str, row: int, sep: str) -> int:
    """The line on which CSV record `row` (1 = the first after the header) starts."""
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh, delimiter=sep)
        start = 1
        for k, _ in enumerate(reader):
            if k == row:
                return start
            start = reader.line_num + 1
    return start


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
        takes = ("generative data (text, messages, sharegpt, alpaca, gritlm)" if kind == "generative"
                 else "embedding data ({query, pos, neg})")
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
    from harness.errors import HarnessError

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
