"""Issue 17: a non-finite loss under DeepSpeed ZeRO-2/3 (2 CPU ranks) is caught before its backward pass and its
update is skipped exactly: the final weights equal those of a run that reads the same batches and never trains on
them (HARNESS_FAULT_DROP, harness/faults.py). The poison (HARNESS_FAULT_NAN) hits one process only, so the skip is
agreed across processes. Too many in a row, or a non-finite loss after accumulated micro-steps, stop the run with one
error line and a checkpoint of the last good state, which resumes to the same weights as the reference."""

from __future__ import annotations

import re

import pytest

from harness_launch import FAST, final_weights, max_abs_diff, run_train

pytestmark = pytest.mark.slow

STEPS = ["train.max_steps=6", "train.micro_batch_size=8", *FAST]
HARNESS_FRAME = re.compile(r'File ".*/harness/\w+\.py", line')  # a traceback through harness code
_references: dict = {}


def reference(tmp_path_factory, accel: str, args: list[str], drop: str):
    """The final weights of a run that trains on none of the batches of steps `drop` (cached per settings)."""
    key = (accel, tuple(args), drop)
    if key not in _references:
        out = tmp_path_factory.mktemp("reference")
        run_train([f"train.output_dir={out}", *STEPS, *args], nproc=2, accel=accel,
                  extra_env={"HARNESS_FAULT_DROP": drop})
        _references[key] = final_weights(out)
    return _references[key]


def errors(proc) -> list[str]:
    """The distinct error lines (each process prints the same one)."""
    return sorted({ln for ln in proc.stderr.splitlines() if ln.startswith("harness: error:")})


# Two of the four stage x precision pairs (each is two 2-process launches): every stage and every precision once. The
# default tier runs zero2-fp32, whose reference the max_nonfinite_skips test below shares; zero3-bf16 is in the
# extended tier (ZeRO-3's skip: the gradient-accumulation test; bf16's stop: the advice test).
@pytest.mark.parametrize("stage, precision", [("zero2", "fp32"), ("zero3", "bf16")])
def test_poisoned_step_is_skipped_exactly(stage, precision, tmp_path, tmp_path_factory):
    """Step 3 poisoned on process 1 only, step 4 on process 0 only: both skipped on both processes, counted in a row;
    the weights end where those of the reference that never trains on steps 3-4 end (the zero2 reference is the
    one of the next test too)."""
    out = tmp_path / "poisoned"
    args = [f"train.precision={precision}"]
    proc = run_train([f"train.output_dir={out}", *STEPS, *args], nproc=2, accel=stage,
                     extra_env={"HARNESS_FAULT_NAN": "3/1,4/0"})
    assert "step 3: gradient norm is not finite (nan); update skipped (1 in a row, at most 3)" in proc.stdout
    assert "step 4: gradient norm is not finite (nan); update skipped (2 in a row, at most 3)" in proc.stdout
    assert proc.stdout.count("not finite") == 2 and "already applied" not in proc.stdout
    diff = max_abs_diff(final_weights(out), reference(tmp_path_factory, stage, args, "3,4"))
    assert diff <= 1e-6, f"{stage}/{precision}: the skipped steps changed the weights by {diff}"


def test_too_many_in_a_row_stop_with_a_checkpoint_that_resumes(tmp_path, tmp_path_factory):
    """max_nonfinite_skips=1, steps 3 and 4 poisoned: one error line at step 4, checkpoint step-4 of the weights after
    step 2; the resumed run (no poison) ends where the reference that never trains on steps 3-4 ends."""
    out = tmp_path / "run"
    args = [f"train.output_dir={out}", *STEPS, "train.precision=fp32", "train.max_nonfinite_skips=1"]
    proc = run_train(args, nproc=2, accel="zero2", extra_env={"HARNESS_FAULT_NAN": "3,4"}, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = errors(proc)
    assert len(err) == 1 and "non-finite gradients in 2 steps in a row (train.max_nonfinite_skips=1)" in err[0], err
    assert f"the last good weights are in {out / 'checkpoints' / 'step-4'}" in err[0]
    assert not HARNESS_FRAME.search(proc.stderr), proc.stderr[-3000:]  # (the launcher's own traceback: exit 1)
    assert (out / "checkpoints" / "step-4" / "COMPLETE").is_file()
    resumed = run_train([*args, "train.resume=auto"], nproc=2, accel="zero2")
    assert "resumed from" in resumed.stdout and "step-4" in resumed.stdout
    diff = max_abs_diff(final_weights(out), reference(tmp_path_factory, "zero2", ["train.precision=fp32"], "3,4"))
    assert diff <= 1e-6, diff


def test_gradient_accumulation_skips_or_stops_with_a_checkpoint(tmp_path, tmp_path_factory):
    """grad_accum=2 under ZeRO-3: a poisoned first micro-step (step 2) is skipped in place; a poisoned second
    micro-step (step 4, process 1) comes after an accumulated backward pass, so the run stops without the update,
    with a checkpoint; resumed, it ends where the reference that never trains on steps 2 and 4 ends."""
    out = tmp_path / "run"
    acc = ["train.grad_accum=2"]
    args = [f"train.output_dir={out}", *STEPS, *acc]
    proc = run_train(args, nproc=2, accel="zero3", extra_env={"HARNESS_FAULT_NAN": "2.0,4.1/1"}, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "step 2: gradient norm is not finite (nan); update skipped (1 in a row" in proc.stdout
    err = errors(proc)
    assert len(err) == 1 and "non-finite loss at step 4 after its first micro-step" in err[0], err
    assert f"the last good weights are in {out / 'checkpoints' / 'step-4'}" in err[0]
    assert not HARNESS_FRAME.search(proc.stderr), proc.stderr[-3000:]
    resumed = run_train([*args, "train.resume=auto"], nproc=2, accel="zero3")
    assert "step-4" in resumed.stdout
    diff = max_abs_diff(final_weights(out), reference(tmp_path_factory, "zero3", acc, "2,4"))
    assert diff <= 1e-6, diff


def test_the_advice_names_a_precision_the_run_does_not_use(tmp_path):
    """One process, every step poisoned: the stop's one line never suggests the precision the run already has."""
    out = tmp_path / "run"
    proc = run_train([f"train.output_dir={out}", "train.max_steps=3", "train.max_nonfinite_skips=0",
                      "train.precision=bf16", *FAST], extra_env={"HARNESS_FAULT_NAN": "*"}, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].endswith(f"the last good weights are in {out}/checkpoints/step-1. "
                                                         "Lower optim.lr, check the data, or use train.precision="
                                                         "fp32"), proc.stderr[-2000:]
