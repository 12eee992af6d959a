"""Run the real entry points in subprocesses for the end-to-end tests (one process or two CPU ranks).

Two CPU ranks use accelerate's multi-GPU path with ACCELERATE_USE_CPU=1 (accelerate's --cpu / MULTI_CPU silently
runs one process); DeepSpeed configs run as they are (no --cpu, which would turn DeepSpeed off).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = str(ROOT / "configs" / "default.yaml")
# Small, fast settings shared by the end-to-end runs (the default recipe's model and data, fewer steps).
FAST = ["train.progress_bar=false", "train.log_every=1", "data.eval_files=[]", "train.report_to=[]",
        "train.summary=false"]  # no plots: ~2 s a run (tests/test_summary.py covers them)
# tests/test_zero.py's data: a weighted mix of two sources (3:1) with 24 records held out by data.eval_split
MIX = ["data.train_files=[{path: data/sample/gen.jsonl, weight: 3}, {path: data/sample/gen_eval.jsonl, weight: 1}]",
       "data.eval_split=24"]
# the 2-process runs of the default recipe per stage (conftest.py's stage_run): 16 steps, an epoch boundary after 14;
# the first 10 are the warm-up (optim.warmup_steps=10), whose learning rates do not depend on train.max_steps
STAGE_STEPS = ["train.max_steps=16", "train.micro_batch_size=16", *FAST, *MIX]
# conftest.py's bf16_run: the default recipe in bf16, 8 steps of micro-batch 8 (warm-up 10: every step's learning rate
# is the same in a shorter run of these settings)
BF16_STEPS = [*FAST, "train.max_steps=8", "train.micro_batch_size=8", "train.save_final=false", "train.precision=bf16"]
STAGES = {"ddp": "multi_gpu", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3"}  # name -> accelerate config


# ------------------------------------------------------------------------------------ CPU slots for launched runs
#
# pytest runs the suite on 2 xdist workers (pyproject's addopts). A launched run spends most of its ~7 s start-up
# importing torch and transformers on one core, so two one-process runs side by side finish in about the time of one,
# while two 2-rank runs side by side are slower than in turn (4 busy processes on 2 cores, gloo polling). So each
# launch first takes as many slots as it starts ranks (os.cpu_count() slots in all, one lock file each, shared by
# every pytest process on this machine): a 2-rank run waits for the whole machine, a 1-process run for one core.
# The locks are flock()s: the kernel drops them when their process ends, so a killed test leaves none behind.
# HARNESS_TEST_SLOTS=N sets the number of slots; 0 turns the gate off.
SLOTS_DIR = Path(os.environ.get("HARNESS_TEST_SLOTS_DIR", f"/tmp/harness-test-slots-{os.getuid()}"))
_holding = False  # this process holds slots now: a nested launch (run_train in a test that holds them) takes no more


def slot_count() -> int:
    return int(os.environ.get("HARNESS_TEST_SLOTS", os.cpu_count() or 1))


@contextlib.contextmanager
def cpu_slots(n: int | None = None):
    """Hold `n` of the machine's slots (None: all of them) for the block. Slots are taken in index order and a
    1-slot request takes whichever is free first, so two requests never wait on each other in a cycle."""
    global _holding
    total = slot_count()
    if total <= 0 or _holding:
        yield
        return
    need = total if n is None else max(1, min(n, total))
    SLOTS_DIR.mkdir(parents=True, exist_ok=True)
    files = [open(SLOTS_DIR / f"slot{i}.lock", "a+") for i in range(total)]
    try:
        if need == 1:
            for f in files:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    continue
            else:
                fcntl.flock(files[0], fcntl.LOCK_EX)  # every slot busy: wait for the first one
        else:
            for f in files[:need]:
                fcntl.flock(f, fcntl.LOCK_EX)
        _holding = True
        yield
    finally:
        _holding = False
        for f in files:
            f.close()  # closing drops whichever locks it holds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_train(overrides: list[str], nproc: int = 1, accel: str | None = None, config: str = DEFAULT,
              python_module: bool = False, timeout: int = 600, check: bool = True,
              extra_env: dict | None = None, address_space_gb: float | None = None,
              cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Train with `overrides`. accel: None (plain python -m harness.train when nproc == 1, else DDP),
    or the name of a file in accelerate_configs/ (ddp = multi_gpu). address_space_gb: an RLIMIT_AS for the run, so
    that large allocations fail for real with the CPU allocator's out-of-memory error. cwd: the folder to start in
    (default: the repository root)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ACCELERATE_USE_CPU", None)  # from this shell: only where set below, or asked for in extra_env
    env.update(extra_env or {})
    if python_module or (accel is None and nproc == 1):
        cmd = [sys.executable, "-m", "harness.train"]
    else:
        name = {None: "multi_gpu", "ddp": "multi_gpu"}.get(accel, accel)
        if name in ("multi_gpu", "cpu"):
            env["ACCELERATE_USE_CPU"] = "1"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "accelerate_configs" / f"{name}.yaml"), "--num_processes", str(nproc),
               "--main_process_port", str(free_port()), str(ROOT / "harness" / "train.py")]
    cmd += ["--config", config, *overrides]
    limit = None
    if address_space_gb is not None:
        import resource

        def limit():
            resource.setrlimit(resource.RLIMIT_AS, (int(address_space_gb * 2**30), resource.RLIM_INFINITY))
    with cpu_slots(nproc):
        proc = subprocess.run(cmd, cwd=cwd or ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=limit)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}\nexit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                             f"--- stderr\n{proc.stderr[-8000:]}")
    return proc


def metrics(run_dir: str | Path) -> list[dict]:
    """Training records of metrics.jsonl (those with a loss), in order."""
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def report(run_dir: str | Path) -> dict:
    return json.loads(Path(run_dir, "report.json").read_text())


def final_weights(run_dir: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir, "final", "model.safetensors")))


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def settled_update_diff(a: dict, b: dict, start: dict, share: float = 0.9) -> tuple[float, float]:
    """(largest |a - b|, fraction of weights compared) over the weights whose update in `b` is at least `share` of
    the largest: after Adam's first step those had a gradient well above eps, so two equal computations must give
    them the same value. The others (a gradient within a few eps of 0) move by lr * g / (|g| + eps), which turns
    ulp-level differences of a ~1e-9 gradient into 1e-5 of weight: update_rel_diff judges them as a whole."""
    step = max((b[k].double() - start[k].double()).abs().max().item() for k in b)
    worst, kept, total = 0.0, 0, 0
    for k in b:
        moved = (b[k].double() - start[k].double()).abs() >= share * step
        kept, total = kept + int(moved.sum()), total + moved.numel()
        if moved.any():
            worst = max(worst, (a[k].double() - b[k].double()).abs()[moved].max().item())
    return worst, kept / total


def rel_close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def initial_weights(config: str = DEFAULT, overrides: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The weights a run starts from (same seed, same build as harness.train)."""
    from accelerate.utils import set_seed

    from harness.config import load_config
    from harness.model import build_model, load_tokenizer

    cfg = load_config(config, overrides or [])
    tok = load_tokenizer(cfg.model)
    set_seed(cfg.train.seed)
    return {k: v.detach().clone() for k, v in build_model(cfg.model, tok).state_dict().items()}


def update_rel_diff(a: dict, b: dict, start: dict) -> float:
    """||(a - start) - (b - start)|| / ||b - start|| over all tensors of `a`: how far two updates differ. Adam's
    first step moves each weight by about lr * sign(gradient), so weights whose gradient is ~0 can differ by a few
    ulps of the gradient without the update differing in any meaningful way; the relative norm measures that."""
    num = sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a)
    den = sum(((b[k].double() - start[k].double()) ** 2).sum() for k in a)
    return float((num / den).sqrt())


def third_party_lines(text: str) -> list[str]:
    """Lines of a run's output that the harness did not write: not `[harness] ...`, `harness: error: ...`, the
    summary table (`| ...`), or a progress bar. A library's warning at start-up or later (torchao's "Failed to load
    ... .so", torch's register_constant, DeepSpeed's accelerator line) is one of these."""
    own = ("[harness]", "harness:", "|")
    return [ln for ln in text.replace("\r", "\n").splitlines()
            if ln.strip() and not ln.startswith(own) and not re.search(r"\d+%\|.*\|", ln)]
