"""A user error under every launcher is printed exactly once; an FSDP launch is refused (harness/config/preflight.py).

Under `accelerate launch` with 2 processes, a worker that exited first made torch elastic SIGTERM the main process
before its `harness: error:` line was out (2 tries in 3 showed only the launcher's traceback). The config is now
checked before the heavy imports, and the non-main processes wait for the launcher after a user error.

    .venv/bin/python -m pytest tests/test_launch_errors.py      # the 10x runs are -m slow
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("all_cpus")  # starts its own launchers: conftest.py

ROOT = Path(__file__).resolve().parent.parent
BAD = "train.max_nonfinite_skips=-2"
LINE = "harness: error: config key 'train.max_nonfinite_skips': must be >= 0, got -2"
FSDP = "harness: error: the launch asks for FSDP"


def env(**extra) -> dict:
    e = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    e.pop("ACCELERATE_USE_CPU", None)
    e.pop("ACCELERATE_USE_FSDP", None)
    return {**e, **extra}


def accelerate(*args: str, **extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env(ACCELERATE_USE_CPU="1", **extra), capture_output=True, text=True,
                          timeout=300)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in (proc.stdout + proc.stderr).splitlines() if "harness: error:" in ln]


def no_workers_left(proc: subprocess.CompletedProcess, out: Path) -> None:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(out) not in ps  # every worker of this run (its output folder is in its command line) has ended


@pytest.mark.slow
def test_a_config_error_under_two_processes_is_printed_once_every_time(tmp_path):
    out = tmp_path / "run"
    for attempt in range(10):
        proc = accelerate("--multi_gpu", "--num_processes", "2", "harness/train.py", "--config",
                          "configs/default.yaml", f"train.output_dir={out}", BAD)
        assert proc.returncode != 0
        assert error_lines(proc) == [LINE], (attempt, proc.stderr[-3000:])
        assert "exitcode  : 2" in proc.stderr  # the launcher's report names the harness's status for a config error
        assert not out.exists()
        no_workers_left(proc, out)


def test_a_config_error_from_python_dash_m_and_train_sh(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "harness.train", "--config", "configs/default.yaml",
                           f"train.output_dir={out}", BAD], cwd=ROOT, env=env(), capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip() == LINE and not proc.stdout, proc.stderr
    for attempt in range(10):
        proc = subprocess.run(["bash", "launch/train.sh", "configs/default.yaml", f"train.output_dir={out}", BAD],
                              cwd=ROOT, env=env(NUM_GPUS="0"), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and error_lines(proc) == [LINE], (attempt, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["generative", "preference"])
def test_a_data_error_under_two_processes_is_printed_once(mode, tmp_path):
    """Found by the main process while it reads the data first (the others wait for it, harness/data/loaders.py):
    every process stops with it, the main process prints it once, no process prints a traceback (rank 1 died at
    accelerate's main_process_first barrier with gloo's `Connection closed by peer` before)."""
    out, bad = tmp_path / "run", tmp_path / "bad.jsonl"
    if mode == "generative":
        bad.write_text('{"text": "fine"}\n[1]\n')
        config, line = "configs/default.yaml", f"harness: error: {bad}:2: expected a JSON object, got list"
    else:
        bad.write_text('{"prompt": "q", "chosen": "yes", "rejected": "no"}\n{"prompt": "q", "rejected": "a"}\n')
        config, line = "configs/dpo-tiny.yaml", f"harness: error: {bad}:2: missing field 'chosen'"
    proc = accelerate("--multi_gpu", "--num_processes", "2", "harness/train.py", "--config", config,
                      f"train.output_dir={out}", f"data.train_files=[{bad}]", "data.eval_files=[]")
    assert proc.returncode != 0
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith(line), proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    # the launcher's own ChildFailedError traceback (accelerate launch exits 1 that way) names no harness file
    assert not [ln for ln in said.splitlines() if 'File "' in ln and "/harness/" in ln], said[-3000:]
    assert "RuntimeError" not in said and "Connection closed" not in said, said[-3000:]
    assert "exitcode  : 1" in proc.stderr  # the launcher's report names the harness's status for a data error
    no_workers_left(proc, out)


@pytest.mark.parametrize("how", ["flag", "yaml", "env"])
def test_an_fsdp_launch_is_refused_in_one_line(how, tmp_path):
    out = tmp_path / "run"
    train = ["harness/train.py", "--config", "configs/default.yaml", f"train.output_dir={out}"]
    if how == "flag":
        proc = accelerate("--use_fsdp", "--fsdp_version", "2", "--num_processes", "2", *train)
    elif how == "yaml":
        (tmp_path / "fsdp.yaml").write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\n"
                                            "num_processes: 2\nnum_machines: 1\nmachine_rank: 0\nuse_cpu: true\n"
                                            "fsdp_config:\n  fsdp_version: 2\n")
        proc = accelerate("--config_file", str(tmp_path / "fsdp.yaml"), *train)
    else:  # what accelerate sets for the workers
        proc = subprocess.run([sys.executable, "-m", "harness.train", *train[1:]], cwd=ROOT,
                              env=env(ACCELERATE_USE_FSDP="true"), capture_output=True, text=True)
        assert proc.returncode == 2
    assert proc.returncode != 0
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith(FSDP), proc.stderr[-3000:]
    assert "--zero N" in lines[0] and "train.deepspeed" in lines[0]
    assert not out.exists()
