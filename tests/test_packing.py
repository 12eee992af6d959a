"""Packing: best-fit rows, per-document positions, the same loss per token, and padding on skewed data."""

from __future__ import annotations

import torch
from accelerate.utils import set_seed

from harness import losses
from harness.config import ModelConfig
from harness.data import samples as data_lib
from harness.model import build_model, load_tokenizer
from harness_launch import ROOT

SKEWED = str(ROOT / "data" / "bench" / "skewed.jsonl")


def test_pack_rows_best_fit_is_complete_and_within_capacity():
    lengths = [50, 30, 70, 20, 100, 10, 60, 40, 5, 15]
    rows = data_lib.pack_rows(lengths, capacity=100)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))  # every sample exactly once
    assert all(sum(lengths[i] for i in r) <= 100 for r in rows)
    assert len(rows) == 4  # 400 tokens in rows of 100: optimal
    assert data_lib.pack_rows(lengths, 100) == rows  # deterministic


def test_auto_max_len_percentile():
    lengths = list(range(1, 101))
    assert data_lib.auto_max_len(lengths, 99) == 104  # p99 = 99 -> next multiple of 8
    assert data_lib.auto_max_len(lengths, 50) == 56
    assert data_lib.auto_max_len([7], 99) == 8


def _tiny_model(tok):
    set_seed(0)
    cfg = ModelConfig(config={"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                              "max_position_embeddings": 1024})
    return build_model(cfg, tok).eval()


def test_packed_rows_give_the_same_loss_per_token_as_padded_samples():
    tok = load_tokenizer(ModelConfig())
    rows = data_lib.load_generative_rows([str(ROOT / "data/sample/gen.jsonl")])
    ds, _ = data_lib.tokenize_dataset(rows.select(range(24)), tok, max_len=128)
    model = _tiny_model(tok)
    with torch.no_grad():
        padded = data_lib.GenerativeCollator(tok.pad_token_id)([ds[i] for i in range(len(ds))])
        s_pad, n_pad = losses.token_loss_sum(model(**data_lib.model_inputs(padded), use_cache=False).logits, padded["labels"])
        packed_ds = data_lib.pack_dataset(ds, 256)
        assert len(packed_ds) < len(ds)
        packed = data_lib.PackedCollator(tok.pad_token_id, 256)([packed_ds[i] for i in range(len(packed_ds))])
        assert "attention_mask" not in data_lib.model_inputs(packed)
        s_pack, n_pack = losses.token_loss_sum(model(**data_lib.model_inputs(packed), use_cache=False).logits, packed["labels"])
    assert int(n_pad) == int(n_pack)
    assert abs(s_pad.item() / int(n_pad) - s_pack.item() / int(n_pack)) < 1e-5 * s_pad.item() / int(n_pad)


def test_packed_documents_do_not_attend_to_each_other():
    """Changing the first document of a packed row leaves the second document's logits unchanged."""
    tok = load_tokenizer(ModelConfig())
    model = _tiny_model(tok)
    a, b = [1, 50, 51, 52, 2], [1, 60, 61, 2]
    row = {"input_ids": a + b, "labels": a + b, "position_ids": list(range(5)) + list(range(4))}
    alt = {**row, "input_ids": [1, 70, 71, 72, 2] + b}
    collate = data_lib.PackedCollator(tok.pad_token_id, 12)
    with torch.no_grad():
        x = model(**data_lib.model_inputs(collate([row])), use_cache=False).logits[0, 5:9]
        y = model(**data_lib.model_inputs(collate([alt])), use_cache=False).logits[0, 5:9]
        alone = model(input_ids=torch.tensor([b])).logits[0]
    assert torch.allclose(x, y, atol=1e-5)
    assert torch.allclose(x, alone, atol=1e-4)


def test_packing_cuts_padding_on_skewed_data_to_under_5_percent():
    tok = load_tokenizer(ModelConfig())
    ds, st = data_lib.tokenize_dataset(data_lib.load_generative_rows([SKEWED]), tok, max_len=512)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(ds), generator=g).tolist()
    collate = data_lib.GenerativeCollator(tok.pad_token_id)
    real = total = 0
    for i in range(0, len(order), 8):  # micro-batches of 8 in a shuffled order, padded to the longest
        batch = collate([ds[j] for j in order[i:i + 8]])
        real += data_lib.real_tokens(batch)
        total += batch["input_ids"].numel()
    unpacked_share = 1 - real / total
    packed = data_lib.pack_dataset(ds, 512)
    packed_share = 1 - sum(packed["length"]) / (len(packed) * 512)
    print(f"padding share on skewed data: unpacked {unpacked_share:.1%}, packed {packed_share:.1%}")
    assert unpacked_share > 0.4
    assert packed_share <= 0.05
