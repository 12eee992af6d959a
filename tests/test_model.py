"""harness.model: the bundled tokenizer, chat markers, building tiny models (config, folder, random init)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from harness.config import ModelConfig
from harness.errors import ConfigError
from harness.model import CHAT_MARKERS, build_model, count_parameters, load_tokenizer

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
