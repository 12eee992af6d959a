"""The training data a checkpoint was written with: each training file's fingerprint (size and a hash of its first
and last 64 KiB: harness/files.py), saved in harness_state.json (`data_files`) and compared on resume. A checkpoint's
data position counts rows of its data: resumed on changed files (pairs appended, the file regenerated) it would
continue at the old row count in the new data's order, silently. So a change is refused in one line naming the file,
unless train.resume_changed_data=true, which trains the new data from the start of a new epoch
(docs/preemption-and-resume.md). Hub datasets have no local file and are not compared.

    fingerprints(cfg.data, cfg.loss.mode, cfg.rft, cfg.rl) -> {"data.train_files": [[path, {size, ends}], ...], ...}
    compare(saved, now) -> what changed, one phrase per file (empty: the same data)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from harness.config.modes import facts
from harness.data import sources
from harness.errors import DataError
from harness.files import fingerprint, fingerprint_change, prefix_fingerprint

def fingerprints(d, loss_mode: str, rft=None, rl=None) -> dict:
    """Every local training data file of the streams of `loss_mode` (`d`: cfg.data) with its fingerprint, by config
    key (files of a folder and of a save_to_disk dataset, sorted; a hub id has none). A missing file is the data's own
    one-line error. A mode that reads the rft / rl sections (loss.mode=rl; `rft`: cfg.rft, `rl`: cfg.rl): its
    questions' source too, as `rft.task` (rft/tasks.py task_fingerprint: a JSONL task's file, or the arithmetic task's
    settings), and the files of `rl.prompts`."""
    mode, out = facts(loss_mode), {}
    if "rft" in mode.sections and rft is not None:
        out["rft.task"] = [task_fingerprint(rft)]
    if "rl" in mode.sections and rl is not None and rl.prompts:
        out["rl.prompts"] = source_files(rl.prompts, "rl.prompts")
    keys = (("train_files",) if mode.reads_data else ()) + (("emb_train_files",) if mode.embeds else ())
    for key in keys:
        out[f"data.{key}"] = source_files(getattr(d, key), f"data.{key}")
    return out


def source_files(entries, what: str) -> list:
    """[[file, fingerprint], ...] of the local files of data sources `entries` (config key `what`)."""
    files = []
    for source in sources.parse_sources(entries, what):
        kind, where = sources.locate(source, what)
        if kind == "files":
            files += where
        elif kind == "saved":
            files += sorted(str(f) for f in Path(where).rglob("*") if f.is_file())
    return [[f, fingerprint(f)] for f in files]


def compare(saved: dict, now: dict) -> list[str]:
    """What changed between the checkpoint's training files (`saved`) and this run's (`now`), one phrase per file:
    a file whose content changed, one added, one gone, or the same files in another order or number. Files
    are matched by content, so the same data under another path (moved, copied) is no change."""
    out = []
    for key in sorted(set(saved) | set(now)):
        if key == "rft.task" and key not in saved:  # a checkpoint of an older harness: its task is not known
            continue
        read, after = saved.get(key, []), now.get(key, [])
        before = [[p, {k: v for k, v in fp.items() if k != "read"} if isinstance(fp, dict) else fp] for p, fp in read]
        if [fp for _, fp in before] == [fp for _, fp in after]:
            continue
        if [p for p, _ in read] == [p for p, _ in after] and all(read_unchanged(p, fp, now_fp) for (p, fp), (_, now_fp)
                                                                  in zip(read, after)):
            continue  # streamed files changed only beyond what the checkpoint's stream had read of them
        old, new = dict((p, fp) for p, fp in before), dict((p, fp) for p, fp in after)
        kept, contents = [fp for _, fp in before], [fp for _, fp in after]
        found = [f"{key}: {p} changed ({fingerprint_change(old[p], fp)})" if p in old else
                 f"{key}: {p} is not among the files the checkpoint's run trained on"
                 for p, fp in after if fp not in kept]
        found += [f"{key}: {p} is gone" for p, fp in before if fp not in contents and p not in new]
        out += found or [f"{key}: the same files in another order or number"]
    return out


def read_unchanged(path: str, saved: dict, now: dict) -> bool:
    """A streamed file whose content changed only beyond what the checkpoint's stream read of it (data.streaming
    saves `read`: its byte offset and the fingerprint of the bytes before it; the resume seeks there): no change
    to the run. A file whose fingerprint is the same is unchanged too."""
    if {k: v for k, v in saved.items() if k != "read"} == now:
        return True
    read = saved.get("read")
    return read is not None and now.get("size", -1) >= read["bytes"] and \
        prefix_fingerprint(path, read["bytes"]) == read["ends"]


def task_fingerprint(rft) -> list:
    """The train questions' source as a training file's entry `[label, fingerprint]` (harness/files.py; compared as
    `changes` compares them): a JSONL task's file (a question's id is its line: an edit anywhere shifts
    them), or the arithmetic task's settings, which make its questions. `rft`: cfg.rft."""
    if rft.task == "arithmetic":
        made = (f"rft.num_train_questions={rft.num_train_questions}, rft.num_test_questions={rft.num_test_questions}, "
                f"rft.num_sft_questions={rft.num_sft_questions}, rft.max_operand={rft.max_operand}, "
                f"rft.task_seed={rft.task_seed}")
        return ["arithmetic", {"size": 0, "ends": hashlib.blake2b(made.encode(), digest_size=16).hexdigest(),
                               "settings": made}]
    if not Path(rft.task).is_file():
        raise DataError(f"{rft.task}: no such file")
    return [rft.task, fingerprint(rft.task)]
