"""Reading one file or dataset into records (harness/data/sources.py decides which and names the rows): JSON Lines and
JSON arrays (plain or gzip) line by line, and through the `datasets` library Parquet / CSV / TSV / Arrow files, hub
datasets and folders saved with save_to_disk; a damaged or unreadable input is a one-line error naming the file.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from harness.errors import ConfigError, DataError
from harness.files import json_beyond_limits

LABELS = {"parquet": "Parquet", "csv": "CSV", "tsv": "TSV", "arrow": "Arrow"}


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


def text_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 file (plain or gzip); a byte that is not UTF-8 is a DataError naming the line and
    column, as every data reader says it."""
    for lineno, raw in _raw_lines(path):
        yield lineno, _decode(raw, f"{path}:{lineno}")


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
        obj = json_line(raw, path, lineno)
        if obj is None:
            continue
        n += 1
        yield lineno, obj
    if n == 0:
        raise DataError(f"{path}: file is empty (no records)")


def json_line(raw: bytes, path: str, lineno: int) -> Optional[dict]:
    """One line of a JSON lines file as its object (None: a blank line); anything else is a DataError naming
    `path:lineno` (the cached reader and data.streaming's share it)."""
    line = _decode(raw, f"{path}:{lineno}")
    if not line.strip():
        return None
    try:
        obj = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: invalid JSON, column {e.colno}: {e.msg}") from None
    except (ValueError, RecursionError) as e:
        raise DataError(f"{path}:{lineno}: {json_beyond_limits(e)}") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
    return obj


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


def load_hub_dataset(source: Source, what: str, cache_dir: Optional[str], streaming: bool = False):
    """A hub data set via datasets.load_dataset(path, subset, split=split or "train"); one line if unavailable.
    streaming: an IterableDataset read as it goes (data.streaming), nothing downloaded ahead."""
    datasets = _quiet_datasets()
    split = source.split or "train"
    try:
        return datasets.load_dataset(source.path, source.subset, split=split, cache_dir=cache_dir,
                                     streaming=streaming)
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
