"""A recipe's model.config shape on a pretrained model.name_or_path: the checkpoint's shape wins, one line says which
recipe keys were ignored (harness/config/shape.py). configs/default.yaml's comment (`model.name_or_path: <a hub id or
local folder>`) is true: the default recipe trains a local pretrained model.

    .venv/bin/python -m pytest tests/test_pretrained_shape.py
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig, LlamaConfig

from harness.config.shape import pretrained_overrides
from tests.harness_launch import DEFAULT, FAST, run_train
from tests.test_lora import save_base


def test_shape_keys_that_differ_are_ignored_the_rest_applies():
    theirs = LlamaConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=2, tie_word_embeddings=True)
    recipe = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 688,
              "tie_word_embeddings": True, "attention_dropout": 0.1}
    keep, ignored = pretrained_overrides(recipe, theirs)
    assert keep == {"attention_dropout": 0.1}
    assert ignored == ["hidden_size", "intermediate_size"]  # num_hidden_layers, tie: the same values


@pytest.mark.slow
def test_the_default_recipe_trains_a_local_pretrained_model(tmp_path):
    base, out = tmp_path / "base", tmp_path / "run"
    save_base(base)
    proc = run_train([*FAST, f"model.name_or_path={base}", "train.max_steps=2", f"train.output_dir={out}"],
                     config=DEFAULT)
    assert proc.returncode == 0
    lines = [ln for ln in proc.stderr.splitlines() if "model.config:" in ln]
    assert len(lines) == 1 and lines[0].startswith(
        "[harness] model.config: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, "
        "num_key_value_heads, max_position_embeddings ignored: the pretrained model.name_or_path="), lines
    trained = AutoConfig.from_pretrained(out / "final")
    assert (trained.hidden_size, trained.num_hidden_layers, trained.intermediate_size) == (32, 2, 64)
