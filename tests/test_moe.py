"""Mixture-of-experts models (harness/moe.py, docs/moe.md): the router's auxiliary loss as the model's own forward
adds it, the experts' load, the active parameters in the FLOP figures.

    .venv/bin/python -m pytest tests/test_moe.py -n 0 -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from harness import moe, train
from harness.config import load_config
from harness.data.samples import model_inputs
from harness.model import unwrap
from harness.objective import Objective
from harness_launch import FAST, ROOT

MOE_TINY = str(ROOT / "configs" / "moe-tiny.yaml")
# the second family: OLMoE (its own router_aux_loss_coef 0.01, router z-loss none in transformers 5.24)
OLMOE = ["model.config={model_type: olmoe, hidden_size: 128, intermediate_size: 96, num_hidden_layers: 2, "
         "num_attention_heads: 4, num_key_value_heads: 4, num_experts: 8, num_experts_per_tok: 2, "
         "router_aux_loss_coef: 0.01, max_position_embeddings: 512, tie_word_embeddings: true}"]


def _step1(tmp_path, monkeypatch, overrides: list[str]) -> tuple[dict, dict, dict]:
    """One step of `harness train` (in this process): (its metrics.jsonl record, the micro-batch it trained on, the
    model's own outputs on that batch with the weights of step 1). The batch is read off Objective.micro_step as
    the loop passes it, and the model's own forward runs there, before the step's update (optim.lr must be > 0;
    the step itself runs unchanged)."""
    seen = {}
    real = Objective.micro_step

    def recording(self, gen, emb, gen_scale):
        if "gen" not in seen:
            model = unwrap(self.model)
            seen["gen"], seen["type"] = {k: v.clone() for k, v in gen.items()}, model.config.model_type
            seen["coef"] = model.config.router_aux_loss_coef
            # use_cache=False as in training: with a cache transformers' masks ignore the packed rows' documents
            with torch.no_grad():
                seen["own"] = model(**model_inputs(gen), labels=gen["labels"], output_router_logits=True,
                                    use_cache=False)
                seen["ce"] = model(**model_inputs(gen), labels=gen["labels"], use_cache=False).loss.item()
        return real(self, gen, emb, gen_scale)

    monkeypatch.setattr(Objective, "micro_step", recording)
    out = tmp_path / "run"
    cfg = load_config(MOE_TINY, [f"train.output_dir={out}", *FAST, "train.max_steps=1", "train.micro_batch_size=4",
                                 "train.save_final=false", "train.save_final_checkpoint=false", *overrides])
    train.run(cfg)
    record = json.loads(Path(out, "metrics.jsonl").read_text().splitlines()[0])
    return record, seen["gen"], seen


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_step1_loss_is_the_models_own_loss_with_the_router_term(tmp_path, monkeypatch, family, chunked, packed):
    """lr 0: the logged step-1 loss equals the model's own forward with labels and output_router_logits (CE +
    router_aux_loss_coef * aux_loss, transformers' load_balancing_loss_func over the rows its attention mask keeps:
    padded rows here, or packed rows without a mask) within 1e-6; aux_loss is logged apart with the experts' load."""
    overrides = (OLMOE if family == "olmoe" else []) + [f"loss.chunked_ce={str(chunked).lower()}",
                                                        "loss.chunked_ce_size=50", f"data.packing={str(packed).lower()}"]
    record, gen, seen = _step1(tmp_path, monkeypatch, overrides)
    ref, ce = seen["own"], seen["ce"]
    assert seen["type"] == family and seen["coef"] == (0.01 if family == "olmoe" else 0.02)
    assert ("position_ids" in gen) == packed  # packed rows: per-document positions, no mask (the aux loss then
    assert packed or (gen["attention_mask"] == 0).any()  # counts every position, in the model's forward as here)
    assert ref.loss.item() - ce > 1e-3  # the router term is not negligible here
    # full logits: the model's own arithmetic (1e-6 absolute). The chunked head sums the CE over 50-position chunks
    # in fp32, another summation order: a loss sum of ~1500 has an fp32 ulp of 1.2e-4, ~6e-7 per rounding once
    # divided by the ~200 tokens (measured 1.2e-6 here), so 1e-6 relative to the loss
    tol = 1e-6 * (abs(ref.loss.item()) if chunked else 1.0)
    assert abs(record["loss"] - ref.loss.item()) <= tol, (record["loss"], ref.loss.item(), ce)
    assert abs(record["aux_loss"] - ref.aux_loss.item()) <= 1e-6
    # the experts' load: the largest expert's share of the routed tokens of the rows the mask keeps, layer mean
    mask = None if packed else gen["attention_mask"].reshape(-1).bool()
    shares = []
    for logits in ref.router_logits:
        top = logits.topk(2, dim=-1).indices if mask is None else logits[mask].topk(2, dim=-1).indices
        shares.append(torch.bincount(top.reshape(-1), minlength=8).max().item() / top.numel())
    assert abs(record["expert_load"] - sum(shares) / len(shares)) <= 1e-6
    assert 1 / 8 <= record["expert_load"] <= 1 / 2


def test_router_coef_zero_gives_the_cross_entropy_alone(tmp_path, monkeypatch):
    record, _, seen = _step1(tmp_path, monkeypatch, ["model.router_aux_loss_coef=0"])
    ce, own = seen["ce"], seen["own"]
    assert abs(record["loss"] - ce) <= 1e-6 and abs(record["aux_loss"] - own.aux_loss.item()) <= 1e-6
    assert own.loss.item() - ce > 1e-3


def test_router_coef_override_and_router_frozen(tmp_path, monkeypatch):
    """model.router_aux_loss_coef=0.5 weighs the model's aux_loss by 0.5; model.train_router=false freezes the
    routers (their weights get no gradient) and nothing else."""
    record, _, seen = _step1(tmp_path, monkeypatch, ["model.router_aux_loss_coef=0.5", "model.train_router=false"])
    assert abs(record["loss"] - (seen["ce"] + 0.5 * seen["own"].aux_loss.item())) <= 1e-6
    from harness.model import build_model, load_tokenizer  # the same build as the run's: which weights it froze

    cfg = load_config(MOE_TINY, ["model.train_router=false"])
    model = build_model(cfg.model, load_tokenizer(cfg.model))
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {f"model.layers.{i}.mlp.gate.weight" for i in range(2)}
    cfg = load_config(MOE_TINY, ["model.train_router=false", "model.lora.enabled=true"])  # peft adapts the router too
    lora = build_model(cfg.model, load_tokenizer(cfg.model))
    trained = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trained and not [n for n in trained if ".mlp.gate." in n]


def _tiny(model_type: str = "qwen3_moe", **kw):
    conf = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=48,
                                moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                decoder_sparse_step=1, **kw)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(conf)


def test_router_loss_gradient_is_the_models_own():
    """The term's gradient reaches the routers as the model's own loss's does (the CE's gradient left out)."""
    model = _tiny(router_aux_loss_coef=0.1)
    x = torch.randint(0, 64, (2, 9))
    mask = torch.ones_like(x)
    mask[1, 6:] = 0
    model(x, attention_mask=mask, labels=x, output_router_logits=True).aux_loss.mul(0.1).backward()
    want = [model.model.layers[i].mlp.gate.weight.grad.clone() for i in range(2)]
    model.zero_grad()
    with moe.RouterLoss(model, None) as router:
        model(x, attention_mask=mask)
    router.term.backward()
    assert model.config.output_router_logits is False  # restored: generation and evaluation untouched
    for i in range(2):
        torch.testing.assert_close(model.model.layers[i].mlp.gate.weight.grad, want[i], rtol=1e-6, atol=1e-9)


def test_dense_model_has_no_router_term():
    conf = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                num_attention_heads=2)
    model = AutoModelForCausalLM.from_config(conf)
    with moe.RouterLoss(model, 0.5) as router:
        model(torch.randint(0, 64, (1, 5)))
    assert router.term == 0.0 and router.sums() == {} and moe.experts_of(conf) == (0, 0)
    assert moe.expert_params(model) == (0, 0) and moe.experts_kwargs(conf, "auto") == {}


def test_preference_loss_adds_the_models_own_router_term(tmp_path, monkeypatch):
    """loss.mode=preference (DPO) on configs/moe-tiny.yaml's model: the step-1 loss is DPO's (log 2 a pair: the
    reference is the starting model) plus router_aux_loss_coef x the model's own aux_loss on the pair batch's one
    forward (chosen and rejected rows, the rows its attention mask keeps), within 1e-6; aux_loss logged apart."""
    import math

    import yaml

    from harness.modes.preference import PreferenceMode

    seen = {}
    real = PreferenceMode.passes

    def recording(self, gen, emb, scale):
        if "own" not in seen:
            model = unwrap(self.model)
            with torch.no_grad():
                seen["own"] = model(**model_inputs(gen), output_router_logits=True, use_cache=False)
            seen["coef"], seen["mask"] = model.config.router_aux_loss_coef, gen["attention_mask"]
        return real(self, gen, emb, scale)

    monkeypatch.setattr(PreferenceMode, "passes", recording)
    moe_model = yaml.safe_load(Path(MOE_TINY).read_text())["model"]["config"]
    out = tmp_path / "run"
    train.run(load_config(str(ROOT / "configs" / "dpo-tiny.yaml"), [
        f"train.output_dir={out}", *FAST, "train.max_steps=1", "train.micro_batch_size=2", "train.save_final=false",
        "train.save_final_checkpoint=false", "model.config=" + json.dumps(moe_model)]))
    record = json.loads(Path(out, "metrics.jsonl").read_text().splitlines()[0])
    own = seen["own"]
    assert (seen["mask"] == 0).any() and seen["coef"] == 0.02  # padded rows: the mask decides what is counted
    assert abs(record["aux_loss"] - own.aux_loss.item()) <= 1e-6
    assert abs(record["loss"] - (math.log(2) + 0.02 * own.aux_loss.item())) <= 1e-6, (record, own.aux_loss)
    assert 1 / 8 <= record["expert_load"] <= 1 / 2


# ----------------------------------------------------------------------------------------------- accounting

def _hand_active(conf) -> tuple[int, int]:
    """(matmul weights a token goes through, routed experts' weights) of configs/moe-tiny.yaml's Qwen3-MoE by hand."""
    h, layers, e, k, i = conf.hidden_size, conf.num_hidden_layers, conf.num_experts, conf.num_experts_per_tok, \
        conf.moe_intermediate_size
    q = conf.num_attention_heads * conf.head_dim
    kv = conf.num_key_value_heads * conf.head_dim
    attention = h * q + 2 * h * kv + q * h
    router = e * h
    experts = e * (2 * i * h + i * h)  # gate_up_proj [E, 2I, H] and down_proj [E, H, I]
    return layers * (attention + router + experts * k // e) + conf.vocab_size * h, layers * experts


def test_active_parameters_in_the_run_flops(tmp_path, monkeypatch):
    """The run's FLOP figures (MFU, report.json's flop_dims) count a token's active weights: attention, the
    router, top-k of E experts (transformers 5's 3-D tensors, which observe.metrics.matmul_params misses) and the
    head; a step's FLOPs are 6 N + 12 L H width per real token (PaLM), computed here by hand."""
    from harness.model import build_model, load_tokenizer
    from harness.observe import metrics

    cfg = load_config(MOE_TINY, [])
    model = build_model(cfg.model, load_tokenizer(cfg.model))
    active, experts = _hand_active(model.config)
    assert moe.expert_params(model) == (experts, experts * 2 // 8)
    assert moe.active_matmul_params(model, metrics.matmul_params(model)) == active
    assert metrics.matmul_params(model) < active  # the Linear layers alone leave the experts out
    flops = {}
    real = Objective.micro_step

    def recording(self, gen, emb, gen_scale):
        sums = real(self, gen, emb, gen_scale)
        flops.setdefault("step", (float(sums.flops), int(gen["attention_mask"].sum()), gen["input_ids"].shape[1]))
        return sums

    monkeypatch.setattr(Objective, "micro_step", recording)
    out = tmp_path / "run"
    train.run(load_config(MOE_TINY, [f"train.output_dir={out}", *FAST, "train.max_steps=1", "train.save_final=false",
                                     "train.save_final_checkpoint=false"]))
    report = json.loads(Path(out, "report.json").read_text())
    assert report["flop_dims"][0] == active
    got, tokens, width = flops["step"]
    h, layers = model.config.hidden_size, model.config.num_hidden_layers
    assert got == tokens * (6 * active + 12 * layers * h * width)

def test_plan_prints_total_and_active_parameters(tmp_path, capsys):
    """`harness plan --from-report` names both counts of the measured run: its parameters and the active matmul
    weights of its FLOP figures."""
    from harness.tools import planner

    out = tmp_path / "run"
    args = [f"train.output_dir={out}", *FAST, "train.max_steps=2", "train.save_final=false",
            "train.save_final_checkpoint=false"]
    train.run(load_config(MOE_TINY, args))
    rep = json.loads(Path(out, "report.json").read_text())
    assert planner.main([MOE_TINY, *args, "--hours", "1", "--from-report", str(out / "report.json"),
                         "--out", str(tmp_path / "plan.json")]) == 0
    line = f"model: {rep['parameters']:,} parameters in all, {rep['flop_dims'][0]:,} matmul weights active per token"
    assert line in capsys.readouterr().out and rep["flop_dims"][0] < rep["parameters"]


QWEN3_30B = str(ROOT / "configs" / "qwen3-30b-a3b-lora.yaml")


def test_zero_plan_prints_total_and_active_parameters():
    """zero-plan on configs/qwen3-30b-a3b-lora.yaml (8 x 80 GB): the memory counts the 30.5B total, the line names the
    ~3.3B active per token, both computed here by hand from Qwen3-30B-A3B's shape; the activation arithmetic takes
    the 8 experts' widths per token (8 x 768; Qwen3-30B-A3B's dense intermediate_size is 6144 too, so the tiny recipe
    with another dense width checks that the expert widths are the ones read)."""
    from harness.tools.zero_plan import Hardware, plan

    base = plan(load_config(QWEN3_30B, ["model.lora.enabled=false"]), Hardware(8, 80))
    c = load_config(QWEN3_30B, []).model.config
    h, layers, e, k, i, v = (c["hidden_size"], c["num_hidden_layers"], c["num_experts"], c["num_experts_per_tok"],
                             c["moe_intermediate_size"], c["vocab_size"])
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    per_layer = (2 * h * q + 2 * h * kv) + 2 * c["head_dim"] + 2 * h + e * h  # attention, q/k norms, 2 norms, router
    experts = e * 3 * i * h
    vocab = base.shape.vocab  # the embedding rows as built (padded to a multiple of 64 over the tokenizer)
    total = layers * (per_layer + experts) + 2 * vocab * h + h  # untied head, final norm
    active = total - layers * experts + layers * experts * k // e
    assert base.shape.params == total and base.shape.active == active
    assert 30.4e9 < total < 30.6e9 and 3.2e9 < active < 3.4e9
    assert f"total {total / 1e9:.2f}B parameters" in base.text and f"A = {active:,}" in base.text
    assert base.shape.intermediate == k * i
    assert f"4*{k * i})" in base.text  # per layer and token: ... + 4i with i = k x the expert's width
    tiny = plan(load_config(MOE_TINY, ["model.config.intermediate_size=1000"]), Hardware(1, 80))
    assert tiny.shape.intermediate == 2 * 128 and "4*256)" in tiny.text  # top-2 of 128-wide experts, not 1000
    lora = plan(load_config(QWEN3_30B, []), Hardware(8, 80))
    assert lora.choice == "3", lora.text  # the frozen 30.5B base partitioned over 8: stages 0-2 do not fit


# ----------------------------------------------------------------------------------------------- LoRA on the experts

def test_lora_on_the_experts_reloads_and_merges_to_the_trained_logits(tmp_path, monkeypatch):
    """model.lora.experts=true with target_modules [q_proj, v_proj]: the adapter holds deltas of the experts' 3-D
    weights (peft's target_parameters), moved by training; peft's AutoPeftModelForCausalLM on final/ and the merged
    final/merged/ give the trained model's logits within 1e-5."""
    from peft import AutoPeftModelForCausalLM
    from safetensors.torch import load_file

    seen = {}
    real = Objective.micro_step

    def keep_model(self, gen, emb, gen_scale):
        seen["model"] = self.model
        return real(self, gen, emb, gen_scale)

    monkeypatch.setattr(Objective, "micro_step", keep_model)
    out = tmp_path / "run"
    train.run(load_config(MOE_TINY, [f"train.output_dir={out}", *FAST, "train.max_steps=3", "optim.lr=5e-2",
                                     "optim.warmup_steps=0", "model.lora.enabled=true", "model.lora.experts=true",
                                     "model.lora.target_modules=[q_proj, v_proj]"]))
    trained = unwrap(seen["model"]).eval()
    adapter = load_file(str(out / "final" / "adapter_model.safetensors"))
    experts = {k: v for k, v in adapter.items() if ".experts." in k}
    assert {k.split("experts.")[-1].rsplit(".", 1)[0] for k in experts} >= {"lora_A", "lora_B", "base_layer.lora_A",
                                                                           "base_layer.lora_B"}, sorted(adapter)
    assert all(v.abs().max() > 0 for k, v in experts.items() if "lora_B" in k)  # trained (lora_B starts at 0)
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        auto = AutoPeftModelForCausalLM.from_pretrained(out / "final").eval()
        merged = AutoModelForCausalLM.from_pretrained(out / "final" / "merged").eval()
        for name, model in (("AutoPeft", auto), ("merged", merged)):
            diff = (model(input_ids=ids).logits - want).abs().max().item()
            assert diff <= 1e-5, (name, diff)


def test_lora_on_the_experts_resumes_exactly_after_kill_9(tmp_path):
    """model.lora.experts: a run killed -9 after step 3's checkpoint (HARNESS_FAULT_PAUSE holds it before step 4)
    and run again resumes from step-3 and logs step 4 as the uninterrupted run does: the expert adapters, their
    optimizer state and the data position restored (the same arithmetic in the same order: 1e-6 relative allows a
    kernel's other summation order; measured equal)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from harness_launch import metrics, report, run_train

    args = [*FAST, "train.max_steps=4", "train.micro_batch_size=2", "data.max_len=64", "optim.lr=5e-2",
            "optim.warmup_steps=0", "model.lora.enabled=true", "model.lora.experts=true",
            "model.lora.target_modules=[q_proj, v_proj]", "train.save_final=false", "train.save_every_steps=1"]
    ref, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    run_train([*args, f"train.output_dir={ref}"], config=MOE_TINY, timeout=300)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "HARNESS_FAULT_PAUSE": "4"}
    proc = subprocess.Popen([sys.executable, "-m", "harness.train", "--config", MOE_TINY, *args,
                             f"train.output_dir={killed}"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    marker, t0 = killed / "checkpoints" / "step-3" / "COMPLETE", time.time()
    while not marker.exists() and proc.poll() is None and time.time() - t0 < 300:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists() and not (killed / "checkpoints" / "step-4").exists()
    run_train([*args, f"train.output_dir={killed}"], config=MOE_TINY, timeout=300)
    assert report(killed)["resumed_from"].endswith("step-3")
    want, got = {m["step"]: m for m in metrics(ref)}, {m["step"]: m for m in metrics(killed)}
    assert want[3]["loss"] != want[4]["loss"]  # the adapters moved: step 4 depends on what was restored
    for key in ("loss", "aux_loss", "expert_load", "grad_norm"):
        assert got[4][key] == pytest.approx(want[4][key], rel=1e-6, abs=1e-9), (key, got[4], want[4])


def test_lora_experts_refusals():
    """One line each: a dense model (nothing to adapt), QLoRA (bitsandbytes leaves the 3-D experts unquantized)."""
    from harness.errors import ConfigError
    from harness.model import build_model, load_tokenizer

    cfg = load_config(str(ROOT / "configs" / "default.yaml"), ["model.lora.enabled=true", "model.lora.experts=true"])
    with pytest.raises(ConfigError, match="model.lora.experts.*no fused 3-D expert weights"):
        build_model(cfg.model, load_tokenizer(cfg.model))
    with pytest.raises(ConfigError, match="model.lora.experts.*not with model.quantization=4bit"):
        load_config(QWEN3_30B, ["model.quantization=4bit", "model.lora.experts=true"])


# ----------------------------------------------------------------------------------------------- a starved expert

SEPARATE = ROOT / "tests" / "assets" / "separate_experts" / "modeling_sepmoe.py"
STARVED = ["the quick brown fox jumps over a lazy dog near seven old barns", "one two three four five six"]


def _moe_tiny_config() -> dict:
    import yaml

    return yaml.safe_load(Path(MOE_TINY).read_text())["model"]["config"]


def _separate_experts_model(folder: Path, tok, **config):
    """configs/moe-tiny.yaml's model with its experts as separate modules (tests/assets/separate_experts: an
    nn.ModuleList of MLPs of which a block runs only those its tokens reach), as remote code (auto_map) in `folder`."""
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(SEPARATE, folder)
    (folder / "config.json").write_text(json.dumps({
        **_moe_tiny_config(), "vocab_size": len(tok), "pad_token_id": tok.pad_token_id, "bos_token_id":
        tok.bos_token_id, "eos_token_id": tok.eos_token_id, **config, "model_type": "sepmoe",
        "auto_map": {"AutoConfig": "modeling_sepmoe.SepMoeConfig",
                     "AutoModelForCausalLM": "modeling_sepmoe.SepMoeForCausalLM"}}))
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, trust_remote_code=True),
                                            trust_remote_code=True)


def _starving_model(folder: Path, records: list, experts: str = "fused", unsampled: bool = False) -> list[int]:
    """configs/moe-tiny.yaml's model (experts fused, or separate modules: _separate_experts_model) with its first
    layer's routing forced: a hidden feature (dimension 0 of the embeddings, +4 for the tokens of records[0] that
    records[1] lacks, -4 for every other token) alone drives expert 0's router logit (x 50; the other experts' rows
    small and random, blind to it): records[1]'s tokens never reach expert 0 in layer 0, some of records[0]'s do.
    `records`: texts, or token ids. unsampled: those tokens are never sampled either (an untied head; dimension 1
    of every embedding is 4, a feature every position carries into the final norm, and the head's column 1 puts
    those tokens' logits ~80 below every other's: p < 1e-30 a draw), so answers sampled to records[1] keep it
    starved. Saved with the bundled tokenizer as a pretrained folder; returns the tokens that reach expert 0."""
    from harness.model import build_model, load_tokenizer

    cfg = load_config(MOE_TINY, ["model.config.tie_word_embeddings=false"] if unsampled else [])
    tok = load_tokenizer(cfg.model)
    torch.manual_seed(0)
    model = (build_model(cfg.model, tok) if experts == "fused"
             else _separate_experts_model(folder, tok, tie_word_embeddings=not unsampled))
    ids = [set(r) if isinstance(r, list) else set(tok(r)["input_ids"]) for r in records]
    only_first = sorted(ids[0] - ids[1])
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, 0] = -4.0
        emb[only_first, 0] = 4.0
        router = model.model.layers[0].mlp.gate.weight
        router.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))  # no ties among the other experts
        router[:, 0] = 0.0
        router[0] = 0.0
        router[0, 0] = 50.0
        if unsampled:
            emb[:, 1] = 4.0
            router[:, 1] = 0.0
            head = model.get_output_embeddings().weight
            head[:, :2] = 0.0
            head[:, 1] = 5.0
            head[only_first, 1] = -5.0
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return only_first


def _expert0_hits(folder: Path, rows: list[list[int]]) -> list[int]:
    """Tokens of each row routed to expert 0 in layer 0 (top-2) by the saved model."""
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        return [int((model(torch.tensor([r]), output_router_logits=True).router_logits[0].topk(2, dim=-1).indices
                     == 0).sum()) for r in rows]


def test_moe_blocks_are_zero3_leaves_and_separate_experts_take_part_in_every_pass(tmp_path):
    """register_zero3_leaves marks each MoE block, and nothing inside or outside it, as a ZeRO-3 leaf (DeepSpeed's
    z3_leaf_module), for fused experts (Qwen3-MoE, OLMoE: not in DeepSpeed's own default list; under peft with LoRA
    on the experts too) and separate expert modules (tests/assets/separate_experts); a dense model has none.
    tie_separate_experts: after a backward pass in which some experts got no token, every expert parameter has a
    gradient (zeros where no token reached it, the model's own elsewhere); evaluation passes are left alone;
    fused experts need no tie. model.experts_implementation=auto builds the remote-code model without a kernel
    choice it does not take."""
    from deepspeed.utils import get_z3_leaf_modules, z3_leaf_module

    from harness.config import ModelConfig
    from harness.lora import apply_lora
    from harness.model import build_model, load_tokenizer

    tok = load_tokenizer(load_config(MOE_TINY, []).model)
    separate = _separate_experts_model(tmp_path / "separate", tok)
    lora = apply_lora(_tiny(), ModelConfig(lora={"enabled": True, "r": 2, "experts": True,
                                                 "target_modules": ["q_proj"]}), added_tokens=[])
    cases = [(_tiny(), "Qwen3MoeSparseMoeBlock", "fused"), (_tiny("olmoe"), "OlmoeSparseMoeBlock", "fused"),
             (lora, "Qwen3MoeSparseMoeBlock", "fused"), (separate, "SepMoeBlock", "separate")]
    for model, name, kind in cases:
        blocks = [layer.mlp for layer in moe.base_model(model).model.layers]
        assert [m for _, m in moe.moe_blocks(model)] == blocks
        assert not any(z3_leaf_module(m) for m in model.modules())
        assert moe.register_zero3_leaves(model).startswith(f"[harness] ZeRO-3: 2 MoE blocks ({name}, {kind} experts) "
                                                           f"registered as leaves")
        assert get_z3_leaf_modules(model) == blocks and all(z3_leaf_module(m) for m in blocks)
    dense = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2))
    assert moe.register_zero3_leaves(dense) is None and moe.tie_separate_experts(dense) is None
    assert moe.tie_separate_experts(_tiny()) is None  # fused: every pass reaches the 3-D tensors already

    x = torch.tensor([tok("one two three")["input_ids"]])
    reached = {e for logits in separate(x, output_router_logits=True).router_logits
               for e in logits.topk(2, dim=-1).indices.unique().tolist()}
    assert len(reached) < 8  # some experts got no token in some layer
    separate(x, labels=x).loss.backward()
    own = {n: p.grad.clone() for n, p in separate.named_parameters() if p.grad is not None}
    assert any(".experts." in n for n, p in separate.named_parameters() if p.grad is None)
    separate.zero_grad(set_to_none=True)
    assert moe.tie_separate_experts(separate).startswith("[harness] MoE: 2 blocks of separate expert modules")
    with torch.no_grad():
        assert torch.equal(separate(x).logits, separate(x, labels=x).logits)  # no tie without autograd
    separate(x, labels=x).loss.backward()
    for n, p in separate.named_parameters():
        assert p.grad is not None, n
        assert torch.allclose(p.grad, own[n], rtol=1e-6, atol=1e-9) if n in own else not p.grad.any(), n

    folder = tmp_path / "separate"
    separate.save_pretrained(folder)
    type(separate)._can_set_experts_implementation_cached_value = None  # (transformers caches its answer per class)
    cfg = ModelConfig(name_or_path=str(folder), trust_remote_code=True, tokenizer="bundled")
    assert type(build_model(cfg, tok)).__name__ == "SepMoeForCausalLM"  # was: "does not support setting experts ..."


@pytest.fixture(scope="module")
def starved_one_process(tmp_path_factory):
    """experts ("fused" or "separate") -> (the runs' common overrides, the 1-process run's folder): the starving
    model of one record per rank, trained 3 steps on 1 process with the global batch as 2 micro-batches. Made on
    first use (a module's cases may run on different xdist workers: each makes its own)."""
    from harness.model import load_tokenizer
    from harness_launch import run_train

    made = {}

    def get(experts: str):
        if experts not in made:
            tmp = tmp_path_factory.mktemp(f"starved-{experts}")
            data = tmp / "two.jsonl"
            data.write_text("".join(json.dumps({"text": r}) + "\n" for r in STARVED))
            _starving_model(tmp / "model", STARVED, experts)
            tok = load_tokenizer(load_config(MOE_TINY, []).model)
            hits = _expert0_hits(tmp / "model", [tok(r)["input_ids"] for r in STARVED])
            assert hits[0] > 0 and hits[1] == 0, hits  # the forcing holds on the starting weights
            common = [*FAST, "train.max_steps=3", f"data.train_files=[{data}]", f"model.name_or_path={tmp / 'model'}",
                      "model.tokenizer=bundled", "train.save_final=false", "optim.warmup_steps=0", "optim.lr=3e-3",
                      "train.micro_batch_size=1", f"model.trust_remote_code={str(experts == 'separate').lower()}"]
            run_train([f"train.output_dir={tmp / 'one'}", *common, "train.grad_accum=2"], config=MOE_TINY, timeout=300)
            made[experts] = common, tmp / "one"
        return made[experts]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("experts,stage", [("fused", "zero3"), ("separate", "zero3"), ("separate", "ddp"),
                                           ("separate", "zero2")])
def test_two_processes_with_a_starved_expert_equal_one_process(starved_one_process, tmp_path, experts, stage):
    """2 processes, one record per rank, layer 0's expert 0 routed no token on the rank holding the second record
    (forced: _starving_model, checked in the fixture): no hang (a 300 s timeout) and the losses of 1 process with
    the same global batch as 2 micro-batches (the aux loss is a mean over micro-batches either way) within 1e-5.
    Fused experts (transformers 5's 3-D form) under ZeRO-3; separate expert modules (tests/assets/separate_experts),
    of which the starved rank runs 7 of 8 in layer 0, under ZeRO-3, DDP and ZeRO-2. Measured without the fixes
    (harness/moe/blocks.py): ZeRO-3 without the block as a leaf and ZeRO-2 without the ties stopped on gloo's
    "collective mismatch" (NCCL would wait); ZeRO-2 with the ties at the block's output trained a wrong step 2 (5.23
    vs 5.76: gradients summed in another order per rank); 1 process without the ties skipped the unreached experts'
    AdamW step (step 3 0.7% off ZeRO-3's). optim.lr 3e-3: at 1e-2 Adam's first steps turn fp32 noise in ~0 gradients
    into step-3 differences up to 9e-6 relative (DDP); at 3e-3 all agreed within 1e-7."""
    from harness_launch import STAGES, metrics, report, run_train

    common, one = starved_one_process(experts)
    proc = run_train([f"train.output_dir={tmp_path}", *common, "train.grad_accum=1"], nproc=2, accel=STAGES[stage],
                     config=MOE_TINY, timeout=300)
    rep = report(tmp_path)
    assert rep["world_size"] == 2 and rep["zero_stage"] == {"ddp": None, "zero2": 2, "zero3": 3}[stage]
    if stage == "zero3":
        block = "Qwen3MoeSparseMoeBlock, fused" if experts == "fused" else "SepMoeBlock, separate"
        assert f"[harness] ZeRO-3: 2 MoE blocks ({block} experts) registered as leaves" in proc.stdout
    ref, got = metrics(one), metrics(tmp_path)
    assert len(ref) == len(got) == 3
    for a, b in zip(ref, got):
        for key in ("loss", "aux_loss", "expert_load"):
            # relative: fp32 sums in another order over two processes (CI saw 1.7e-5 absolute at loss 4.06, 4e-6)
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (a["step"], key, a[key], b[key])


# one GRPO step and one RFT generation with a starved expert: one prompt a rank, the second prompt's rank (its prompt
# and the answers sampled to it) never reaching layer 0's expert 0
PROMPTS = ["the quick brown fox jumps over a lazy dog near seven old barns", "one two three four five six"]
ENV = {"PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}"}  # rl_rewards


@pytest.fixture(scope="module")
def starved_sampling(tmp_path_factory):
    """(folder, the prompts as JSONL for rl.prompts and for an rft task): the starving model (_starving_model,
    unsampled) of the prompts in the chat template, the routing checked on the starting weights: the first prompt
    reaches expert 0, the second does not, nor does it with any continuation of tokens that can be sampled (8 random
    ones here; the others' logits ~80 below theirs at every position)."""
    from harness.model import load_tokenizer
    from harness.rft.contract import encode
    from harness.rft.tasks import JsonlTask, prompt_text

    tmp = tmp_path_factory.mktemp("starved-sampling")
    tasks = tmp / "prompts.jsonl"  # rl.prompts reads `prompt`, an rft JSONL task `question` and `answer`
    tasks.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p, "question": p, "answer": 0}) + "\n"
                             for i, p in enumerate(PROMPTS)))
    tok = load_tokenizer(load_config(MOE_TINY, []).model)
    task = JsonlTask(str(tasks))
    rows = encode(tok, [prompt_text(task, q, tok) for q in task.split("train")])
    starved = _starving_model(tmp / "model", rows, unsampled=True)
    g = torch.Generator().manual_seed(0)
    sampled = [t for t in range(len(tok)) if t not in set(starved)]
    tails = [[sampled[i] for i in torch.randint(len(sampled), (8,), generator=g)] for _ in range(4)]
    hits = _expert0_hits(tmp / "model", [rows[0], rows[1], *[rows[1] + t for t in tails]])
    assert hits[0] > 0 and hits[1:] == [0] * 5, hits
    model = AutoModelForCausalLM.from_pretrained(tmp / "model")
    with torch.no_grad():
        logp = model(torch.tensor([rows[1] + tails[0]])).logits.log_softmax(-1)
    assert logp[0, :, starved].max() < -60, logp[0, :, starved].max()  # p < 1e-26 per draw
    return tmp / "model", tasks


@pytest.mark.slow
def test_grpo_step_on_zero3_with_a_starved_expert_equals_one_process(starved_sampling, tmp_path):
    """One GRPO generation batch (loss.mode=rl, rl.rows=padded: the router term added; rl.beta > 0: under ZeRO-3
    the reference is a second partitioned engine, its blocks leaves too) trained twice (rl.iterations=2: step 2's
    ratios and KL read step 1's update) on 2-process ZeRO-3, one prompt x 4 answers a rank, the rank of the second
    prompt routing no token to layer 0's expert 0 in its generation, policy and reference passes
    (starved_sampling): no hang (300 s) and 1 process with the same 2 prompts as 2 micro-batches gives the same
    steps. Same answers (drawn per question and step from the step-0 weights: same rewards and lengths), and loss,
    aux_loss, expert_load, kl within 1e-5 relative: the same sums in fp32 in another order (GRPO's over the step's
    answer tokens, the aux loss per micro-batch then over the 2 micro-batches either way; measured bit-equal at
    step 1), where a skipped gather would hang and a wrong reduction move step 2 by far more."""
    from harness_launch import metrics, report, run_train

    folder, prompts = starved_sampling
    common = [*FAST, "train.max_steps=2", "rl.iterations=2", "optim.lr=1e-3", "optim.warmup_steps=0",
              "train.save_final=false", "train.save_final_checkpoint=false", "train.eval_at_start=false",
              "train.eval_every=100", f"model.name_or_path={folder}", "model.tokenizer=bundled",
              f"rl.prompts=[{prompts}]", "rl.rewards=[{function: rl_rewards:length_share}]", "rl.rows=padded",
              "rl.beta=0.1", "rl.questions_per_step=2", "rl.num_generations=4", "rl.max_completion_length=8"]
    grpo = str(ROOT / "configs" / "grpo-tiny.yaml")
    run_train([f"train.output_dir={tmp_path / 'one'}", *common, "train.grad_accum=2"], config=grpo, extra_env=ENV,
              timeout=300)
    proc = run_train([f"train.output_dir={tmp_path / 'zero3'}", *common, "train.grad_accum=1"], nproc=2,
                     accel="zero3", config=grpo, extra_env=ENV, timeout=300)
    rep = report(tmp_path / "zero3")
    assert rep["world_size"] == 2 and rep["zero_stage"] == 3
    assert ("[harness] ZeRO-3: 2 MoE blocks (Qwen3MoeSparseMoeBlock, fused experts) registered as leaves"
            in proc.stdout)
    one, zero3 = metrics(tmp_path / "one"), metrics(tmp_path / "zero3")
    assert [m["step"] for m in one] == [m["step"] for m in zero3] == [1, 2] and 0 < one[0]["reward_std"]
    assert [m["gen_calls"] for m in zero3] == [1, 0]  # one generation; step 2 trains again on its answers
    scale = {"loss": max(abs(m["loss"]) for m in one)}  # (as tests/test_rl.py: step 2's GRPO term and router term
    for a, b in zip(one, zero3):                         # nearly cancel, 0.0066 = -0.046 + 0.053)
        assert (a["reward"], a["completion_length"]) == pytest.approx((b["reward"], b["completion_length"]), rel=1e-6)
        for key in ("loss", "aux_loss", "expert_load"):
            assert abs(a[key] - b[key]) <= 1e-5 * scale.get(key, abs(a[key])), (a["step"], key, a[key], b[key])
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-5, abs=1e-12)
    assert one[1]["kl"] > 0  # step 1 moved the policy off the reference


@pytest.mark.slow
def test_rft_generation_from_a_moe_model_on_two_processes_equals_one(starved_sampling, tmp_path):
    """`harness rft generate` (the continuous engine) from the starving MoE model on 2 processes, one question a
    process, the second's never reaching layer 0's expert 0, against 1 process: every question's answers are the
    same (drawn per question and sample: the shards' counts and distinct answers, rft.keep_per_question =
    rft.oversample: all of them), and so are the kept examples. Each process generates with its own whole model
    (no collective in a forward); finishes within 300 s."""
    import os
    import subprocess
    import sys

    from harness.rft import generate as gen
    from harness_launch import cpu_slots, free_port

    folder, tasks = starved_sampling
    args = ["generate", str(ROOT / "configs" / "rft-tiny.yaml"), f"model.name_or_path={folder}", f"rft.task={tasks}",
            f"data.train_files=[{tasks}]", "rft.oversample=4", "rft.keep_per_question=4", "rft.max_new_tokens=8",
            "rft.questions_per_batch=1", "rft.engine=continuous"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    outs = {n: tmp_path / f"gen{n}" for n in (1, 2)}
    for n, out in outs.items():
        launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                  "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
        cmd = [sys.executable, *(launch if n == 2 else []), "-m", "harness.rft", *args, f"rft.output_dir={out}"]
        with cpu_slots(n):
            proc = subprocess.run(cmd, cwd=ROOT, env={**env, "ACCELERATE_USE_CPU": "1"} if n == 2 else env,
                                  capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    shards = {n: {r["qid"]: r for r in gen.read_shards(out / gen.SHARDS)} for n, out in outs.items()}
    assert sorted(shards[2]) == sorted(shards[1]) == ["q0", "q1"]
    assert {len(list((outs[2] / gen.SHARDS).glob("rank-*.jsonl")))} == {2}  # one question each
    for qid, rec in shards[1].items():
        assert rec["samples"] == 4 and rec["kept"] + rec["rejected"]
        assert {k: shards[2][qid][k] for k in rec} == rec, qid
    kept = {n: sorted((out / gen.OUTPUT).read_text().splitlines()) for n, out in outs.items()}
    assert kept[1] == kept[2]
    assert json.loads((outs[2] / gen.STATS).read_text())["processes"] == 2


# ----------------------------------------------------------------------------------------------- regional compile

def test_compiled_moe_blocks_take_every_routing_and_the_warmed_tail_without_compiling_again():
    """Regional compile of a tiny Qwen3-MoE (static shapes, as packed rows run): after the first full batch, 20
    micro-batches of new tokens (a new routing each: the experts' token counts change) and the epoch's short last
    micro-batch, warmed before step 1 by `warm_generative_tail` with the router loss on as training has it, compile
    nothing more. Before the warm-up ran in generative runs, configs/moe-tiny.yaml packed (111 rows in 8s: 7 left
    at step 14) recompiled 7 graph pieces after step 1; the routing itself never recompiled."""
    from accelerate import Accelerator
    from accelerate.utils import compile_regions
    from torch._dynamo.utils import counters
    from torch.utils.data import DataLoader

    from harness.data.samples import PackedCollator
    from harness.objective import Parts
    from harness.speed.buckets import warm_generative_tail
    from harness.speed.compiling import dynamo_counters

    g = torch.Generator().manual_seed(5)
    rows = [{"input_ids": (ids := torch.randint(3, 64, (14,), generator=g).tolist()), "labels": ids,
             "position_ids": list(range(8)) + list(range(6))} for _ in range(43)]  # 21 batches of 2, then 1 row
    loader = DataLoader(rows, batch_size=2, collate_fn=PackedCollator(0, 16))
    model = _tiny(router_aux_loss_coef=0.02).train()
    torch._dynamo.reset()
    counters.clear()
    compiled = compile_regions(model, backend="eager", dynamic=False)
    cfg = load_config(MOE_TINY, ["data.packing=true"])
    objective = Objective(cfg.loss, cfg.model, cfg.train.grad_accum, Parts(Accelerator(cpu=True), compiled))
    said = []
    assert warm_generative_tail(objective, compiled, loader, said.append) == 1 and "of 1 rows" in said[0]
    assert all(p.grad is None for p in model.parameters())  # the warm-up kept nothing
    graphs, loads = None, set()
    for batch in loader:
        with moe.RouterLoss(compiled, None) as router:
            total, _ = objective.generative_loss_sum(batch)
        (total + router.term).backward()
        loads.add(round(router.load.item(), 6))
        graphs = dynamo_counters()["graphs"] if graphs is None else graphs  # step 1: the full batch's graphs
    assert len(loads) > 3  # the routing changed from batch to batch
    assert dynamo_counters()["graphs"] == graphs, "a routing or the short last batch compiled after step 1"


@pytest.mark.extended
def test_regional_compile_of_moe_tiny_recompiles_nothing_after_step_1(tmp_path):
    """`harness train` on configs/moe-tiny.yaml, regional compile, packed rows, 20 steps across the epoch's end
    (the short last micro-batch at step 14): report.json's recompiles_after_first_step is 0 (was 7)."""
    from harness_launch import report, run_train

    out = tmp_path / "run"
    run_train([f"train.output_dir={out}", *FAST, "train.max_steps=20", "train.compile=regional", "data.packing=true",
               "train.save_final=false"], config=MOE_TINY, timeout=600)
    c = report(out)["compile"]
    assert c["recompiles_after_first_step"] == 0 and c["recompile_limit_hit"] == [], c
    assert c["warmed_embedding_shapes"]["generative_shapes"] == 1 and c["block_calls_eager"] == 0, c


# ----------------------------------------------------------------------------------------------- rl and distill modes

def _moe_model_override() -> str:
    import yaml

    return "model.config=" + json.dumps(yaml.safe_load(Path(MOE_TINY).read_text())["model"]["config"])


def _recording(monkeypatch, mode_class, seen: dict) -> None:
    """Mode.passes records, on its first micro-batch, the model's own aux loss on the batch (the weights of the
    pass) and the StepSums the pass returns."""
    real = mode_class.passes

    def recording(self, gen, emb, scale):
        first = "own" not in seen
        if first:
            model = unwrap(self.model)
            with torch.no_grad():
                seen["own"] = model(**model_inputs(gen), output_router_logits=True, use_cache=False).aux_loss.item()
            seen["coef"] = model.config.router_aux_loss_coef
        sums = real(self, gen, emb, scale)
        if first:
            seen["sums"] = sums
        return sums

    monkeypatch.setattr(mode_class, "passes", recording)


@pytest.mark.parametrize("rows", ["padded", "shared_prompts"])
def test_rl_loss_adds_the_models_own_router_term(tmp_path, monkeypatch, capsys, rows):
    """loss.mode=rl (GRPO, one micro-batch of 2 questions x 4 answers) on configs/moe-tiny.yaml's model: with
    rl.rows=padded the step-1 loss is GRPO's plus router_aux_loss_coef x the model's own aux_loss on the micro-batch
    (as TRL's GRPOTrainer adds it), within 1e-6, aux_loss logged apart; shared_prompts' rows (an attention mask the
    model's load-balancing loss cannot read) add none, and the start says so in one line."""
    from harness.modes.rl import RlMode

    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    seen: dict = {}
    _recording(monkeypatch, RlMode, seen)
    out = tmp_path / "run"
    train.run(load_config(str(ROOT / "configs" / "grpo-tiny.yaml"), [
        f"train.output_dir={out}", *FAST, "train.max_steps=1", "train.save_final=false",
        "train.save_final_checkpoint=false", "train.eval_at_start=false", "train.eval_every=100",
        "model.name_or_path=null", "model.tokenizer=bundled", _moe_model_override(), f"rl.rows={rows}",
        "rl.reward=rl_rewards:digits", "rl.questions_per_step=2", "rl.num_generations=4",
        "rl.max_completion_length=8", "rft.num_test_questions=2"]))
    record = json.loads(Path(out, "metrics.jsonl").read_text().splitlines()[0])
    said = "rl: the router's aux loss is not added on rl.rows=shared_prompts" in capsys.readouterr().out
    grpo = seen["sums"].rl_loss_sum.item()  # (1 process, 1 micro-batch: the logged GRPO loss)
    if rows == "shared_prompts":
        assert said and "aux_loss" not in record and abs(record["loss"] - grpo) <= 1e-6
        return
    assert not said and seen["coef"] == 0.02 and seen["own"] > 0
    assert abs(record["aux_loss"] - seen["own"]) <= 1e-6
    assert abs(record["loss"] - (grpo + 0.02 * seen["own"])) <= 1e-6, (record, seen)


def test_distill_loss_adds_the_models_own_router_term(tmp_path, monkeypatch):
    """loss.mode=distill with a MoE student (configs/moe-tiny.yaml's model) and a dense tiny teacher: the step-1
    loss is the divergence per token plus router_aux_loss_coef x the student's own aux_loss on the micro-batch,
    within 1e-6; aux_loss logged apart."""
    from harness.config import ModelConfig
    from harness.model import load_run_tokenizer
    from harness.modes.distill import DistillMode

    tok = load_run_tokenizer(ModelConfig(tokenizer="bundled"), "auto", "distill")
    teacher = tmp_path / "teacher"
    torch.manual_seed(1)
    config = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                  max_position_embeddings=256, tie_word_embeddings=True,
                                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(teacher)
    tok.save_pretrained(teacher)
    seen: dict = {}
    _recording(monkeypatch, DistillMode, seen)
    out = tmp_path / "run"
    train.run(load_config(MOE_TINY, [f"train.output_dir={out}", *FAST, "train.max_steps=1", "train.micro_batch_size=4",
                                     "train.save_final=false", "train.save_final_checkpoint=false",
                                     "loss.mode=distill", f"distill.teacher={teacher}", "distill.lmbda=0"]))
    record = json.loads(Path(out, "metrics.jsonl").read_text().splitlines()[0])
    sums = seen["sums"]
    divergence = (sums.gen_sum / sums.gen_count).item()
    assert seen["coef"] == 0.02 and seen["own"] > 0
    assert abs(record["aux_loss"] - seen["own"]) <= 1e-6
    assert abs(record["loss"] - (divergence + 0.02 * seen["own"])) <= 1e-6, (record, seen)
