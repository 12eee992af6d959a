"""train.early_stopping, train.keep_best and train.eval_prompts end to end, on a tiny model (two launches share one
uninterrupted run): the run stops at the step its patience says, also after a kill -9 and a resume; best/ loads with
from_pretrained and holds the weights of the best evaluation's checkpoint, which rotation kept; the prompts' answers
are in metrics.jsonl and tensorboard's text tab.

    python -m pytest tests/test_early_stopping.py -q
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.config import load_config
from harness.config.best import DIRECTIONS
from harness.errors import ConfigError
from harness_launch import DEFAULT, ROOT, report, run_train

TINY = ["model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=2",
        "model.config.num_attention_heads=2", "model.config.num_key_value_heads=2", "data.max_len=64",
        "train.micro_batch_size=4", "optim.warmup_steps=0", "optim.lr=5e-3", "train.progress_bar=false",
        "train.summary=false", "train.log_every=2"]
# evaluations every 2 steps; an improvement must be more than 1 nat (the tiny model's eval loss falls about 0.2 per
# evaluation here), so the first evaluation is the best and the patience of 2 is spent two evaluations later
RUN = [*TINY, "train.max_steps=20", "train.eval_every=2", "train.save_every_steps=2", "train.save_total_limit=1",
       "train.early_stopping={metric: eval_loss, patience: 2, min_delta: 1.0}", "train.keep_best=true",
       "train.eval_prompts=['What is 3 + 4?', {text: The cat}]", "train.eval_prompts_max_new_tokens=4"]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def expected_stop(evals: dict, patience: int, min_delta: float) -> tuple[int, int]:
    """(the step where the patience is spent, the best step) by the rule, from the logged eval_loss of each step."""
    best, best_step, bad = None, None, 0
    for step in sorted(s for s in evals if s > 0):
        if best is None or best - evals[step] > min_delta:
            best, best_step, bad = evals[step], step, 0
        else:
            bad += 1
            if bad == patience:
                return step, best_step
    raise AssertionError(f"the patience is never spent: {evals}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("early") / "run"
    run_train([f"train.output_dir={out}", *RUN])
    return out


def test_early_stopping_stops_where_the_patience_says_and_keeps_the_best(uninterrupted):
    out = uninterrupted
    evals = {r["step"]: r["eval_loss"] for r in records(out) if "eval_loss" in r}
    stop, best_step = expected_stop(evals, patience=2, min_delta=1.0)
    rep = report(out)
    assert rep["stopped_by"] == "early_stopping" and rep["steps"] == stop < rep["planned_steps"] == 20
    assert max(evals) == stop  # no evaluation after the stop, and the final one is the loop's (not repeated)
    assert [r["step"] for r in records(out) if "eval_loss" in r] == sorted(evals)
    assert rep["best"] == {"metric": "eval_loss", "value": evals[best_step], "step": best_step, "bad": 2,
                           "dir": str(out / "best")}
    assert (out / "final" / "model.safetensors").is_file()  # an early stop ends with the export
    # the best evaluation's checkpoint outlives train.save_total_limit=1; best/ holds its weights
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == sorted({f"step-{best_step}", f"step-{stop}"}), kept
    saved = load_file(out / "checkpoints" / f"step-{best_step}" / "model.safetensors")
    best = load_file(out / "best" / "model.safetensors")
    final = load_file(out / "final" / "model.safetensors")
    assert set(best) <= set(saved) and len(best) > 5
    for name, tensor in best.items():
        assert torch.equal(tensor, saved[name]), name  # the same fp32 tensors, written twice
    assert any(not torch.equal(best[n], final[n]) for n in best)  # (and not the last step's)
    # best/ loads with transformers' from_pretrained, those weights in it (lm_head tied to the embeddings)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "best")
    AutoTokenizer.from_pretrained(out / "best")
    assert type(model).__name__ == "LlamaForCausalLM"
    loaded = model.state_dict()
    for name, tensor in best.items():
        assert torch.equal(loaded[name], tensor), name


def test_eval_prompts_are_answered_at_each_evaluation(uninterrupted):
    out = uninterrupted
    rows = [r for r in records(out) if "eval_samples" in r]
    evals = [r["step"] for r in records(out) if "eval_loss" in r]
    assert [r["step"] for r in rows] == evals  # step 0, each evaluation, the last (once)
    for r in rows:
        assert [s["prompt"] for s in r["eval_samples"]] == ["What is 3 + 4?", "The cat"]
        assert all(isinstance(s["answer"], str) for s in r["eval_samples"])
    assert any(s["answer"] for r in rows for s in r["eval_samples"])  # greedy text, not always empty
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    texts = {}
    for path in glob.glob(str(out / "tensorboard" / "**" / "events.out.tfevents.*"), recursive=True):
        acc = EventAccumulator(path, size_guidance={"tensors": 0})
        acc.Reload()
        if "eval/samples/text_summary" in acc.Tags()["tensors"]:
            texts.update({e.step: e.tensor_proto.string_val[0].decode() for e in
                          acc.Tensors("eval/samples/text_summary")})
    assert sorted(texts) == evals
    first = rows[0]["eval_samples"][1]
    assert f"| The cat | {first['answer']} |" in texts[0]


def test_a_kill_9_and_resume_stop_where_the_uninterrupted_run_stops(uninterrupted, tmp_path):
    """The victim is held before step 5 (harness/faults.py) once the checkpoint of step 4 is complete: its patience
    count is 1 there. Resumed, the run stops at the same step with the same best (without the saved count it would
    stop an evaluation later; without the saved best, the next evaluation would be the best)."""
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "HARNESS_FAULT_PAUSE": "5"}
    env.pop("ACCELERATE_USE_CPU", None)
    proc = subprocess.Popen([sys.executable, "-m", "harness.train", "--config", DEFAULT, f"train.output_dir={out}",
                             *RUN], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    marker, t0 = out / "checkpoints" / "step-4" / "COMPLETE", time.time()
    while not marker.exists() and proc.poll() is None and time.time() - t0 < 600:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists()
    state = json.loads((out / "checkpoints" / "step-4" / "harness_state.json").read_text())
    assert state["best"]["bad"] == 1 and state["best"]["step"] == 2, state["best"]
    run_train([f"train.output_dir={out}", *RUN])
    ref, got = report(uninterrupted), report(out)
    assert got["resumed_from"].endswith("step-4")
    assert got["stopped_by"] == "early_stopping" and got["steps"] == ref["steps"]
    assert got["best"]["step"] == ref["best"]["step"] and got["best"]["value"] == pytest.approx(ref["best"]["value"],
                                                                                                rel=1e-6)
    evals = lambda o: {r["step"]: r["eval_loss"] for r in records(o) if "eval_loss" in r}  # noqa: E731
    assert evals(out) == pytest.approx(evals(uninterrupted), rel=1e-6)


def test_the_metric_is_checked_before_step_1():
    base = [*TINY, "train.eval_every=2"]
    with pytest.raises(ConfigError, match=r"'train.early_stopping.metric': unknown metric 'eval_bleu'"):
        load_config(DEFAULT, [*base, "train.early_stopping={metric: eval_bleu, patience: 2}"])
    with pytest.raises(ConfigError, match=r"eval_mrr is not logged by this run .*this run logs eval_loss"):
        load_config(DEFAULT, [*base, "train.early_stopping={metric: eval_mrr, patience: 2}"])
    with pytest.raises(ConfigError, match=r"'train.keep_best': needs evaluations during training"):
        load_config(DEFAULT, [*TINY, "train.keep_best=true"])
    with pytest.raises(ConfigError, match=r"unknown config key 'train.early_stopping.patiense'"):
        load_config(DEFAULT, [*base, "train.early_stopping.patiense=2"])
    with pytest.raises(ConfigError, match=r"'train.eval_prompts\[0\]'"):
        load_config(DEFAULT, [*base, "train.eval_prompts=[3]"])
    cfg = load_config(DEFAULT, [*base, "train.early_stopping.patience=3"])  # metric: eval_loss by default
    assert cfg.train.early_stopping == {"patience": 3} and DIRECTIONS["eval_loss"] is False


def test_two_processes_answer_on_the_main_process_and_keep_the_best_to_the_planned_end(uninterrupted, tmp_path):
    """2 processes (DDP): the main process generates while the other waits at the barrier; the answers are logged
    once per evaluation, and the step-0 answers (the same initial weights) equal the one-process run's. keep_best
    without patience (ranking only) to the planned end: the last step's evaluation is the loop's, once, and its
    ranking is in the last checkpoint; best/ is written by both processes' export."""
    out = tmp_path / "run"
    run_train([f"train.output_dir={out}", *TINY, "train.max_steps=4", "train.eval_every=2", "train.report_to=[]",
               "train.keep_best=true", "train.eval_prompts=['What is 3 + 4?', {text: The cat}]",
               "train.eval_prompts_max_new_tokens=4"], nproc=2, timeout=900)
    rows = {r["step"]: r["eval_samples"] for r in records(out) if "eval_samples" in r}
    assert sorted(rows) == [0, 2, 4] and len([r for r in records(out) if "eval_samples" in r]) == 3
    one = {r["step"]: r["eval_samples"] for r in records(uninterrupted) if "eval_samples" in r}
    assert rows[0] == one[0]
    evals = {r["step"]: r["eval_loss"] for r in records(out) if "eval_loss" in r}
    assert len([r for r in records(out) if "eval_loss" in r]) == len(evals) == 3  # 0, 2, 4: none twice
    rep = report(out)
    best_step = min((2, 4), key=evals.get)
    assert rep["stopped_by"] is None and rep["steps"] == 4 and rep["best"]["step"] == best_step
    assert (out / "best" / "model.safetensors").is_file() and (out / "final" / "model.safetensors").is_file()
    state = json.loads((out / "checkpoints" / "step-4" / "harness_state.json").read_text())
    assert state["best"]["step"] == best_step and state["best"]["value"] == evals[best_step]


def test_a_best_export_cut_short_is_redone_on_resume(tmp_path):
    """The checkpoint of step 2 (the best evaluation's) is complete and its best/ export never landed (a kill -9 or a
    full disk during it: here best/ removed after the run stopped at step 2). Resumed, the run writes best/ again
    from the checkpoint's weights before going on, says so, and report.json's best/ holds that step's model
    (failed before: best/ stayed missing, or held an older best, while report.json named it)."""
    out = tmp_path / "run"
    run_train([f"train.output_dir={out}", *RUN, "train.stop_at_step=2"])
    assert json.loads((out / "best" / "best_step.json").read_text()) == {"step": 2}
    import shutil

    shutil.rmtree(out / "best")
    proc = run_train([f"train.output_dir={out}", *RUN])  # to the early stop
    assert "[harness] best/ holds no model, not step 2's, the best (its export was cut short): exported again" in \
        proc.stdout
    rep = report(out)
    assert rep["resumed_from"].endswith("step-2") and rep["best"]["step"] == 2 and rep["best"]["dir"] == str(out / "best")
    saved = load_file(out / "checkpoints" / "step-2" / "model.safetensors")
    best = load_file(out / "best" / "model.safetensors")
    assert len(best) > 5 and all(torch.equal(t, saved[n]) for n, t in best.items())
    assert json.loads((out / "best" / "best_step.json").read_text()) == {"step": 2}


def test_a_finished_early_stopped_run_stays_finished(uninterrupted, tmp_path):
    """The early-stopped run's command run again (on a copy of its folder) does nothing and says why, even with a
    larger train.max_steps (failed before: each rerun resumed from its last checkpoint, trained one more step and
    replaced final/ and report.json)."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    before = {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*")}
    steps = report(out)["steps"]
    for more in ([], ["train.max_steps=40"]):
        again = run_train([f"train.output_dir={out}", *RUN, *more])
        assert again.stdout.strip().splitlines()[-1].startswith(
            f"[harness] {out} holds a finished run (step {steps}/20, stopped early: its evaluations stopped improving "
            f"(train.early_stopping)): final model "), again.stdout[-2000:]
    assert {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_a_patience_lowered_on_resume_stops_at_once_and_is_said(tmp_path):
    """Paused at step 4 (one evaluation without improvement, patience 2), resumed with patience 1: the patience is
    spent at the checkpoint, so the run stops there, step 4, without training a step, and says the change (failed
    before: it trained step 5, not a word)."""
    out = tmp_path / "run"
    run_train([f"train.output_dir={out}", *RUN, "train.stop_at_step=4"])
    lower = "train.early_stopping={metric: eval_loss, patience: 1, min_delta: 1.0}"
    proc = run_train([f"train.output_dir={out}", *RUN, lower])
    assert ("[harness] train.early_stopping changed since the checkpoint: patience 2 -> 1; applied from here (1 "
            "evaluation(s) without improvement so far, the patience is spent: the run stops now)") in proc.stdout
    rep = report(out)
    assert rep["stopped_by"] == "early_stopping" and rep["steps"] == 4, rep
    assert not (out / "checkpoints" / "step-5").exists()
