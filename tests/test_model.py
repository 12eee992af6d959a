"""harness.model: the bundled tokenizer, chat markers, building tiny models (config, folder, random init), and the
embedding passes (bidirectional attention per model family and kernel, embed, support checks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from harness.config import ModelConfig
from harness.errors import ConfigError
from harness.losses import pool
from harness.model import (
    BIDIRECTIONAL_FAMILIES,
    BIDIRECTIONAL_KERNELS,
    CHAT_MARKERS,
    bidirectional_mask,
    build_model,
    check_embedding_support,
    count_parameters,
    embed,
    load_tokenizer,
)

TINY = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig())


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tok) -> Path:
    """A tiny llama saved with save_pretrained (weights + config, no tokenizer)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(config=dict(TINY)), tok)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


def _train_bpe() -> Tokenizer:
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sentences = ["hello world", "the quick brown fox", "jumps over the lazy dog", "what is two plus two"]
    bpe.train_from_iterator(sentences * 5, trainer)
    return bpe


@pytest.fixture(scope="module")
def plain_tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer trained in the test, with bos/eos/pad/unk only: no chat markers."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(), bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    for m in CHAT_MARKERS:
        assert fast.convert_tokens_to_ids(m) == fast.unk_token_id  # really absent
    path = tmp_path_factory.mktemp("plain-tokenizer")
    fast.save_pretrained(path)
    return path


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------------------------- tokenizer


def test_bundled_tokenizer_ids(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<s>", "</s>")


def test_bundled_tokenizer_chat_markers_are_single_tokens(tok):
    marker_ids = []
    for m in CHAT_MARKERS:
        ids = tok(m, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, m
        assert ids[0] == tok.convert_tokens_to_ids(m) != tok.unk_token_id
        marker_ids.append(ids[0])
    assert len(set(marker_ids)) == len(CHAT_MARKERS)
    # ... also inside text, and they decode back to themselves.
    ids = tok("<|user|>\nhi<|assistant|>\nyo", add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|user|>")
    assert tok.convert_tokens_to_ids("<|assistant|>") in ids
    assert tok.decode(ids) == "<|user|>\nhi<|assistant|>\nyo"


def test_tokenizer_explicitly_bundled(tok):
    other = load_tokenizer(ModelConfig(tokenizer="bundled"))
    assert len(other) == len(tok)
    assert other("hello world")["input_ids"] == tok("hello world")["input_ids"]


def test_tokenizer_missing_source_is_config_error(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        load_tokenizer(ModelConfig(tokenizer=str(tmp_path / "no-tokenizer-here")))
    assert str(excinfo.value).startswith("config key 'model.tokenizer': cannot load tokenizer ")
    assert "\n" not in str(excinfo.value)


def test_tokenizer_without_markers_gets_them(plain_tokenizer_dir):
    plain = PreTrainedTokenizerFast.from_pretrained(plain_tokenizer_dir)
    tok = load_tokenizer(ModelConfig(tokenizer=str(plain_tokenizer_dir)))
    assert len(tok) == len(plain) + len(CHAT_MARKERS)
    ids = []
    for m in CHAT_MARKERS:
        one = tok(m, add_special_tokens=False)["input_ids"]
        assert len(one) == 1 and one[0] == tok.convert_tokens_to_ids(m), m
        assert one[0] >= len(plain) and one[0] != tok.unk_token_id
        ids.append(one[0])
    assert len(set(ids)) == len(CHAT_MARKERS)
    text = tok("<|system|>\nhello<|user|>", add_special_tokens=False)["input_ids"]
    assert text[0] == ids[0] and text[-1] == ids[1]
    # The original special tokens are untouched.
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (plain.pad_token_id, plain.bos_token_id, plain.eos_token_id)


def test_tokenizer_without_pad_uses_eos(tmp_path):
    fast = PreTrainedTokenizerFast(tokenizer_object=_train_bpe(), bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(tmp_path)
    tok = load_tokenizer(ModelConfig(tokenizer=str(tmp_path)))
    assert tok.pad_token_id == tok.eos_token_id is not None


# ----------------------------------------------------------------------------------------------- build_model


def test_build_model_from_config(tok):
    model = build_model(ModelConfig(config=dict(TINY)), tok)
    assert model.config.model_type == "llama"
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 2
    assert model.config.vocab_size == len(tok) == model.get_input_embeddings().num_embeddings
    assert model.get_output_embeddings().weight.shape[0] == len(tok)
    assert model.config.pad_token_id == tok.pad_token_id == 0
    assert model.config.bos_token_id == tok.bos_token_id == 1
    assert model.config.eos_token_id == tok.eos_token_id == 2
    assert count_parameters(model) == sum(p.numel() for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not model.is_activation_checkpointing
    out = model(input_ids=torch.tensor([[1, 5, 6, 2]]))
    assert out.logits.shape == (1, 4, len(tok))


def test_build_model_dtype(tok):
    model = build_model(ModelConfig(config=dict(TINY)), tok, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_config_vocab_size_can_be_overridden(tok):
    model = build_model(ModelConfig(config={**TINY, "vocab_size": 4096}), tok)
    assert model.get_input_embeddings().num_embeddings == 4096


def test_gradient_checkpointing(tok):
    model = build_model(ModelConfig(config=dict(TINY), gradient_checkpointing=True), tok)
    assert model.is_activation_checkpointing
    assert model.config.use_cache is False
    model.train()
    loss = model(input_ids=torch.tensor([[1, 10, 11, 12]]), labels=torch.tensor([[1, 10, 11, 12]])).loss
    loss.backward()
    assert model.get_input_embeddings().weight.grad is not None


def test_from_folder_loads_identical_weights(tiny_model_dir, tok):
    saved = build_model(ModelConfig(name_or_path=str(tiny_model_dir)), tok)
    again = build_model(ModelConfig(name_or_path=str(tiny_model_dir), random_init=False), tok)
    for a, b in zip(_weights(saved).items(), _weights(again).items()):
        assert a[0] == b[0]
        torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
    torch.manual_seed(0)
    reference = build_model(ModelConfig(config=dict(TINY)), tok)  # same seed as the saved one
    ref = _weights(reference)
    for name, tensor in _weights(saved).items():
        torch.testing.assert_close(tensor, ref[name], rtol=0, atol=0)


def test_random_init_from_folder(tiny_model_dir, tok):
    loaded = build_model(ModelConfig(name_or_path=str(tiny_model_dir)), tok)
    torch.manual_seed(123)
    fresh = build_model(ModelConfig(name_or_path=str(tiny_model_dir), random_init=True), tok)
    arch = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    assert {k: getattr(fresh.config, k) for k in arch} == {k: getattr(loaded.config, k) for k in arch}
    assert type(fresh) is type(loaded)
    a, b = _weights(loaded), _weights(fresh)
    assert list(a) == list(b)
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    assert count_parameters(fresh) == count_parameters(loaded)
    matrices = [k for k, v in a.items() if v.dim() >= 2]
    assert matrices
    for k in matrices:  # every weight matrix is newly drawn (norm weights start at 1 either way)
        assert not torch.equal(a[k], b[k]), k


def test_folder_with_config_overrides(tiny_model_dir, tok):
    model = build_model(
        ModelConfig(name_or_path=str(tiny_model_dir), random_init=True, config={"num_hidden_layers": 1}), tok
    )
    assert model.config.num_hidden_layers == 1
    assert len(model.model.layers) == 1


@pytest.mark.parametrize("name", ["missing-folder", "nobody-harness-test/does-not-exist"])
def test_nonexistent_name_or_path(tmp_path, tok, name):
    name_or_path = str(tmp_path / name) if name == "missing-folder" else name
    with pytest.raises(ConfigError) as excinfo:
        build_model(ModelConfig(name_or_path=name_or_path), tok)
    msg = str(excinfo.value)
    assert "model.name_or_path" in msg
    assert msg.startswith(f"config key 'model.name_or_path': cannot build model '{name_or_path}': ")
    assert "\n" not in msg
    assert excinfo.value.exit_code == 2


def test_unknown_model_type_is_config_error(tok):
    with pytest.raises(ConfigError, match=r"^config key 'model.name_or_path': cannot build model 'no-such-arch'"):
        build_model(ModelConfig(config={**TINY, "model_type": "no-such-arch"}), tok)


def test_build_model_with_added_markers_from_config(plain_tokenizer_dir):
    tok = load_tokenizer(ModelConfig(tokenizer=str(plain_tokenizer_dir)))
    model = build_model(ModelConfig(config=dict(TINY)), tok)
    assert model.get_input_embeddings().num_embeddings >= len(tok)
    marker_ids = torch.tensor([[tok.bos_token_id, *tok.convert_tokens_to_ids(CHAT_MARKERS), tok.eos_token_id]])
    assert model(input_ids=marker_ids).logits.shape[-1] >= len(tok)


def test_build_model_resizes_embeddings_for_added_markers(tmp_path, plain_tokenizer_dir):
    plain = PreTrainedTokenizerFast.from_pretrained(plain_tokenizer_dir)
    # A saved model whose vocabulary is exactly the plain tokenizer's: no room for the chat markers.
    small = build_model(ModelConfig(config={**TINY, "vocab_size": len(plain)}), plain)
    assert small.get_input_embeddings().num_embeddings == len(plain)
    small.save_pretrained(tmp_path / "small")

    tok = load_tokenizer(ModelConfig(tokenizer=str(plain_tokenizer_dir)))
    assert len(tok) > len(plain)
    for random_init in (False, True):
        model = build_model(
            ModelConfig(name_or_path=str(tmp_path / "small"), tokenizer=str(plain_tokenizer_dir), random_init=random_init),
            tok,
        )
        n = model.get_input_embeddings().num_embeddings
        assert n >= len(tok)
        assert n % 64 == 0  # resized with pad_to_multiple_of=64
        assert model.get_output_embeddings().weight.shape[0] == n
        assert model.config.vocab_size == n
        marker_ids = torch.tensor([tok.convert_tokens_to_ids(CHAT_MARKERS)])
        assert model(input_ids=marker_ids).logits.shape == (1, len(CHAT_MARKERS), n)


# ----------------------------------------------------------------------------------------------- embedding passes

FAMILIES = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
}
KERNELS = ["sdpa", "eager"]


def _tiny_family(tok, model_type: str, impl: str):
    cfg = {**TINY, "model_type": model_type, **FAMILIES[model_type]}
    torch.manual_seed(0)
    model = build_model(ModelConfig(config=cfg, attn_implementation=impl), tok)
    assert model.config.model_type == model_type
    assert model.config._attn_implementation == impl
    return model.eval()


@pytest.fixture(scope="module", params=[(f, k) for f in FAMILIES for k in KERNELS], ids=lambda p: f"{p[0]}-{p[1]}")
def family_model(request, tok):
    return _tiny_family(tok, *request.param)


def _last_hidden(model, input_ids, mask):
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    return out.hidden_states[-1]


def test_family_list_matches_the_tests():
    assert set(BIDIRECTIONAL_FAMILIES) == set(FAMILIES)
    assert set(BIDIRECTIONAL_KERNELS) == set(KERNELS)


def test_bidirectional_mask_layout():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    sdpa = bidirectional_mask(mask, "sdpa")
    assert sdpa.shape == (2, 1, 3, 3) and sdpa.dtype == torch.bool
    assert sdpa[0].all()
    assert sdpa[1, 0, :, :2].all() and not sdpa[1, 0, :, 2].any()  # only the padding key is hidden, for every query
    eager = bidirectional_mask(mask, "eager")
    assert eager.shape == (2, 1, 3, 3) and eager.dtype == torch.float32
    assert eager[0].eq(0).all() and eager[1, 0, :, :2].eq(0).all()
    assert eager[1, 0, :, 2].eq(torch.finfo(torch.float32).min).all()


def test_bidirectional_vs_causal(family_model):
    """With bidirectional_mask, position 0 sees a later token; with the plain 2-D mask it does not (causal)."""
    model = family_model
    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    changed = ids.clone()
    changed[0, 4] = 99
    mask = torch.ones_like(ids)
    impl = model.config._attn_implementation
    bi = bidirectional_mask(mask, impl)

    h_bi, h_bi_changed = _last_hidden(model, ids, bi), _last_hidden(model, changed, bi)
    assert (h_bi[0, 0] - h_bi_changed[0, 0]).abs().max() > 1e-4
    assert (h_bi[0, 3] - h_bi_changed[0, 3]).abs().max() > 1e-4

    h_c, h_c_changed = _last_hidden(model, ids, mask), _last_hidden(model, changed, mask)
    torch.testing.assert_close(h_c[0, :4], h_c_changed[0, :4], rtol=0, atol=1e-6)
    assert (h_c[0, 4] - h_c_changed[0, 4]).abs().max() > 1e-4
    # A 4-D all-ones mask is *not* causal: the bidirectional pass differs from the causal one at position 0.
    assert (h_bi[0, 0] - h_c[0, 0]).abs().max() > 1e-4


@pytest.mark.parametrize("bidirectional", [True, False])
def test_padding_invariance(family_model, tok, bidirectional):
    """A right-padded row gives the same hidden states on its tokens as the row alone, unpadded."""
    model = family_model
    impl = model.config._attn_implementation
    pad = tok.pad_token_id
    long_row = [1, 30, 31, 32, 33, 34, 35]
    short_row = [1, 50, 51, 52]
    ids = torch.tensor([long_row, short_row + [pad] * 3])
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])

    def m(x):
        return bidirectional_mask(x, impl) if bidirectional else x

    batched = _last_hidden(model, ids, m(mask))
    alone = _last_hidden(model, torch.tensor([short_row]), m(torch.ones(1, 4, dtype=torch.long)))
    torch.testing.assert_close(batched[1, :4], alone[0], rtol=1e-5, atol=1e-5)
    alone_long = _last_hidden(model, torch.tensor([long_row]), m(torch.ones(1, 7, dtype=torch.long)))
    torch.testing.assert_close(batched[0], alone_long[0], rtol=1e-5, atol=1e-5)
    # Padding ids do not matter either (they are hidden keys).
    other_pad = ids.clone()
    other_pad[1, 4:] = 77
    torch.testing.assert_close(_last_hidden(model, other_pad, m(mask))[1, :4], batched[1, :4], rtol=1e-5, atol=1e-5)


POOLINGS = ["mean", "weightedmean", "lasttoken"]


def test_embed_normalised_fp32(family_model, tok):
    model = family_model
    pad = tok.pad_token_id
    batch = {
        "input_ids": torch.tensor([[1, 60, 61, 62, 63, 64], [1, 70, 71, 72, pad, pad], [1, 80, 81, pad, pad, pad]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]]),
        "pool_mask": torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0]]),
    }
    hidden = _last_hidden(model, batch["input_ids"], bidirectional_mask(batch["attention_mask"],
                                                                         model.config._attn_implementation))
    embs = {}
    for pooling in POOLINGS:
        with torch.no_grad():
            emb = embed(model, batch, pooling, bidirectional=True)
            causal = embed(model, batch, pooling, bidirectional=False)
        assert emb.shape == (3, model.config.hidden_size) and emb.dtype == torch.float32
        torch.testing.assert_close(emb.norm(dim=-1), torch.ones(3), rtol=0, atol=1e-5)
        assert causal.shape == emb.shape and causal.dtype == torch.float32
        # = pooling the bidirectional pass's last hidden states by hand
        torch.testing.assert_close(emb, pool(hidden, batch["pool_mask"], pooling), rtol=1e-5, atol=1e-6)
        # The two attentions give different embeddings (even lasttoken: the last position sees every token either
        # way, but in the second layer it sees different representations of them).
        assert (emb[0] - causal[0]).abs().max() > 1e-4
        embs[pooling] = emb
    # Each row is the same embedded alone, unpadded (one pooling per row).
    for i, (n, pooling) in enumerate(zip([6, 4, 3], POOLINGS)):
        one = {k: v[i:i + 1, :n] for k, v in batch.items()}
        with torch.no_grad():
            alone = embed(model, one, pooling, bidirectional=True)
        torch.testing.assert_close(alone[0], embs[pooling][i], rtol=1e-5, atol=1e-5)


def test_embed_gradients_flow(tok):
    model = _tiny_family(tok, "llama", "sdpa")
    batch = {"input_ids": torch.tensor([[1, 60, 61, 62]]), "attention_mask": torch.ones(1, 4, dtype=torch.long),
             "pool_mask": torch.tensor([[0, 1, 1, 1]])}
    embed(model, batch, "mean", bidirectional=True).sum().backward()
    assert model.get_input_embeddings().weight.grad is not None
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------------------- support checks


def test_check_embedding_support_unsupported_family():
    with pytest.raises(ConfigError) as excinfo:
        check_embedding_support("gpt2", "sdpa", "bidirectional")
    assert str(excinfo.value) == (
        "config key 'model.embed_attention': bidirectional attention is not available for model type 'gpt2' "
        "(supported: llama, mistral, qwen2, qwen3); use model.embed_attention=causal"
    )
    assert excinfo.value.exit_code == 2


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_check_embedding_support_flash_attention(model_type):
    with pytest.raises(ConfigError) as excinfo:
        check_embedding_support(model_type, "flash_attention_2", "bidirectional")
    assert str(excinfo.value) == (
        "config key 'model.attn_implementation': bidirectional embedding passes need sdpa or eager, "
        "got flash_attention_2"
    )


def test_check_embedding_support_family_checked_first():
    with pytest.raises(ConfigError, match=r"^config key 'model.embed_attention': .* model type 'gpt2'"):
        check_embedding_support("gpt2", "flash_attention_2", "bidirectional")


@pytest.mark.parametrize("model_type", [*FAMILIES, "gpt2", "phi3"])
@pytest.mark.parametrize("impl", ["sdpa", "eager", "flash_attention_2", "flex_attention"])
def test_check_embedding_support(model_type, impl):
    assert check_embedding_support(model_type, impl, "causal") is None  # causal never raises
    if model_type in FAMILIES and impl in KERNELS:
        assert check_embedding_support(model_type, impl, "bidirectional") is None
    else:
        with pytest.raises(ConfigError):
            check_embedding_support(model_type, impl, "bidirectional")


# ----------------------------------------------------------------------------------------------- attn_implementation=auto


def test_auto_attention_picks_sdpa_or_eager(tok, capsys):
    """auto (the default): sdpa where the family supports it; eager with one line where it does not (gemma2)."""
    small = {**TINY, "num_key_value_heads": 2, "head_dim": 16}
    assert ModelConfig().attn_implementation == "auto"
    llama = build_model(ModelConfig(config={**small, "model_type": "llama"}), tok)
    assert llama.config._attn_implementation == "sdpa"
    assert capsys.readouterr().out == ""
    gemma2 = build_model(ModelConfig(config={**small, "model_type": "gemma2"}), tok)
    assert gemma2.config._attn_implementation == "eager"
    assert capsys.readouterr().out.strip().splitlines() == [
        "harness: model.attn_implementation=auto: gemma2 does not support sdpa, using eager"]


def test_explicit_sdpa_is_not_replaced(tok):
    small = {**TINY, "num_key_value_heads": 2, "head_dim": 16, "model_type": "gemma2"}
    with pytest.raises(ConfigError, match="does not support an attention implementation"):
        build_model(ModelConfig(config=small, attn_implementation="sdpa"), tok)
