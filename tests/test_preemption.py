"""Preemption: SIGTERM to a 2-process run (as a container stop or a spot reclaim sends it to every process),
kill -9 with periodic checkpoints, and time-based saving."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import checkpoint
from harness_launch import FAST, ROOT, final_weights, free_port, max_abs_diff, metrics, rel_close, run_train

pytestmark = pytest.mark.slow

ARGS = ["train.max_steps=60", "train.micro_batch_size=16", *FAST]


def start(out: Path, extra: list[str]) -> subprocess.Popen:
    """A 2-process DDP run in its own process group (so a signal can reach every process, like a preemption)."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs/multi_gpu.yaml"), "--num_processes", "2", "--main_process_port",
           str(free_port()), str(ROOT / "harness/train.py"), "--config", str(ROOT / "configs/default.yaml"),
           f"train.output_dir={out}", *ARGS, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    path = out / "metrics.jsonl"
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"run ended early:\n{proc.stdout.read()[-3000:]}")
        if path.exists():
            steps = [json.loads(x).get("step", 0) for x in path.read_text().splitlines() if x.strip()]
            if steps and max(steps) >= step:
                return
        time.sleep(0.05)
    raise AssertionError("timed out waiting for training steps")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    run_train([f"train.output_dir={out}", *ARGS], nproc=2)
    return out


def test_sigterm_checkpoints_within_seconds_exits_0_and_resumes_exactly(uninterrupted, tmp_path):
    """SIGTERM reaches both training processes (as from a scheduler that signals the workers, or a launch script
    that forwards it): both agree, checkpoint, exit 0, and so does the launcher. (A SIGTERM to accelerate's launcher
    itself makes torch elastic's agent forward it and then exit 1 on its own account; the workers still save.)"""
    import psutil

    out = tmp_path / "run"
    proc = start(out, [])
    wait_for_step(out, 8, proc)
    workers = [c for c in psutil.Process(proc.pid).children(recursive=True) if "harness/train.py" in " ".join(c.cmdline())]
    assert len(workers) == 2
    t0 = time.time()
    for w in workers:
        w.send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=60)
    elapsed = time.time() - t0
    assert proc.returncode == 0, log[-3000:]
    assert elapsed < 10, elapsed
    complete, _ = checkpoint.list_checkpoints(out)
    assert complete, log[-3000:]
    step = complete[-1][0]
    assert 8 <= step < 60 and "stopped (signal)" in log
    assert not (out / "final").exists()

    resumed = run_train([f"train.output_dir={out}", *ARGS], nproc=2)
    assert f"step-{step}" in resumed.stdout
    diff = max_abs_diff(final_weights(out), final_weights(uninterrupted))
    assert diff <= 1e-6, diff
    a, b = metrics(out), metrics(uninterrupted)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert all(rel_close(x["loss"], y["loss"], 1e-6) for x, y in zip(a, b))


def test_kill_9_loses_at_most_one_checkpoint_interval(tmp_path):
    out = tmp_path / "run"
    proc = start(out, ["train.save_every_steps=5"])
    wait_for_step(out, 17, proc)
    reached = max(json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip())
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    complete, incomplete = checkpoint.list_checkpoints(out)
    newest = complete[-1][0]
    assert reached - newest <= 5, (reached, newest, incomplete)
    resumed = run_train([f"train.output_dir={out}", *ARGS, "train.save_every_steps=5"], nproc=2)
    assert f"step-{newest}" in resumed.stdout and (out / "final" / "model.safetensors").is_file()


def test_time_based_checkpoints_and_time_budget(tmp_path):
    """save_every_minutes writes checkpoints by the clock; a time budget too small for the run stops it early with a
    checkpoint and the final export."""
    out = tmp_path / "run"
    proc = run_train([f"train.output_dir={out}", "train.max_steps=100000", "train.micro_batch_size=4", *FAST,
                      "train.save_every_minutes=0.05", "train.time_budget_hours=0.015"])  # 3 s saves, 54 s window
    rep = json.loads((out / "report.json").read_text())
    assert rep["stopped_by"] == "time_budget" and 10 < rep["steps"] < 100000
    assert rep["wall_time_s"] < 54
    assert (out / "final" / "model.safetensors").is_file()
    assert proc.stdout.count("[harness] checkpoint:") >= 2
