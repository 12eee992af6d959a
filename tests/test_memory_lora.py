"""harness/tools/zero_plan.py for LoRA / QLoRA (issue 16), the activation-checkpointing proposal, and the sizing recipes that
carry a hub id plus model.config (sized offline).

    .venv/bin/python -m pytest tests/test_memory_lora.py
"""

from __future__ import annotations

import pytest

from harness.config import load_config
from harness.tools.sizing import ModelShape
from harness.tools.zero_plan import GIB, QUANT_BYTES, Hardware, main, plan, state_row

P_70B = 68_976_648_192  # Llama-2-70B, published


def lora_params(r, layers, h, hkv, i):
    """r x (in + out) for q, o (h -> h), k, v (h -> h_kv), gate, up (h -> i), down (i -> h), per layer."""
    return layers * r * (2 * (h + h) + 2 * (h + hkv) + 3 * (h + i))


def checkpointed_activations(layers, tokens, h, hkv, i, vocab, b=2, logit_positions=None):
    """logit_positions: one chunk of the chunked loss (loss.chunked_ce) instead of every token's logits."""
    per = 8 * h + b * (5 * h + 3 * hkv + 4 * i)
    return layers * tokens * h * b + tokens * per + (logit_positions or tokens) * vocab * 10


def test_70b_lora_on_8x80_fits_zero3():
    cfg = load_config("configs/llama-70b.yaml", ["model.lora.enabled=true"])
    p = plan(cfg, Hardware(8, 80, host_mem_gb=2000), source="configs/llama-70b.yaml")
    h, hkv, i, L, N = 8192, 1024, 28672, 80, 8
    T = lora_params(8, L, h, hkv, i)
    assert T == 103_546_880 and p.shape.trainable == T and p.shape.frozen == P_70B
    # stages 0-2 keep the whole frozen fp32 base (4 x 69.0B = 257 GiB) on every GPU: too big; ZeRO-3 partitions it
    assert [r.total / GIB > 72 for r in p.rows[:3]] == [True] * 3
    layer = 2 * h * h + 2 * h * hkv + 3 * h * i + 2 * h + T // L  # the largest layer, adapters included
    act = checkpointed_activations(L, 4096, h, hkv, i, 32000, logit_positions=1024)
    s3 = (4 * P_70B + 4 * T) / N + 4 * T / N + 8 * T / N + 2 * layer * 4 + act + 2 * GIB  # fp32 weights (default)
    assert p.choice == "3" and p.rows[3].total == pytest.approx(s3)
    assert s3 / GIB == pytest.approx(47.5, abs=0.05)  # the chunked loss: 1,024 positions of logits at a time
    assert "logits: chunked (loss.chunked_ce=auto), one chunk at a time: 1,024 x 32000" in p.text
    assert f"{s3 / GIB:>9.1f}  fits" in p.text and p.text.endswith("choice: zero3")
    # train.weights=bf16: DeepSpeed's bf16 mode stores the frozen base in 2 bytes
    b16 = plan(load_config("configs/llama-70b.yaml", ["model.lora.enabled=true", "train.weights=bf16"]),
               Hardware(8, 80, host_mem_gb=2000))
    s3_b16 = (2 * P_70B + 2 * T) / N + 2 * T / N + 12 * T / N + 2 * layer * 2 + act + 2 * GIB
    assert b16.choice == "3" and b16.rows[3].total == pytest.approx(s3_b16) and s3_b16 / GIB == pytest.approx(28.2, abs=0.05)
    assert f"trainable T = {T:,}" in p.text and f"frozen base F = {P_70B:,}" in p.text
    assert main(["configs/llama-70b.yaml", "--gpus", "8", "--gpu-mem-gb", "80", "model.lora.enabled=true"]) == 0


def test_70b_qlora_is_not_partitioned_and_fits_stage0():
    # the sizing recipe has no hub id: QLoRA needs one (config validation), the shape stays model.config's
    cfg = load_config("configs/llama-70b.yaml", ["model.lora.enabled=true", "model.quantization=4bit",
                                                 "model.name_or_path=meta-llama/Llama-2-70b-hf"])
    p = plan(cfg, Hardware(8, 80, host_mem_gb=2000))
    h, hkv, i, L = 8192, 1024, 28672, 80
    T, linear = lora_params(8, L, h, hkv, i), L * (2 * h * h + 2 * h * hkv + 3 * h * i)
    rest = P_70B - linear
    s0 = linear * QUANT_BYTES["4bit"] + rest * 4 + 4 * T + 4 * T + 8 * T + 4 * T \
        + checkpointed_activations(L, 4096, h, hkv, i, 32000, logit_positions=1024) + 2 * GIB  # the chunked loss
    assert p.choice == "0" and p.rows[0].total == pytest.approx(s0)
    assert [r.supported for r in p.rows] == [True, True, True, False, False]
    assert p.text.count("not supported (model.quantization=4bit") == 2


def test_8b_qlora_on_one_24gb_gpu_fits_stage0():
    cfg = load_config("configs/llama3-8b-qlora.yaml")
    p = plan(cfg, Hardware(1, 24, host_mem_gb=64), source="configs/llama3-8b-qlora.yaml")
    h, hkv, i, L, V = 4096, 1024, 14336, 32, 128256
    T = lora_params(16, L, h, hkv, i)
    linear = L * (2 * h * h + 2 * h * hkv + 3 * h * i)
    rest = 2 * V * h + (2 * L + 1) * h  # embedding, untied head, norms
    assert (p.shape.trainable, p.shape.linear_params, p.shape.frozen - linear) == (T, linear, rest)
    assert QUANT_BYTES["4bit"] == pytest.approx(0.5159, abs=1e-4)
    # stage 0, one process: quantized Linears + fp32 rest + trainable fp32 weights, grads, Adam; no DDP buckets
    # the chunked loss, also through LoRA's trainable tokens on the head (the hub tokenizer gets the chat markers)
    s0 = linear * QUANT_BYTES["4bit"] + rest * 4 + 16 * T \
        + checkpointed_activations(L, 2 * 2048, h, hkv, i, V, logit_positions=1024) + 2 * GIB
    assert p.choice == "0" and p.rows[0].total == pytest.approx(s0) and s0 / GIB < 17.2
    assert "sizing offline from model.config" in p.text
    assert p.text.endswith("lowest stage that fits: 0 -> accelerate_configs/single_gpu.yaml\nchoice: zero0")


def test_full_70b_plan_unchanged():
    cfg = load_config("configs/llama-70b.yaml")
    p = plan(cfg, Hardware(8, 80, host_mem_gb=2000))
    assert p.shape.trainable is None and p.shape.params == P_70B
    for o, r in zip(("0", "1", "2", "3"), p.rows):
        ref = state_row(o, ModelShape(**{**p.shape.__dict__}), Hardware(8, 80), r.activations, r.overhead)
        assert (r.weights, r.grads, r.optim, r.extra) == (ref.weights, ref.grads, ref.optim, ref.extra)
    assert p.rows[3].weights == 4 * P_70B / 8 and p.rows[3].optim == 8 * P_70B / 8
    assert p.choice == "3-offload" and p.proposal is None and "proposed:" not in p.text


SHAPE_1B = ModelShape(params=10**9, hidden=2048, intermediate=5632, layers=20, heads=16, kv_heads=4, vocab=32000,
                      model_type="llama", layer_params=40_000_000, embed_params=65_536_000)


def test_1b_on_one_24gb_gpu_proposes_checkpointing_before_offload():
    cfg = load_config("configs/default.yaml", ["train.micro_batch_size=4", "data.max_len=2048"])
    p = plan(cfg, Hardware(1, 24, host_mem_gb=64), shape=SHAPE_1B)
    # without checkpointing: 16 x 1e9 B = 14.9 GiB of states + 20 layers of activations (13 GiB) + logits: too big
    assert p.choice == "3-offload" and p.proposal == "0"
    with_ckpt = 16 * 10**9 + checkpointed_activations(20, 8192, 2048, 512, 5632, 32000, logit_positions=1024) \
        + 2 * GIB
    assert with_ckpt / GIB == pytest.approx(18.5, abs=0.05)
    assert (f"with activation checkpointing (model.gradient_checkpointing=true): activations "
            f"{(with_ckpt - 16 * 10**9 - 2 * GIB) / GIB:.1f} GiB, stage 0 fits at {with_ckpt / GIB:.1f} GiB") in p.text
    assert "proposed: zero0 model.gradient_checkpointing=true -> accelerate_configs/single_gpu.yaml" in p.text
    assert p.text.endswith("choice: zero3_offload")
    # already on: no proposal; nothing fits even with it: none
    on = load_config("configs/default.yaml", ["train.micro_batch_size=4", "data.max_len=2048",
                                              "model.gradient_checkpointing=true"])
    assert plan(on, Hardware(1, 24, host_mem_gb=64), shape=SHAPE_1B).proposal is None
    assert plan(cfg, Hardware(1, 12, host_mem_gb=8), shape=SHAPE_1B).proposal is None


@pytest.mark.parametrize("recipe", ["configs/qwen2.5-0.5b-sft.yaml", "configs/llama3-8b-qlora.yaml"])
def test_hub_recipes_load_and_plan_offline(recipe, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config(recipe)
    assert cfg.model.name_or_path and "model_type" in cfg.model.config
    assert main([recipe, "--gpus", "1", "--gpu-mem-gb", "24", "--host-mem-gb", "64"]) == 0
    out = capsys.readouterr().out
    assert "sizing offline from model.config" in out and out.rstrip().endswith("choice: zero0")
    if "qwen" in recipe:
        assert "P = 494,032,768 parameters" in out  # Qwen2.5-0.5B, published (tied embeddings)
