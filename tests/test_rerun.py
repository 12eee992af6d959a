"""A finished run stays finished: rerunning its command changes nothing and exits 0; train.overwrite=true trains
it again (deleting the previous outputs first, even with checkpoints there).

    .venv/bin/python -m pytest tests/test_rerun.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from harness.checkpoint import store
from harness.checkpoint.manifest import verify_checkpoint
from harness.config import load_config
from harness.errors import ConfigError
from harness.rundir import finished
from harness.stopping import EARLY_STOPPING, TIME_BUDGET
from harness_launch import DEFAULT, FAST, final_weights, max_abs_diff, metrics, report, run_train


def _mtimes(out) -> dict:
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*")}


def test_finished_run_is_not_run_again_unless_overwrite(tmp_path):
    out = tmp_path / "run"
    args = [f"train.output_dir={out}", "train.max_steps=3", "train.save_every_steps=2", *FAST]
    run_train(args)
    assert report(out)["steps"] == 3 and not (out / ".lock").exists()  # released at the end
    before = _mtimes(out)
    assert {"metrics.jsonl", "report.json", "final", "config.yaml", "checkpoints/step-2",
            "checkpoints/step-3"} <= set(before)  # step-3: the end of the run

    line = (f"[harness] {out} holds a finished run (step 3/3): final model {out}/final, report {out}/report.json, "
            f"metrics {out}/metrics.jsonl; nothing to do (train.overwrite=true trains it again)")
    start = time.perf_counter()
    again = run_train(args)
    seconds = time.perf_counter() - start
    assert again.stdout.strip().splitlines() == [line]
    # answered before torch is imported: 0.20-0.33 s measured on the 2-core machine (docs/bench/config-errors-cpu.txt)
    assert seconds < 15, seconds
    cli = subprocess.run([sys.executable, "-m", "harness.cli", "train", DEFAULT, *args], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert cli.returncode == 0 and cli.stdout.strip().splitlines() == [line], cli.stderr
    assert _mtimes(out) == before  # nothing rewritten, nothing added

    over = run_train([*args, "train.overwrite=true"])
    assert f"[harness] train.overwrite=true: deleted the previous run's checkpoints, final, metrics.jsonl, " \
           f"report.json in {out}" in over.stdout
    assert "resumed from" not in over.stdout and "[harness] done: step 3" in over.stdout
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    assert (out / "report.json").stat().st_mtime_ns > before["report.json"]


def test_what_counts_as_finished(tmp_path):
    import json

    def rep(**kw):
        (tmp_path / "report.json").write_text(json.dumps({"steps": 3, "planned_steps": 3, "final_dir": None, **kw}))
        return finished.finished_run(tmp_path)

    assert finished.finished_run(tmp_path) is None  # no report
    assert rep(stopped_by=None) and rep(stopped_by="time_budget") and rep(stopped_by="early_stopping")
    assert rep(stopped_by=None, final_dir=str(tmp_path / "final")) is None  # its export is gone
    (tmp_path / "final").mkdir()
    assert rep(stopped_by=None, final_dir=str(tmp_path / "final"))
    assert rep(stopped_by="nonfinite") is None
    assert finished.STOPPED_BY_TIME == TIME_BUDGET and finished.STOPPED_EARLY == EARLY_STOPPING  # the light copies
    (tmp_path / "report.json").write_text("{cut")
    assert finished.finished_run(tmp_path) is None


def test_defaults_resume_and_save_every_30_minutes():
    t = load_config(DEFAULT).train
    assert t.resume == "auto" and t.save_every_minutes == 30 and t.overwrite is False
    with pytest.raises(ConfigError, match="train.overwrite': starts the run over, so it cannot resume from"):
        load_config(DEFAULT, ["train.overwrite=true", "train.resume=/some/step-4"])


def test_overwrite_never_deletes_what_no_run_wrote(tmp_path, monkeypatch, capsys):
    """An empty train.output_dir (an unset shell variable) is refused before anything; train.overwrite=true in a
    folder that holds the names of run outputs but no harness run (here the current folder, given as `.`) deletes
    nothing. Both through the `harness` command, in the user's folder."""
    from harness import cli

    mine = {"checkpoints/notes.txt": "mine", "final/model.bin": "mine", "plots/a.png": "mine", "summary.md": "mine",
            "metrics.jsonl": "mine", "report.json": "{}", "tensorboard/x": "mine"}
    for rel, text in mine.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", DEFAULT, "train.output_dir=", "train.overwrite=true", *FAST]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "harness: error: config key 'train.output_dir': is empty (an unset shell variable?); give the run folder, "
        "e.g. train.output_dir=runs/my-run"]
    assert cli.main(["train", DEFAULT, "train.output_dir=.", "train.overwrite=true", *FAST]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "harness: error: config key 'train.overwrite': . holds checkpoints, final, metrics.jsonl, report.json, "
        "summary.md, plots, tensorboard but no harness run (no config.yaml written by harness train): nothing deleted; "
        "use another train.output_dir")
    assert {rel: (tmp_path / rel).read_text() for rel in mine} == mine
    assert not (tmp_path / ".lock").exists() and not (tmp_path / "config.yaml").exists()


def test_max_steps_below_an_interrupted_runs_checkpoint_is_refused(tmp_path):
    """Below an interrupted run's checkpoint: refused in one line, nothing written (raised on a finished run: the
    test below)."""
    out = tmp_path / "run"
    args = [f"train.output_dir={out}", "train.save_every_steps=2", *FAST]
    run_train([*args, "train.max_steps=3", "train.stop_at_step=2"])  # interrupted at step 2
    low = run_train([*args, "train.max_steps=1"], check=False)
    assert low.returncode == 2 and "Traceback" not in low.stderr, low.stderr[-3000:]
    assert low.stderr.strip().splitlines()[-1] == (
        f"harness: error: config key 'train.max_steps': the run to resume is at step 2 ({out}/checkpoints/step-2), "
        "past the 1 steps this config plans; rerun with the run's own train.max_steps (>= 2), or start over with "
        "train.overwrite=true")
    assert not (out / "report.json").exists() and not (out / "final").exists()


def test_more_steps_on_a_finished_run_continue_from_its_final_step(tmp_path):
    """A finished run of 5 steps (checkpoints every 2: the run's last periodic one is step 4) rerun with
    train.max_steps=7 continues from the step-5 checkpoint its end wrote: its first step is 6, nothing is trained
    twice, and (a constant learning rate, so the schedule does not depend on the planned total; one process, fp32)
    its final weights equal an uninterrupted 7-step run's."""
    args = ["train.save_every_steps=2", "optim.scheduler=constant", "optim.warmup_steps=0", *FAST]
    full, out = tmp_path / "full", tmp_path / "run"
    run_train([f"train.output_dir={full}", *args, "train.max_steps=7"])
    first = run_train([f"train.output_dir={out}", *args, "train.max_steps=5"])
    assert f"[harness] checkpoint: {out}/checkpoints/step-5 (" in first.stdout
    assert [s for s, _ in store.list_checkpoints(out)[0]] == [4, 5] and verify_checkpoint(out / "checkpoints/step-5").ok
    more = run_train([f"train.output_dir={out}", *args, "train.max_steps=7"])
    assert more.stdout.splitlines()[0] == (
        f"[harness] {out} holds a finished run (step 5/5); train.max_steps=7 (it planned 5) asks for more: continuing "
        f"from its last checkpoint {out}/checkpoints/step-5 (step 5) with the new schedule; final/ and report.json are "
        "replaced at the end")
    assert f"resumed from {out}/checkpoints/step-5: step 5" in more.stdout
    assert "optim.lr changed" not in more.stdout and report(out)["resumed_changes"] is None  # the same lr
    trained = [int(line.split()[2].split("/")[0]) for line in more.stdout.splitlines()
               if line.startswith("[harness] step ")]
    assert trained == [6, 7], more.stdout[-3000:]
    rep = report(out)
    assert (rep["steps"], rep["planned_steps"]) == (7, 7) and [r["step"] for r in metrics(out)] == list(range(1, 8))
    diff = max_abs_diff(final_weights(out), final_weights(full))
    print(f"continued 5 -> 7 vs uninterrupted 7 steps: final weights max abs diff {diff:.3g}")
    assert diff <= 1e-6, diff


def test_a_changed_learning_rate_is_applied_on_resume_and_said(tmp_path):
    """optim.lr changed between attempts takes effect from the resumed step, in one line and in report.json's
    resumed_changes: an interrupted run (3e-3, stopped at step 2) resumed with 1e-3, then, finished, extended to 6
    steps with 5e-4 (the checkpoint's scheduler and optimizer state carried the old peak, which went on silently
    while config.yaml recorded the new one). A constant schedule, so the logged lr is the peak itself."""
    out = tmp_path / "run"
    args = [f"train.output_dir={out}", "optim.scheduler=constant", "optim.warmup_steps=0", *FAST]
    run_train([*args, "train.max_steps=4", "train.stop_at_step=2", "optim.lr=3e-3"])
    second = run_train([*args, "train.max_steps=4", "optim.lr=1e-3"])
    assert (f"[harness] optim.lr changed since {out}/checkpoints/step-2: 0.003 -> 0.001, applied from step 3 (the "
            f"schedule's warm-up and decay act on the new peak)") in second.stdout, second.stdout[-3000:]
    assert report(out)["resumed_changes"] == {"optim.lr": {"from": 3e-3, "to": 1e-3, "from_step": 3}}
    third = run_train([*args, "train.max_steps=6", "optim.lr=5e-4"])
    assert f"optim.lr changed since {out}/checkpoints/step-4: 0.001 -> 0.0005, applied from step 5" in third.stdout
    assert report(out)["resumed_changes"] == {"optim.lr": {"from": 1e-3, "to": 5e-4, "from_step": 5}}
    lrs = [r["lr"] for r in metrics(out)]
    assert lrs == pytest.approx([3e-3, 3e-3, 1e-3, 1e-3, 5e-4, 5e-4], rel=1e-12), lrs  # (float32 not involved)
