"""loss.chunked_ce in the training objective and the evaluation: the chunked output-head loss (ChunkedHeadLoss) gives
the same loss sums, token counts and gradients as the full logits, in-process (fp32, CPU, relative 1e-5), and
end to end (slow: one process, 2-process DDP and ZeRO-1/2/3, relative 1e-4); QLoRA in process (slow: bitsandbytes).

    python -m pytest tests/test_chunked_objective.py -m "not slow"
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from harness.config import ModelConfig, load_config
from harness.data import IGNORE_INDEX
from harness.errors import ConfigError
from harness.model import build_model, load_tokenizer
from harness.chunked_loss import AUTO_MIN_LOGITS_BYTES, resolve_chunked_ce
from harness.objective import Objective, Parts
from harness_launch import DEFAULT, FAST, final_weights, initial_weights, metrics, rel_close, report, run_train, \
    update_rel_diff

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64}


def _close(got: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    got, ref = torch.as_tensor(got).detach().double(), torch.as_tensor(ref).detach().double()
    torch.testing.assert_close(got, ref, rtol=rel, atol=rel * float(ref.abs().max()) + 1e-12)


class _Accelerator:
    """What Objective uses of accelerate's Accelerator, for one process: backward divides by the accumulation
    (as accelerate does), reduce and no_sync are identities."""

    num_processes, process_index = 1, 0
    device = torch.device("cpu")

    def __init__(self, accum: int):
        from accelerate.utils import DistributedType

        self.accum, self.distributed_type = accum, DistributedType.NO

    def reduce(self, tensor, op):
        return tensor

    def backward(self, loss):
        (loss / self.accum).backward()

    def no_sync(self, model):
        return contextlib.nullcontext()


def _cfg(mode: str, averaging: str, accum: int):
    over = [f"loss.mode={mode}", f"loss.gen_averaging={averaging}", f"train.grad_accum={accum}",
            "data.emb_train_files=[x.jsonl]", "loss.gen_weight=0.7", "loss.emb_weight=1.3"]
    return load_config(DEFAULT, over)


def _model(tied: bool, lora: bool):
    cfg = ModelConfig(config={**TINY, "tie_word_embeddings": tied}, attn_implementation="eager",
                      lora={"enabled": True, "r": 4, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
                      if lora else {})
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    return build_model(cfg, tok)


def _gen_batch(gen: torch.Generator, vocab: int, packed: bool, rows: int = 3, width: int = 20) -> dict:
    ids = torch.randint(5, vocab, (rows, width), generator=gen)
    labels = ids.clone()
    labels[torch.rand(rows, width, generator=gen) < 0.2] = IGNORE_INDEX  # prompts, untrained tokens
    if packed:  # documents back to back: per-document position ids, no attention mask; a padded tail
        cuts = [[0, 7, 12], [0, 9], [0, 4, 11, 16]]
        pos = torch.zeros(rows, width, dtype=torch.long)
        for r, starts in enumerate(cuts):
            bounds = starts + [width]
            for a, b in zip(bounds[:-1], bounds[1:]):
                pos[r, a:b] = torch.arange(b - a)
                labels[r, a] = IGNORE_INDEX  # nothing predicted across a boundary
        labels[2, 16:] = IGNORE_INDEX  # the tail "document" (padding) is not trained
        return {"input_ids": ids, "labels": labels, "position_ids": pos, "token_mask": torch.ones_like(ids)}
    mask = torch.ones_like(ids)
    for r, n in enumerate((width, width - 6, width - 11)):
        mask[r, n:] = 0
    labels[mask == 0] = IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _emb_batch(gen: torch.Generator, vocab: int, queries: int = 2, group: int = 2) -> dict:
    def side(n: int, width: int) -> dict:
        ids = torch.randint(5, vocab, (n, width), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, width - 3:] = 0
        pool = mask.clone()
        pool[:, :2] = 0  # the instruction
        return {"input_ids": ids, "attention_mask": mask, "pool_mask": pool}

    return {"query": side(queries, 9), "passage": side(queries * group, 11)}


def _step(model, cfg, chunk_size, gens, embs):
    """One optimizer step's gradients (train_step's loop, without the update) and the summed log figures."""
    model.zero_grad(set_to_none=True)
    objective = Objective(cfg.loss, cfg.model, cfg.train.grad_accum, Parts(_Accelerator(len(gens)), model),
                          chunk_size=chunk_size)
    scale = objective.gen_scale(gens) if gens[0] is not None else 0.0
    sums = [objective.micro_step(g, e, scale) for g, e in zip(gens, embs)]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return sums, grads


@pytest.mark.parametrize("mode, averaging, packed, tied, lora, accum", [
    ("generative", "token", False, True, False, 2),
    ("generative", "mixed", False, False, False, 2),
    ("generative", "token", True, False, False, 2),
    ("generative", "mixed", True, True, False, 1),
    ("generative", "token", False, True, True, 2),
    ("generative", "mixed", True, False, True, 2),
    ("unified", "token", True, False, False, 2),
    ("unified", "mixed", False, True, True, 2),
])
def test_micro_step_chunked_equals_full_logits(mode, averaging, packed, tied, lora, accum):
    model = _model(tied, lora)
    vocab = model.get_output_embeddings().out_features
    cfg = _cfg(mode, averaging, accum)
    gen = torch.Generator().manual_seed(accum * 8 + 4 * packed + 2 * tied + lora)
    gens = [_gen_batch(gen, vocab, packed) for _ in range(accum)]
    embs = [_emb_batch(gen, vocab) if mode == "unified" else None for _ in range(accum)]
    ref_sums, ref_grads = _step(model, cfg, None, gens, embs)
    for chunk in (7, 1024):  # several chunks (7 does not divide a batch's positions); one chunk
        sums, grads = _step(model, cfg, chunk, gens, embs)
        for s, r in zip(sums, ref_sums):
            _close(s.gen_sum, r.gen_sum)
            assert int(s.gen_count) == int(r.gen_count) > 0
            _close(s.gen_mean_sum, r.gen_mean_sum)
            if mode == "unified":
                _close(s.emb_sum, r.emb_sum)
        assert grads.keys() == ref_grads.keys() and ref_grads
        if lora:
            assert all("lora_" in n for n in ref_grads)
        for name in ref_grads:
            _close(grads[name], ref_grads[name])
    # the head is left as it was: a plain forward gives logits again
    out = model(input_ids=gens[0]["input_ids"], use_cache=False)
    assert out.logits.shape == (*gens[0]["input_ids"].shape, vocab)


@pytest.mark.slow
def test_qlora_micro_step_chunked_equals_full_logits(tmp_path):
    """QLoRA (a 4-bit nf4 base by bitsandbytes, LoRA on top, real kernels on the CPU): the chunked loss through the
    (unquantized) output head gives the full-logit path's losses and adapter gradients, untied head."""
    pytest.importorskip("bitsandbytes")
    from harness.lora import is_quantized
    from tests.test_lora import save_base

    save_base(tmp_path / "base", tied=False)
    cfg = load_config(DEFAULT, [f"model.name_or_path={tmp_path / 'base'}", "model.config={}", "model.tokenizer=null",
                                "model.quantization=4bit", "model.lora.enabled=true", "model.lora.r=8",
                                "train.grad_accum=2"])
    # No added tokens (as with an instruct tokenizer and its own template): the head stays a plain Linear. With added
    # tokens peft wraps the head (trainable_token_indices), which the chunked loss takes too (tests/test_chunked_ce.py).
    tok = load_tokenizer(cfg.model, markers=False)
    torch.manual_seed(0)
    model = build_model(cfg.model, tok, precision="fp32")
    assert is_quantized(model)
    vocab = len(tok)
    gen = torch.Generator().manual_seed(5)
    gens = [_gen_batch(gen, vocab, packed) for packed in (False, True)]
    ref_sums, ref_grads = _step(model, cfg, None, gens, [None, None])
    sums, grads = _step(model, cfg, 7, gens, [None, None])
    for s, r in zip(sums, ref_sums):
        _close(s.gen_sum, r.gen_sum)
        assert int(s.gen_count) == int(r.gen_count) > 0
    assert grads.keys() == ref_grads.keys() and ref_grads and all("lora_" in n for n in ref_grads)
    for name in ref_grads:
        _close(grads[name], ref_grads[name])


def test_evaluation_chunked_equals_full_logits():
    from harness.evaluation import evaluate_generative

    model = _model(tied=False, lora=False)
    vocab = model.get_output_embeddings().out_features
    gen = torch.Generator().manual_seed(3)
    batches = [_gen_batch(gen, vocab, packed=p) for p in (False, True, False)]
    loader = torch.utils.data.DataLoader(batches, batch_size=1, collate_fn=lambda one: one[0])  # ready-made batches
    acc = _Accelerator(1)
    ref = evaluate_generative(acc, model, loader)
    got = evaluate_generative(acc, model, loader, chunk_size=5)
    assert got == pytest.approx(ref, rel=1e-5) and ref > 0
    assert model.training  # put back in training mode


# ----------------------------------------------------------------------------------------------- the setting


def _refused_model():
    cfg = AutoConfig.for_model("cohere", **{k: v for k, v in TINY.items() if k != "model_type"}, logit_scale=0.0625,
                               vocab_size=96)
    return AutoModelForCausalLM.from_config(cfg)


def test_resolve_chunked_ce():
    model = _model(tied=True, lora=False)
    vocab = model.get_output_embeddings().out_features
    big = AUTO_MIN_LOGITS_BYTES // (4 * vocab) + 1  # positions whose fp32 logits pass the auto threshold
    small = AUTO_MIN_LOGITS_BYTES // (4 * vocab) - 1
    cfg = lambda *o: ((c := load_config(DEFAULT, list(o))).loss, c.train.compile)  # noqa: E731 - loss, train.compile
    notes = []
    assert resolve_chunked_ce(*cfg(), model, small, notes.append) is None
    assert resolve_chunked_ce(*cfg(), model, big, notes.append) == 1024
    assert resolve_chunked_ce(*cfg("loss.chunked_ce_size=64"), model, big, notes.append) == 64
    assert resolve_chunked_ce(*cfg("train.compile=full"), model, big, notes.append) is None
    assert resolve_chunked_ce(*cfg("loss.chunked_ce=true"), model, 1, notes.append) == 1024
    assert resolve_chunked_ce(*cfg("loss.chunked_ce=false"), model, big, notes.append) is None
    assert resolve_chunked_ce(*cfg("loss.chunked_ce=true"), model, 0, notes.append) is None  # no generative data
    assert notes == []
    refused = _refused_model()  # vocabulary 96
    big, small = AUTO_MIN_LOGITS_BYTES // (4 * 96) + 1, AUTO_MIN_LOGITS_BYTES // (4 * 96) - 1
    assert resolve_chunked_ce(*cfg(), refused, small, notes.append) is None and notes == []  # small: off anyway
    assert resolve_chunked_ce(*cfg(), refused, big, notes.append) is None
    assert len(notes) == 1 and "loss.chunked_ce=auto stays off" in notes[0] and "logit_scale" in notes[0]
    with pytest.raises(ConfigError, match=r"^config key 'loss.chunked_ce': true, but .*logit_scale.*chunked_ce=false"):
        resolve_chunked_ce(*cfg("loss.chunked_ce=true"), refused, big, notes.append)


def test_chunked_ce_config_keys():
    assert load_config(DEFAULT).loss.chunked_ce == "auto"
    assert load_config(DEFAULT).loss.chunked_ce_size == 1024
    assert load_config(DEFAULT, ["loss.chunked_ce=true"]).loss.chunked_ce is True
    with pytest.raises(ConfigError, match="'loss.chunked_ce'"):
        load_config(DEFAULT, ["loss.chunked_ce=sometimes"])
    with pytest.raises(ConfigError, match="'loss.chunked_ce_size': must be >= 1"):
        load_config(DEFAULT, ["loss.chunked_ce_size=0"])
    with pytest.raises(ConfigError, match="'loss.chunked_ce': true is not supported with train.compile=full"):
        load_config(DEFAULT, ["loss.chunked_ce=true", "train.compile=full"])


# ----------------------------------------------------------------------------------------------- end to end

E2E = ["train.max_steps=5", "train.progress_bar=false", "train.log_every=1", "train.report_to=[]",
       "train.summary=false", "loss.chunked_ce_size=300"]  # 300 does not divide a micro-batch's positions
assert "data.eval_files=[]" in FAST  # these runs keep the recipe's eval files: the eval loss is compared too


def _e2e(out, chunked: bool, nproc: int = 1, accel: str | None = None, micro: int = 16):
    proc = run_train([f"train.output_dir={out}", *E2E, f"loss.chunked_ce={str(chunked).lower()}",
                      f"train.micro_batch_size={micro}"], nproc=nproc, accel=accel)
    assert ("generative loss: chunked through the output head, 300 positions" in proc.stdout) == chunked
    return metrics(out), _evals(out), final_weights(out)


def _evals(out) -> list[float]:
    import json
    from pathlib import Path

    rows = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["eval_loss"] for r in rows if "eval_loss" in r]


@pytest.fixture(scope="module")
def full_logits_run(tmp_path_factory):
    """The default recipe, 5 steps, one process, loss.chunked_ce=false: the reference of the runs below."""
    return _e2e(tmp_path_factory.mktemp("full"), chunked=False)


def _same(got, ref, rel: float, evals: bool = True) -> None:
    """evals: compare the eval losses too (not across process counts: the prepared eval loader of 2 processes
    repeats samples to even out the shards, so its mean differs from one process's whatever the loss path)."""
    (m, ev, w), (m_ref, ev_ref, w_ref) = got, ref
    assert len(m) == len(m_ref) == 5 and len(ev) == len(ev_ref) == 2  # eval at the start and at the end
    for a, b in zip(m, m_ref):
        for key in ("loss", "grad_norm"):
            assert rel_close(a[key], b[key], rel), (a["step"], key, a[key], b[key])
    if evals:
        for a, b in zip(ev, ev_ref):
            assert rel_close(a, b, rel), (ev, ev_ref)
    # (a ZeRO-1/2 export also holds the tied lm_head.weight; compare the reference's tensors)
    assert update_rel_diff({k: w[k] for k in w_ref}, w_ref, initial_weights()) < rel


@pytest.mark.slow
def test_one_process_chunked_equals_full_logits(full_logits_run, tmp_path):
    _same(_e2e(tmp_path / "chunked", chunked=True), full_logits_run, 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("accel", ["ddp", "zero1", "zero2", "zero3"])
def test_two_processes_chunked_equal_one_process_full_logits(accel, full_logits_run, tmp_path):
    """2 processes x 8 rows with the chunked loss (under ZeRO-1/2 the gradients are reduced and partitioned by the
    engine; under ZeRO-3 the head's weight is gathered by the engine's hooks while the chunked loss runs) against
    1 process x 16 rows with the full logits: the same global batch."""
    _same(_e2e(tmp_path / accel, chunked=True, nproc=2, accel=accel, micro=8), full_logits_run, 1e-4, evals=False)
    rep = report(tmp_path / accel)
    assert rep["world_size"] == 2 and rep["zero_stage"] == (None if accel == "ddp" else int(accel[-1]))
