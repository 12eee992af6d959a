"""The resumable output of `harness rft generate`: per-question records in append-only shards, their merge into
rft.jsonl (and pairs.jsonl), and the settings a restarted run must share.

    python -c "from harness.rft.shards import read_shards; print(len(read_shards(__import__('pathlib').Path('runs/rft-tiny/generate/shards'))))"

A question is done once its line is in `<output_dir>/shards/rank-R.jsonl` (flush + fsync after each write); a
half-written last line (a kill during the write) is cut before appending; the merge writes each question once.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Optional

from harness.errors import ConfigError, HarnessError, one_line
from harness.files import disk_full, fingerprint_change, write_json, write_text
from harness.checkpoint.datafiles import task_fingerprint
from harness.rft.tasks import Question, Task

SHARDS = "shards"
OUTPUT = "rft.jsonl"
PAIRS = "pairs.jsonl"
STATS = "stats.json"
SETTINGS = "settings.json"


def judge(task: Task, q: Question, responses: list[str], keep: int) -> dict:
    """One question's shard record: counts, its distinct verified responses and its distinct failed ones (at most
    `keep` of each, first come; the failed ones make the preference pairs)."""
    kept: list[str] = []
    rejected: list[str] = []
    correct = answered = duplicates = 0
    for r in responses:
        ok = task.verify(r, q)
        answered += task.extract(r) is not None
        correct += ok
        if ok:
            if r in kept:
                duplicates += 1
            elif len(kept) < keep:
                kept.append(r)
        elif r not in rejected and len(rejected) < keep:
            rejected.append(r)
    return {"qid": q.qid, "question": q.question, "answer": q.answer, "samples": len(responses), "correct": correct,
            "answered": answered, "duplicates": duplicates, "kept": kept, "rejected": rejected}


# ----------------------------------------------------------------------------------------------- shards


def repair_shard(path: Path) -> None:
    """Cut a partial last line (a run killed while writing) so that appending continues on a clean line."""
    if not path.is_file():
        return
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end != len(data):
        with path.open("r+b") as fh:
            fh.truncate(end)
            fh.flush()
            os.fsync(fh.fileno())


def read_shards(folder: Path) -> list[dict]:
    """Every complete question record of every shard file (a partial last line is ignored)."""
    records = []
    for f in sorted(folder.glob("rank-*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # only the last line of a killed run can be partial
    return records


def append_records(path: Path, records: list[dict]) -> None:
    """Append whole lines (flush + fsync). A write that fails (a full disk, a file-size limit) is cut back to the last
    whole line and is one HarnessError: the questions done so far stay done."""
    data = memoryview("".join(json.dumps(r) + "\n" for r in records).encode("utf-8"))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:
                while data:
                    data = data[os.write(fd, data):]
                os.fsync(fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)  # no cut line left behind
                raise
        finally:
            os.close(fd)
    except OSError as e:
        raise not_written(path, e, "the questions already in the shards stay done; free some space (or raise the "
                                   "file-size limit), then run the same command to continue") from None


def not_written(path: Path, e: OSError, then: str) -> HarnessError:
    """The one-line error of a file of the generation that could not be written."""
    full = ": the disk is full" if disk_full(e, path.parent) else ""
    return HarnessError(f"could not write {path} ({one_line(e, 200)}){full}; {then}")


def preference_pairs(task: Task, q: Question, record: dict, most: int) -> list[dict]:
    """At most `most` pairs of one question: its i-th verified answer with its i-th failed one, in TRL's
    conversational preference format (prompt messages, chosen and rejected assistant turns)."""
    prompt = task.messages(q)
    return [{"prompt": prompt, "chosen": [{"role": "assistant", "content": good}],
             "rejected": [{"role": "assistant", "content": bad}]}
            for good, bad in list(zip(record.get("kept", []), record.get("rejected", [])))[:most]]


def merge(task: Task, questions: list[Question], folder: Path, pairs: int = 0) -> dict:
    """shards/ -> rft.jsonl (chat records in question order), pairs.jsonl when `pairs` > 0 (at most that many
    preference pairs per question), stats.json; returns the stats."""
    by_qid: dict[str, dict] = {}
    repeats = 0
    for r in read_shards(folder / SHARDS):
        repeats += r["qid"] in by_qid
        by_qid.setdefault(r["qid"], r)
    rows = []
    for q in questions:
        r = by_qid.get(q.qid)
        for answer in (r or {}).get("kept", []):
            rows.append({"messages": task.messages(q) + [{"role": "assistant", "content": answer}]})
    done = [by_qid[q.qid] for q in questions if q.qid in by_qid]
    pair_rows = [x for q in questions if q.qid in by_qid for x in preference_pairs(task, q, by_qid[q.qid], pairs)]
    outputs = [(folder / OUTPUT, rows)] + ([(folder / PAIRS, pair_rows)] if pairs else [])
    samples = sum(r["samples"] for r in done)
    stats = {
        "questions": len(questions),
        "questions_covered": len(done),
        "questions_with_kept": sum(bool(r["kept"]) for r in done),
        "kept_examples": len(rows),
        "samples": samples,
        "correct_samples": sum(r["correct"] for r in done),
        "success_rate": sum(r["correct"] for r in done) / max(samples, 1),
        "answer_rate": sum(r["answered"] for r in done) / max(samples, 1),
        "duplicates_dropped": sum(r["duplicates"] for r in done),
        "repeated_question_records": repeats,
        "preference_pairs": len(pair_rows) if pairs else None,
        "output": str(folder / OUTPUT),
    }
    for path, lines in outputs:
        write_lines(path, lines)
    write_lines(folder / STATS, stats)
    return stats


def write_lines(path: Path, rows) -> None:
    """JSON lines (or, for a dict, a JSON file) written whole or not at all; a failed write is one HarnessError (the
    shards are whole: the merge runs again with the same command)."""
    try:
        if isinstance(rows, dict):
            write_json(path, rows)
        else:
            write_text(path, "".join(json.dumps(x) + "\n" for x in rows))
    except OSError as e:
        raise not_written(path, e, "every sampled question is kept in the shards; free some space, then run the "
                                   "same command to merge them") from None


def generation_settings(r, model: Optional[str]) -> dict:
    """What the shards' answers depend on: a restarted run must use the same, or its output would mix two runs
    (`r`: cfg.rft; model: --model, else model.name_or_path)."""
    return {"model": str(model), "task": r.task, "test_file": r.test_file,
            "num_train_questions": r.num_train_questions, "num_test_questions": r.num_test_questions,
            "num_sft_questions": r.num_sft_questions, "max_operand": r.max_operand, "task_seed": r.task_seed,
            "tolerance": r.tolerance, "oversample": r.oversample, "temperature": r.temperature, "top_p": r.top_p,
            "max_new_tokens": r.max_new_tokens, "keep_per_question": r.keep_per_question, "seed": r.seed,
            **({"stop_strings": list(r.stop_strings)} if r.stop_strings else {}),
            **({"top_k": r.top_k} if r.top_k else {}), **({"min_p": r.min_p} if r.min_p else {}),
            "task_questions": task_fingerprint(r)[1]}  # a JSONL task edited in place: its ids are line numbers


LATER = ("seed", "task_questions")  # recorded since a later version: shards started without them continue


def check_settings(path: Path, settings: dict, write: bool = True) -> None:
    """Record the settings of a new run; refuse to continue one that was started with other settings."""
    if path.exists():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(old, dict):
                raise ValueError(f"holds a JSON {type(old).__name__}, not an object")
        except (OSError, ValueError) as e:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
            raise HarnessError(f"{path} cannot be read ({one_line(e, 200)}): it records the settings the shards in "
                               f"{path.parent} were sampled with; restore it, or remove it to continue them with this "
                               f"config's settings, or use another rft.output_dir") from None
        diff = [k for k in [*settings, *(k for k in old if k not in settings)]
                if old.get(k) != settings.get(k) and (k in old or k not in LATER)]
        if diff and diff[0] == "task_questions":
            raise ConfigError(f"config key 'rft.task': {settings['task']} changed since the shards in {path.parent} "
                              f"were sampled ({fingerprint_change(old[diff[0]], settings[diff[0]])}): a JSONL question's id is "
                              f"its line, so its questions would be taken for others; put the file back, or use "
                              f"another rft.output_dir")
        if diff:
            key = "model.name_or_path (or --model)" if diff[0] == "model" else f"rft.{diff[0]}"
            raise ConfigError(f"config key '{key}': {path.parent.parent} was started with "
                              f"{diff[0]}={old.get(diff[0])!r}, now {settings.get(diff[0])!r}; use another rft.output_dir "
                              f"or the same settings to continue")
        return
    if write:
        write_lines(path, settings)


