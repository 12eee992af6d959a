"""The continuous generation engine (harness/rft/engine.py) against the static path, on a tiny random model whose
greedy answers run from a few tokens to max_new_tokens: identical greedy text with slots refilled in batch buckets,
the compiled step without recompiles, one batched prefill per prompt, the device-side pick against transformers'
warpers, top-p at its limit equal to greedy, seeded samples, stop strings, the out-of-memory
back-off, the KV budget, the fallback for a model it cannot serve; preference pairs from the shards.

    .venv/bin/python -m pytest tests/test_rft_engine.py
"""

from __future__ import annotations

import json

import pytest
import torch

from harness.config import ModelConfig, load_config
from harness.errors import ConfigError, HarnessError
from harness.rft import generate as gen
from harness.rft.decode import SlotCache, Step, bucket_for, buckets, graphs, pick
from harness.rft.engine import ContinuousEngine, servable
from harness.rft.sampling import StaticEngine, make_engine
from harness.rft.tasks import ArithmeticTask, Question
from tests.harness_launch import ROOT

# untied embeddings and a wide init: a random model that does not just repeat its last token, so that its answers
# end (EOS) anywhere from the first token to max_new_tokens
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "tie_word_embeddings": False, "initializer_range": 0.3}
NEW = 30


@pytest.fixture(scope="module")
def setup():
    from accelerate.utils import set_seed

    from harness.model import build_model, load_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest, and spared the wait of busy shared cores
    cfg = ModelConfig(config=dict(TINY))
    tok = load_tokenizer(cfg)
    tok.padding_side = "left"
    set_seed(0)
    model = build_model(cfg, tok).eval()
    t = ArithmeticTask(n_train=12, n_test=0, n_sft=0, max_operand=12)
    prompts = [gen.prompt_text(t, q, tok) for q in t.split("train")]
    static = gen.Sampler(model, tok, max_new_tokens=NEW, micro=64).sample(prompts, 1, greedy=True)
    yield model, tok, prompts, static
    torch.set_num_threads(threads)


def test_greedy_text_equals_the_static_path_with_slots_refilled_in_buckets(setup, monkeypatch):
    model, tok, prompts, static = setup
    moves, sizes = [], []
    move, step = SlotCache.move, Step.__call__
    monkeypatch.setattr(SlotCache, "move", lambda self, s, d, c: moves.append(len(s)) or move(self, s, d, c))
    monkeypatch.setattr(Step, "__call__", lambda self, c, b, *a: sizes.append(b) or step(self, c, b, *a))
    e = ContinuousEngine(model, tok, NEW, max_slots=3)
    out = e.generate(prompts, 1, greedy=True)
    assert out == static and moves  # running sequences moved into the rows of ended ones
    assert {2, 3} <= set(sizes) <= {1, 2, 3} and e.step.compiled is False  # buckets(3); no compile on CPU
    assert min(e.stats.lengths) < 10 and max(e.stats.lengths) == NEW  # mixed lengths: early EOS and the cap
    assert e.stats.sequences == len(prompts) and 1 < e.stats.mean_batch() <= 3
    s = gen.Sampler(model, tok, max_new_tokens=NEW, micro=64)
    s.sample(prompts, 1, greedy=True)  # one batch waits for its longest: the early-ended rows are padding
    assert s.stats.waste() == pytest.approx(1 - sum(s.stats.lengths) / (len(prompts) * NEW))


def test_buckets():
    assert buckets(256) == [1, 2, 4, 8, *range(16, 257, 16)] and buckets(20) == [1, 2, 4, 8, 16, 20]
    assert buckets(3) == [1, 2, 3] and buckets(1) == [1] and bucket_for(17, buckets(40)) == 32


def test_the_compiled_step_runs_a_mixed_length_generation_without_recompiling(setup, monkeypatch):
    """torch.compile(fullgraph) of the decode step: one graph for all the buckets; after a first run has warmed it,
    a second whole generation (answers ending from the first token to max_new_tokens, rows refilled) compiles
    nothing more."""
    import torch._dynamo

    model, tok, prompts, static = setup
    sizes = []
    call = Step._compiled
    monkeypatch.setattr(Step, "_compiled", lambda self, c, b, *a: sizes.append(b) or call(self, c, b, *a))
    torch._dynamo.reset()
    before = graphs()
    e = ContinuousEngine(model, tok, NEW, max_slots=5, compile=True)  # compiled buckets 2, 4, 5
    assert e.generate(prompts, 1, greedy=True) == static
    warm = graphs()
    assert warm - before == 1 and len(set(sizes)) >= 2 and set(sizes) <= {2, 4, 5}  # one graph, several buckets
    out = e.generate(prompts, 1, greedy=True)
    assert out == static and graphs() == warm  # no graph compiled, no recompilation
    assert e.compiled and e.stats.steps > 2 * NEW and max(e.stats.lengths) == NEW and min(e.stats.lengths) < 10


def test_a_step_that_does_not_compile_runs_eagerly_with_one_line(setup):
    model, tok, prompts, static = setup
    said = []
    e = ContinuousEngine(model, tok, NEW, max_slots=4, say=said.append, compile=True)

    def untraceable(*args):  # what torch.compile raises for a forward it cannot capture whole
        from torch._dynamo.exc import Unsupported

        raise Unsupported("graph break in a model's forward (simulated)")

    e.step.fn = untraceable
    assert e.generate(prompts, 1, greedy=True) == static
    assert not e.compiled and len(said) == 1 and "did not compile (Unsupported" in said[0]


def test_a_prompt_is_prefilled_once_for_its_samples_and_seeded_samples_repeat(setup):
    model, tok, prompts, static = setup
    e = ContinuousEngine(model, tok, NEW, max_slots=5)  # 4 samples of 3 prompts: a prompt's samples split
    calls = []
    prefill = e._prefill
    e._prefill = lambda ids: calls.append(len(ids)) or prefill(ids)
    a = e.generate(prompts[:3], 4, temperature=1.0, seed=7)
    assert sum(calls) == 3 and calls[0] == 2 and [len(g) for g in a] == [4, 4, 4] and len(set(a[0])) > 1
    assert ContinuousEngine(model, tok, NEW, max_slots=5).generate(prompts[:3], 4, temperature=1.0, seed=7) == a
    # top-p at its limit keeps the most likely token only: sampling is then greedy decoding
    assert e.generate(prompts, 1, temperature=0.7, top_p=1e-6, seed=1) == static


def test_a_sample_draws_the_same_tokens_alone_batched_or_at_another_slot_count(setup):
    """Per-sample seeds: sample (i, j)'s draws are a function of seed(i, j) and its token positions only, so the
    same sample drawn alone, among other prompts, or with other slots (and rows moved under it) gives the same
    tokens; greedy ignores the seed."""
    model, tok, prompts, static = setup
    qid = {p: k for k, p in enumerate(prompts)}  # a prompt's own id, whatever its index in the call
    picked = [prompts[4], prompts[1], prompts[7]]

    def seeded(these):
        return lambda i, j: 1000 * qid[these[i]] + j

    def draw(these, slots):
        e = ContinuousEngine(model, tok, NEW, max_slots=slots)
        e.generate(these, 3, temperature=1.0, seed=seeded(these))
        return {(qid[p], j): e.last_ids[i][j] for i, p in enumerate(these) for j in range(3)}

    together = draw(prompts, 5)  # all 12 prompts x 3 samples through 5 slots: rows refilled and moved
    assert len({tuple(t) for t in together.values()}) > 20  # samples differ from one another
    for slots in (1, 4, 16):
        got = draw(picked, slots)
        assert got == {k: together[k] for k in got}
    alone = draw([prompts[7]], 2)
    assert alone == {k: together[k] for k in alone}
    e = ContinuousEngine(model, tok, NEW, max_slots=3)
    assert e.generate(prompts[:4], 1, temperature=1.0, seed=5) != e.generate(prompts[:4], 1, temperature=1.0, seed=6)
    assert e.generate(prompts, 1, greedy=True, seed=3) == static


def test_the_device_draws_are_uniform_and_a_pure_function_of_seed_and_position():
    from harness.rft.decode import sample_seed, uniform

    seeds = torch.tensor([sample_seed(7, i, 0) for i in range(20000)])
    u = uniform(seeds, torch.full((20000,), 33))
    assert u.dtype == torch.float64 and u.shape == (20000, 1) and (u >= 0).all() and (u < 1).all()
    # deciles within 0.01 of 0.1 each (4.7 standard deviations of a frequency at p = 0.1 over 20,000 draws)
    assert torch.allclose(torch.histc(u, 10, 0, 1) / 20000, torch.full((10,), 0.1, dtype=torch.float64), atol=0.01)
    assert len(set((u[:, 0] * 2**48).long().tolist())) == 20000  # 48 bits: no two alike
    assert torch.equal(uniform(seeds[5:6], torch.tensor([33])), u[5:6])  # the same row alone
    assert not torch.equal(uniform(seeds[:4], torch.full((4,), 34)), u[:4])  # the next position draws anew
    big = torch.tensor([2**32 - 1, 0])  # the extreme seeds and counters stay in 32-bit lanes (no int64 overflow)
    assert ((uniform(big, torch.tensor([2**31 - 1, 2**32 - 1])) - 0.5).abs() < 0.5).all()
    assert sample_seed(lambda i, j: 10 * i + j, 2, 3) == sample_seed(lambda i, j: 23, 0, 0) != sample_seed(7, 2, 3)


def test_the_device_pick_applies_transformers_warpers_then_draws_from_them():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    ref = TopPLogitsWarper(0.8)(None, TemperatureLogitsWarper(0.7)(None, logits.clone())).softmax(-1)
    u = torch.rand(6, 1, generator=g, dtype=torch.float64)
    got = pick(logits, u, torch.tensor(0.7), torch.tensor(0.8))
    cdf = ref.double().cumsum(-1)  # the draw: the first token whose cumulative probability under transformers' warpers passes u
    assert torch.equal(got, (cdf <= u * cdf[:, -1:]).sum(-1)) and (ref.gather(1, got[:, None]) > 0).all()
    # a draw from softmax: frequencies of 20,000 draws of one row within 0.02 of the probabilities
    # (4 standard deviations of a frequency at p = 0.5 over 20,000 draws: 4 * sqrt(0.25 / 20000) = 0.014)
    p = torch.tensor([[0.0, 1.0, 2.0, -30.0]]).log_softmax(-1)
    draws = pick(p.expand(20000, -1), torch.rand(20000, 1, generator=g, dtype=torch.float64), torch.tensor(1.0), None)
    assert torch.allclose(torch.bincount(draws, minlength=4) / 20000, p.exp()[0], atol=0.02)


def test_a_model_set_on_the_engine_is_the_one_it_decodes_with(setup):
    import copy

    model, tok, prompts, static = setup
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight.mul_(-1)  # another model: other greedy answers
    e = ContinuousEngine(model, tok, NEW, max_slots=4)
    assert e.generate(prompts[:4], 1, greedy=True) == static[:4]
    e.model = other  # as loss.mode=rl does before each call
    want = gen.Sampler(other, tok, max_new_tokens=NEW, micro=64).sample(prompts[:4], 1, greedy=True)
    assert want != static[:4] and e.generate(prompts[:4], 1, greedy=True) == want


def test_on_done_comes_as_each_prompt_ends(setup):
    model, tok, prompts, static = setup
    seen = []
    ContinuousEngine(model, tok, NEW, max_slots=5).generate(prompts, 2, greedy=True,
                                                           on_done=lambda i, r: seen.append((i, r)))
    assert sorted(i for i, _ in seen) == list(range(len(prompts)))
    assert all(r == [static[i][0]] * 2 for i, r in seen)
    assert [i for i, _ in seen] != list(range(len(prompts)))  # short answers are written before long ones


def test_stop_strings_end_the_answer(setup):
    model, tok, prompts, static = setup
    long = next(s[0] for s in static if len(s[0]) > 20)
    stop = long[8:12]
    out = ContinuousEngine(model, tok, NEW, max_slots=4, stop_strings=(stop,)).generate(prompts, 1, greedy=True)
    for (got,), (full,) in zip(out, static):
        assert full.startswith(got)
        if stop in full:  # ended at the token that completes the stop string, which the text keeps
            assert stop in got and len(got) <= full.index(stop) + len(stop) + 16
        else:
            assert got == full


def test_out_of_memory_halves_the_sequences_in_flight_and_loses_nothing(setup):
    model, tok, prompts, static = setup
    said = []
    e = ContinuousEngine(model, tok, NEW, max_slots=8, say=said.append)
    prefill, step = e._prefill, e.step.fn
    prefills = []

    def small_gpu_prefill(ids):  # the second prefill fails once, with sequences running
        prefills.append(1)
        if len(prefills) == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated, in a prefill)")
        return prefill(ids)

    def small_gpu_step(ids, *args):
        if ids.shape[0] > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated limit of 2 sequences)")
        return step(ids, *args)

    e._prefill, e.step.fn = small_gpu_prefill, small_gpu_step
    assert e.generate(prompts, 1, greedy=True) == static
    assert e.max_slots == 2 and len(said) == 2 and "out of memory" in said[0]  # 8 -> 4 -> 2


def test_the_kv_budget_sets_the_sequences_in_flight(setup):
    model, tok, _, _ = setup
    e = ContinuousEngine(model, tok, NEW, max_slots=256, kv_cache_gb=(e1 := 10 * 2**20 / 2**30))
    per_slot = e.slot_bytes(100) + 12 * model.config.vocab_size
    assert e.plan_slots(100) == min(256, int(e1 * 2**30 // per_slot)) < 256
    with pytest.raises(HarnessError, match="rft.kv_cache_gb"):
        ContinuousEngine(model, tok, NEW, max_slots=8, kv_cache_gb=1e-9).plan_slots(100)


def test_engine_choice_and_the_fallback_for_a_model_it_cannot_serve(setup):
    model, tok, _, _ = setup
    r = load_config(str(ROOT / "configs" / "rft-tiny.yaml")).rft
    assert r.engine == "continuous" and isinstance(make_engine(r, model, tok), ContinuousEngine)
    assert r.compile is None and not make_engine(r, model, tok).compiled  # rft.compile null: eager on CPU
    r.compile = True
    assert make_engine(r, model, tok).compiled  # asked for (compiled at its first step)
    r.compile = None
    r.engine = "static"
    assert isinstance(make_engine(r, model, tok), StaticEngine)
    r.engine = "continuous"
    said = []
    model.config.layer_types = ["sliding_attention", "full_attention"]
    try:
        assert "sliding_attention" in servable(model)
        assert isinstance(make_engine(r, model, tok, said.append), StaticEngine)
    finally:
        del model.config.layer_types
    assert len(said) == 1 and "using rft.engine=static" in said[0]
    r.engine = "vllm"
    try:
        import vllm  # noqa: F401
    except ImportError:
        from harness.rft.sampling import load_engine

        with pytest.raises(ConfigError, match="vllm is not installed"):
            load_engine(r, "unused", torch.device("cpu"))


def test_preference_pairs_pair_a_verified_answer_with_a_failed_one(tmp_path):
    t = ArithmeticTask(n_train=2, n_test=0, n_sft=0, max_operand=5)
    qs = t.split("train")
    (tmp_path / gen.SHARDS).mkdir()
    good, bad = t.worked_answer(qs[0]), "The answer is -1."
    gen.append_records(tmp_path / gen.SHARDS / "rank-0.jsonl", [
        gen.judge(t, qs[0], [good, bad, bad, "no answer", good], 4),
        gen.judge(t, qs[1], ["The answer is -3."], 4)])  # nothing verified: no pair
    stats = gen.merge(t, qs, tmp_path, pairs=1)
    rows = [json.loads(x) for x in (tmp_path / gen.PAIRS).read_text().splitlines()]
    assert stats["preference_pairs"] == 1 and rows == [{
        "prompt": [{"role": "user", "content": qs[0].question}],
        "chosen": [{"role": "assistant", "content": good}], "rejected": [{"role": "assistant", "content": bad}]}]
    gen.merge(t, qs, tmp_path, pairs=3)
    assert len((tmp_path / gen.PAIRS).read_text().splitlines()) == 1  # one verified answer: one pair
    rec = gen.judge(t, Question("q", "What is 1 + 1?", 2.0), ["The answer is 3.", "The answer is 3.", "x"], 4)
    assert rec["rejected"] == ["The answer is 3.", "x"]


def test_rft_engine_transformers_gives_the_static_greedy_text(setup):
    """rft.engine=transformers: transformers' continuous batching (paged cache, its own scheduler thread) gives the
    static path's greedy text, a prompt's on_done as its samples end, and seeded samples that repeat."""
    from harness.rft.hf_engine import TransformersEngine

    model, tok, prompts, static = setup
    r = load_config(str(ROOT / "configs" / "rft-tiny.yaml"),
                    ["rft.engine=transformers", f"rft.max_new_tokens={NEW}"]).rft
    e = make_engine(r, model, tok)
    assert isinstance(e, TransformersEngine) and e.max_slots == r.micro_batch_sequences
    seen = []
    assert e.generate(prompts, 1, greedy=True, on_done=lambda i, got: seen.append(i)) == static
    assert sorted(seen) == list(range(len(prompts))) and max(e.stats.lengths) == NEW and min(e.stats.lengths) < 10
    a = e.generate(prompts[:3], 4, temperature=1.0, seed=7)
    assert [len(g) for g in a] == [4, 4, 4] and len(set(a[0])) > 1
    assert TransformersEngine(model, tok, NEW).generate(prompts[:3], 4, temperature=1.0, seed=7) == a
    assert model.config._attn_implementation == "sdpa"  # the manager gave the model its attention back


def test_transformers_engine_cuts_at_the_token_that_completes_a_stop_string(setup):
    from harness.rft.hf_engine import cut_at_stop

    _, tok, _, _ = setup
    ids = tok("The answer is 12. Then more text follows", add_special_tokens=False)["input_ids"]
    got = cut_at_stop(ids, tok, ("is 12",))
    assert "is 12" in tok.decode(got) and "is 12" not in tok.decode(got[:-1]) and len(got) < len(ids)
    assert cut_at_stop(ids, tok, ("absent",)) == ids and cut_at_stop(ids, tok, ()) == ids
