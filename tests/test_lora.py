"""LoRA through peft (harness/lora.py apply_lora, merged_copy; final/ export in harness/checkpoint/export.py).

    .venv/bin/python -m pytest tests/test_lora.py            # -m "not slow" for the unit tests only
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import AutoPeftModelForCausalLM, PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from harness.config import ModelConfig, load_config
from harness.errors import ConfigError
from harness.lora import apply_lora, is_peft, merged_copy
from harness.model import build_model, load_tokenizer
from tests.harness_launch import DEFAULT, FAST, ROOT, initial_weights, run_train

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "tie_word_embeddings": True}


def tiny_lora(**lora) -> tuple:
    cfg = ModelConfig(config=dict(TINY), lora={"enabled": True, **lora})
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    return build_model(cfg, tok), tok


def test_lora_freezes_the_base_and_trains_adapters():
    model, _ = tiny_lora(r=4)
    assert is_peft(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".lora_")[0].split(".")[-1] for n in trainable} >= {"q_proj", "v_proj", "down_proj"}
    plain, _ = tiny_lora(enabled=False)
    assert not is_peft(plain)


def test_lora_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="model.lora.rank"):
        load_config(DEFAULT, ["model.lora.rank=4"])
    with pytest.raises(ConfigError, match="model.lora.r"):
        load_config(DEFAULT, ["model.lora.r=0"])
    with pytest.raises(ConfigError, match="model.lora.enabled"):
        load_config(DEFAULT, ["model.lora.enabled=maybe"])
    with pytest.raises(ConfigError, match="model.lora.target_modules"):
        apply_lora(tiny_lora(enabled=False)[0], ModelConfig(lora={"enabled": True, "target_modules": ["nope"]}))
    assert load_config(DEFAULT, ["model.lora.enabled=true", "model.lora.r=4"]).model.lora == {"enabled": True, "r": 4}


def test_merged_copy_equals_the_peft_model():
    model, _ = tiny_lora(r=4, alpha=8)
    with torch.no_grad():  # lora_B starts at zero: give the adapters a real update
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    merged = merged_copy(model, model.state_dict())
    assert not is_peft(merged)
    ids = torch.randint(0, 100, (2, 12))
    model.eval()
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, merged(input_ids=ids).logits
        with model.disable_adapter():
            c = model(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(a, c, atol=1e-3)  # the adapters do change the output


LORA = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8", "train.max_steps=3", "optim.lr=1e-2",
        "optim.warmup_steps=0", "model.config.num_hidden_layers=2", "model.config.hidden_size=64",
        "model.config.intermediate_size=128"]


def check_lora_run(run_dir) -> None:
    """Adapters moved, base weights did not, final/ holds the adapter, and adapter + base = final/merged/."""
    start = initial_weights(DEFAULT, LORA)
    adapter = load_file(str(run_dir / "final" / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    b_keys = [k for k in adapter if "lora_B" in k]
    assert max(adapter[k].abs().max().item() for k in b_keys) > 0  # lora_B starts at zero

    merged = AutoModelForCausalLM.from_pretrained(run_dir / "final" / "merged")
    scale = 8 / 4
    changed = 0
    for name, w in merged.state_dict().items():
        peft_name = "base_model.model." + name
        lora_a = peft_name.replace(".weight", ".lora_A.weight")
        if lora_a in adapter:  # merged = base + scale * B @ A; the base part must be the initial weight
            delta = scale * adapter[lora_a.replace("lora_A", "lora_B")] @ adapter[lora_a]
            base = start[peft_name.replace(".weight", ".base_layer.weight")]
            assert torch.allclose(w - delta, base, atol=1e-5), name
            changed += 1
        elif peft_name in start:
            assert torch.equal(w, start[peft_name]), name  # frozen: embeddings, norms
    assert changed >= 14

    # the adapter in final/ on the untouched base gives the merged model's output
    base_model = AutoModelForCausalLM.from_pretrained(run_dir / "final" / "merged")
    base_model.load_state_dict({k.removeprefix("base_model.model.").replace(".base_layer", ""): v
                                for k, v in start.items() if "lora_" not in k}, strict=False)
    peft_model = PeftModel.from_pretrained(base_model, run_dir / "final").eval()
    ids = torch.randint(0, 200, (2, 16))
    with torch.no_grad():
        assert torch.allclose(peft_model(input_ids=ids).logits, merged.eval()(input_ids=ids).logits, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("accel", ["ddp", "zero3"])
def test_lora_under_ddp_and_zero3(tmp_path, accel):
    run_train([*FAST, *LORA, f"train.output_dir={tmp_path}"], nproc=2, accel=accel)
    check_lora_run(tmp_path)


# ----------------------------------------------------------------------------------------------- added tokens


def save_base(folder, tied: bool = True, vocab_size: int = 300):
    """A tiny pretrained-style base in `folder`: a llama saved with save_pretrained and a BPE tokenizer (trained on
    the sample data) without the chat markers, so that load_tokenizer adds them and build_model resizes."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    from tests.harness_launch import ROOT

    texts = [json.dumps(json.loads(line)) for line in (ROOT / "data" / "sample" / "gen.jsonl").read_text().splitlines()]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="</s>")
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    AutoModelForCausalLM.from_config(conf).save_pretrained(folder)
    return len(tok)


def load_adapter_on_base(base, final):
    """What a user does with final/ (docs/qlora.md): the original base, resized to the tokenizer saved with the
    adapter (the same padding to a multiple of 64 as in training), then the adapter."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(base)
    model.resize_token_embeddings(len(tok), pad_to_multiple_of=64)
    return PeftModel.from_pretrained(model, final).eval(), tok


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_added_token_rows_are_trained_and_saved_with_the_adapter(tmp_path, tied):
    """Regression: the chat markers added to a pretrained base's tokenizer used to keep random, frozen rows under
    LoRA, and final/ did not carry them."""
    base, run = tmp_path / "base", tmp_path / "run"
    n_base = save_base(base, tied)
    over = [*FAST, f"model.name_or_path={base}", "model.config={}", "model.tokenizer=null",
            "model.lora.enabled=true", "model.lora.r=4",
            "train.max_steps=4", "optim.lr=5e-2", "optim.warmup_steps=0", "train.micro_batch_size=4"]
    start = initial_weights(DEFAULT, over)
    run_train([*over, f"train.output_dir={run}"])
    final = run / "final"
    adapter = load_file(str(final / "adapter_model.safetensors"))
    deltas = {k: v for k, v in adapter.items() if "trainable_tokens_delta" in k}
    assert len(deltas) == (1 if tied else 2), sorted(adapter)  # embedding (+ untied head), not whole matrices
    assert not any(k.endswith(("embed_tokens.weight", "lm_head.weight")) for k in adapter)
    for k, v in deltas.items():
        assert v.shape[0] == 4  # the four chat markers, not the vocabulary's padding rows (AutoPeft: len(tok) rows)
        k0 = next(s for s in start if s.startswith(k.removesuffix(".weight").rsplit(".", 1)[0]) and "delta" in s)
        assert not torch.allclose(v, start[k0][:4]), k  # trained

    peft_model, tok = load_adapter_on_base(base, final)
    marker = tok.convert_tokens_to_ids("<|assistant|>")
    assert marker >= n_base
    emb = peft_model.get_input_embeddings()
    row = emb(torch.tensor([[marker]]))[0, 0]
    trained = deltas[next(k for k in deltas if "embed_tokens" in k)]
    assert torch.allclose(row, trained[marker - n_base], atol=1e-6)
    merged = AutoModelForCausalLM.from_pretrained(final / "merged").eval()
    ids = tok("<|user|>\nHow many people live in Dunmore?\n<|assistant|>\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        n = len(tok)  # every id the tokenizer has (the padding rows after them are not saved with the adapter)
        a, b = peft_model(input_ids=ids).logits[..., :n], merged(input_ids=ids).logits[..., :n]
        assert torch.allclose(a, b, atol=1e-4)
        out = peft_model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 5


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_added_token_rows_under_zero3_without_cuda_are_one_line(tmp_path):
    """Regression: LoRA on a base whose tokenizer lacks the chat markers, under ZeRO-3 without CUDA, stopped in peft's
    raw "Torch not compiled with CUDA enabled" traceback (peft gathers ZeRO-3's added rows onto CUDA only); now one
    line naming the key and what runs instead, before any step."""
    base = tmp_path / "base"
    save_base(base)
    proc = run_train([*FAST, f"model.name_or_path={base}", "model.config={}", "model.tokenizer=null",
                      "model.lora.enabled=true", "model.lora.r=4", "train.max_steps=2", "train.deepspeed=zero3",
                      f"train.output_dir={tmp_path / 'run'}"], check=False)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "CUDA enabled" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("harness: error:")]
    assert len(errors) == 1 and "'model.lora.enabled'" in errors[0] and "ZeRO-3 needs a CUDA GPU" in errors[0], errors
    assert "train.deepspeed=zero2" in errors[0]
    assert not (tmp_path / "run" / "metrics.jsonl").is_file() or not (tmp_path / "run" / "metrics.jsonl").read_text()


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def added_tokens_run(request, tmp_path_factory):
    """A LoRA run on a local pretrained base whose tokenizer gets the chat markers (vocabulary resized, padded to 64),
    with its last checkpoint loaded into the trained model (the reference for final/)."""
    from harness.model import load_run_tokenizer

    tmp = tmp_path_factory.mktemp("added-tokens")
    base, run = tmp / "base", tmp / "run"
    save_base(base, request.param)
    over = [*FAST, f"model.name_or_path={base}", "model.config={}", "model.tokenizer=null",
            "model.lora.enabled=true", "model.lora.r=4", "train.max_steps=2", "train.save_every_steps=2",
            "optim.lr=5e-2", "optim.warmup_steps=0", "train.micro_batch_size=4"]
    run_train([*over, f"train.output_dir={run}"])
    cfg = load_config(DEFAULT, over)
    trained = build_model(cfg.model, load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode))
    missing, unexpected = trained.load_state_dict(load_file(str(run / "checkpoints/step-2/model.safetensors")),
                                                  strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)  # a tied head: saved once
    return request.param, base, run, trained.eval()


def every_token_diff(model, trained, n_tokens: int) -> float:
    """Max abs difference of the logits over every id the tokenizer has, as input and as output."""
    ids = torch.arange(n_tokens - n_tokens % 4).reshape(4, -1)
    with torch.no_grad():
        a = model(input_ids=ids).logits[..., :n_tokens]
        b = trained(input_ids=ids).logits[..., :n_tokens]
    return (a - b).abs().max().item()


def test_an_adapter_with_added_tokens_gives_the_trained_logits_for_every_id(added_tokens_run):
    """Regression: peft's one-line loader (AutoPeftModelForCausalLM.from_pretrained(final)) raised IndexError: it
    resizes the base to len(tokenizer), and the adapter's trainable_token_indices included the vocabulary's padding
    rows. Now the adapter holds the tokenizer's rows: AutoPeft, the manual recipe (resize, PeftModel) and
    final/merged/ give the trained model's logits for every id the tokenizer has."""
    from peft import AutoPeftModelForCausalLM

    tied, base, run, trained = added_tokens_run
    final = run / "final"
    auto = AutoPeftModelForCausalLM.from_pretrained(final).eval()
    manual, tok = load_adapter_on_base(base, final)
    merged = AutoModelForCausalLM.from_pretrained(final / "merged").eval()
    assert auto.get_base_model().config.vocab_size == len(tok)  # AutoPeft's resize: no padding
    for name, model in (("AutoPeft", auto), ("manual", manual), ("merged", merged)):
        diff = every_token_diff(model, trained, len(tok))
        print(f"{'tied' if tied else 'untied'}: {name} vs the trained model, {len(tok)} ids, max abs diff {diff:.3g}")
        assert diff <= 1e-5, (name, diff)


def test_an_adapter_saved_with_padding_rows_is_trimmed_to_load(added_tokens_run, tmp_path):
    """An adapter saved the old way (the padding rows in trainable_token_indices) fails AutoPeft with IndexError;
    trim_padding_rows rewrites it in place, and it then gives the trained model's logits."""
    from peft import AutoPeftModelForCausalLM

    from harness.checkpoint.adapter_tokens import padding_indices, trim_padding_rows

    _, _, run, trained = added_tokens_run
    old = tmp_path / "old"
    from transformers import AutoTokenizer

    trained.save_pretrained(old, save_embedding_layers=False)
    AutoTokenizer.from_pretrained(run / "final").save_pretrained(old)
    n = len(AutoTokenizer.from_pretrained(old))
    assert padding_indices(old, n)
    with pytest.raises(IndexError):
        AutoPeftModelForCausalLM.from_pretrained(old)
    assert trim_padding_rows(old) and not padding_indices(old, n)
    assert not trim_padding_rows(old)  # idempotent
    assert every_token_diff(AutoPeftModelForCausalLM.from_pretrained(old).eval(), trained, n) <= 1e-5


def test_random_init_lora_export_names_its_base(tmp_path):
    """A random-init LoRA run's base exists nowhere else: final/base/ holds it and adapter_config.json names it, so
    the adapter loads the way peft loads any adapter, and equals final/merged/."""
    run_train([*FAST, "train.max_steps=2", "model.lora.enabled=true", "model.lora.r=4", "optim.lr=5e-2",
               f"train.output_dir={tmp_path}"])
    final = tmp_path / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((final / "base").resolve())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    peft_model = PeftModel.from_pretrained(base, final).eval()
    merged = AutoModelForCausalLM.from_pretrained(final / "merged").eval()
    from peft import AutoPeftModelForCausalLM

    auto = AutoPeftModelForCausalLM.from_pretrained(final).eval()  # peft's one-line loader
    ids = torch.randint(0, 200, (2, 16))
    with torch.no_grad():
        assert torch.allclose(peft_model(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4)
        assert torch.allclose(auto(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4)


def test_a_copied_lora_run_folder_loads_with_peft_from_another_folder(tmp_path, monkeypatch):
    """A random-init LoRA run started in orig/ with output_dir runs/lora: adapter_config.json names the base by its
    path from there (runs/lora/final/base), so the run folder copied to copy/runs/ (the original deleted) loads with
    peft's one-line AutoPeftModelForCausalLM from copy/, and with PeftModel over final/base from any folder; the
    logits equal the original's (1e-5: the same weights and the same float32 CPU kernels) and generation agrees."""
    orig = tmp_path / "orig"
    orig.mkdir()
    run_train([*FAST, "train.max_steps=2", "model.lora.enabled=true", "model.lora.r=4", "optim.lr=5e-2",
               f"data.train_files=[{ROOT / 'data' / 'sample' / 'gen.jsonl'}]", "train.output_dir=runs/lora"], cwd=orig)
    final = orig / "runs" / "lora" / "final"
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == "runs/lora/final/base"
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    original = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(final / "base"), final).eval()
    with torch.no_grad():
        want = original(input_ids=ids).logits
        want_gen = original.generate(input_ids=ids[:1, :8], max_new_tokens=6, do_sample=False)

    shutil.copytree(orig / "runs", tmp_path / "copy" / "runs")
    shutil.rmtree(orig)
    monkeypatch.chdir(tmp_path / "copy")
    auto = AutoPeftModelForCausalLM.from_pretrained("runs/lora/final").eval()  # peft's one-line loader
    monkeypatch.chdir(tmp_path)
    copied = tmp_path / "copy" / "runs" / "lora" / "final"
    anywhere = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(copied / "base"), copied).eval()
    with torch.no_grad():
        for model in (auto, anywhere):
            assert (model(input_ids=ids).logits - want).abs().max().item() <= 1e-5
            gen = model.generate(input_ids=ids[:1, :8], max_new_tokens=6, do_sample=False)
            assert gen.shape == (1, 14) and torch.equal(gen, want_gen)

    # final/ alone, copied into another tree and loaded from a third folder (issue 74): with the call its model card
    # (final/README.md) and docs/run-folder.md give, base/ read from the adapter's folder; and with harness's own
    # loader (`harness chat`), which resolves the stored base relative to the adapter, also without merged/
    alone = tmp_path / "elsewhere" / "adapter"
    shutil.copytree(copied, alone)
    shutil.rmtree(alone / "merged")
    shutil.rmtree(tmp_path / "copy")
    (tmp_path / "third").mkdir()
    monkeypatch.chdir(tmp_path / "third")
    card = (alone / "README.md").read_text()
    assert '/base")\nmodel = PeftModel.from_pretrained(base' in card and "wherever the folder was copied" in card, card
    from harness.checkpoint.export import adapter_base
    from harness.tools.chat import load_model

    assert adapter_base(alone) == str(alone / "base")
    with pytest.raises((OSError, ValueError)):  # peft's one-liner reads runs/lora/final/base from here
        AutoPeftModelForCausalLM.from_pretrained(str(alone))
    card_call = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(f"{alone}/base"), str(alone)).eval()
    with torch.no_grad():
        for model in (card_call, load_model(str(alone), "cpu")):
            assert (model(input_ids=ids).logits - want).abs().max().item() <= 1e-5
            assert torch.equal(model.generate(input_ids=ids[:1, :8], max_new_tokens=6, do_sample=False), want_gen)


def test_a_pretrained_base_trains_in_train_mode(tmp_path):
    """from_pretrained returns a model in eval mode; the harness trained it so (dropout off) until the first
    evaluation switched it back, with or without LoRA on top (its new modules alone in train mode). Every module of
    the built model must be in train mode."""
    from tests.harness_launch import DEFAULT

    save_base(tmp_path / "base")
    for lora in ("false", "true"):
        cfg = load_config(DEFAULT,
                          [f"model.name_or_path={tmp_path / 'base'}", "model.config={}", "model.tokenizer=null",
                           f"model.lora.enabled={lora}"])
        model = build_model(cfg.model, load_tokenizer(cfg.model, markers=False))
        assert not [name for name, m in model.named_modules() if not m.training], lora
