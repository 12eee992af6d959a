"""Preference training (loss.mode=preference, harness/preference.py, harness/data/pairs.py).

- equal to TRL: on one tiny model and one pair batch, the loss, rewards and gradients of dpo (sigmoid, and with label
  smoothing), ipo, simpo and orpo match TRL's own computation within 1e-5 relative: DPOTrainer._compute_loss with
  its fused LM head (dpo, ipo), CPOTrainer.cpo_loss (simpo, conservative dpo) and ORPOTrainer.odds_ratio_loss on
  TRL's get_batch_logps of the full logits;
- TRL's record layouts, and the bad records that are one error line naming file:line;
- a DPO run of the tiny recipe raises the held-out reward accuracy above 0.5 and the margin (slow).

    python -m pytest tests/test_preference.py
"""

from __future__ import annotations

import copy
import json
import re
import types
from collections import defaultdict

import pytest
import torch
import yaml

from harness.config import load_config
from harness.data import IGNORE_INDEX, pairs
from harness.data.chat import resolve_template
from harness.errors import DataError
from harness.model import build_model, load_run_tokenizer
from harness.preference import pair_terms, sequence_logps

trl = pytest.importorskip("trl")

RECORDS = [
    {"prompt": [{"role": "user", "content": "What colour is the sky?"}],
     "chosen": [{"role": "assistant", "content": "Sure! The sky is blue. Hope this helps."}],
     "rejected": [{"role": "assistant", "content": "no idea"}]},
    {"prompt": "What colour is snow? ", "chosen": "Sure! Snow is white.", "rejected": "The snow is red, I think"},
    {"chosen": [{"role": "user", "content": "Colour of grass?"}, {"role": "assistant", "content": "Green, surely."}],
     "rejected": [{"role": "user", "content": "Colour of grass?"}, {"role": "assistant", "content": "why ask"}]},
]


@pytest.fixture(scope="module")
def setup():
    cfg = load_config("configs/dpo-tiny.yaml", ["train.output_dir=/tmp/unused"])
    tok = load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
    torch.manual_seed(0)
    model = build_model(cfg.model, tok, precision="fp32").float()
    rows = [pairs.preference_record(r, f"test:{i + 1}") for i, r in enumerate(RECORDS)]
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    tokenized = pairs.tokenize_pairs(cols, tok, 96, resolve_template(tok, "auto"))
    samples = [{**{k: v[i] for k, v in tokenized.items()}, "index": i} for i in range(len(rows))]
    batch = pairs.PairCollator(tok.pad_token_id)(samples)
    batch["ref_logps"] = torch.tensor([-40.0, -31.5, -12.25, -20.0, -9.5, -14.0])  # some reference
    return cfg, model, batch


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(a, b, rel=1e-5):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert torch.allclose(a, b, rtol=rel, atol=rel * float(b.abs().max()) + 1e-12), (a, b)  # relative to its scale


def ours(cfg_loss, model, batch):
    """Our loss (mean over pairs, + ORPO's NLL per chosen token), rewards and gradients, 5-position chunks."""
    model.zero_grad()
    logps, counts = sequence_logps(model, batch, chunk_size=5)
    per_pair, rc, rr, nll, tokens = pair_terms(cfg_loss, logps, counts, batch)
    loss = per_pair.mean() + (nll / tokens if cfg_loss.preference == "orpo" else 0)
    loss.backward()
    return loss.detach(), rc, rr, _grads(model)


def trl_dpo(kind, beta, model, batch):
    """TRL's DPOTrainer._compute_loss (precomputed reference log-probs) on a copy with its fused LM head."""
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    model = copy.deepcopy(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    n = batch["input_ids"].shape[0] // 2
    accel = types.SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t)
    trainer = types.SimpleNamespace(
        model=model, accelerator=accel, aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=[{"dpo": "sigmoid"}.get(kind, kind)], loss_weights=[1.0],
        beta=beta, use_weighting=False, label_smoothing=0.0, _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1, ref_model=None, args=types.SimpleNamespace())
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "completion_mask": (batch["labels"] != IGNORE_INDEX).long(),
              "ref_chosen_logps": batch["ref_logps"][:n], "ref_rejected_logps": batch["ref_logps"][n:]}
    model.train()
    loss = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), metrics, _grads(model)


def trl_functions(kind, beta, ls, gamma, model, batch):
    """TRL's loss functions (CPOTrainer.cpo_loss, ORPOTrainer.odds_ratio_loss) on TRL's get_batch_logps of the
    full logits; ORPO's NLL on the chosen completion tokens."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    model = copy.deepcopy(model)
    model.zero_grad()
    n = batch["input_ids"].shape[0] // 2
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    accel = types.SimpleNamespace(device=torch.device("cpu"))
    fake = types.SimpleNamespace(beta=beta, label_smoothing=ls, simpo_gamma=gamma, alpha=0.0, accelerator=accel,
                                 loss_type="simpo" if kind == "simpo" else "sigmoid")
    if kind == "cdpo":  # conservative DPO = CPO's smoothed sigmoid loss on the log-ratios to the reference
        logps = CPOTrainer.get_batch_logps(logits, batch["labels"], average_log_prob=False) - batch["ref_logps"]
        losses, rc, rr = CPOTrainer.cpo_loss(fake, logps[:n], logps[n:])
        loss = losses.mean()
    elif kind == "simpo":
        logps = CPOTrainer.get_batch_logps(logits, batch["labels"], average_log_prob=True)
        losses, rc, rr = CPOTrainer.cpo_loss(fake, logps[:n], logps[n:])
        loss = losses.mean()
    else:
        logps = ORPOTrainer.get_batch_logps(logits, batch["labels"], average_log_prob=True)
        losses, rc, rr, _, _ = ORPOTrainer.odds_ratio_loss(fake, logps[:n], logps[n:])
        nll = torch.nn.functional.cross_entropy(logits[:n, :-1].reshape(-1, logits.shape[-1]),
                                                batch["labels"][:n, 1:].reshape(-1), ignore_index=IGNORE_INDEX)
        loss = nll - losses.mean()
    loss.backward()
    return loss.detach(), rc, rr, _grads(model)


@pytest.mark.parametrize("kind,ls", [("dpo", 0.0), ("ipo", 0.0)])
def test_dpo_ipo_equal_trl_trainer(setup, kind, ls):
    cfg, model, batch = setup
    cfg_loss = types.SimpleNamespace(preference=kind, beta=0.3, label_smoothing=ls, simpo_gamma=0.5)
    loss, rc, rr, grads = ours(cfg_loss, model, batch)
    ref_loss, m, ref_grads = trl_dpo(kind, 0.3, model, batch)
    _close(loss, ref_loss)
    _close(rc.mean(), m["rewards/chosen"])
    _close(rr.mean(), m["rewards/rejected"])
    _close((rc - rr).mean(), m["rewards/margins"])
    _close((rc > rr).float().mean(), m["rewards/accuracies"])
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        _close(grads[name], ref_grads[name])


@pytest.mark.parametrize("kind,ls", [("cdpo", 0.2), ("simpo", 0.0), ("simpo", 0.1), ("orpo", 0.0)])
def test_simpo_orpo_cdpo_equal_trl_functions(setup, kind, ls):
    cfg, model, batch = setup
    cfg_loss = types.SimpleNamespace(preference="dpo" if kind == "cdpo" else kind, beta=0.5, label_smoothing=ls,
                                     simpo_gamma=0.7)
    loss, rc, rr, grads = ours(cfg_loss, model, batch)
    ref_loss, ref_rc, ref_rr, ref_grads = trl_functions(kind, 0.5, ls, 0.7, model, batch)
    _close(loss, ref_loss)
    _close(rc, ref_rc)
    _close(rr, ref_rr)
    for name in grads:
        _close(grads[name], ref_grads[name])


def test_chunking_keeps_values(setup):
    """One chunk or many: the same sequence log-probs (and no [2n, T, V] tensor kept between chunks)."""
    _, model, batch = setup
    with torch.no_grad():
        a, ca = sequence_logps(model, batch, chunk_size=3)
        b, cb = sequence_logps(model, batch, chunk_size=10_000)
    _close(a, b, 1e-6)
    assert ca.tolist() == cb.tolist() and min(ca.tolist()) > 0


def test_the_heads_log_probs_are_recomputed_in_backward_only_when_large(monkeypatch):
    """The output head's chunks are recomputed in the backward pass (torch.utils.checkpoint) only when the pass's
    fp32 log-probs over the vocabulary would take more than KEEP_LOGPS_BYTES (64 MiB); below it the recomputation
    (the head's forward pass again) cost time for memory no one needed.
    The gradients are the same either way: the same operations on the same tensors in one process
    (exact equality is justified: no reduction runs in another order)."""
    import harness.preference as preference

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9), generator=g)
    labels[0, :3] = IGNORE_INDEX
    calls = []
    real = preference.checkpoint
    monkeypatch.setattr(preference, "checkpoint", lambda fn, *a, **k: calls.append(1) or real(fn, *a, **k))
    grads = {}
    for threshold in (preference.KEEP_LOGPS_BYTES, 0):  # this size, then as if it were large
        monkeypatch.setattr(preference, "KEEP_LOGPS_BYTES", threshold)
        calls.clear()
        out = preference.token_logps(hidden, weight, labels, chunk_size=4)
        out.sum().backward()
        grads[threshold] = (out.detach(), hidden.grad.clone(), weight.grad.clone(), len(calls))
        hidden.grad, weight.grad = None, None
    kept, recomputed = grads.values()
    assert kept[3] == 0 and recomputed[3] == 5  # 18 positions in chunks of 4: 5 chunks checkpointed
    assert all(torch.equal(a, b) for a, b in zip(kept[:3], recomputed[:3]))
    with torch.no_grad():  # no gradients: never checkpointed
        calls.clear()
        preference.token_logps(hidden, weight, labels, chunk_size=4)
        assert not calls


def test_layouts_and_labels(setup):
    """TRL's three layouts: the implicit prompt is the shared turns; labels only on the completion."""
    row = pairs.preference_record(RECORDS[2], "f.jsonl:3")
    assert [s["role"] for s in row["prompt"]] == ["user"] and row["chosen"][0]["content"] == "Green, surely."
    text = pairs.preference_record({"chosen": "The sky is blue", "rejected": "The sky is red"}, "f.jsonl:1")
    assert text["prompt"][0]["content"] == "The sky is " and text["rejected"][0]["content"] == "red"
    _, _, batch = setup
    n = batch["input_ids"].shape[0] // 2
    trained = batch["labels"] != IGNORE_INDEX
    assert trained.any(1).all() and not trained[:, 0].any()
    assert (batch["labels"][trained] == batch["input_ids"][trained]).all() and n == 3


@pytest.mark.parametrize("kind", ["dpo", "simpo", "orpo"])
def test_an_epochs_filling_trains_no_pair(setup, kind):
    """A pair batch cut to its real pairs keeps their chosen and rejected rows and reference log-probs; a stand-in
    (a batch of an epoch's filling only, harness/data/loaders.without_padding) counts no pair and back-propagates
    zeros, finite even where a loss divides by the completion length (simpo: the stand-in's labels are ignored)."""
    from harness.data.loaders import without_padding

    cfg, model, batch = setup
    cut = without_padding(batch, 2)
    assert cut["pair_index"].tolist() == [0, 1] and cut["input_ids"].shape[0] == 4
    assert torch.equal(cut["input_ids"], batch["input_ids"][[0, 1, 3, 4]])
    assert torch.equal(cut["ref_logps"], batch["ref_logps"][[0, 1, 3, 4]])
    stand_in = without_padding(batch, 0)
    assert stand_in["pair_index"].numel() == 0 and stand_in["input_ids"].shape[0] == 2
    loss_cfg = copy.copy(cfg.loss)
    loss_cfg.preference = kind
    model.zero_grad()
    logps, counts = sequence_logps(model, stand_in, chunk_size=5)
    per_pair, rc, rr, nll, tokens = pair_terms(loss_cfg, logps, counts, stand_in)
    assert per_pair.numel() == rc.numel() == rr.numel() == 0 and int(tokens) == 0
    (per_pair.sum() + nll).backward()
    grads = _grads(model)
    assert grads and all(torch.equal(g, torch.zeros_like(g)) for g in grads.values())


@pytest.mark.parametrize("record,message", [
    ({"prompt": "q", "rejected": "a"}, "f.jsonl:7: missing field 'chosen'"),
    ({"prompt": "q", "chosen": "a", "rejected": "a"}, "f.jsonl:7: fields 'chosen' and 'rejected' are equal"),
    ({"prompt": "q", "chosen": "", "rejected": "b"}, "f.jsonl:7: field 'chosen': empty completion"),
    ({"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"},
     "f.jsonl:7: fields 'chosen' and 'rejected' must both be text or both be messages"),
])
def test_bad_records_are_one_line(record, message):
    with pytest.raises(DataError) as e:
        pairs.preference_record(record, "f.jsonl:7")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_truncated_to_nothing_names_the_record(setup, tmp_path):
    cfg, _, _ = setup
    tok = load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
    row = pairs.preference_record({"prompt": "a long prompt " * 20, "chosen": "yes", "rejected": "no"}, "p.jsonl:4")
    cols = {k: [v] for k, v in row.items()}
    with pytest.raises(DataError, match=r"^p.jsonl:4: field 'chosen': truncated to nothing"):
        pairs.tokenize_pairs(cols, tok, 16, resolve_template(tok, "auto"))


# ----------------------------------------------------------------------------------------------- a DPO run


# the tiny recipe, 6 steps of 8 pairs, evaluated at steps 0, 3 and 6; the 2-process runs split each batch 4 + 4
RUN = ["train.max_steps=6", "train.eval_every=3", "train.log_every=1", "train.progress_bar=false",
       "train.report_to=[]", "train.save_final=false"]


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    from harness_launch import run_train

    out = tmp_path_factory.mktemp("dpo")
    run_train([f"train.output_dir={out}", *RUN], config="configs/dpo-tiny.yaml")
    return out


@pytest.mark.slow
def test_dpo_run_learns_the_preference(dpo_run):
    records = [json.loads(line) for line in (dpo_run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_rewards/accuracies" in r]
    train = [r for r in records if "rewards/accuracies" in r]
    assert evals[0]["step"] == 0 and evals[0]["eval_rewards/margins"] == 0  # the reference is the starting model
    assert evals[-1]["eval_rewards/accuracies"] > 0.5
    assert evals[-1]["eval_rewards/margins"] > evals[0]["eval_rewards/margins"]
    assert train and {"loss", "rewards/chosen", "rewards/rejected", "rewards/margins"} <= set(train[-1])
    assert (dpo_run / "reference_logps.pt").is_file()
    summary = (dpo_run / "summary.md").read_text()
    assert "eval reward accuracy" in summary and "eval reward margin" in summary


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_two_processes_under_zero_equal_one(dpo_run, stage, tmp_path):
    """2 processes x 4 pairs under ZeRO-2 / ZeRO-3 = 1 process x 8 pairs: loss, rewards and eval figures at every
    step (<= 1e-5 relative); the reference log-probs divided between the processes are the same."""
    from harness_launch import rel_close, report, run_train

    out = tmp_path / stage
    run_train([f"train.output_dir={out}", *RUN, "train.micro_batch_size=4", "train.summary=false"], nproc=2,
              accel=stage, config="configs/dpo-tiny.yaml")
    assert report(out)["zero_stage"] == int(stage[-1]) and report(out)["world_size"] == 2
    one, two = ([json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (dpo_run, out))
    keys = [k for k in one[-1] if k.startswith(("loss", "rewards/", "eval_"))]
    pairs_of = [(a, b) for a, b in zip(one, two) if a["step"] == b["step"]]
    assert len(pairs_of) == len(one) == len(two)
    bad = [(a["step"], k, a[k], b[k]) for a, b in pairs_of for k in keys + ["eval_rewards/margins"]
           if k in a and not (rel_close(a[k], b[k], 1e-5) or abs(a[k] - b[k]) < 1e-6)]  # step 1's rewards are ~0
    assert not bad, bad
    ref_one, ref_two = (torch.load(d / "reference_logps.pt") for d in (dpo_run, out))
    assert torch.allclose(ref_one["train"]["logps"], ref_two["train"]["logps"], rtol=1e-5)


@pytest.mark.slow
def test_a_stopped_dpo_run_resumes_on_another_process_count_as_if_uninterrupted(dpo_run, tmp_path):
    """Exact and elastic resume of a preference run: two processes (4 pairs each) stop at step 3 with a checkpoint;
    one process (4 pairs, accumulation 2) goes on from it. The reference log-probs are read back, not computed from
    the resumed model, and steps 4-6 (loss, rewards, the eval at step 6) equal the uninterrupted one-process run's."""
    from harness_launch import rel_close, report, run_train

    out = tmp_path / "run"
    first = run_train([f"train.output_dir={out}", *RUN, "train.micro_batch_size=4", "train.stop_at_step=3"], nproc=2,
                      accel="ddp", config="configs/dpo-tiny.yaml")
    assert "stopped (stop_at_step) at step 3/6" in first.stdout, first.stdout[-3000:]
    second = run_train([f"train.output_dir={out}", *RUN, "train.micro_batch_size=4", "train.grad_accum=2",
                        "train.resume=auto"], config="configs/dpo-tiny.yaml")
    said = second.stdout
    assert "resumed from" in said and "step-3" in said and "layout changed: 2 -> 1 process(es)" in said, said[-3000:]
    assert re.search(r"reference log-probs of \d+ train pairs read from", said) and "computed" not in said, said[-3000:]
    rep = report(out)
    assert rep["world_size"] == 1 and rep["grad_accum"] == 2 and rep["steps"] == 6

    def figures(folder, after=0):  # {(step, key): value} of the loss, reward and eval figures past `after`
        keys = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "eval_loss",
                "eval_rewards/margins", "eval_rewards/accuracies")
        return {(r["step"], k): r[k] for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
                if r.get("step", 0) > after for k in keys if k in r}

    resumed, uninterrupted = figures(out, after=3), figures(dpo_run, after=3)
    assert resumed.keys() == uninterrupted.keys() and {s for s, _ in resumed} == {4, 5, 6}
    assert (6, "eval_rewards/margins") in resumed
    bad = [(sk, uninterrupted[sk], v) for sk, v in resumed.items()
           if not (rel_close(uninterrupted[sk], v, 1e-5) or abs(uninterrupted[sk] - v) < 1e-6)]
    assert not bad, bad


@pytest.mark.slow
def test_a_dpo_resume_with_another_seed_on_a_random_init_model_is_refused(tmp_path):
    """The reference of a random-init model is the model its seed made: a resume with another train.seed computed it
    from the new seed's model (up to 1.89 nats off) while the weights went on from the checkpoint. Refused in one
    line before anything is computed."""
    from harness_launch import run_train

    out = tmp_path / "run"
    args = [f"train.output_dir={out}", "train.max_steps=2", "train.stop_at_step=1", "train.eval_every=0",
            "train.eval_at_start=false", "train.progress_bar=false", "train.report_to=[]", "train.save_final=false",
            "train.summary=false"]
    run_train(args, config="configs/dpo-tiny.yaml")
    ref = (out / "reference_logps.pt").read_bytes()
    other = run_train([*args[:2], *args[3:], "train.seed=7"], config="configs/dpo-tiny.yaml", check=False)
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-3000:]
    assert other.stderr.strip().splitlines()[-1] == (
        f"harness: error: config key 'train.seed': the run to resume ({out}/checkpoints/step-1) started from the "
        f"random model of train.seed=42, which is its loss.preference=dpo reference; with 7 the reference would be "
        f"another model's while the weights continue the run: rerun with train.seed=42, or start over with "
        f"train.overwrite=true")
    assert (out / "reference_logps.pt").read_bytes() == ref and not (out / "checkpoints" / "step-2").exists()
    state = json.loads((out / "checkpoints" / "step-1" / "harness_state.json").read_text())
    assert state["seed"] == 42  # dpo-tiny's train.seed, recorded with the loop state
    # (the same seed resumes and reads the reference back: test_a_stopped_dpo_run_resumes_on_another_process_count)


@pytest.mark.slow
def test_dpo_compiled_regionally_equals_eager(dpo_run, tmp_path):
    """train.compile=regional with the preference objective (one process): the reference pass, the pair forwards
    (chosen and rejected in one batch) and the evaluations all run the compiled decoder blocks, nothing recompiles
    after the first step, and the loss, rewards and eval figures equal the eager run's step by step."""
    from harness_launch import rel_close, report, run_train

    out = tmp_path / "regional"
    run_train([f"train.output_dir={out}", *RUN, "train.compile=regional", "train.summary=false"],
              config="configs/dpo-tiny.yaml", timeout=900)
    c = report(out)["compile"]
    assert c["mode"] == "regional" and c["ran_compiled"] and c["block_calls_eager"] == 0, c
    assert c["recompiles_after_first_step"] == 0 and c["recompile_limit_hit"] == [], c
    compiled, eager = ([json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (out, dpo_run))
    assert [r["step"] for r in compiled] == [r["step"] for r in eager]
    keys = [k for k in eager[-1] if k.startswith(("loss", "rewards/", "eval_"))]
    bad = [(a["step"], k, a[k], b[k]) for a, b in zip(compiled, eager) for k in keys + ["eval_rewards/margins"]
           if k in b and not (rel_close(a[k], b[k], 1e-4) or abs(a[k] - b[k]) < 1e-6)]
    assert not bad, bad


def test_a_damaged_reference_file_is_computed_again_in_one_line(tmp_path):
    """reference_logps.pt cut short (a full disk) or overwritten: one line, and the values are computed again (a
    traceback before: torch.load's own error stopped the run)."""
    from harness.preference import stored_reference

    path, said = tmp_path / "reference_logps.pt", []
    torch.save({"train": {"fingerprint": "x", "logps": torch.zeros(4, 2)}}, path)
    assert stored_reference(path, said.append)["train"]["fingerprint"] == "x" and not said
    path.write_bytes(path.read_bytes()[:40])
    assert stored_reference(path, said.append) == {}
    assert len(said) == 1 and str(path) in said[0] and "computed again" in said[0]
    torch.save([1, 2], path)
    assert stored_reference(path, said.append) == {} and "not a dict" in said[1]
    assert stored_reference(tmp_path / "none.pt", said.append) == {} and len(said) == 2


def test_a_reference_file_of_another_layout_or_a_folder_in_its_place_is_one_line(tmp_path):
    """A dict of another layout, or a folder where reference_logps.pt goes: every rerun stopped with a traceback
    (KeyError / IsADirectoryError) until it was deleted; now one line, the values computed again and, for a folder
    (left alone), not stored."""
    from harness.preference import stored_reference, write_reference

    path, said = tmp_path / "reference_logps.pt", []
    good = {"train": {"fingerprint": "x", "logps": torch.zeros(4, 2, dtype=torch.float64)}}
    for other in ({"train": torch.zeros(4, 2)}, {"train": {"fingerprint": "x", "values": torch.zeros(4, 2)}},
                  {"train": {"fingerprint": "x", "logps": torch.zeros(4)}}):
        torch.save(other, path)
        assert stored_reference(path, said.append) == {} and "another layout" in said[-1], said[-1:]
        write_reference(path, good, said.append)  # what the run then stores in its place
        assert stored_reference(path, said.append)["train"]["fingerprint"] == "x"
    path.unlink()
    path.mkdir()
    assert stored_reference(path, said.append) == {} and "a folder" in said[-1]
    write_reference(path, good, said.append)
    assert path.is_dir() and "not stored" in said[-1] and "\n" not in said[-1]


def test_a_full_disk_while_writing_the_reference_file_is_one_line_and_leaves_nothing_cut(tmp_path):
    """A write past a file-size limit (RLIMIT_FSIZE: the same failure as a full disk's ENOSPC, without root tricks)
    left a cut reference_logps.tmp and a traceback; now one line, no temporary, the previous file intact."""
    import resource

    from harness.errors import HarnessError
    from harness.preference import write_reference

    path = tmp_path / "reference_logps.pt"
    small = {"train": {"fingerprint": "x", "logps": torch.zeros(4, 2, dtype=torch.float64)}}
    write_reference(path, small)
    before = path.read_bytes()
    big = {"train": {"fingerprint": "y", "logps": torch.zeros(100_000, 2, dtype=torch.float64)}}  # 1.6 MB
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # (Python ignores SIGXFSZ: the write fails, EFBIG)
    try:
        with pytest.raises(HarnessError) as e:
            write_reference(path, big)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(e.value).startswith(f"could not write {path} (") and "nothing was trained" in str(e.value), e.value
    assert "\n" not in str(e.value) and path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reference_logps.pt"]


def save_pref_base(folder) -> None:
    """dpo-tiny's model saved as a pretrained base with its tokenizer (the chat markers already in the vocabulary, as
    in an instruct model's: nothing is added, so the tied head stays a plain Linear; a base that lacks them:
    test_lora_dpo_on_a_base_whose_tokenizer_lacks_the_chat_markers)."""
    from harness.model import build_model, load_tokenizer
    from harness_launch import ROOT

    cfg = load_config(ROOT / "configs" / "dpo-tiny.yaml")
    tok = load_tokenizer(cfg.model, cfg.data.chat_template)
    torch.manual_seed(0)
    build_model(cfg.model, tok).save_pretrained(folder)
    tok.save_pretrained(folder)


@pytest.mark.slow
def test_qlora_dpo_takes_the_4bit_base_as_its_reference_and_learns(tmp_path):
    """DPO with LoRA on a 4-bit base (real bitsandbytes on the CPU): the reference is the quantized base itself (the
    starting adapter is zero, so the step-0 eval margin is exactly 0 and no second model is loaded), the adapter
    learns the preference (eval margin and accuracy up by the end), and final/ holds only the adapter."""
    pytest.importorskip("bitsandbytes")
    from harness_launch import report, run_train

    base, out = tmp_path / "base", tmp_path / "run"
    save_pref_base(base)
    run_train([f"train.output_dir={out}", f"model.name_or_path={base}", "model.config={}", "model.tokenizer=null",
               "model.quantization=4bit", "model.lora.enabled=true", "model.lora.r=8", "model.lora.alpha=16",
               "train.max_steps=8", "train.eval_every=8", "train.log_every=2", "train.progress_bar=false",
               "train.report_to=[]", "optim.lr=2e-2"], config="configs/dpo-tiny.yaml")
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if "eval_rewards/margins" in r]
    assert [e["step"] for e in evals] == [0, 8]
    assert evals[0]["eval_rewards/margins"] == 0 and evals[0]["eval_rewards/chosen"] == 0
    assert evals[-1]["eval_rewards/margins"] > 0.01 and evals[-1]["eval_rewards/accuracies"] > 0.5, evals
    assert report(out)["loss_mode"] == "preference"
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["quantization"] == "4bit"
    assert (out / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_lora_dpo_on_a_base_whose_tokenizer_lacks_the_chat_markers(tmp_path):
    """A pretrained base whose tokenizer has no chat markers (a base model's): they are added, and under LoRA peft
    trains their rows apart (trainable tokens), wrapping the tied head. The sequence log-probs take that head in
    chunks (before: refused in one line, "not a plain Linear"): the reference is the base (step-0 eval margin
    exactly 0), the adapter learns the preference, and final/ holds the adapter with the markers' rows."""
    from safetensors.torch import load_file

    from harness_launch import run_train
    from tests.test_lora import save_base

    base, out = tmp_path / "base", tmp_path / "run"
    save_base(base)
    run_train([f"train.output_dir={out}", f"model.name_or_path={base}", "model.config={}", "model.tokenizer=null",
               "model.lora.enabled=true", "model.lora.r=8", "model.lora.alpha=16", "train.max_steps=8",
               "train.eval_every=8", "train.log_every=2", "train.progress_bar=false", "train.report_to=[]",
               "optim.lr=2e-2"], config="configs/dpo-tiny.yaml")
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if "eval_rewards/margins" in r]
    assert [e["step"] for e in evals] == [0, 8]
    assert evals[0]["eval_rewards/margins"] == 0 and evals[0]["eval_rewards/chosen"] == 0
    assert evals[-1]["eval_rewards/margins"] > 0.01 and evals[-1]["eval_rewards/accuracies"] > 0.5, evals
    adapter = load_file(str(out / "final" / "adapter_model.safetensors"))
    assert any("trainable_tokens_delta" in k for k in adapter), sorted(adapter)
