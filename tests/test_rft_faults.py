"""`harness rft generate` against bad input and an unlucky machine (harness/rft/generate.py, shards.py, tasks.py): each
is one `harness: error:` line, nothing half-written is left, and the questions already done stay done.

    .venv/bin/python -m pytest tests/test_rft_faults.py
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from harness.errors import DataError, HarnessError
from harness.rft import generate as gen
from harness.tools.rft import main as rft_main
from harness.rft.tasks import JsonlTask
from harness.rundir import lock
from tests.harness_launch import ROOT

RECIPE = str(ROOT / "configs" / "rft-tiny.yaml")
TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 128}
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random model saved with its tokenizer (what `--model` / model.name_or_path names)."""
    import torch

    from harness.config import ModelConfig
    from harness.model import build_model, load_tokenizer

    folder = tmp_path_factory.mktemp("model")
    cfg = ModelConfig(config=dict(TINY))
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    build_model(cfg, tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def overrides(model_dir, out) -> list[str]:
    """8 questions x 2 samples of 4 new tokens: a second on the CPU."""
    return [f"model.name_or_path={model_dir}", f"rft.output_dir={out}", "rft.max_operand=4",
            "rft.num_train_questions=8", "rft.num_test_questions=4", "rft.num_sft_questions=4", "rft.oversample=2",
            "rft.max_new_tokens=4", "rft.questions_per_batch=4"]


def one_error_line(err: str) -> str:
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.strip()]
    assert "Traceback" not in err and lines and lines[-1].startswith("harness: error: "), err[-3000:]
    return lines[-1]


def test_a_negative_stop_after_is_refused(model_dir, tmp_path, capsys):
    """--stop-after -1 was accepted and sampled nothing (exit 0)."""
    assert rft_main(["generate", RECIPE, "--stop-after", "-1", *overrides(model_dir, tmp_path / "gen")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--stop-after: must be >= 0" in line and "got -1" in line
    assert not (tmp_path / "gen").exists()


def test_a_second_generation_into_one_folder_is_refused(model_dir, tmp_path, capsys):
    """Two `rft generate` runs into one folder both sampled every question (no lock); the second is now refused
    while the first holds <output_dir>/shards/.lock (a live process of this host: what a running generation is)."""
    out = tmp_path / "gen"
    (out / gen.SHARDS).mkdir(parents=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (out / gen.SHARDS / lock.LOCK_NAME).write_text(json.dumps(lock.identity(other.pid)))
        assert rft_main(["generate", RECIPE, *overrides(model_dir, out)]) == 1
        line = one_error_line(capsys.readouterr().err)
        assert f"is in use by another run (host" in line and f"pid {other.pid}" in line, line
        assert "use another rft.output_dir" in line
        assert not list((out / gen.SHARDS).glob("rank-*.jsonl"))  # nothing sampled
    finally:
        other.kill()
        other.wait()
    # once that run is gone its lock is stale: taken over, and the generation runs and releases the lock
    assert rft_main(["generate", RECIPE, *overrides(model_dir, out)]) == 0
    assert len(gen.read_shards(out / gen.SHARDS)) == 8 and not (out / gen.SHARDS / lock.LOCK_NAME).exists()
    assert "taking the folder over" in capsys.readouterr().out


def test_a_question_file_with_a_byte_that_is_not_utf8_is_one_line(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_bytes(b'{"question": "ok", "answer": 1}\n{"question": "\xff?", "answer": 2}\n')
    with pytest.raises(DataError) as e:  # what every data reader says (harness/data/readers.py)
        JsonlTask(str(f)).split("train")
    assert str(e.value).startswith(f"{f}:2: not UTF-8 text (byte 0xff at column 15)"), e.value


def test_a_damaged_settings_file_is_one_line(model_dir, tmp_path, capsys):
    out = tmp_path / "gen"
    (out / gen.SHARDS).mkdir(parents=True)
    for damaged in (b'{"model": "x", "task', b"[1, 2]", b"\xff\xfe"):
        (out / gen.SHARDS / gen.SETTINGS).write_bytes(damaged)
        assert rft_main(["generate", RECIPE, *overrides(model_dir, out)]) == 1
        line = one_error_line(capsys.readouterr().err)
        assert f"{out / gen.SHARDS / gen.SETTINGS} cannot be read (" in line and "remove it" in line, line


def test_generation_past_a_file_size_limit_is_one_line_and_keeps_what_is_done(model_dir, tmp_path):
    """RLIMIT_FSIZE (a quota; a full disk fails the same write with ENOSPC) reached in the middle of the shard: one
    line, no cut line left in the shard, and the same command continues once there is room. (Before: three chained
    OSErrors from rft/shards.py.)"""
    out = tmp_path / "gen"
    shard = out / gen.SHARDS / "rank-0.jsonl"
    shard.parent.mkdir(parents=True)
    done = [{"qid": f"old-{i}", "question": "q", "answer": 1.0, "samples": 2, "correct": 0, "answered": 0,
             "duplicates": 0, "kept": [], "rejected": []} for i in range(16)]
    gen.append_records(shard, done)
    before = shard.read_bytes()
    limit = len(before) + 100  # room for the lock and settings.json, not for one more question's line

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    cmd = [sys.executable, "-m", "harness.rft", "generate", RECIPE, *overrides(model_dir, out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600, preexec_fn=small_files)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = one_error_line(proc.stderr)
    assert line.startswith(f"harness: error: could not write {shard} (OSError: [Errno 27] File too large)"), line
    assert "the questions already in the shards stay done" in line
    assert shard.read_bytes() == before  # whole lines only
    assert not (out / gen.OUTPUT).exists() and not (out / gen.SHARDS / lock.LOCK_NAME).exists()
    assert rft_main(["generate", RECIPE, *overrides(model_dir, out)]) == 0  # room again: it goes on
    assert len(gen.read_shards(out / gen.SHARDS)) == 16 + 8 and json.loads((out / gen.STATS).read_text())[
        "questions_covered"] == 8


def test_a_merge_that_the_disk_keeps_out_is_one_line_and_leaves_no_temporary(tmp_path):
    from harness.rft.tasks import ArithmeticTask

    task = ArithmeticTask(n_train=2, n_test=0, n_sft=0, max_operand=4)
    (tmp_path / gen.SHARDS).mkdir()
    qs = task.split("train")
    gen.append_records(tmp_path / gen.SHARDS / "rank-0.jsonl",
                       [gen.judge(task, q, [f"The answer is {q.answer:g}."] * 2, 2) for q in qs])
    (tmp_path / gen.OUTPUT).mkdir()  # a folder where rft.jsonl goes: the rename fails (as a full disk's write)
    with pytest.raises(HarnessError, match=f"could not write {tmp_path / gen.OUTPUT} .*run the same command to merge"):
        gen.merge(task, qs, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [gen.OUTPUT, gen.SHARDS]


def test_an_error_while_sampling_is_printed_on_its_own_line(model_dir, tmp_path, capsys):
    """A KV-cache budget that holds no sequence: its one line was printed after the progress bar, on the bar's line."""
    assert rft_main(["generate", RECIPE, *overrides(model_dir, tmp_path / "gen"), "rft.engine=continuous",
                     "rft.kv_cache_gb=1e-9"]) == 1
    err = capsys.readouterr().err
    assert "rft generate" in err  # the bar was drawn (tqdm writes to a pipe as well)
    said = [x for x in err.split("\n") if "harness: error:" in x]
    assert len(said) == 1 and said[0].startswith("harness: error: rft.kv_cache_gb: "), err[-2000:]


def test_a_jsonl_task_edited_between_two_runs_is_refused(model_dir, tmp_path, capsys):
    """Issue 55, fault 1: a JSONL question's id is its line; `rft generate` stopped, its task edited in place (8
    questions inserted at the top), rerun: it said `28/28 questions covered` though the new questions were never
    sampled and the shifted old ones were sampled again under new ids (the shards' settings kept only the path).
    The task file is now fingerprinted with the settings: the rerun is one line naming it, and nothing is sampled."""
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": i + 1}) + "\n" for i in range(20)))
    out = tmp_path / "gen"
    args = ["generate", RECIPE, *overrides(model_dir, out), f"rft.task={task}", "--stop-after", "1"]
    assert rft_main(args) == 0
    done = len(gen.read_shards(out / gen.SHARDS))
    assert done == 4
    task.write_text("".join(json.dumps({"question": f"What is {i} x 2?", "answer": i * 2}) + "\n" for i in range(8))
                    + task.read_text())
    assert rft_main(args) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"harness: error: config key 'rft.task': {task} changed since the shards in "
                           f"{out / gen.SHARDS} were sampled ("), line
    assert "put the file back, or use another rft.output_dir" in line
    assert len(gen.read_shards(out / gen.SHARDS)) == done


def test_a_restarted_generation_draws_what_an_uninterrupted_one_would_and_another_seed_is_refused(model_dir, tmp_path,
                                                                                                  capsys):
    """Issue 55 (11): the continuous engine seeded a whole call from its first question, so a restart drew other
    samples than an uninterrupted run, and a restart with another rft.seed mixed two seeds' samples silently. Each
    answer is now seeded from rft.seed, its question's id and its index, and rft.seed is in the shards' settings."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert rft_main(["generate", RECIPE, *overrides(model_dir, whole)]) == 0
    assert rft_main(["generate", RECIPE, "--stop-after", "1", *overrides(model_dir, parts)]) == 0
    assert len(gen.read_shards(parts / gen.SHARDS)) == 4  # stopped after one batch of 4 questions
    capsys.readouterr()
    assert rft_main(["generate", RECIPE, *overrides(model_dir, parts), "rft.seed=1"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "config key 'rft.seed'" in line and "seed=0, now 1" in line, line
    assert rft_main(["generate", RECIPE, *overrides(model_dir, parts)]) == 0
    a, b = (sorted(gen.read_shards(d / gen.SHARDS), key=lambda x: x["qid"]) for d in (whole, parts))
    assert len(a) == 8 and a == b and len({x for rec in a for x in rec["rejected"]}) > 8  # sampled, not greedy
    assert json.loads((parts / gen.SHARDS / gen.SETTINGS).read_text())["seed"] == 0
