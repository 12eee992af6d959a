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


def test_a_model_folder_without_a_tokenizer_names_the_key_to_set(tmp_path):
    """Regression: with model.tokenizer null (the default) a model folder holding weights but no tokenizer gave
    transformers' 'Couldn't instantiate the backend tokenizer' alone, without saying what to set."""
    from transformers import LlamaForCausalLM

    from harness.config import ConfigError, load_config
    from harness.model import load_tokenizer

    LlamaForCausalLM(LlamaConfig(hidden_size=16, num_hidden_layers=1, intermediate_size=32, num_attention_heads=2,
                                 num_key_value_heads=2, vocab_size=64)).save_pretrained(tmp_path / "base")
    cfg = load_config(DEFAULT, [f"model.name_or_path={tmp_path / 'base'}"])
    with pytest.raises(ConfigError) as e:
        load_tokenizer(cfg.model)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("config key 'model.tokenizer': cannot load tokenizer") and "'bundled'" in msg
