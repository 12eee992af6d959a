"""Two nodes on localhost (issue 17): two launchers with --num_machines 2, one CPU process each, train exactly as
two processes on one node do (DDP and DeepSpeed ZeRO-3, gloo), and a checkpoint written that way resumes to the
same final weights. Then launch/train.sh with NUM_NODES=2 (NUM_GPUS=1 makes it launch one process per node; with no
GPU the processes run on the CPU: ACCELERATE_USE_CPU=1 for DDP, DeepSpeed's CPU accelerator for ZeRO-3)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness_launch import (DEFAULT, FAST, MIX, ROOT, STAGES, final_weights, free_port, max_abs_diff, metrics,
                            rel_close, report)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("all_cpus")]  # own launchers: conftest.py

STEPS = ["train.max_steps=6", "train.micro_batch_size=16", *FAST, *MIX]  # tests/test_zero.py's settings, 6 steps


def _env(stage: str, **extra) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "CUDA_VISIBLE_DEVICES": "", **extra}
    env.pop("ACCELERATE_USE_CPU", None)
    if stage == "ddp":
        env["ACCELERATE_USE_CPU"] = "1"  # DDP on CPU; DeepSpeed must not see it (it would turn DeepSpeed off)
    return env


def two_nodes(commands: list[list[str]], envs: list[dict], timeout: int = 600) -> list[str]:
    """Run one command per node at once; both must exit 0. Returns their outputs."""
    procs = [subprocess.Popen(c, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c, e in zip(commands, envs)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-6000:]
    return outs


def accelerate_two_nodes(stage: str, overrides: list[str]) -> list[str]:
    port = free_port()
    cmds = []
    for rank in (0, 1):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "accelerate_configs" / f"{STAGES[stage]}.yaml"), "--num_machines", "2", "--machine_rank",
               str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--num_processes", "2"]
        if stage != "ddp":
            cmd += ["--deepspeed_multinode_launcher", "standard"]  # torch's launcher, not pdsh
        cmds.append(cmd + [str(ROOT / "harness" / "train.py"), "--config", DEFAULT, *overrides])
    return two_nodes(cmds, [_env(stage), _env(stage)])


def assert_ran_as(run, stage: str) -> None:
    rep = report(run)
    assert rep["world_size"] == 2 and rep["zero_stage"] == (3 if stage == "zero3" else None), rep


def assert_same_losses(run, reference) -> None:
    """The 6 losses of `run` against the first 6 of the reference: 2 processes on one node, tests/test_zero.py's
    16-step run of the stage (conftest.py's stage_run; steps 1-10 are the warm-up, whose learning rates do not depend
    on train.max_steps)."""
    got, ref = [r["loss"] for r in metrics(run)], [r["loss"] for r in metrics(reference)][:6]
    assert len(got) == len(ref) == 6, (got, ref)
    bad = [(i + 1, a, b) for i, (a, b) in enumerate(zip(got, ref)) if not rel_close(a, b, 1e-5)]
    assert not bad, f"(step, two nodes, one node): {bad}"


@pytest.mark.parametrize("stage", ["ddp", "zero3"])
def test_two_launchers_equal_one_node_and_resume(stage, stage_run, tmp_path):
    full, parts = tmp_path / "full", tmp_path / "parts"
    accelerate_two_nodes(stage, [f"train.output_dir={full}", *STEPS])
    assert_ran_as(full, stage)
    assert_same_losses(full, stage_run(stage))
    first = accelerate_two_nodes(stage, [f"train.output_dir={parts}", *STEPS, "train.stop_at_step=3"])
    assert "stopped (stop_at_step) at step 3/6" in first[0], first[0][-3000:]
    second = accelerate_two_nodes(stage, [f"train.output_dir={parts}", *STEPS, "train.resume=auto"])
    assert "resumed from" in second[0] and "step-3" in second[0], second[0][-3000:]
    diff = max_abs_diff(final_weights(parts), final_weights(full))
    assert diff <= 1e-6, f"{stage}: resumed on two nodes differs from uninterrupted by {diff}"


@pytest.mark.parametrize("stage", ["zero3"])  # DDP across two launchers: the accelerate test above
def test_train_sh_two_nodes_on_localhost(stage, stage_run, tmp_path):
    out, port = tmp_path / "run", free_port()
    cmd = ["bash", "launch/train.sh", "--zero", "0" if stage == "ddp" else "3", "configs/default.yaml",
           f"train.output_dir={out}", *STEPS]
    env = dict(NUM_GPUS="1", NUM_NODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PERSIST_DIR="none",
               PYTHON=sys.executable, MAX_RETRIES="0")
    outs = two_nodes([cmd, cmd], [_env(stage, NODE_RANK=str(r), **env) for r in (0, 1)])
    assert "2 node(s) x 1 GPU(s) = 2 processes" in outs[0], outs[0][-3000:]
    assert_ran_as(out, stage)
    assert_same_losses(out, stage_run(stage))
    assert (out / "train-node0.log").is_file() and (out / "train-node1.log").is_file()
