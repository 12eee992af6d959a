"""DeepSpeed ZeRO stages and exact resume, with two real CPU ranks (gloo).

One set of 2-process runs of the default recipe (16 steps, crossing an epoch boundary after step 14; conftest.py's
stage_run) serves several checks: equal losses under DDP and ZeRO-1/2/3, ZeRO-3's partitioned parameters, the ZeRO-3
export, the uninterrupted baselines for the resume tests, and the one-node references of tests/test_multinode.py.
The training data is a weighted mix of two sources (3:1: a subset of gen.jsonl and 2.75 passes over gen_eval.jsonl)
with 24 records held out by data.eval_split, so the mix and the split are shown to be the same on every process,
under every stage and on resume.
"""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from harness_launch import (FAST, STAGE_STEPS, STAGES, final_weights, max_abs_diff, metrics, rel_close, report,
                            run_train)

pytestmark = pytest.mark.slow


def test_first_ten_losses_equal_across_ddp_and_zero_stages(stage_run):
    ref = [r["loss"] for r in metrics(stage_run("ddp"))][:10]
    assert len(ref) == 10 and ref[-1] < ref[0]
    for name in ("zero1", "zero2", "zero3"):
        got = [r["loss"] for r in metrics(stage_run(name))][:10]
        bad = [(i + 1, a, b) for i, (a, b) in enumerate(zip(ref, got)) if not rel_close(a, b, 1e-4)]
        assert not bad, f"{name} differs from DDP at (step, ddp, {name}): {bad}"
        rep = report(stage_run(name))
        assert rep["world_size"] == 2 and rep["zero_stage"] == int(name[-1])
        start = report(stage_run("ddp"))["eval_at_start"]["eval_loss"]  # the same held-out records everywhere
        assert rel_close(rep["eval_at_start"]["eval_loss"], start, 1e-5), (name, rep["eval_at_start"], start)
    assert report(stage_run("ddp"))["zero_stage"] is None


def test_zero3_partitions_parameters_across_ranks(stage_run):
    rep = report(stage_run("zero3"))
    total, held = rep["parameters"], rep["parameters_per_rank"]
    assert len(held) == 2
    for h in held:
        assert 0.45 * total <= h <= 0.55 * total, (held, total)
    assert report(stage_run("zero2"))["parameters_per_rank"] == [total, total]


def test_zero3_export_reloads_and_matches_the_trained_weights(stage_run):
    """final/ under ZeRO-3 (weights gathered from both ranks) reloads with AutoModelForCausalLM and equals the
    DDP run's weights (the same training, unpartitioned)."""
    model = AutoModelForCausalLM.from_pretrained(stage_run("zero3") / "final")
    z3 = {k: v for k, v in model.state_dict().items()}
    exported = final_weights(stage_run("zero3"))
    assert max_abs_diff({k: z3[k] for k in exported}, exported) == 0.0
    assert max_abs_diff(exported, final_weights(stage_run("ddp"))) < 1e-4


@pytest.mark.parametrize("stage", ["ddp", "zero3"])
def test_stopped_and_resumed_run_ends_with_the_same_weights(stage, stage_run, tmp_path):
    """Stop after step 10 (checkpoint), resume with train.resume=auto: same final weights (<= 1e-6) and the same
    metrics for the steps after the resume (which cross the epoch boundary after step 14) and the same eval loss."""
    out = tmp_path / stage
    args = [f"train.output_dir={out}", *STAGE_STEPS, "train.save_every_steps=5"]
    first = run_train([*args, "train.stop_at_step=10"], nproc=2, accel=STAGES[stage])
    assert "stopped (stop_at_step) at step 10/16" in first.stdout
    assert not (out / "final").exists()
    second = run_train([*args, "train.resume=auto"], nproc=2, accel=STAGES[stage])
    assert "resumed from" in second.stdout and "step-10" in second.stdout
    assert report(out)["resumed_from"].endswith("step-10")

    diff = max_abs_diff(final_weights(out), final_weights(stage_run(stage)))
    assert diff <= 1e-6, f"{stage}: resumed weights differ from the uninterrupted run by {diff}"
    resumed = {r["step"]: r for r in metrics(out)}
    baseline = {r["step"]: r for r in metrics(stage_run(stage))}
    assert sorted(resumed) == sorted(baseline) == list(range(1, 17))
    for step in range(11, 17):
        for key in ("loss", "lr", "grad_norm", "epoch"):
            assert rel_close(resumed[step][key], baseline[step][key], 1e-6), (step, key, resumed[step], baseline[step])
    assert rel_close(report(out)["eval"]["eval_loss"], report(stage_run(stage))["eval"]["eval_loss"], 1e-6)


@pytest.mark.parametrize("launcher", ["python", "accelerate"])
def test_single_process_deepspeed(launcher, tmp_path):
    """ZeRO-2 with one process under plain `python -m harness.train` (no mpi4py) and under accelerate launch."""
    out = tmp_path / launcher
    args = [f"train.output_dir={out}", "train.max_steps=3", *FAST]
    if launcher == "python":
        proc = run_train([*args, "train.deepspeed=zero2"])
    else:
        proc = run_train(args, nproc=1, accel="zero2")
    assert "mpi4py" not in proc.stderr
    rep = report(out)
    assert rep["distributed_type"] == "DEEPSPEED" and rep["zero_stage"] == 2 and rep["world_size"] == 1
    assert (out / "final" / "model.safetensors").is_file()


def test_deepspeed_bf16_on_cpu_and_zero2_optimizer_offload(tmp_path):
    """bf16 under ZeRO-2 with 2 ranks trains DDP's model (train.weights=fp32: DeepSpeed's torch_autocast, which also
    reduces the Linear layers' gradients in bf16: measured 5e-5 of the loss over 8 steps); ZeRO-2 with the optimizer
    offloaded to the CPU (DeepSpeed CPU Adam)."""
    bf16, ddp = tmp_path / "bf16", tmp_path / "ddp-bf16"
    args = ["train.max_steps=4", "train.precision=bf16", *FAST]
    run_train([f"train.output_dir={bf16}", *args], nproc=2, accel="zero2")
    run_train([f"train.output_dir={ddp}", *args], nproc=2)
    rep = report(bf16)
    assert rep["precision"] == "bf16" and rep["world_size"] == 2 and rep["weights"] == "fp32"
    zero2, plain = [r["loss"] for r in metrics(bf16)], [r["loss"] for r in metrics(ddp)]
    assert len(zero2) == len(plain) == 4
    assert all(abs(a - b) <= 2e-4 * abs(b) for a, b in zip(zero2, plain)), (zero2, plain)
    off = tmp_path / "offload"
    run_train([f"train.output_dir={off}", "train.max_steps=3", "train.deepspeed=zero2_offload", *FAST], timeout=900)
    rep = report(off)
    assert rep["zero_stage"] == 2 and rep["offload_optimizer"] == "cpu"
    assert metrics(off)[-1]["loss"] < metrics(off)[0]["loss"]


def test_deepspeed_launcher_with_accelerate_use_cpu_is_refused_not_silent_ddp(tmp_path):
    """ACCELERATE_USE_CPU=1 with a DeepSpeed accelerate config would run plain DDP: one line, before any training."""
    out = tmp_path / "run"
    proc = run_train([f"train.output_dir={out}", "train.max_steps=3", *FAST], nproc=1, accel="zero2",
                     extra_env={"ACCELERATE_USE_CPU": "1"}, check=False)
    assert proc.returncode != 0
    assert ("harness: error: the accelerate config asks for DeepSpeed (ACCELERATE_USE_DEEPSPEED=true), but "
            "ACCELERATE_USE_CPU=1 turns DeepSpeed off (the run would be MULTI_CPU); launch DeepSpeed without it "
            "(DeepSpeed runs on CPU by itself)") in proc.stderr.splitlines()
    assert not (out / "config.yaml").exists() and not (out / ".lock").exists()
