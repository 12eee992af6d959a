"""Every recipe in configs/ (globbed, so new ones are covered): it loads and validates, `launch/train.sh --dry-run`
prints its accelerate command on 8 x 80 GB (faked with NUM_GPUS / GPU_MEM_GB / HOST_MEM_GB), and for the real-model
recipes (a hub model.name_or_path with its shape in model.config) `harness zero-plan` sizes it offline.

    .venv/bin/python -m pytest tests/test_recipes.py      # ~5 s a recipe
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.config import load_config
from test_launch import launch_cmd, sh

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").glob("*.yaml"))
MODELS = {r: (yaml.safe_load((ROOT / r).read_text()) or {}).get("model") or {} for r in RECIPES}
REAL = [r for r, m in MODELS.items() if m.get("name_or_path") and m.get("config")]


def zero_args(recipe: str) -> list[str]:
    """--zero auto sizes the model; a recipe on an earlier run's export (rft-tiny on runs/.../final) gets an explicit
    stage instead, whether or not the repository's runs/ holds that export (the tests never read the user's runs)."""
    name = MODELS[recipe].get("name_or_path") or ""
    return ["--zero", "0"] if name.startswith("runs/") else ["--zero", "auto"]


def test_recipes_found():
    assert "configs/default.yaml" in RECIPES and "configs/gritlm-7b-mistral.yaml" in REAL


def test_every_recipe_loads():
    """Every shipped recipe validates (in this process; the shell's dry run of most is in the extended tier)."""
    for recipe in RECIPES:
        assert load_config(str(ROOT / recipe)).train.output_dir, recipe


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_loads_and_dry_runs(recipe):
    cfg = load_config(str(ROOT / recipe))  # validates
    assert cfg.train.output_dir
    r = sh("train.sh", "--dry-run", *zero_args(recipe), recipe, NUM_GPUS=8, GPU_MEM_GB=80, HOST_MEM_GB=2000)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    cmd = launch_cmd(r.stdout)
    assert "--num_processes 8" in cmd and cmd.endswith(f"harness/train.py --config {recipe}")
    assert "dry run: nothing started" in r.stdout


@pytest.mark.parametrize("recipe", REAL)
def test_real_model_recipe_zero_plan(recipe):
    r = subprocess.run([sys.executable, "-m", "harness.cli", "zero-plan", recipe, "--gpus", "8", "--gpu-mem-gb", "80"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    assert "sizing offline from model.config" in r.stdout
    choice = r.stdout.strip().splitlines()[-1]
    assert choice.startswith("choice: ") and choice != "choice: none", r.stdout


def test_gritlm_7b_recipe_matches_the_paper():
    cfg = load_config(str(ROOT / "configs/gritlm-7b-mistral.yaml"))
    t, world = cfg.train, 8
    assert cfg.model.name_or_path == "mistralai/Mistral-7B-v0.1" and cfg.loss.mode == "unified"
    assert t.emb_micro_batch_size * t.grad_accum * world == 2048 and t.micro_batch_size * t.grad_accum * world == 256
    assert (cfg.optim.lr, cfg.loss.temperature, cfg.model.pooling, cfg.model.embed_attention) == (
        2e-5, 0.02, "mean", "bidirectional")
    d = cfg.data
    assert (d.query_max_len, d.passage_max_len, d.max_len, t.precision) == (256, 2048, 2048, "bf16")
    r = sh("train.sh", "--dry-run", "--zero", "3", "configs/gritlm-7b-mistral.yaml", NUM_GPUS=8, GPU_MEM_GB=80,
           HOST_MEM_GB=2000)
    assert "--config_file accelerate_configs/zero3.yaml" in launch_cmd(r.stdout)  # the paper's full sharding
    r = sh("train.sh", "--dry-run", "configs/gritlm-7b-mistral.yaml", NUM_GPUS=8, GPU_MEM_GB=80, HOST_MEM_GB=2000)
    assert "--zero auto chose stage 2" in r.stdout  # the lowest that fits (chunked loss; fp32 weights: stage 1 does not)
