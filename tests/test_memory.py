"""harness/tools/zero_plan.py: parameter counts on the meta device, model-state bytes per ZeRO stage, the activation estimate
against the tensors torch really saves for backward, and the stage choice.

    .venv/bin/python -m pytest tests/test_memory.py
"""

from __future__ import annotations

import pytest
import torch

from harness.config import load_config
from harness.model import build_model, count_parameters, load_tokenizer
from harness.tools.sizing import ModelShape, activation_terms, model_shape
from harness.tools.zero_plan import GIB, Hardware, main, plan, state_row

SHAPE = ModelShape(params=10**9, hidden=2048, intermediate=5632, layers=20, heads=16, kv_heads=4, vocab=32000,
                   model_type="llama", layer_params=40_000_000, embed_params=65_536_000)


def test_meta_count_equals_the_built_model():
    cfg = load_config("configs/default.yaml")
    shape = model_shape(cfg)
    model = build_model(cfg.model, load_tokenizer(cfg.model))
    assert shape.params == count_parameters(model)
    assert (shape.hidden, shape.intermediate, shape.layers, shape.heads, shape.kv_heads) == (256, 688, 4, 4, 4)
    assert shape.layer_params == sum(p.numel() for p in model.model.layers[0].parameters())


@pytest.mark.parametrize("recipe, params", [("configs/llama-7b.yaml", 6_738_415_616),     # Llama-2-7B, published
                                            ("configs/llama-70b.yaml", 68_976_648_192)])  # Llama-2-70B
def test_meta_count_of_the_sizing_recipes(recipe, params):
    shape = model_shape(load_config(recipe))
    assert shape.params == params
    h, i, hkv = shape.hidden, shape.intermediate, shape.kv_heads * (shape.hidden // shape.heads)
    assert shape.layer_params == 2 * h * h + 2 * h * hkv + 3 * h * i + 2 * h  # q, o + k, v + MLP + 2 norms


def test_state_bytes_partitioned_by_stage():
    """train.weights=fp32 (the default): fp32 weights and gradients on every stage, the optimizer updating the weights
    themselves (DeepSpeed's torch_autocast); bf16: DeepSpeed's bf16 mode, 16-bit weights and gradients plus an fp32
    master copy. 16 bytes a parameter either way; what is partitioned differs."""
    P, N = SHAPE.params, 8
    hw = Hardware(gpus_per_node=8, gpu_mem_gb=80)
    options = ("0", "1", "2", "3", "3-offload")
    rows = {o: state_row(o, SHAPE, hw, activations=0, overhead=0) for o in options}
    assert (rows["0"].weights, rows["0"].grads, rows["0"].optim, rows["0"].extra) == (4 * P, 4 * P, 8 * P, 4 * P)
    assert (rows["1"].weights, rows["1"].grads, rows["1"].optim) == (4 * P, 4 * P, 8 * P / N)
    assert (rows["2"].weights, rows["2"].grads, rows["2"].optim) == (4 * P, 4 * P / N, 8 * P / N)
    assert (rows["3"].weights, rows["3"].grads, rows["3"].optim) == (4 * P / N, 4 * P / N, 8 * P / N)
    assert rows["3"].extra == 2 * 65_536_000 * 4  # two gathered embeddings (the largest unit) in fp32
    assert rows["3-offload"].total == rows["3"].extra and rows["3-offload"].host == 16 * P  # 1 node holds it all
    b16 = {o: state_row(o, SHAPE, hw, 0, 0, weights="bf16") for o in options}
    # stage 0 with bf16 weights is DeepSpeed without ZeRO (fp32 master copies), its gradient buckets 16-bit
    assert (b16["0"].weights, b16["0"].grads, b16["0"].optim, b16["0"].extra) == (2 * P, 2 * P, 12 * P, 2 * P)
    assert (b16["1"].weights, b16["1"].grads, b16["1"].optim) == (2 * P, 2 * P, 12 * P / N)
    assert (b16["2"].weights, b16["2"].grads, b16["2"].optim) == (2 * P, 2 * P / N, 12 * P / N)
    assert (b16["3"].weights, b16["3"].grads, b16["3"].optim) == (2 * P / N, 2 * P / N, 12 * P / N)
    assert b16["3"].extra == 2 * 65_536_000 * 2  # in bf16
    assert b16["3-offload"].total == b16["3"].extra and b16["3-offload"].host == 18 * P
    fp16 = state_row("1", SHAPE, hw, 0, 0, weights="fp16")  # DeepSpeed's fp16 mode: 16-bit too
    assert (fp16.weights, fp16.grads, fp16.optim) == (2 * P, 2 * P, 12 * P / N)
    assert state_row("0", SHAPE, hw, 0, 0, weights="fp16").weights == 4 * P  # DDP with fp16 autocast
    two_nodes = state_row("3-offload", SHAPE, Hardware(8, 80, nodes=2), 0, 0, weights="bf16")
    assert two_nodes.host == 18 * P / 2
    one = state_row("0", SHAPE, Hardware(1, 80), 0, 0)
    assert one.extra == 0 and one.total == 16 * P  # no DDP buckets in a single process
    fp32 = state_row("1", SHAPE, hw, 0, 0)
    assert (fp32.weights, fp32.grads, fp32.optim) == (4 * P, 4 * P, 8 * P / N)


def test_activation_arithmetic_by_hand():
    cfg = load_config("configs/default.yaml", ["train.micro_batch_size=2", "data.max_len=1024"])
    h, hkv, i, T, L = 2048, 512, 5632, 2048, 20
    per = 8 * h + 2 * (5 * h + 3 * hkv + 4 * i)
    _, full = activation_terms(cfg, SHAPE, 2)
    assert full == L * T * per + T * 32000 * 10
    cfg.model.gradient_checkpointing = True
    _, ckpt = activation_terms(cfg, SHAPE, 2)
    assert ckpt == L * T * h * 2 + T * per + T * 32000 * 10
    cfg.model.attn_implementation = "eager"
    _, eager = activation_terms(cfg, SHAPE, 2)
    assert eager - ckpt == T * 16 * 1024 * 6
    emb = load_config("configs/gritlm-tiny.yaml", ["loss.mode=embedding", "train.emb_micro_batch_size=8",
                                                   "data.train_group_size=2", "data.query_max_len=32",
                                                   "data.passage_max_len=64", "loss.grad_cache_chunks=2"])
    _, e = activation_terms(emb, SHAPE, 2)
    tokens = 8 // 2 * (32 + 2 * 64)
    assert e == L * tokens * (8 * h + 2 * (5 * h + 3 * hkv + 4 * i))  # no logits in an embedding pass


def _saved_bytes(layers: int, checkpointing: bool) -> tuple[int, object]:
    """Bytes of the tensors autograd keeps for backward in a bf16 forward of the default model (weights excluded)."""
    cfg = load_config("configs/default.yaml", [f"model.config.num_hidden_layers={layers}",
                                               f"model.gradient_checkpointing={str(checkpointing).lower()}"])
    torch.manual_seed(0)
    model = build_model(cfg.model, load_tokenizer(cfg.model), dtype=torch.bfloat16)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 2000, (4, 64))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return sum(n for ptr, n in seen.items() if ptr not in weights), cfg


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_estimate_matches_what_torch_saves(checkpointing):
    # two extra decoder layers: the difference is exactly what the per-layer formula predicts (within 5%)
    (four, cfg), (two, _) = _saved_bytes(4, checkpointing), _saved_bytes(2, checkpointing)
    shape = model_shape(cfg)
    T = 4 * 64
    h, i = shape.hidden, shape.intermediate
    per_layer = T * h * 2 if checkpointing else T * (8 * h + 2 * (5 * h + 3 * h + 4 * i))
    assert (four - two) / (2 * per_layer) == pytest.approx(1.0, abs=0.05)


def test_choice_and_exit_codes(capsys):
    cfg = load_config("configs/default.yaml")
    p = plan(cfg, Hardware(8, 80), shape=SHAPE)
    assert p.choice == "0" and p.text.endswith("choice: zero0")  # 1B fits plainly in DDP on 80 GB
    assert plan(cfg, Hardware(8, 24), shape=SHAPE).choice == "1"
    assert plan(cfg, Hardware(8, 13), shape=SHAPE).choice == "2"
    assert plan(cfg, Hardware(8, 10), shape=SHAPE).choice == "3"
    # bf16 weights keep 2 bytes less per parameter on every GPU under ZeRO-1/2: a lower stage fits
    bf16w = load_config("configs/default.yaml", ["train.weights=bf16"])
    assert plan(bf16w, Hardware(8, 12), shape=SHAPE).choice == "2" and plan(cfg, Hardware(8, 12), shape=SHAPE).choice == "3"
    assert "16-bit weights 2 + grads 2 + fp32 master 4" in plan(bf16w, Hardware(8, 12), shape=SHAPE).text
    assert plan(cfg, Hardware(8, 7.5, host_mem_gb=64), shape=SHAPE).choice == "3-offload"
    none = plan(cfg, Hardware(8, 7.5, host_mem_gb=8), shape=SHAPE)
    assert none.choice is None and none.text.endswith("choice: none") and "no stage fits" in none.text
    for r in p.rows:  # the printed table is the arithmetic
        assert f"{r.total / GIB:>9.1f}" in p.text
    assert main(["configs/default.yaml", "--gpus", "8", "--gpu-mem-gb", "0.5"]) == 3
    assert "choice: none" in capsys.readouterr().out
    assert main(["configs/default.yaml", "--gpus", "1", "--gpu-mem-gb", "24", "train.bogus=1"]) == 2
    assert capsys.readouterr().err.strip() == "harness: error: unknown config key 'train.bogus'"


def test_harness_zero_plan_command(capsys):
    from harness import cli

    assert cli.main(["zero-plan", "configs/default.yaml", "--gpus", "2", "--gpu-mem-gb", "16"]) == 0
    out = capsys.readouterr().out
    assert "1 node(s) x 2 GPU(s) of 16 GiB = 2 data-parallel processes" in out
    assert out.rstrip().endswith("lowest stage that fits: 0 -> accelerate_configs/multi_gpu.yaml\nchoice: zero0")
