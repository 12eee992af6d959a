"""The model family matrix (issue 16): each family, built from a tiny transformers config (hidden 64, 2 layers, 4
heads, the bundled tokenizer's vocabulary, the family's own default for tied / untied heads), trains generatively
with packing under 2-process DeepSpeed ZeRO-3 and its final/ export reloads with AutoModelForCausalLM; the families
that check_embedding_support accepts also train in the unified mode with bidirectional embedding passes (1 process).

Each run is kept short (2 steps, micro-batch 2, max_len 64, no eval, no summary): ~15-25 s per 2-process run on a
2-core CPU. gemma2 has no sdpa kernel: model.attn_implementation=auto (the default) picks eager for it."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from harness.model import BIDIRECTIONAL_FAMILIES
from tests.harness_launch import FAST, metrics, report, run_train

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128)
FAMILIES = {
    "llama": dict(num_key_value_heads=2),  # GQA: 2 key/value heads for 4 query heads
    "mistral": dict(num_key_value_heads=2),
    "qwen2": dict(num_key_value_heads=2),
    "qwen3": dict(num_key_value_heads=2, head_dim=16),
    "gemma": dict(num_key_value_heads=2, head_dim=16),
    "gemma2": dict(num_key_value_heads=2, head_dim=16),
    "gemma3_text": dict(num_key_value_heads=2, head_dim=16),
    "phi3": dict(num_key_value_heads=2),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=128),  # its own names; no GQA
    "gpt_neox": dict(),
    "olmo2": dict(num_key_value_heads=2),
    "starcoder2": dict(num_key_value_heads=2),
}
RUN = [*FAST, "train.max_steps=2", "train.micro_batch_size=2", "data.max_len=64", "train.eval_at_start=false",
       "train.compile=none"]


def _config(tmp_path, family: str, unified: bool = False) -> str:
    """A job YAML for a tiny `family` model (vocab_size: the tokenizer's, set by harness.model)."""
    model = {"name_or_path": None, "tokenizer": "bundled",
             "config": {"model_type": family, **({} if family == "gpt2" else TINY), **FAMILIES[family]}}
    job = {"model": model, "data": {"train_files": ["data/sample/gen.jsonl"], "max_len": 64},
           "optim": {"lr": 2.0e-3, "warmup_steps": 0}, "train": {"output_dir": str(tmp_path / "run")}}
    if unified:
        model["embed_attention"] = "bidirectional"
        job["data"].update(emb_train_files=["data/sample/emb.jsonl"], train_group_size=2, query_max_len=32,
                           passage_max_len=32)
        job["loss"] = {"mode": "unified"}
    path = tmp_path / f"{family}.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def _check_losses(run_dir, key: str = "loss"):
    losses = [r[key] for r in metrics(run_dir)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    return losses


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packing_isolates_documents(family):
    """Packed rows rely on transformers building a block-diagonal causal mask from position_ids (no attention
    mask, use_cache=False as harness.objective calls it): the second document's logits equal those of it alone."""
    from harness.config import ModelConfig
    from harness.model import build_model, load_tokenizer

    tok = load_tokenizer(ModelConfig())
    torch.manual_seed(0)
    model = build_model(ModelConfig(config={"model_type": family, **({} if family == "gpt2" else TINY),
                                            **FAMILIES[family]}), tok).eval()
    a, b = torch.randint(5, 200, (1, 10)), torch.randint(5, 200, (1, 12))
    position_ids = torch.cat([torch.arange(10), torch.arange(12)])[None]
    with torch.no_grad():
        packed = model(input_ids=torch.cat([a, b], 1), position_ids=position_ids, use_cache=False).logits[:, 10:]
        alone = model(input_ids=b, use_cache=False).logits
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_family_list():
    assert set(BIDIRECTIONAL_FAMILIES) <= set(FAMILIES)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_generative_zero3_packing(tmp_path, family):
    run_dir = tmp_path / "run"
    proc = run_train([*RUN, "data.packing=true", "train.save_final=true"], nproc=2, accel="zero3",
                     config=_config(tmp_path, family))
    _check_losses(run_dir)
    rep = report(run_dir)
    assert rep["zero_stage"] == 3 and rep["world_size"] == 2, rep
    auto_eager = "gemma2 does not support sdpa, using eager" in proc.stdout
    assert auto_eager == (family == "gemma2"), proc.stdout[-2000:]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final", dtype=torch.float32)
    assert model.config.model_type == family
    default_tied = AutoConfig.for_model(family).tie_word_embeddings
    assert model.config.tie_word_embeddings == default_tied
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert tied == default_tied
    ids = torch.tensor([[model.config.bos_token_id or 0, 5, 6, 7]])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()


@pytest.mark.slow
@pytest.mark.parametrize("family", list(BIDIRECTIONAL_FAMILIES))
def test_unified_bidirectional(tmp_path, family):
    run_dir = tmp_path / "run"
    run_train([*RUN, "train.save_final=false", "train.emb_micro_batch_size=2"], config=_config(tmp_path, family, True))
    _check_losses(run_dir)
    for key in ("loss_gen", "loss_emb"):
        _check_losses(run_dir, key)
