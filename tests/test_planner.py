"""harness.tools.planner: the plan's arithmetic on fixed inputs (hand-computed), and `harness plan` for real.

    .venv/bin/python -m pytest tests/test_planner.py -m "not slow"     # the arithmetic only
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from harness.config import load_config
from harness.data import loaders
from harness.observe import timing
from harness.tools import planner
from harness.tools import plan_arithmetic
from harness.tools.plan_arithmetic import Calibration

CAL = Calibration(s_per_step=0.5, warmup_extra_s=3.0, startup_s=12.0, eval_s=4.0, save_s=2.0, export_s=1.5,
                  optimizer_s_per_step=0.1, world_size=1, source="fixed")


def cfg_of(*overrides: str):
    return load_config("configs/default.yaml", list(overrides))


def gen_data(items: int = 400, samples: int = 400, lengths=None) -> dict:
    lengths = lengths or [40] * samples
    return {"primary": "generative", "generative": {
        "samples": samples, "tokens": sum(lengths), "max_len": 128, "p50_len": 40, "p95_len": 40, "longest": max(lengths),
        "truncated_samples": 0, "truncated_tokens": 0, "items": items, "packing": False, "full_lengths": lengths}}


def test_schedule_matches_the_loop():
    # 400 samples, micro-batch 16, 1 process: 25 micro-batches, accumulation 2 -> 12 steps per epoch, 1.5 epochs -> 19
    assert loaders.schedule_steps(400, 16, 1, 2, -1, 1.5) == {"micro_per_epoch": 25, "steps_per_epoch": 12,
                                                              "total_steps": 19}
    # 2 processes: ceil(25 / 2) = 13 micro-batches each
    assert loaders.schedule_steps(400, 16, 2, 1, -1, 1.0)["total_steps"] == 13
    assert loaders.schedule_steps(400, 16, 2, 1, 50, 1.0)["total_steps"] == 50  # max_steps wins


def test_counts():
    assert plan_arithmetic.count_evals(150, 0, True, True) == 2  # step 0 and the end
    assert plan_arithmetic.count_evals(150, 50, True, True) == 4  # 0, 50, 100, 150 (the last is the final one)
    assert plan_arithmetic.count_evals(151, 50, False, True) == 4  # 50, 100, 150, 151
    assert plan_arithmetic.count_evals(150, 50, True, False) == 0
    assert plan_arithmetic.count_saves(100, 30, 0.0, 0.0) == 4  # 30, 60, 90 and the last step's
    assert plan_arithmetic.count_saves(90, 30, 0.0, 0.0) == 3  # 30, 60, 90: the last one on the schedule
    assert plan_arithmetic.count_saves(100, 0, 600.0, 4.0) == 3  # every 4 minutes of 10, and the last step's


def test_estimate_adds_the_phases():
    e = plan_arithmetic.estimate(100, CAL, evals=2, save_every_steps=30)  # 4 checkpoints: 30, 60, 90, 100
    assert e["train_s"] == pytest.approx(50.0)
    assert e["total_s"] == pytest.approx(12 + 3 + 50 + 8 + 8 + 1.5)
    # twice the compute per step, same optimizer cost: 0.4 * 2 + 0.1
    assert plan_arithmetic.estimate(10, CAL, 0, 0, work_ratio=2.0)["s_per_step"] == pytest.approx(0.9)


def test_plan_fits_with_hand_computed_total():
    cfg = cfg_of("train.epochs=2", "train.micro_batch_size=16")  # 25 steps per epoch -> 50 steps
    plan = planner.make_plan(cfg, gen_data(), CAL, hours=1.0, margin_min=30, flop_dims=(1000, 2, 64))
    # start-up 12 + warm-up 3 + 50 x 0.5 + 2 evaluations x 4 (step 0 and the end) + the last step's checkpoint 2
    # + export 1.5 = 51.5 s
    assert plan["estimate"]["steps"] == 50
    assert plan["estimated_s"] == pytest.approx(51.5)
    assert plan["window_s"] == 1800 and plan["fits"] and plan["adjustments"] == []
    assert any("fits" in line for line in plan["derivations"])


def test_plan_too_small_proposes_adjustments_that_fit():
    lengths = [20] * 300 + [120] * 100  # skewed: unpacked batches are padded to their longest sample
    cfg = cfg_of("train.epochs=4", "train.micro_batch_size=16")  # 100 steps -> 12+3+50+8+2+1.5 = 76.5 s
    window_h = (60 + 60) / 3600  # 120 s window, 60 s margin -> 60 s
    plan = planner.make_plan(cfg, gen_data(lengths=lengths), CAL, hours=window_h, margin_min=1.0, flop_dims=(10**6, 2, 64))
    assert plan["estimated_s"] == pytest.approx(76.5) and not plan["fits"]
    kinds = {next(iter(a["overrides"])): a for a in plan["adjustments"]}
    epochs = kinds["train.epochs"]
    # fixed 26.5 s; 60 - 26.5 = 33.5 s of steps -> 67 steps -> 2.68 epochs of 25 steps (ceil(2.68 * 25) = 67)
    assert epochs["overrides"]["train.epochs"] == pytest.approx(2.68) and epochs["fits"]
    assert epochs["estimate"]["steps"] == 67 and epochs["estimate"]["total_s"] <= 60
    # packing removes the padding: the same tokens in fewer, full rows
    assert kinds["train.profile"]["overrides"] == {"train.profile": "balanced", "data.packing": True}
    assert kinds["train.profile"]["estimate"]["total_s"] < plan["estimated_s"]
    # a shorter max_len cuts the 120-token samples
    assert kinds["data.max_len"]["overrides"]["data.max_len"] < 128
    # more accumulation saves optimizer steps: 50 steps instead of 100 save 50 x 0.1 s
    acc = kinds["train.grad_accum"]
    assert acc["overrides"] == {"train.grad_accum": 2}
    assert plan["estimated_s"] - acc["estimate"]["total_s"] == pytest.approx(5.0)
    for a in plan["adjustments"]:
        assert a["reason"]


def test_epoch_work_padding_and_packing():
    flop = (100, 1, 8)
    lengths = [10, 30, 10, 30]
    padded = plan_arithmetic.epoch_work(lengths, 64, False, 2, 0, flop)
    assert padded["tokens"] == 80 and padded["positions"] >= 80
    packed = plan_arithmetic.epoch_work(lengths, 64, True, 2, 0, flop)
    assert packed["items"] == 2 and packed["positions"] == 128  # 30+30 and 10+10 in rows of 64
    assert plan_arithmetic.epoch_work(lengths, 16, True, 2, 0, flop)["tokens"] == 52  # 30 -> 16 twice


def test_budget_tracker_and_plan_accuracy(tmp_path):
    b = timing.BudgetTracker(t_process=1000.0, hours=1.0, reserve_s=60)
    st = b.status(steps_done=10, steps_left=90, loop_s=100.0, now=1200.0)
    assert st == {"budget_elapsed_s": 200.0, "budget_remaining_s": 3400.0, "eta_s": 900.0, "on_track": 1}
    assert b.status(10, 400, 100.0, now=1200.0)["on_track"] == 0  # 4000 s left to run, 3400 s in the window
    assert "NOT on track" in b.describe(b.status(10, 400, 100.0, now=1200.0))
    cfg = cfg_of()
    (tmp_path / "plan.json").write_text(json.dumps({"estimated_s": 110.0, "fingerprint": timing.config_fingerprint(cfg),
                                                    "estimate": {"train_s": 90.0}}))
    acc = timing.plan_vs_actual(tmp_path / "plan.json", timing.config_fingerprint(cfg), 100.0)
    assert acc["error_pct"] == pytest.approx(10.0) and acc["accuracy"] == pytest.approx(0.9) and acc["same_config"]
    assert timing.plan_vs_actual(tmp_path / "none.json", timing.config_fingerprint(cfg), 100.0) is None


def test_steady_rate_from_records():
    recs = [{"step": s, "loss": 1.0, "elapsed_s": e} for s, e in [(5, 8.0), (10, 10.0), (25, 16.0)]]
    s, extra = planner.steady_rate(recs, 5)
    assert s == pytest.approx(0.4) and extra == pytest.approx(6.0)


def test_timings_split_warmup_and_steady():
    t = timing.Timings(eval_s=2.0, save_s=1.0, warmup_done_s=5.0)
    t.loop(25.0, steps=25)  # 25 s of steps: the first 5 took 5 s, the next 20 took 20 s
    assert t.steady_s_per_step == pytest.approx(1.0) and t.warmup_extra_s == pytest.approx(0.0)
    t = timing.Timings(eval_s=3.0)  # a step-0 evaluation of 3 s, before the loop's clock
    t.loop_started(time.time() - 10.0)
    assert t.startup_s == pytest.approx(7.0, abs=0.1)


def test_the_training_clock_leaves_evaluations_and_saves_out(monkeypatch):
    """One clock (metrics.Throughput): what is excluded leaves both the log interval and the training time."""
    from harness.observe import metrics

    now = [100.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    meter = metrics.Throughput()
    now[0] += 7.0
    meter.exclude(2.0)  # an evaluation inside the first 7 s
    assert meter.trained() == pytest.approx(5.0) and meter.interval() == pytest.approx(5.0)
    now[0] += 4.0
    meter.exclude(1.0)  # a checkpoint
    assert meter.interval() == pytest.approx(3.0)
    assert meter.trained() == pytest.approx(8.0) and meter.elapsed() == pytest.approx(11.0)


@pytest.mark.slow
@pytest.mark.usefixtures("all_cpus")  # its plan measures throughput, its train is timed against it
def test_plan_then_train_records_accuracy(tmp_path, repo_root):
    """A real calibration, a real run of the planned config, and report.json's estimate against actual; then a
    window too small: the plan says so and its first adjustment fits when re-planned from the same measurements."""
    out = tmp_path / "run"
    args = ["configs/default.yaml", "train.epochs=2", f"train.output_dir={out}", "train.report_to=[]",
            "train.progress_bar=false"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    plan = subprocess.run([sys.executable, "-m", "harness.cli", "plan", *args, "--hours", "1", "--steps", "10"],
                          cwd=repo_root, capture_output=True, text=True, env=env, timeout=600)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert " 5. window: 1 h - 30 min margin" in plan.stdout and "fits" in plan.stdout
    est = json.loads((out / "plan.json").read_text())
    assert est["schedule"]["total_steps"] == 50 and est["estimate"]["steps"] == 50
    train = subprocess.run([sys.executable, "-m", "harness.train", "--config", *args], cwd=repo_root,
                           capture_output=True, text=True, env=env, timeout=600)
    assert train.returncode == 0, train.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["plan"]["estimated_s"] == pytest.approx(est["estimated_s"]) and rep["plan"]["same_config"]
    assert rep["plan"]["actual_s"] == pytest.approx(rep["timings"]["process_wall_s"])
    actual = rep["plan"]["actual_s"]  # the accuracy itself is a timing (docs/benchmarks.md), not asserted here
    assert rep["plan"]["error_pct"] == pytest.approx(100 * (est["estimated_s"] - actual) / actual)

    # a window with room for half of the training steps: told so; the first fitting adjustment (fewer epochs) fits
    # again when re-planned from the same measurements
    hours = (rep["plan"]["actual_s"] - rep["timings"]["steady_s_per_step"] * 25) / 3600
    small = subprocess.run([sys.executable, "-m", "harness.cli", "plan", *args, "--hours", f"{hours:.6f}",
                            "--margin-minutes", "0", "--from-report", str(out / "report.json"),
                            "--out", str(tmp_path / "small.json")],
                           cwd=repo_root, capture_output=True, text=True, env=env, timeout=600)
    assert small.returncode == 0, small.stderr[-3000:]
    assert "does NOT fit" in small.stdout
    p = json.loads((tmp_path / "small.json").read_text())
    first = next(a for a in p["adjustments"] if a["fits"])
    assert first["overrides"] == {"train.epochs": pytest.approx(first["overrides"]["train.epochs"])}
    assert 0.5 < first["overrides"]["train.epochs"] < 2
    again = subprocess.run([sys.executable, "-m", "harness.cli", "plan", *args,
                            *[f"{k}={v}" for k, v in first["overrides"].items()], "--hours", f"{hours:.6f}",
                            "--margin-minutes", "0", "--from-report", str(out / "report.json"),
                            "--out", str(tmp_path / "again.json")],
                           cwd=repo_root, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0 and json.loads((tmp_path / "again.json").read_text())["fits"], again.stdout
    # without --out, the plan goes into the finished run's folder: said, with what a train there would do
    into = subprocess.run([sys.executable, "-m", "harness.cli", "plan", *args, "--hours", "1", "--from-report",
                           str(out / "report.json")], cwd=repo_root, capture_output=True, text=True, env=env, timeout=600)
    assert into.returncode == 0, into.stderr[-3000:]
    assert f"[plan] {out} holds a finished run: plan.json is written beside its report" in into.stdout


def test_largest_fitting_bisection():
    assert plan_arithmetic.largest_fitting(1, 100, lambda x: x * 2.0, 71.0) == 35
    assert plan_arithmetic.largest_fitting(1, 100, lambda x: x, 1000.0) == 100
    assert plan_arithmetic.largest_fitting(5, 100, lambda x: x, 4.0) is None


def test_plan_prices_the_estimate_and_each_adjustment():
    cfg = cfg_of("train.epochs=4", "train.micro_batch_size=16", "train.price_per_hour=3.6", "train.price_unit=machine")
    plan = planner.make_plan(cfg, gen_data(), CAL, hours=(60 + 60) / 3600, margin_min=1.0, flop_dims=(1000, 2, 64))
    assert plan["estimate"]["cost"] == pytest.approx(76.5 / 3600 * 3.6)  # 0.0765
    assert "cost: 0.021 h x 3.6 per machine per hour = 0.0765" in plan["derivations"]
    for a in plan["adjustments"]:
        assert a["estimate"]["cost"] == pytest.approx(a["estimate"]["total_s"] / 3600 * 3.6)


def test_a_run_with_an_adjustment_is_compared_with_that_adjustment(tmp_path):
    cfg = cfg_of("train.epochs=2")
    plan = {"estimated_s": 300.0, "fingerprint": "other", "estimate": {"total_s": 300.0},
            "adjustments": [{"overrides": {"train.epochs": 2}, "fingerprint": timing.config_fingerprint(cfg),
                             "estimate": {"total_s": 100.0, "train_s": 90.0}}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    acc = timing.plan_vs_actual(tmp_path / "plan.json", timing.config_fingerprint(cfg), 105.0)
    assert acc["estimated_s"] == 100.0 and acc["estimate_of"] == "adjustment train.epochs=2" and acc["same_config"]
    assert acc["error_pct"] == pytest.approx(-100 * 5 / 105)


def test_preference_data_counts_both_sequences_of_a_pair(tmp_path):
    """loss.mode=preference: the plan's data are pairs (the schedule's items, micro_batch_size pairs per micro-batch)
    and its tokens are those of both sequences, chosen and rejected, as the run tokenizes them."""
    from harness.data import chat, pairs
    from harness.model import load_run_tokenizer

    cfg = load_config("configs/dpo-tiny.yaml", [f"train.output_dir={tmp_path}", "train.max_steps=-1",
                                                "train.epochs=2"])
    data = planner.analyse_data(cfg)
    pref = data["preference"]
    assert data["primary"] == "preference" and pref["pairs"] == pref["items"] == 192 and pref["sequences"] == 384
    tok = load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
    rows, _ = loaders.training_rows(cfg.data, cfg.train.seed, "preference")
    ds, _ = pairs.tokenize_pair_dataset(rows, tok, 96, chat.resolve_template(tok, cfg.data.chat_template))
    both = sum(len(c) for c in ds["chosen_ids"]) + sum(len(r) for r in ds["rejected_ids"])
    assert pref["tokens"] == both > sum(ds["length"])  # more than the longer side of each pair
    plan = planner.make_plan(cfg, data, CAL, hours=1.0, margin_min=30, flop_dims=None)
    # 192 pairs / 8 per micro-batch = 24 micro-batches an epoch, 2 epochs: 48 steps
    assert plan["schedule"]["steps_per_epoch"] == 24 and plan["estimate"]["steps"] == 48
    assert any(line.startswith("data: 192 preference pairs = 384 sequences") for line in plan["derivations"])
