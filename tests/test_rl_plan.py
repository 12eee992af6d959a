"""loss.mode=rl in the plans (harness/tools/rl_plan.py): the generation's KV cache in `harness zero-plan` (by hand and
against the engine's own sizing), and a step's time split into generation and training in `harness plan`.

    .venv/bin/python -m pytest tests/test_rl_plan.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness.config import load_config
from harness.tools import plan_arithmetic, planner, rl_plan
from harness.tools.plan_arithmetic import Calibration
from harness.tools.zero_plan import GIB, Hardware, plan

# the model of tests/test_rl.py: 2 layers, 4 heads of 8 (hidden 32), 2 key/value heads
TINY = ["model.name_or_path=null", "model.tokenizer=bundled",
        "model.config={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 128}"]


def test_kv_cache_arithmetic_by_hand_and_as_the_engine_sizes_it():
    cfg = load_config("configs/grpo-tiny.yaml", [*TINY, "rft.max_new_tokens=12", "rl.num_generations=6"])
    # 2 (key, value) x 2 layers x 2 kv heads x 8 head_dim x (20 + 12) positions x 4 B (fp32) = 8,192 B a slot
    m = rl_plan.generation_memory(cfg.rl, cfg.rft, rl_plan.KvShape(2, 2, 8, 2048), 20, 4)
    # the slots: the answers of a generation batch (one engine call: 4 questions x 6), rft.micro_batch_sequences
    # (256 by default) at most
    assert (m.width, m.slot_bytes, m.slots) == (32, 8192, 24)
    # a decode step's logits per slot and vocabulary entry: fp32 logits 4 + the sampling's peak (stats.PICK_BYTES)
    assert m.kv == 24 * 8192 and m.logits == 24 * 40 * 2048
    kv = rl_plan.KvShape(2, 2, 8, 2048)
    assert rl_plan.generation_memory(cfg.rl, cfg.rft, kv, 20, 4, world=2).slots == 12  # 2 questions each
    # one rollout call: 24 answers x (8,192 + 81,920) B = 2,162,688 B = 0.0020 GiB, rounded up to 0.01
    assert m.rollout_gb == 0.01
    # a budget: 0.001 GiB = 1,073,741.8 B over 90,112 B a slot (KV + logits) = 11 slots
    capped = load_config("configs/grpo-tiny.yaml", [*TINY, "rft.max_new_tokens=12", "rft.kv_cache_gb=0.001"])
    assert rl_plan.generation_memory(capped.rl, capped.rft, rl_plan.KvShape(2, 2, 8, 2048), 20, 4).slots == 11
    # 16-bit weights: half the bytes
    assert rl_plan.generation_memory(cfg.rl, cfg.rft, rl_plan.KvShape(2, 2, 8, 2048), 20, 2).slot_bytes == 4096

    # the engine's own sizing of the same model (its slot_bytes and plan_slots under the same budget)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from harness.model import load_run_tokenizer
    from harness.rft.engine import ContinuousEngine

    tok = load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).to(torch.float32)
    engine = ContinuousEngine(model, tok, 12, 256, kv_cache_gb=0.001, say=lambda m: None)
    assert engine.slot_bytes(32) == 8192 and engine.plan_slots(32) == 11


def test_rl_micro_batch_rows():
    cfg = load_config("configs/grpo-tiny.yaml", ["train.grad_accum=2", "rl.questions_per_step=16"])  # x 16 answers
    assert rl_plan.micro_batch_rows(cfg.rl, cfg.train, 2) == 4 * 16  # 16 / (2 processes x 2 micro-batches) x 16


def test_zero_plan_names_the_generation_cache():
    cfg = load_config("configs/grpo-tiny.yaml", [*TINY, "rl.questions_per_step=16"])
    from harness.model import load_run_tokenizer

    prompts = rl_plan.prompt_tokens(cfg.rft, load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode))
    p = plan(cfg, Hardware(2, 16))
    width = max(prompts.values()) + 40
    slot = 2 * 2 * 2 * 8 * width * 4  # fp32 weights (train.weights=fp32): the engine's cache is fp32 too
    # one engine call a generation batch: 16 questions / 2 processes x 16 answers = 128 slots (of 256 at most)
    assert "KV cache: 128 slots" in p.text and "freed for the training pass when the decode step is eager" in p.text
    assert f"= {width} positions" in p.text and "8 questions x 16 sequences need rft.kv_cache_gb=" in p.text
    assert "16 questions / (2 processes x grad_accum 1) x 16 answers = 128 rows" in p.text
    assert "activations (16-bit, micro-batch 128, max_len " + str(width) in p.text
    header = next(line for line in p.text.splitlines() if line.startswith("stage"))
    assert header.split()[:8] == ["stage", "weights", "grads", "optim", "extra", "activ", "gen", "overhead"]
    rows = {r.option: r for r in p.rows}
    for r in p.rows:
        assert r.generation == 128 * slot
        assert f"{r.generation / GIB:>9.1f}" in p.text and f"{r.total / GIB:>9.1f}" in p.text
    # ZeRO-3: the generation gathers the full weights beyond the partition each GPU holds
    P = p.shape.params
    assert rows["3"].gen_peak == pytest.approx(128 * 40 * p.shape.vocab + P * 4 - P * 4 / 2)  # logit_bytes(4)
    assert rows["0"].gen_peak == 128 * 40 * p.shape.vocab
    assert rows["0"].total == pytest.approx(rows["0"].weights + rows["0"].grads + rows["0"].optim + rows["0"].overhead
                                            + rows["0"].generation + max(rows["0"].extra + rows["0"].activations,
                                                                         rows["0"].gen_peak))
    # rl.beta > 0: the reference copy beside the cache
    beta = plan(load_config("configs/grpo-tiny.yaml", [*TINY, "rl.questions_per_step=16", "rl.beta=0.04"]),
                Hardware(2, 16))
    assert beta.rows[0].generation == 128 * slot + P * 4 and "a frozen reference copy" in beta.text
    three = {r.option: r for r in beta.rows}["3"]  # ZeRO-3: the copy partitioned as the weights (2 GPUs: P x 4 / 2)
    assert three.generation == pytest.approx(128 * slot + P * 4 / 2) and three.weights == pytest.approx(P * 4 / 2)
    # ... but not with LoRA: the reference is the same model with its adapters disabled (rollout.py), no copy
    lora = plan(load_config("configs/grpo-tiny.yaml", [*TINY, "rl.questions_per_step=16", "rl.beta=0.04",
                                                       "model.lora.enabled=true"]), Hardware(2, 16))
    assert lora.rows and all(r.generation == 128 * slot for r in lora.rows), [r.generation for r in lora.rows]
    assert "adapters disabled (no copy)" in lora.text and "a frozen reference copy" not in lora.text


# ----------------------------------------------------------------------------------------------- harness plan

RL_CAL = Calibration(s_per_step=2.0, warmup_extra_s=1.0, startup_s=10.0, eval_s=5.0, save_s=1.0, export_s=2.0,
                     optimizer_s_per_step=0.1, source="fixed", gen_s_per_batch=2.4, steps_per_generation=2,
                     rl_train_s_per_step=0.7)


def test_rl_estimate_counts_generation_batches():
    # 2.0 s a step = 2.4 / 2 generation + 0.8 without it; 25 steps: 25 x 0.8 + ceil(25 / 2) = 13 batches x 2.4
    e = plan_arithmetic.estimate(25, RL_CAL, evals=2)
    assert e["s_per_step"] == pytest.approx(0.8) and e["generations"] == 13
    assert e["train_s"] == pytest.approx(25 * 0.8 + 13 * 2.4) and e["generation_s"] == pytest.approx(31.2)
    assert e["total_s"] == pytest.approx(10 + 1 + 51.2 + 2 * 5 + 1 + 2)


def test_rl_plan_lines_and_schedule():
    cfg = load_config("configs/grpo-tiny.yaml", ["train.max_steps=-1", "train.epochs=1", "rl.questions_per_step=16",
                                                 "train.eval_every=25"])
    data = planner.analyse_data(cfg)
    assert data == {"primary": "rl", "rl": {"questions": 400, "items": 400}}
    p = planner.make_plan(cfg, data, RL_CAL, hours=1.0, margin_min=30, flop_dims=None)
    # 400 questions / 16 a micro-batch (1 process, accumulation 1) = 25 steps; evaluations: step 0 and the end
    assert p["estimate"]["steps"] == 25 and p["estimate"]["evals"] == 2
    text = "\n".join(p["derivations"])
    assert "400 train questions of rft.task=arithmetic" in text and "16 x rl.num_generations 16 = 256 answers" in text
    assert "generation 2.4000 s per generation batch (every 2 step(s)) + training passes 0.7000 s" in text
    assert "25 steps x 0.8000 s + 13 generation batches x 2.4000 s = 51.2" in text


def test_rl_rates_from_records():
    # log every step; generation batches start at steps 1, 3, 5 (rl.iterations 2); settle after step 2
    recs = [{"step": s, "loss": 0.1, "gen_s_per_step": g, "train_s_per_step": t}
            for s, g, t in [(1, 9.0, 1.0), (2, 0.0, 0.5), (3, 2.0, 0.6), (4, 0.0, 0.6), (5, 2.2, 0.7), (6, 0.0, 0.7)]]
    gen, train, batches = rl_plan.rl_rates(recs, 2, 2)
    assert batches == 2 and gen == pytest.approx(2.1) and train == pytest.approx(0.65)
    # logged every 2 steps: the record carries the mean of its 2 steps
    recs2 = [{"step": s, "loss": 0.1, "gen_s_per_step": g, "train_s_per_step": t}
             for s, g, t in [(2, 4.5, 0.75), (4, 1.0, 0.6), (6, 1.1, 0.7)]]
    assert rl_plan.rl_rates(recs2, 2, 2) == pytest.approx((2.1, 0.65, 2))


@pytest.mark.slow
def test_plan_of_an_rl_recipe_calibrates_a_short_run(tmp_path, repo_root):
    """`harness plan` on configs/grpo-tiny.yaml (a tiny random model, 4 questions x 4 answers): a calibration of 1 + 2
    steps, generation and training seconds apart, the estimate counting both."""
    args = ["configs/grpo-tiny.yaml", *TINY, "rl.questions_per_step=4", "rl.num_generations=4", "train.max_steps=25",
            "rft.num_test_questions=8", "rft.max_new_tokens=16", f"train.output_dir={tmp_path}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "plan", *args, "--hours", "1"], cwd=repo_root,
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "calibration: 1 + 2 steps" in proc.stdout and "calibration run of 3 steps" in proc.stdout
    p = json.loads((tmp_path / "plan.json").read_text())
    cal, est = p["calibration"], p["estimate"]
    assert cal["gen_s_per_batch"] > 0 and cal["rl_train_s_per_step"] > 0 and cal["steps_per_generation"] == 1
    assert est["generations"] == 25 and est["evals"] == 2  # 25 steps, evaluations at 0 and the end
    assert est["train_s"] == pytest.approx(25 * est["s_per_step"] + 25 * cal["gen_s_per_batch"])
    assert "generation batches x" in proc.stdout and "rl step: generation" in proc.stdout
