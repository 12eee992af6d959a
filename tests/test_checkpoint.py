"""Checkpoint folders: completeness marker, rotation, choosing what to resume from, and the errors around it."""

from __future__ import annotations

import json

import pytest

from harness import checkpoint
from harness.errors import ConfigError
from harness_launch import FAST, metrics, run_train


def make_ckpt(root, step, complete=True):
    p = root / "checkpoints" / f"step-{step}"
    p.mkdir(parents=True)
    (p / "model.safetensors").write_text("x")
    if complete:
        (p / checkpoint.STATE_FILE).write_text(json.dumps({"step": step}))
        (p / checkpoint.MARKER).write_text("complete\n")
    return p


def test_list_checkpoints_sorts_by_step_and_separates_incomplete(tmp_path):
    for s in (10, 2, 100):
        make_ckpt(tmp_path, s)
    partial = make_ckpt(tmp_path, 150, complete=False)
    (tmp_path / "checkpoints" / "notes").mkdir()
    complete, incomplete = checkpoint.list_checkpoints(tmp_path)
    assert [s for s, _ in complete] == [2, 10, 100]
    assert incomplete == [partial]


def test_marker_without_state_is_incomplete(tmp_path):
    p = make_ckpt(tmp_path, 5)
    (p / checkpoint.STATE_FILE).unlink()
    assert checkpoint.list_checkpoints(tmp_path) == ([], [p])


def test_rotation_keeps_newest_and_removes_stale_incomplete(tmp_path):
    for s in (1, 2, 3, 4):
        make_ckpt(tmp_path, s)
    old_partial = make_ckpt(tmp_path, 0, complete=False)
    new_partial = make_ckpt(tmp_path, 9, complete=False)
    deleted = checkpoint.rotate(tmp_path, keep=2)
    complete, incomplete = checkpoint.list_checkpoints(tmp_path)
    assert [s for s, _ in complete] == [3, 4]
    assert incomplete == [new_partial]  # newer than every complete one: may be a save in progress
    assert old_partial in deleted
    assert checkpoint.rotate(tmp_path, keep=0) == []  # keep all


def test_resolve_resume(tmp_path):
    assert checkpoint.resolve_resume(tmp_path, "auto") == (None, [])
    assert checkpoint.resolve_resume(tmp_path, None) == (None, [])
    make_ckpt(tmp_path, 4)
    newest = make_ckpt(tmp_path, 8)
    partial = make_ckpt(tmp_path, 12, complete=False)
    assert checkpoint.resolve_resume(tmp_path, "auto") == (newest, [partial])
    assert checkpoint.resolve_resume(tmp_path, str(newest))[0] == newest


@pytest.mark.parametrize("case, message", [
    ("fresh-over-checkpoints", "config key 'train.resume': {root}/checkpoints already holds checkpoints (newest "
                               "step-8); use train.resume=auto to continue or another train.output_dir"),
    ("missing", "config key 'train.resume': {root}/nope is not a folder"),
    ("incomplete", "config key 'train.resume': {root}/checkpoints/step-12 is not a complete checkpoint (no COMPLETE "
                   "marker or harness_state.json)"),
])
def test_resolve_resume_errors(tmp_path, case, message):
    make_ckpt(tmp_path, 8)
    make_ckpt(tmp_path, 12, complete=False)
    arg = {"fresh-over-checkpoints": None, "missing": str(tmp_path / "nope"),
           "incomplete": str(tmp_path / "checkpoints" / "step-12")}[case]
    with pytest.raises(ConfigError) as e:
        checkpoint.resolve_resume(tmp_path, arg)
    assert str(e.value) == message.format(root=tmp_path)


@pytest.mark.slow
def test_incomplete_checkpoint_is_reported_and_skipped(tmp_path):
    """A crash during a save leaves a folder without the marker: resume=auto passes over it and says so."""
    out = tmp_path / "run"
    args = [f"train.output_dir={out}", "train.max_steps=6", "train.save_every_steps=2", *FAST, "train.save_final=false"]
    run_train([*args, "train.stop_at_step=4"])
    broken = out / "checkpoints" / "step-5"
    broken.mkdir()
    (broken / "model.safetensors").write_text("half")
    proc = run_train(args)
    assert f"{broken} is an incomplete checkpoint" in proc.stdout
    assert "resumed from" in proc.stdout and "step-4" in proc.stdout
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert not broken.exists()  # removed by rotation once a newer complete checkpoint exists


@pytest.mark.slow
def test_resume_from_a_path_that_is_not_a_checkpoint_is_one_line(tmp_path):
    proc = run_train([f"train.output_dir={tmp_path}", f"train.resume={tmp_path}", *FAST], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"harness: error: config key 'train.resume': {tmp_path} is not a complete checkpoint "
        "(no COMPLETE marker or harness_state.json)")
    assert "Traceback" not in proc.stderr
