"""The loop's pieces, in process: the named step sums through a checkpoint, the stop decision as a truth table, and
the cadences of evaluation, logging and checkpoints (the end-to-end runs are in test_train.py and test_zero.py)."""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from harness.checkpoint import resume, store
from harness.evaluation import Evaluator
from harness.observe.reporting import StepLog
from harness.state import LoopState, StepSums, UnloggedSums, gritlm_figures
from harness.stopping import (EARLY_STOPPING, NONFINITE, SIGNAL, STOP_AT_STEP, TIME_BUDGET, BestMetric, NonfiniteGuard,
                              StopFlags, stop_reason)


@pytest.fixture
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    acc = Accelerator(cpu=True)
    yield acc
    AcceleratorState._reset_state(reset_partial_state=True)


# ----------------------------------------------------------------------------------------------- step sums


def test_step_sums_add_up_by_name(accelerator):
    sums = UnloggedSums(accelerator.device)
    sums.add(StepSums(gen_sum=torch.tensor(6.0), gen_count=torch.tensor(3), tokens=torch.tensor(5), samples=2))
    sums.add(StepSums(gen_sum=torch.tensor(4.0), gen_count=2, tokens=4, wait_s=0.5))
    total = sums.total(accelerator, reset=False)
    assert (total.gen_sum, total.gen_count, total.tokens, total.samples, total.wait_s) == (10.0, 5.0, 9.0, 2.0, 0.5)
    assert sums.total(accelerator, reset=True) == total  # reset after reading
    assert sums.total(accelerator, reset=False) == StepSums(*[0.0] * len(StepSums.names()))


def test_unlogged_sums_round_trip_through_a_checkpoint(accelerator, tmp_path):
    """What was summed but not yet logged when a checkpoint was written is carried on by the resumed run."""
    sums = UnloggedSums(accelerator.device)
    sums.add(StepSums(gen_sum=7.25, gen_count=3, gen_micro=1, tokens=11, flops=1e9, wait_s=0.125))
    state = LoopState(step=4, streams={"gen": {"epoch": 1, "batches": 2}}, tokens=100, elapsed_s=3.0, first_loss=2.5)
    saved = state.to_save(1.5, sums.total(accelerator, reset=False))
    path = store.save_checkpoint(accelerator, tmp_path, saved, keep=0)
    loaded = LoopState.from_saved(resume.load_checkpoint(accelerator, path))
    assert (loaded.step, loaded.streams, loaded.tokens, loaded.first_loss) == (4, state.streams, 100, 2.5)
    assert loaded.elapsed_s == 4.5  # earlier attempts + this one
    carried = UnloggedSums(accelerator.device, loaded.unlogged).total(accelerator, reset=False)
    assert carried == sums.total(accelerator, reset=False)


def test_checkpoints_from_before_the_named_sums_still_resume(accelerator):
    """harness_state.json written before the sums had names holds them as `log_acc`, a list in StepSums order."""
    old = {"step": 10, "streams": {"gen": {"epoch": 0, "batches": 10}}, "tokens": 5771, "elapsed_s": 2.0,
           "log_acc": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0], "first_loss": 7.0}
    state = LoopState.from_saved(json.loads(json.dumps(old)))
    assert state.step == 10 and state.unlogged["gen_sum"] == 1.0 and state.unlogged["wait_s"] == 11.0
    assert asdict(UnloggedSums(accelerator.device, state.unlogged).total(accelerator, reset=False)) == \
        {**dict.fromkeys(StepSums.names(), 0.0), **dict(zip(StepSums.names(), old["log_acc"]))}  # later sums: 0


def test_losses_from_sums_token_and_mixed_averaging_and_unified():
    cfg = lambda avg: SimpleNamespace(gen_averaging=avg, gen_weight=1.0, emb_weight=0.5)  # noqa: E731
    s = StepSums(gen_sum=12.0, gen_count=4.0, gen_mean_sum=5.0, gen_micro=2.0, emb_sum=3.0, emb_count=2.0)
    assert gritlm_figures(StepSums(gen_sum=12.0, gen_count=4.0, gen_mean_sum=5.0, gen_micro=2.0),
                          cfg("token"), False) == {"loss": 3.0}
    assert gritlm_figures(StepSums(gen_sum=12.0, gen_count=4.0, gen_mean_sum=5.0, gen_micro=2.0),
                          cfg("mixed"), False) == {"loss": 2.5}
    assert gritlm_figures(StepSums(emb_sum=3.0, emb_count=2.0), cfg("token"), False) == {"loss": 1.5}
    assert gritlm_figures(s, cfg("token"), True) == {"loss": 3.0 + 0.5 * 1.5, "loss_gen": 3.0, "loss_emb": 1.5}


# ----------------------------------------------------------------------------------------------- stopping


@pytest.mark.parametrize("signal,window,nonfinite,step", list(itertools.product([False, True], [False, True],
                                                                                  [False, True], [5, 10, 20])))
def test_stop_decision_truth_table(signal, window, nonfinite, step):
    """Non-finite beats a signal beats the window beats stop_at_step; the planned last step is no early stop."""
    flags = StopFlags(signal=signal, save_due=True, window_closing=window)
    expected = (NONFINITE if nonfinite else SIGNAL if signal else TIME_BUDGET if window
                else STOP_AT_STEP if step == 10 else None)
    assert stop_reason(flags, step, stop_at=10, total_steps=20, nonfinite=nonfinite) == expected


@pytest.mark.parametrize("signal,nonfinite", list(itertools.product([False, True], [False, True])))
def test_spent_patience_beats_a_signal_not_a_nonfinite_step(signal, nonfinite):
    """train.early_stopping: the run is finished; a pause saved with the patience spent would train one step more."""
    flags = StopFlags(signal=signal)
    expected = NONFINITE if nonfinite else EARLY_STOPPING
    assert stop_reason(flags, 5, stop_at=5, total_steps=20, nonfinite=nonfinite, patience_spent=True) == expected


def test_best_metric_counts_evaluations_without_improvement():
    """Lower is better for a loss, higher for recall; an improvement beats the best by more than min_delta; the
    step-0 baseline and a missing or non-finite value are not evaluations; the state goes through a checkpoint."""
    loss = BestMetric("eval_loss", higher=False, patience=2, min_delta=0.1, saved=None)
    assert loss.observe(0, {"eval_loss": 1.0}) is False and loss.value is None  # the baseline
    assert loss.observe(2, {"eval_loss": 5.0}) and (loss.value, loss.step, loss.bad) == (5.0, 2, 0)
    assert not loss.observe(4, {"eval_loss": 4.95}) and loss.bad == 1  # better, but by less than min_delta
    assert not loss.observe(5, {"eval_loss": float("nan")}) and loss.bad == 1
    saved = json.loads(json.dumps(loss.state()))  # harness_state.json
    again = BestMetric("eval_loss", higher=False, patience=2, min_delta=0.1, saved=saved)
    assert loss.observe(6, {"eval_loss": 4.7}) and again.observe(6, {"eval_loss": 4.7})  # 0.3 better: the best
    for m in (loss, again):
        assert not m.observe(8, {"eval_loss": 4.8}) and not m.spent
        assert not m.observe(10, {"eval_loss": 4.65}) and m.spent and (m.step, m.bad) == (6, 2)
    recall = BestMetric("eval_recall_at_1", higher=True, patience=1, min_delta=0.0, saved={"metric": "eval_loss",
                                                                                        "value": 1.0, "step": 3})
    assert recall.value is None  # another metric's saved state is not this one's
    assert recall.observe(1, {"eval_recall_at_1": 0.5}) and not recall.observe(2, {"eval_recall_at_1": 0.5})
    assert recall.spent
    never = BestMetric("eval_loss", higher=False, patience=0, min_delta=0.0)  # keep_best alone: ranks, never stops
    for step in range(1, 6):
        never.observe(step, {"eval_loss": 1.0})
    assert never.bad == 4 and not never.spent


def test_keep_best_checkpoints_a_new_best_and_rotation_keeps_it(tmp_path):
    best = BestMetric("eval_loss", higher=False, patience=0, min_delta=0.0)
    ckpt = store.Checkpointer(None, tmp_path, every_steps=0, every_minutes=0, keep=1, say=print, on_saved=print,
                              best=best, export_best=lambda: tmp_path / "best")
    best.observe(2, {"eval_loss": 3.0})
    assert ckpt.due(2, forced=False) and not ckpt.due(3, forced=False)
    assert ckpt.kept() == tmp_path / "checkpoints" / "step-2"
    plain = store.Checkpointer(None, tmp_path, every_steps=0, every_minutes=0, keep=1, say=print, on_saved=print,
                               best=best)  # early stopping without keep_best: no checkpoint of its own
    assert not plain.due(2, forced=False) and plain.kept() is None


def test_a_new_bests_export_is_left_out_of_the_training_clock(tmp_path):
    """train.keep_best: the checkpoint of a new best evaluation is exported to best/ (save_pretrained: a minute for a
    7B model); that time goes to the save, which the training clock leaves out (`on_saved`). It counted as training
    before: the log interval's tokens/s after a new best fell (1/6 in a grpo-tiny run), and the report's step times
    that `harness plan` calibrates from grew."""
    import time

    best = BestMetric("eval_loss", higher=False, patience=0, min_delta=0.0)
    saved = []

    def export():  # as export_model: the folder written, then returned (the Checkpointer records its step in it)
        time.sleep(0.2)
        (tmp_path / "best").mkdir(exist_ok=True)
        return tmp_path / "best"

    ckpt = store.Checkpointer(None, tmp_path, every_steps=0, every_minutes=0, keep=1, say=print,
                              on_saved=saved.append, best=best, export_best=export)
    ckpt.write = lambda loop_state: ckpt.folder(loop_state["step"])  # the collective write: tests/test_checkpoint.py
    best.observe(2, {"eval_loss": 3.0})
    ckpt.save({"step": 2})
    assert len(saved) == 1 and saved[0] >= 0.2, saved  # one save: the checkpoint and the export
    ckpt.save({"step": 3})  # not a new best: the checkpoint alone
    assert len(saved) == 2, saved


def test_stop_at_step_equal_to_the_planned_end_is_no_early_stop():
    assert stop_reason(StopFlags(), 20, stop_at=20, total_steps=20, nonfinite=False) is None


def test_nonfinite_guard_skips_then_stops():
    said = []
    guard = NonfiniteGuard(max_skips=2, is_deepspeed=False, say=said.append)
    norms = [1.0, float("nan"), float("inf"), 0.5, float("nan"), float("nan"), float("nan")]
    assert [guard.must_stop(i + 1, torch.tensor(n), skipped=n != n or n == float("inf"))
            for i, n in enumerate(norms)] == [False, False, False, False, False, False, True]
    assert guard.in_a_row == 3 and "update skipped (3 in a row, at most 2)" in said[-1] and not guard.applied
    ds = NonfiniteGuard(max_skips=5, is_deepspeed=True, say=said.append)
    assert ds.must_stop(1, None, skipped=False) is False
    assert ds.must_stop(2, float("nan"), skipped=True) is False  # DeepSpeed: the loss check ran no backward pass
    assert ds.must_stop(3, torch.tensor(float("nan")), skipped=False) is True and ds.applied
    assert said[-1].endswith("DeepSpeed already applied it")
    stranded = NonfiniteGuard(max_skips=5, is_deepspeed=True, say=said.append)
    assert stranded.must_stop(4, float("nan"), skipped=True, stranded=True) is True
    assert stranded.stranded and not stranded.applied and "the run stops here" in said[-1]


class _FakeAccelerator:
    """accelerate's Accelerator as LossCheck sees it under DeepSpeed: backward passes recorded, reduce an identity
    that counts the collectives, sync_gradients set by the test."""

    process_index, device, sync_gradients = 0, torch.device("cpu"), False

    def __init__(self):
        self.passes, self.reduces = [], 0

    def backward(self, loss):
        self.passes.append(float(loss))

    def reduce(self, tensor, op):
        self.reduces += 1
        return tensor


@pytest.mark.parametrize("losses, skipped, stranded, passes, reduces", [
    ([1.0, 2.0, 3.0], False, False, [1.0, 2.0, 3.0], 2),
    ([float("nan"), 2.0, 3.0], True, False, [], 1),  # caught before the first backward pass: none at all
    ([1.0, float("inf"), 3.0], True, True, [1.0, float("inf")], 2),  # caught before the engine's pass
    ([1.0, 2.0, float("nan")], True, True, [1.0, 2.0], 2),
])
def test_loss_check_before_the_first_and_the_last_backward_pass(losses, skipped, stranded, passes, reduces):
    """Under DeepSpeed: the flag is agreed (one reduce) before the step's first backward pass and before the one on
    the accumulation boundary (where the engine steps); a non-finite loss then means no (further) backward pass."""
    from harness.objective import LossCheck

    acc = _FakeAccelerator()
    check = LossCheck(acc, before_backward=True)
    check.new_step(1)
    for i, loss in enumerate(losses):
        acc.sync_gradients = i == len(losses) - 1
        check.backward(torch.tensor(loss))
    assert (check.skipped, check.stranded) == (skipped, stranded)
    assert acc.passes == passes and acc.reduces == reduces


# ----------------------------------------------------------------------------------------------- cadences


def due_steps(obj, total: int) -> list[int]:
    return [s for s in range(1, total + 1) if obj.due(s)]


def test_evaluation_log_and_checkpoint_cadences_are_independent():
    """train.max_steps=8, log_every=2, eval_every=3, save_every_steps=3: each on its own steps."""
    job = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(log_every=2, eval_every=3, emb_micro_batch_size=1,
                                                                    eval_prompts=[])), total_steps=8)
    evaluator = Evaluator(job, on_done=print, on_samples=print)
    log = StepLog(job, logger=None, bar=None, budget=None, start_step=0)
    ckpt = store.Checkpointer(None, None, every_steps=3, every_minutes=0, keep=0, say=print, on_saved=print)
    assert due_steps(evaluator, 8) == [3, 6]  # the last step's evaluation is the final one, after the loop
    assert due_steps(log, 8) == [2, 4, 6, 8]
    assert [s for s in range(1, 9) if ckpt.due(s, forced=False)] == [3, 6]
    assert ckpt.due(7, forced=True)  # a stop or save_every_minutes forces one
    seven = StepLog(SimpleNamespace(cfg=job.cfg, total_steps=7), logger=None, bar=None, budget=None, start_step=0)
    assert due_steps(seven, 7) == [2, 4, 6, 7]  # and always at the last step
    job.cfg.train.eval_every = 0
    never = Evaluator(job, on_done=print, on_samples=print)
    assert due_steps(never, 8) == []
    job.cfg.train.eval_every = 3
    ranked = Evaluator(job, on_done=print, on_samples=print, best=BestMetric("eval_loss", False, 2, 0.0))
    assert due_steps(ranked, 8) == [3, 6, 8]  # ranked: the last step's evaluation is the loop's (its checkpoint's)


def test_time_based_checkpoint_is_due_after_its_minutes(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(store.time, "time", lambda: clock[0])
    ckpt = store.Checkpointer(None, None, every_steps=0, every_minutes=2, keep=0, say=print, on_saved=print)
    clock[0] += 119
    assert not ckpt.minutes_due()
    clock[0] += 1
    assert ckpt.minutes_due()
    off = store.Checkpointer(None, None, every_steps=0, every_minutes=0, keep=0, say=print, on_saved=print)
    clock[0] += 1e6
    assert not off.minutes_due()


# ----------------------------------------------------------------------------------------------- the one exit path


def _open_files_under(folder) -> list[str]:
    import os

    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder)):
            out.append(target)
    return out


@pytest.mark.parametrize("how", ["step raises", "stop_at_step"])
def test_the_run_closes_what_it_opened_however_it_ends(tmp_path, monkeypatch, how):
    """A step that raises and an early stop both leave no signal handler, sampler thread, open metrics file or open
    tracker behind (the one ExitStack in train.run)."""
    import signal
    import threading

    from accelerate.state import AcceleratorState

    from harness import train
    from harness.config import load_config
    from harness_launch import DEFAULT

    out = tmp_path / "run"
    cfg = load_config(DEFAULT, [f"train.output_dir={out}", "train.max_steps=6", "train.progress_bar=false",
                                "train.summary=false", "data.eval_files=[]", "train.monitor_interval_s=0.05",
                                "train.report_to=[tensorboard]", "train.log_every=1"]
                      + (["train.stop_at_step=2"] if how == "stop_at_step" else []))
    if how == "step raises":
        real, calls = train.train_step, []

        def failing_step(*args):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("boom in step 2")
            return real(*args)

        monkeypatch.setattr(train, "train_step", failing_step)
    handler_before = signal.getsignal(signal.SIGTERM)
    try:
        if how == "step raises":
            with pytest.raises(RuntimeError, match="boom in step 2"):
                train.run(cfg)
        else:
            assert train.run(cfg) == {"steps": 2, "stopped_early": "stop_at_step"}
        assert signal.getsignal(signal.SIGTERM) is handler_before
        assert not [t for t in threading.enumerate() if t.name == "harness-utilisation" and t.is_alive()]
        assert _open_files_under(out) == []  # metrics.jsonl and the tensorboard event file are closed
        assert (out / "metrics.jsonl").read_text().count('"loss"') == (1 if how == "step raises" else 2)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_the_end_of_run_lines_say_what_they_mean():
    """A plan line says which way the estimate was off (`+3.8%` read as a slower run); a run that logged one loss
    says it once (`loss 7.0288 -> 7.0288` for a 5-step run)."""
    from harness.observe.reporting import loss_change, plan_line

    assert plan_line({"estimated_s": 132.7, "actual_s": 127.9, "error_pct": 3.75}) == (
        "plan: estimated 132.7s of training, actual 127.9s (the estimate 3.8% over)")
    assert plan_line({"estimated_s": 100.0, "actual_s": 110.0, "error_pct": -9.09}).endswith("(the estimate 9.1% under)")
    assert plan_line({"estimated_s": 100.0, "actual_s": 100.0, "error_pct": 0.0}).endswith("(as estimated)")
    assert loss_change(7.0288, 7.0288) == "loss 7.0288" and loss_change(6.3712, 0.9) == "loss 6.3712 -> 0.9000"
    assert loss_change(None, None) == "loss nan"
