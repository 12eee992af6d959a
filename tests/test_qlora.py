"""QLoRA: model.quantization=4bit|8bit through bitsandbytes (harness/lora.py quantization_kwargs and merged_copy,
harness/model.py build_model; config checks in harness/config/checks.py check_quantization). Real bitsandbytes on the
CPU, no mocks.

    .venv/bin/python -m pytest tests/test_qlora.py            # -m "not slow" for the config checks only
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from harness.config import load_config
from harness.errors import ConfigError
from tests.harness_launch import DEFAULT, FAST, run_train
from tests.test_lora import load_adapter_on_base, save_base

pytest.importorskip("bitsandbytes")


def test_quantization_config_checks(tmp_path):
    q = ["model.quantization=4bit", "model.name_or_path=some/model", "model.config={}"]
    with pytest.raises(ConfigError, match="model.quantization.*model.lora.enabled=true"):
        load_config(DEFAULT, q)
    with pytest.raises(ConfigError, match="model.quantization.*pretrained"):
        load_config(DEFAULT, ["model.quantization=4bit", "model.lora.enabled=true"])  # from model.config
    with pytest.raises(ConfigError, match="model.quantization.*pretrained"):
        load_config(DEFAULT, [*q, "model.lora.enabled=true", "model.random_init=true"])
    for ds in ("zero3", "zero3_offload"):
        with pytest.raises(ConfigError, match="ZeRO-3.*ZeRO stage 0, 1 or 2") as e:
            load_config(DEFAULT, [*q, "model.lora.enabled=true", f"train.deepspeed={ds}"])
        assert "\n" not in str(e.value)
    for ds in ("zero1", "zero2"):
        load_config(DEFAULT, [*q, "model.lora.enabled=true", f"train.deepspeed={ds}"])
    with pytest.raises(ConfigError, match="model.quantization"):
        load_config(DEFAULT, ["model.quantization=2bit"])
    assert load_config(DEFAULT, [*q, "model.lora.enabled=true"]).model.quantization == "4bit"


def test_missing_bitsandbytes_is_one_line(monkeypatch):
    from harness import lora

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'harness\[qlora\]'") as e:
        lora.quantization_kwargs("4bit", "fp32")
    assert "\n" not in str(e.value)


def test_compute_dtype_follows_precision():
    from harness.lora import quantization_kwargs

    assert quantization_kwargs("4bit", "bf16")["quantization_config"].bnb_4bit_compute_dtype == torch.bfloat16
    qc = quantization_kwargs("4bit", "fp32")["quantization_config"]
    assert (qc.bnb_4bit_compute_dtype, qc.bnb_4bit_quant_type, qc.bnb_4bit_use_double_quant) == \
        (torch.float32, "nf4", True)
    assert quantization_kwargs("8bit", "fp32")["quantization_config"].load_in_8bit


@pytest.mark.slow
def test_qlora_4bit_trains_on_cpu(tmp_path):
    """build_model + the harness's optimizer on a 4-bit base: adapters change, the loss on one fixed batch falls."""
    from harness.lora import is_quantized
    from harness.model import build_model, load_tokenizer
    from harness.optim import build_optimizer

    save_base(tmp_path / "base")
    cfg = load_config(DEFAULT, [f"model.name_or_path={tmp_path / 'base'}", "model.config={}", "model.tokenizer=null",
                                "model.quantization=4bit", "model.lora.enabled=true", "model.lora.r=8",
                                "optim.lr=1e-2", "optim.weight_decay=0"])
    tok = load_tokenizer(cfg.model)
    torch.manual_seed(0)
    model = build_model(cfg.model, tok, precision="fp32")
    assert is_quantized(model)
    import bitsandbytes as bnb

    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj
    assert hasattr(q_proj, "lora_A") and isinstance(q_proj.base_layer, bnb.nn.Linear4bit)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = build_optimizer(model, cfg.optim)
    ids = tok(["<|user|>\nthe cat sat on the mat\n<|assistant|>\nhello world"] * 4, return_tensors="pt")["input_ids"]
    losses = []
    for _ in range(30):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, start[n])]
    assert len(moved) == len(start)  # every adapter and the added tokens' rows


def test_an_evaluation_pass_leaves_the_4bit_weights_as_training_uses_them(tmp_path):
    """bitsandbytes 0.50 repacks a 4-bit layer's weight in place for its AVX512-BF16 CPU kernel the first time the
    layer runs in eval mode without gradients (an evaluation pass, the RL engine's generation): on such a CPU the
    repack failed on this model's small layers ("shape '[32, 0]' is invalid"), and on wider ones the
    training passes after it ran the repacked weight (absmax in bf16: 7e-3 off on a 64 x 64 layer). build_model keeps
    the layout training uses, so an evaluation pass changes nothing: the same process, the same inputs and kernels,
    so the losses before and after are compared exactly. (On a CPU without AVX512-BF16 bitsandbytes never repacks.)"""
    import bitsandbytes as bnb

    from harness.model import build_model, load_tokenizer

    save_base(tmp_path / "base")
    cfg = load_config(DEFAULT, [f"model.name_or_path={tmp_path / 'base'}", "model.config={}", "model.tokenizer=null",
                                "model.quantization=4bit", "model.lora.enabled=true", "model.lora.r=8"])
    tok = load_tokenizer(cfg.model)
    model = build_model(cfg.model, tok, precision="fp32")
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and not any(m.support_avx512bf16_for_cpu for m in layers)
    ids = tok(["<|user|>\nthe cat sat on the mat\n<|assistant|>\nhello world"] * 2, return_tensors="pt")["input_ids"]
    before = model(input_ids=ids, labels=ids).loss
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    model.train()
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)
    assert torch.equal(model(input_ids=ids, labels=ids).loss, before)


@pytest.mark.slow
def test_qlora_run_exports_adapter_and_merged_model(tmp_path):
    """A QLoRA run (resumed once from a checkpoint): final/ holds the adapter, which loads onto the original base;
    final/merged/ is that unquantized base with the adapter merged in."""
    base, run = tmp_path / "base", tmp_path / "run"
    save_base(base)
    over = [*FAST, f"model.name_or_path={base}", "model.config={}", "model.tokenizer=null", "model.quantization=4bit",
            "model.lora.enabled=true", "model.lora.r=4", "train.max_steps=4", "optim.lr=5e-2",
            "optim.warmup_steps=0", "train.micro_batch_size=4", f"train.output_dir={run}"]
    run_train([*over, "train.stop_at_step=2"])
    out = run_train(over).stdout
    assert "resumed from" in out
    final = run / "final"
    adapter = load_file(str(final / "adapter_model.safetensors"))
    assert all("lora_" in k or "trainable_tokens_delta" in k for k in adapter)
    assert max(v.abs().max().item() for k, v in adapter.items() if "lora_B" in k) > 0
    peft_model, tok = load_adapter_on_base(base, final)
    merged = AutoModelForCausalLM.from_pretrained(final / "merged").eval()
    assert getattr(merged.config, "quantization_config", None) is None
    ids = tok("<|user|>\nHow many people live in Dunmore?\n<|assistant|>\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        # the tokenizer's ids: the vocabulary's padding rows are no token (the adapter leaves them out, so a loader's
        # resize draws them afresh; adapter_tokens.py)
        n = len(tok)
        assert torch.allclose(peft_model(input_ids=ids).logits[..., :n], merged(input_ids=ids).logits[..., :n],
                              atol=1e-4)
        assert merged.generate(input_ids=ids, max_new_tokens=4, do_sample=False).shape[1] == ids.shape[1] + 4
    assert isinstance(peft_model, PeftModel)


@pytest.mark.slow
def test_qlora_grpo_with_a_reference_trains_on_cpu(tmp_path):
    """loss.mode=rl on a 4-bit base with LoRA and rl.beta > 0: the engine samples the adapted quantized model (its
    bitsandbytes layers eagerly), the reference is the same model with its adapters disabled; 2 steps train, the KL
    to the reference moves off 0 after the first update."""
    from tests.harness_launch import ROOT, metrics

    base = tmp_path / "base"
    save_base(base)
    out = tmp_path / "run"
    run_train([f"model.name_or_path={base}", "model.lora.enabled=true", "model.quantization=4bit", "rl.beta=0.1",
               "rl.reward=rl_rewards:digits", "train.max_steps=2", "rl.questions_per_step=2", "rl.num_generations=4",
               "rft.max_new_tokens=8", "rft.num_test_questions=4", "train.eval_at_start=false", "optim.lr=1e-2",
               "optim.warmup_steps=0", "train.summary=false", "train.progress_bar=false", "train.log_every=1",
               f"train.output_dir={out}"], config=str(ROOT / "configs/grpo-tiny.yaml"),
              extra_env={"PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}"})
    steps = [m for m in metrics(out) if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2] and steps[0]["kl"] == pytest.approx(0, abs=1e-6)
    assert steps[1]["kl"] > 0 and all(m["gen_calls"] == 1 for m in steps)
