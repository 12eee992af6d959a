"""`harness rft generate` against bad input and an unlucky machine (harness/rft/generate.py, shards.py, tasks.py): each
is one `harness: error:` line, nothing half-written is left, and the questions already done stay done.

    .venv/bin/python -m pytest tests/test_rft_faults.py
"""

from __future__ import annotations

import pytest

from harness.rft import main as rft_main
from tests.harness_launch import ROOT

RECIPE = str(ROOT / "configs" / "rft-tiny.yaml")
TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 128}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random model saved with its tokenizer (what `--model` / model.name_or_path names)."""
    import torch

    from harness.config import ModelConfig
    from harness.model import build_model, load_tokenizer

    folder = tmp_path_factory.mktemp("model")
    cfg = ModelConfig(config=dict(TINY))
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    build_model(cfg, tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def overrides(model_dir, out) -> list[str]:
    """8 questions x 2 samples of 4 new tokens: a second on the CPU."""
    return [f"model.name_or_path={model_dir}", f"rft.output_dir={out}", "rft.max_operand=4",
            "rft.num_train_questions=8", "rft.num_test_questions=4", "rft.num_sft_questions=4", "rft.oversample=2",
            "rft.max_new_tokens=4", "rft.questions_per_batch=4"]


def test_an_error_while_sampling_is_printed_on_its_own_line(model_dir, tmp_path, capsys):
    """A KV-cache budget that holds no sequence: its one line was printed after the progress bar, on the bar's line."""
    assert rft_main(["generate", RECIPE, *overrides(model_dir, tmp_path / "gen"), "rft.engine=continuous",
                     "rft.kv_cache_gb=1e-9"]) == 1
    err = capsys.readouterr().err
    assert "rft generate" in err  # the bar was drawn (tqdm writes to a pipe as well)
    said = [x for x in err.split("\n") if "harness: error:" in x]
    assert len(said) == 1 and said[0].startswith("harness: error: rft.kv_cache_gb: "), err[-2000:]
