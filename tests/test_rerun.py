"""A finished run stays finished: rerunning its command changes nothing and exits 0; train.overwrite=true trains
it again (deleting the previous outputs first, even with checkpoints there).

    .venv/bin/python -m pytest tests/test_rerun.py
"""

from __future__ import annotations

import pytest

from harness.config import load_config
from harness.errors import ConfigError
from harness.observe import reporting
from harness_launch import DEFAULT, FAST, metrics, report, run_train


def _mtimes(out) -> dict:
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*")}


def test_finished_run_is_not_run_again_unless_overwrite(tmp_path):
    out = tmp_path / "run"
    args = [f"train.output_dir={out}", "train.max_steps=3", "train.save_every_steps=2", *FAST]
    run_train(args)
    assert report(out)["steps"] == 3 and not (out / ".lock").exists()  # released at the end
    before = _mtimes(out)
    assert {"metrics.jsonl", "report.json", "final", "config.yaml", "checkpoints/step-2"} <= set(before)

    again = run_train(args)
    assert again.stdout.strip().splitlines() == [
        f"[harness] {out} holds a finished run (step 3/3): final model {out}/final, report {out}/report.json, "
        f"metrics {out}/metrics.jsonl; nothing to do (train.overwrite=true trains it again)"]
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
        return reporting.finished_run(tmp_path)

    assert reporting.finished_run(tmp_path) is None  # no report
    assert rep(stopped_by=None) and rep(stopped_by="time_budget")
    assert rep(stopped_by=None, final_dir=str(tmp_path / "final")) is None  # its export is gone
    (tmp_path / "final").mkdir()
    assert rep(stopped_by=None, final_dir=str(tmp_path / "final"))
    assert rep(stopped_by="nonfinite") is None
    (tmp_path / "report.json").write_text("{cut")
    assert reporting.finished_run(tmp_path) is None


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


def test_max_steps_changed_on_a_rerun(tmp_path):
    """Below an interrupted run's checkpoint: refused in one line, nothing written. Raised on a finished run: it
    continues from its last checkpoint with the new schedule, in one line, and ends at the new last step."""
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
    run_train([*args, "train.max_steps=3"])  # finished at step 3; its last checkpoint is step-2
    more = run_train([*args, "train.max_steps=5"])
    assert more.stdout.splitlines()[0] == (
        f"[harness] {out} holds a finished run (step 3/3); train.max_steps=5 (it planned 3) asks for more: continuing "
        f"from its last checkpoint {out}/checkpoints/step-2 (step 2) with the new schedule; final/ and report.json are "
        "replaced at the end")
    assert f"resumed from {out}/checkpoints/step-2: step 2" in more.stdout
    rep = report(out)
    assert (rep["steps"], rep["planned_steps"]) == (5, 5) and [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5]
