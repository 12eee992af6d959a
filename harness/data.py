"""Generative training data: JSONL records -> validated rows -> tokenized samples -> padded batches.

Records (one JSON object a line; files or folders of *.jsonl):
    {"text": "..."}                                                     loss on every token
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}   loss on assistant turns only

Every line is checked; a malformed one stops the run with `file:line: <problem>` (a DataError), and so do an
empty file, a missing path and a record with nothing to train on. Nothing is dropped silently: samples that
lose all their trainable tokens to truncation are counted and reported.

Loading and caching go through `datasets`: the validated rows become an Arrow dataset (`Dataset.from_generator`,
fingerprinted by the files' paths, sizes and modification times) and tokenization is a batched, cached `map`.

Chat layout (GritLM's format; the markers are special tokens, see harness.model.CHAT_MARKERS):
    <s><|system|>\\n{system}\\n<|user|>\\n{user}\\n<|assistant|>\\n{assistant}</s><|user|>\\n...
The loss covers `{assistant}</s>` of every assistant turn.

    python -m harness.data data/sample/gen.jsonl     # validate files and print token-length statistics
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from harness.errors import DataError

ROLES = ("system", "user", "assistant")
IGNORE_INDEX = -100


# ----------------------------------------------------------------------------------------------- files


def expand_files(paths: list[str], what: str = "data.train_files") -> list[str]:
    """Files and folders (-> their *.jsonl, sorted) to a list of files; a missing path or empty folder is an error."""
    files: list[str] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = sorted(str(f) for f in path.rglob("*.jsonl"))
            if not found:
                raise DataError(f"{p}: folder has no *.jsonl files ({what})")
            files.extend(found)
        elif path.is_file():
            files.append(str(path))
        else:
            raise DataError(f"{p}: no such file or folder ({what}; relative paths are read from {os.getcwd()})")
    return files


def read_jsonl(path: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; malformed JSON or an empty file raises DataError."""
    n = 0
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON, column {e.colno}: {e.msg}") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            n += 1
            yield lineno, obj
    if n == 0:
        raise DataError(f"{path}: file is empty (no records)")


# ----------------------------------------------------------------------------------------------- validation


def _string(value: Any, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{field}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: field '{field}' is empty")
    return value


def generative_segments(obj: dict, where: str) -> list[dict]:
    """A record as a list of {role, content} segments; `text` records become one segment of role "text"."""
    has_text, has_messages = "text" in obj, "messages" in obj
    if has_text and has_messages:
        raise DataError(f"{where}: record has both 'text' and 'messages'; give one")
    if has_text:
        return [{"role": "text", "content": _string(obj["text"], where, "text")}]
    if not has_messages:
        raise DataError(f"{where}: missing field 'text' or 'messages' (keys: {', '.join(obj) or 'none'})")
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: field 'messages' must be a non-empty list")
    segments = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise DataError(f"{where}: field 'messages[{i}]' must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise DataError(f"{where}: field 'messages[{i}].role' must be one of {', '.join(ROLES)}, got {role!r}")
        if "content" not in m:
            raise DataError(f"{where}: missing field 'messages[{i}].content'")
        segments.append({"role": role, "content": _string(m["content"], where, f"messages[{i}].content")})
    if not any(s["role"] == "assistant" for s in segments):
        raise DataError(f"{where}: field 'messages' has no assistant turn (nothing to train on)")
    return segments


def _generate_rows(files: list[str], stamps: list) -> Iterator[dict]:
    """Validated rows for datasets.Dataset.from_generator (`stamps` only feeds the cache fingerprint)."""
    for path in files:
        for lineno, obj in read_jsonl(path):
            yield {"segments": generative_segments(obj, f"{path}:{lineno}"), "origin": f"{path}:{lineno}"}


def _unwrap(e: BaseException) -> BaseException:
    """datasets wraps errors raised inside a generator; find our DataError in the chain."""
    seen = e
    while seen is not None:
        if isinstance(seen, DataError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return e


def load_generative_rows(paths: list[str], cache_dir: str | None = None, what: str = "data.train_files"):
    """Validate the files and return a `datasets.Dataset` of rows {segments: [{role, content}], origin}."""
    import datasets

    datasets.disable_progress_bars()  # one-line errors stay one line; the run prints its own data summary
    files = expand_files(paths, what)
    stamps = [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]
    features = datasets.Features({
        "segments": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "origin": datasets.Value("string"),
    })
    try:
        return datasets.Dataset.from_generator(
            _generate_rows, gen_kwargs={"files": files, "stamps": stamps}, features=features, cache_dir=cache_dir
        )
    except Exception as e:  # noqa: BLE001 - re-raised unless it wraps a DataError
        err = _unwrap(e)
        if isinstance(err, DataError):
            raise err from None
        raise


# ----------------------------------------------------------------------------------------------- tokenization


@dataclass(frozen=True)
class ChatFormat:
    """Strings around each turn. Loss covers the assistant content and the eos that follows it."""

    system: str = "<|system|>\n{content}\n"
    user: str = "<|user|>\n{content}\n"
    assistant_prefix: str = "<|assistant|>\n"


def tokenize_generative(batch: dict, tokenizer, max_len: int, fmt: ChatFormat = ChatFormat()) -> dict:
    """Batched `map` function: segments -> input_ids, labels (IGNORE_INDEX outside the trained spans)."""
    # Collect every string piece with its trained flag, tokenize them all in one call, then reassemble.
    pieces: list[str] = []
    layout: list[list[tuple[int, bool]]] = []
    for segments in batch["segments"]:
        parts = []
        for seg in segments:
            role, content = seg["role"], seg["content"]
            if role == "text":
                parts += [(content, True)]
            elif role == "assistant":
                parts += [(fmt.assistant_prefix, False), (content, True)]
            else:
                parts += [(getattr(fmt, role).format(content=content), False)]
        row = []
        for text, trained in parts:
            row.append((len(pieces), trained))
            pieces.append(text)
        layout.append(row)
    ids = tokenizer(pieces, add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    out: dict[str, list] = {"input_ids": [], "labels": [], "length": [], "truncated": []}
    for row in layout:
        input_ids = [bos] if bos is not None else []
        labels = [IGNORE_INDEX] * len(input_ids)
        for idx, trained in row:
            piece = ids[idx] + ([eos] if trained else [])  # a trained span (text, assistant turn) ends with eos
            input_ids += piece
            labels += piece if trained else [IGNORE_INDEX] * len(piece)
        out["truncated"].append(len(input_ids) > max_len)
        out["input_ids"].append(input_ids[:max_len])
        out["labels"].append(labels[:max_len])
        out["length"].append(min(len(input_ids), max_len))
    return out


def tokenize_dataset(rows, tokenizer, max_len: int):
    """Tokenize rows (cached by datasets next to the rows' Arrow files); returns (dataset, stats). Samples left
    with no trained token are removed and counted in stats['dropped_no_labels'] (the other stats describe the
    kept samples)."""
    ds = rows.map(
        tokenize_generative,
        batched=True,
        batch_size=1000,
        fn_kwargs={"tokenizer": tokenizer, "max_len": max_len},
        remove_columns=["segments"],
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


class GenerativeCollator:
    """Right-pads input_ids/labels to the longest sample in the micro-batch (optionally to a multiple of 8)."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 1):
        self.pad_token_id = pad_token_id
        self.multiple = pad_to_multiple_of

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(s["input_ids"]) for s in samples)
        width = -(-longest // self.multiple) * self.multiple
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


if __name__ == "__main__":
    from harness.config import ModelConfig
    from harness.model import load_tokenizer

    rows = load_generative_rows(sys.argv[1:] or ["data/sample/gen.jsonl"])
    _, st = tokenize_dataset(rows, load_tokenizer(ModelConfig()), max_len=1 << 20)
    print(json.dumps(st, indent=2))
