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
from harness.rft.contract import Completion, Sampling, encode, texts
from harness.rft.decode import SlotCache, Step, bucket_for, buckets, graphs, pick
from harness.rft.engine import ContinuousEngine, servable
from harness.rft.sampling import StaticEngine, make_engine
from harness.rft.stats import eos_ids
from harness.rft.tasks import ArithmeticTask, Question
from tests.harness_launch import ROOT

# untied embeddings and a wide init: a random model that does not just repeat its last token, so that its answers
# end (EOS) anywhere from the first token to max_new_tokens
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "tie_word_embeddings": False, "initializer_range": 0.3}
NEW = 30


def ask(engine, prompts: list[str], n: int, on_done=None, **sampling) -> list[list[str]]:
    """The engine's answers as text, as its callers get them: the prompts encoded once, ids in, completions out,
    decoded by the caller (harness/rft/contract.py)."""
    tok = engine.sampler.tok if isinstance(engine, StaticEngine) else engine.tok
    return texts(tok, engine.generate(encode(tok, prompts), n, Sampling(**sampling), on_done=on_done), engine.eos)


def drawn(engine, prompts: list[str], n: int, **sampling) -> list[list[list[int]]]:
    """The token ids the engine drew (EOS kept), per prompt: what loss.mode=rl trains on."""
    got = engine.generate(encode(engine.tok, prompts), n, Sampling(**sampling))
    return [[list(c.ids) for c in group] for group in got]


def sample(sampler, prompts: list[str], n: int, **sampling) -> list[list[str]]:
    """The static path's answers (model.generate, gen.Sampler) as text."""
    return texts(sampler.tok, sampler.sample(encode(sampler.tok, prompts), n, Sampling(**sampling)),
                 eos_ids(sampler.model, sampler.tok))


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
    static = sample(gen.Sampler(model, tok, max_new_tokens=NEW, micro=64), prompts, 1, greedy=True)
    yield model, tok, prompts, static
    torch.set_num_threads(threads)


def test_greedy_text_equals_the_static_path_with_slots_refilled_in_buckets(setup, monkeypatch):
    model, tok, prompts, static = setup
    moves, sizes = [], []
    move, step = SlotCache.move, Step.__call__
    monkeypatch.setattr(SlotCache, "move", lambda self, s, d, c: moves.append(len(s)) or move(self, s, d, c))
    monkeypatch.setattr(Step, "__call__", lambda self, c, b, *a: sizes.append(b) or step(self, c, b, *a))
    e = ContinuousEngine(model, tok, NEW, max_slots=3)
    out = ask(e, prompts, 1, greedy=True)
    assert out == static and moves  # running sequences moved into the rows of ended ones
    assert {2, 3} <= set(sizes) <= {1, 2, 3} and e.step.compiled is False  # buckets(3); no compile on CPU
    assert min(e.stats.lengths) < 10 and max(e.stats.lengths) == NEW  # mixed lengths: early EOS and the cap
    assert e.stats.sequences == len(prompts) and 1 < e.stats.mean_batch() <= 3
    s = gen.Sampler(model, tok, max_new_tokens=NEW, micro=64)
    sample(s, prompts, 1, greedy=True)  # one batch waits for its longest: the early-ended rows are padding
    assert s.stats.waste() == pytest.approx(1 - sum(s.stats.lengths) / (len(prompts) * NEW))


def test_buckets():
    assert buckets(256) == [1, 2, 4, 8, *range(16, 257, 16)] and buckets(20) == [1, 2, 4, 8, 16, 20]
    assert buckets(3) == [1, 2, 3] and buckets(1) == [1] and bucket_for(17, buckets(40)) == 32


def test_the_compiled_step_runs_a_mixed_length_generation_without_recompiling(setup, monkeypatch):
    """torch.compile(fullgraph) of the decode step: one graph for all the buckets; after a first run has warmed it,
    a second whole generation (answers ending from the first token to max_new_tokens, rows refilled) compiles
    nothing more; a sampled one compiles the pick's other form. The step counts its own graphs."""
    import torch._dynamo

    model, tok, prompts, static = setup
    sizes = []
    call = Step._compiled
    monkeypatch.setattr(Step, "_compiled", lambda self, c, b, *a: sizes.append(b) or call(self, c, b, *a))
    torch._dynamo.reset()
    before = graphs()
    e = ContinuousEngine(model, tok, NEW, max_slots=5, compile=True)  # compiled buckets 2, 4, 5
    assert ask(e, prompts, 1, greedy=True) == static
    warm = graphs()
    assert warm - before == 1 and len(set(sizes)) >= 2 and set(sizes) <= {2, 4, 5}  # one graph, several buckets
    at, ring = e.cache.at, e.runner.ring  # (the write columns: filled in place outside the compiled region)
    out = ask(e, prompts, 1, greedy=True)
    assert out == static and graphs() == warm  # no graph compiled, no recompilation
    assert e.cache.at is at and e.runner.ring is ring
    assert e.compiled and e.stats.steps > 2 * NEW and max(e.stats.lengths) == NEW and min(e.stats.lengths) < 10
    ask(e, prompts[:2], 2, temperature=1.0)  # sampled: the pick's other form, a graph of its own
    assert e.step.compiled_graphs == graphs() - before == 2  # what the step compiled (CompileWatch reports it apart)


def test_a_step_that_does_not_compile_runs_eagerly_with_one_line(setup):
    model, tok, prompts, static = setup
    said = []
    e = ContinuousEngine(model, tok, NEW, max_slots=4, say=said.append, compile=True)

    def untraceable(*args):  # what torch.compile raises for a forward it cannot capture whole
        from torch._dynamo.exc import Unsupported

        raise Unsupported("graph break in a model's forward (simulated)")

    e.step.fn = untraceable
    assert ask(e, prompts, 1, greedy=True) == static
    assert not e.compiled and len(said) == 1 and "did not compile (Unsupported" in said[0]


def test_a_prompt_is_prefilled_once_for_its_samples_and_seeded_samples_repeat(setup):
    model, tok, prompts, static = setup
    e = ContinuousEngine(model, tok, NEW, max_slots=5)  # 4 samples of 3 prompts: a prompt's samples split
    calls = []
    prefill = e.runner.prefill
    e.runner.prefill = lambda ids: calls.append(len(ids)) or prefill(ids)
    a = ask(e, prompts[:3], 4, temperature=1.0, seed=7)
    assert sum(calls) == 3 and calls[0] == 2 and [len(g) for g in a] == [4, 4, 4] and len(set(a[0])) > 1
    assert ask(ContinuousEngine(model, tok, NEW, max_slots=5), prompts[:3], 4, temperature=1.0, seed=7) == a
    # top-p at its limit keeps the most likely token only: sampling is then greedy decoding
    assert ask(e, prompts, 1, temperature=0.7, top_p=1e-6, seed=1) == static


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
        got = drawn(e, these, 3, temperature=1.0, seed=seeded(these))
        return {(qid[p], j): got[i][j] for i, p in enumerate(these) for j in range(3)}

    together = draw(prompts, 5)  # all 12 prompts x 3 samples through 5 slots: rows refilled and moved
    assert len({tuple(t) for t in together.values()}) > 20  # samples differ from one another
    for slots in (1, 4, 16):
        got = draw(picked, slots)
        assert got == {k: together[k] for k in got}
    alone = draw([prompts[7]], 2)
    assert alone == {k: together[k] for k in alone}
    e = ContinuousEngine(model, tok, NEW, max_slots=3)
    assert ask(e, prompts[:4], 1, temperature=1.0, seed=5) != ask(e, prompts[:4], 1, temperature=1.0, seed=6)
    assert ask(e, prompts, 1, greedy=True, seed=3) == static


def test_the_device_draws_are_uniform_and_a_pure_function_of_seed_and_position():
    from harness.rft.decode import draws, sample_seed, uniform

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
    # a row's draws, computed once when its sample is admitted, are uniform() of its seed at each position
    table = draws(seeds[:3], 40)
    assert table.shape == (3, 40) and torch.equal(table[:, 33:34], u[:3])
    assert all(torch.equal(table[r, c:c + 1], uniform(seeds[r:r + 1], torch.tensor([c]))[0]) for r in range(3)
               for c in (0, 1, 39))


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


def test_a_model_served_by_the_engine_is_the_one_it_decodes_with(setup):
    """`serving(model)`: the engine runs another model object within (loss.mode=rl's gathered weights), its own
    after; nothing outside sets its model or cache."""
    import copy

    model, tok, prompts, static = setup
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight.mul_(-1)  # another model: other greedy answers
    e = ContinuousEngine(model, tok, NEW, max_slots=4)
    assert ask(e, prompts[:4], 1, greedy=True) == static[:4]
    want = sample(gen.Sampler(other, tok, max_new_tokens=NEW, micro=64), prompts[:4], 1, greedy=True)
    with e.serving(other):  # as loss.mode=rl does for each call
        assert want != static[:4] and ask(e, prompts[:4], 1, greedy=True) == want
    assert e.model is model and e.cache is None  # its own model again; the eager step's cache freed
    assert ask(e, prompts[:4], 1, greedy=True) == static[:4]


def test_on_done_comes_as_each_prompt_ends(setup):
    model, tok, prompts, static = setup
    seen = []
    ask(ContinuousEngine(model, tok, NEW, max_slots=5), prompts, 2, greedy=True,
        on_done=lambda i, r: seen.append((i, texts(tok, [r], eos_ids(model, tok))[0])))  # completions
    assert sorted(i for i, _ in seen) == list(range(len(prompts)))
    assert all(r == [static[i][0]] * 2 for i, r in seen)
    assert [i for i, _ in seen] != list(range(len(prompts)))  # short answers are written before long ones


def test_stop_strings_end_the_answer(setup):
    model, tok, prompts, static = setup
    long = next(s[0] for s in static if len(s[0]) > 20)
    stop = long[8:12]
    out = ask(ContinuousEngine(model, tok, NEW, max_slots=4, stop_strings=(stop,)), prompts, 1, greedy=True)
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
    prefill, step = e.runner.prefill, e.step.fn
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

    e.runner.prefill, e.step.fn = small_gpu_prefill, small_gpu_step
    assert ask(e, prompts, 1, greedy=True) == static
    assert e.max_slots == 2 and len(said) == 2 and "out of memory" in said[0]  # 8 -> 4 -> 2


def test_the_kv_budget_sets_the_sequences_in_flight(setup):
    model, tok, _, _ = setup
    e = ContinuousEngine(model, tok, NEW, max_slots=256, kv_cache_gb=(e1 := 10 * 2**20 / 2**30))
    per_slot = e.slot_bytes(100) + 40 * model.config.vocab_size  # fp32 logits 4 + the pick's 36 (stats.PICK_BYTES)
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
    assert ask(e, prompts, 1, greedy=True, on_done=lambda i, got: seen.append(i)) == static
    assert sorted(seen) == list(range(len(prompts))) and max(e.stats.lengths) == NEW and min(e.stats.lengths) < 10
    a = ask(e, prompts[:3], 4, temperature=1.0, seed=7)
    assert [len(g) for g in a] == [4, 4, 4] and len(set(a[0])) > 1
    assert ask(TransformersEngine(model, tok, NEW), prompts[:3], 4, temperature=1.0, seed=7) == a
    assert model.config._attn_implementation == "sdpa"  # the manager gave the model its attention back


def test_transformers_engine_stops_at_a_stop_string_during_generation(setup):
    """rft.engine=transformers ended stop strings by cutting the finished tokens: each answer ran to EOS or
    max_new_tokens first. Its requests now stream, and one that completes a stop string is cancelled: fewer tokens
    computed than the whole answer, and the continuous engine's greedy text up to the stop string."""
    from harness.rft.hf_engine import TransformersEngine

    model, tok, prompts, static = setup
    k = max(range(len(prompts)), key=lambda i: len(static[i][0]))  # the longest greedy answer
    full = ContinuousEngine(model, tok, NEW, max_slots=2)
    assert ask(full, [prompts[k]], 1, greedy=True) == [static[k]] and len(static[k][0]) > 20
    stop = static[k][0][6:9]
    want = ask(ContinuousEngine(model, tok, NEW, max_slots=2, stop_strings=(stop,)), [prompts[k]], 2, greedy=True)
    e = TransformersEngine(model, tok, NEW, stop_strings=(stop,))
    got = ask(e, [prompts[k]], 2, greedy=True)
    assert got == want and stop in got[0][0] and len(got[0][0]) < len(static[k][0])
    assert e.stats.lengths[0] < full.stats.lengths[0] and e.computed < 2 * full.stats.lengths[0], \
        (e.stats.lengths, e.computed, full.stats.lengths)


GQA = {**TINY, "num_attention_heads": 4, "num_key_value_heads": 1}  # 4 query heads on 1 key/value head


def test_the_compiled_step_of_a_grouped_query_model_reads_the_cache_without_repeating_its_heads(setup, monkeypatch):
    """Issue 52 (1): under torch.compile transformers' SDPA integration repeats the cache's key/value heads
    (repeat_kv: a copy of every layer's cache each step) over the cache's whole width. The step's graph now holds
    no tensor of the query heads over the cache's columns, attends over the filled width bucket only, and gives
    model.generate's greedy text."""
    import torch._dynamo
    from accelerate.utils import set_seed

    from harness.model import build_model
    from harness.rft import decode

    _, tok, prompts, _ = setup
    set_seed(1)
    model = build_model(ModelConfig(config=dict(GQA)), tok).eval()
    static = sample(gen.Sampler(model, tok, max_new_tokens=NEW, micro=64), prompts[:6], 1, greedy=True)

    def graph_shapes():
        shapes = []

        def record(gm, example_inputs):  # a backend that keeps the shapes of every value in the graph
            for node in gm.graph.nodes:
                v = node.meta.get("example_value")
                if isinstance(v, torch.Tensor):
                    shapes.append(tuple(d if isinstance(d, int) else -1 for d in v.shape))
            return gm.forward

        torch._dynamo.reset()
        e = ContinuousEngine(model, tok, NEW, max_slots=4, compile=True, kv_cache_gb=None)
        e.step.fn = torch.compile(e.step._run, backend=record, fullgraph=True)
        e.slots.cache_for(256, e.compiled)  # a wide cache (as a call with long prompts leaves it), of which ~50 columns are used
        out = ask(e, prompts[:6], 1, greedy=True)
        return out, shapes, e.cache.width

    out, shapes, width = graph_shapes()
    assert out == static
    head_dim = GQA["hidden_size"] // 4
    repeated = [s for s in shapes if len(s) >= 4 and 4 in s[1:3] and any(d >= 64 for d in s[2:]) and s[-1] == head_dim]
    assert shapes and not repeated, repeated[:3]
    attended = {s[-1] for s in shapes if len(s) == 4 and s[1:3] == (1, 1)}  # the masks [rows, 1, 1, columns]
    assert width == 256 and 64 in attended and not {128, 256} & attended  # the bucket of 64 columns
    # the same inspection finds the copy when transformers' own SDPA runs the step (what the check guards against)
    monkeypatch.setattr(decode._Attention, "__enter__", lambda self: None)
    out, shapes, _ = graph_shapes()
    assert out == static and [s for s in shapes if len(s) >= 4 and 4 in s[1:3] and 64 in s[2:]]


def test_every_eos_id_of_the_generation_config_ends_an_answer(setup):
    """Issue 52 (2): only the tokenizer's EOS stopped a sequence; generation_config.eos_token_id lists (Llama-3's
    <|eot_id|>, Qwen's <|im_end|>) were ignored, so answers ran on to max_new_tokens."""
    import copy

    model, tok, prompts, static = setup
    e = ContinuousEngine(model, tok, NEW, max_slots=4)
    long = [ids[0] for ids in drawn(e, prompts, 1, greedy=True) if len(ids[0]) >= 12]
    second = long[0][5]  # a token that a greedy answer draws in its middle
    other = copy.deepcopy(model)
    other.generation_config.eos_token_id = [tok.eos_token_id, second]
    e = ContinuousEngine(other, tok, NEW, max_slots=4)
    got = drawn(e, prompts, 1, greedy=True)
    assert texts(tok, [[Completion(tuple(g[0]))] for g in got], e.eos) == \
        sample(gen.Sampler(other, tok, max_new_tokens=NEW, micro=64), prompts, 1, greedy=True)
    ended = [ids[0] for ids in got if second in ids[0]]
    assert ended and all(ids.index(second) == len(ids) - 1 for ids in ended)  # each stopped at the second id
    assert len(ended[0]) < len(long[0]) and tok.eos_token_id in got[0][0] + [tok.eos_token_id]


def test_stop_strings_decode_only_the_tokens_that_can_end_one(setup):
    """Issue 52 (3): stop strings decoded every sequence's tail every step. Now a token is decoded with its tail
    only if its text can end a stop string; the first token at which the text holds a stop string is found all
    the same (texts with the stop strings, random token sequences)."""
    from harness.rft.decode import StopStrings

    _, tok, _, _ = setup
    stops = ("is 12", "Question:")
    g = torch.Generator().manual_seed(0)
    seqs = [tok(t, add_special_tokens=False)["input_ids"] for t in (
        "The answer is 12. Question: next", "this is 123 and", "No Question here", "Question:", "é is 12 ü")]
    seqs += [torch.randint(0, len(tok), (40,), generator=g).tolist() for _ in range(20)]
    seqs += [x + tok("is 12", add_special_tokens=False)["input_ids"] for x in seqs[5:10]]

    def first(check, ids):
        return next((k for k in range(len(ids)) if check(ids[:k + 1])), None)

    m = StopStrings(tok, stops)
    decoded = []
    decode = tok.decode
    whole = lambda ids: any(s in decode(ids, skip_special_tokens=True) for s in stops)  # noqa: E731
    want = [first(whole, ids) for ids in seqs]
    tok.decode = lambda *a, **k: decoded.append(1) or decode(*a, **k)
    try:
        got = [first(m, ids) for ids in seqs]
    finally:
        del tok.decode
    assert got == want and sum(x is not None for x in want) >= 8
    assert len(decoded) < 0.3 * sum(len(ids) if k is None else k + 1 for ids, k in zip(seqs, want))
    assert StopStrings(tok, ("Answer: ",)).enders() is None  # ends in a space: every token decoded
    # ASCII last characters: a partial UTF-8 token cannot complete one (not decoded); a non-ASCII one: it can
    ascii_, accented = StopStrings(tok, stops).enders(), StopStrings(tok, ("12 ü",)).enders()
    partial = {i for i in range(len(tok)) if "\ufffd" in decode([i])}
    assert partial and not partial & ascii_ and partial <= accented
    umlaut = StopStrings(tok, ("12 ü",))
    texts = seqs[4:5] + [x + tok("12 ü", add_special_tokens=False)["input_ids"] for x in seqs[5:10]]
    assert [first(umlaut, ids) for ids in texts] == [
        first(lambda ids: "12 ü" in decode(ids, skip_special_tokens=True), ids) for ids in texts]


def test_the_inverse_cdf_never_draws_a_masked_token_and_keeps_the_tiny_ones():
    """Issue 52 (7): a draw whose u x total rounded to total returned the last token, masked by top-p or not; an
    fp32 cumulative sum over a 128k vocabulary dropped every token under ~6e-8 near its end."""
    logits = torch.tensor([[3.0, 2.0, 1.0, -5.0, -6.0]])  # top-p 0.9 masks the last two
    top = torch.tensor(0.9)
    for u in (1.0, 1 - 2**-48, 0.0):
        got = pick(logits, torch.tensor([[u]], dtype=torch.float64), torch.tensor(1.0), top)
        assert int(got) in (0, 1, 2), (u, got)
    assert int(pick(logits, torch.tensor([[1.0]], dtype=torch.float64), torch.tensor(1.0), None)) == 4
    vocab = 128_000
    big = torch.zeros(1, vocab)
    big[0, -1] = -20.0  # the last token: probability e^-20 / 128k, about 1.6e-14 (fp32 cdf: no interval at all)
    p_last = big.softmax(-1)[0, -1].double()
    u = torch.tensor([[1 - float(p_last) / 2]], dtype=torch.float64)  # inside the last token's interval
    assert int(pick(big, u, torch.tensor(1.0), None)) == vocab - 1


def test_the_cache_is_planned_once_and_reused_by_later_calls(setup, monkeypatch):
    """Issue 52 (5): each generate() planned the cache again from the free memory of the moment, which the kept cache
    (and training beside it) lowers: 209 -> 21 -> 2 slots in three calls, reallocated, graphs compiled again. Here
    the plan falls call after call (what torch.cuda.mem_get_info gives then); the first plan's cache serves all."""
    model, tok, prompts, static = setup
    made = []
    init = SlotCache.__init__
    monkeypatch.setattr(SlotCache, "__init__", lambda self, *a: made.append(a[1]) or init(self, *a))
    e = ContinuousEngine(model, tok, NEW, max_slots=8, compile=True)
    plans = iter([5, 3, 2, 1])
    e.slots.plan = lambda width: next(plans)  # the free memory falls at each reading
    assert ask(e, prompts[:6], 1, greedy=True) == static[:6]
    warm = graphs()
    for _ in range(2):
        assert ask(e, prompts[:6], 1, greedy=True) == static[:6]
    assert made == [5] and e.cache.slots == 5 and graphs() == warm  # one cache, no recompilation


def test_no_queue_drain_when_the_tokens_are_read_one_step_behind(setup):
    """Issue 52 (4): with slots refilled at mixed answer lengths the engine read step k-1's tokens right after an
    admission, before step k was queued (88 of 242 steps drained the GPU queue). One step behind (lag 1, as on
    CUDA), no step's tokens are read with no later step queued, admissions included; greedy text unchanged."""
    model, tok, prompts, static = setup
    e = ContinuousEngine(model, tok, NEW, max_slots=3)
    e.runner.lag = 1
    assert ask(e, prompts, 1, greedy=True) == static
    assert min(e.stats.lengths) < 10 and max(e.stats.lengths) == NEW and e.stats.steps > NEW  # rows refilled
    assert e.stats.queue_drains == 0
    e = ContinuousEngine(model, tok, NEW, max_slots=3)  # CPU: each step read at once, counted as drains
    ask(e, prompts[:2], 1, greedy=True)
    assert e.stats.queue_drains >= e.stats.steps and e.stats.host_ms_per_step() > 0


def test_top_k_and_min_p_filter_as_transformers_warpers_and_the_draw_never_picks_a_filtered_token(setup):
    """rft.top_k, rft.min_p: the device pick keeps the tokens (and the distribution) that transformers' warpers
    keep, in generate()'s order (temperature, top-k, top-p, min-p); no draw, at any u, lands on a filtered token;
    the engine draws under them (seeded: the same run to run) and passes them to transformers' generate."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 64, generator=g) * 3
    logits[0, :5] = 4.0  # ties at the k-th value: kept by both
    u = torch.rand(8, 1, generator=g, dtype=torch.float64)
    temp = torch.tensor(0.7)
    for k, p, m in ((5, None, None), (0, None, 0.2), (10, 0.9, 0.1), (3, None, 0.5)):
        ref = TemperatureLogitsWarper(0.7)(None, logits.clone())
        ref = TopKLogitsWarper(k)(None, ref) if k else ref
        ref = TopPLogitsWarper(p)(None, ref) if p else ref
        ref = (MinPLogitsWarper(m)(None, ref) if m else ref).softmax(-1)
        cdf = ref.double().cumsum(-1)
        args = (temp, None if p is None else torch.tensor(p), k, None if m is None else torch.tensor(m))
        assert torch.equal(pick(logits, u, *args), (cdf <= u * cdf[:, -1:]).sum(-1)), (k, p, m)
        for x in (0.0, 0.5, 1 - 2**-48, 1.0):  # the edges of the draw: never a filtered token
            got = pick(logits, torch.full((8, 1), x, dtype=torch.float64), *args)
            assert (ref.gather(1, got[:, None]) > 0).all(), (k, p, m, x)
    from harness.rft import decode

    model, tok, prompts, static = setup
    draws = []

    def checked(logits, u, t, p, k=0, m=None):  # every draw of the engine (first tokens and steps) checked
        got = pick(logits, u, t, p, k, m)
        ref = MinPLogitsWarper(float(m))(None, TopKLogitsWarper(k)(None, logits / t)).softmax(-1)
        assert k == 2 and (ref.gather(1, got[:, None]) > 0).all()
        draws.append(len(got))
        return got
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode, "pick", checked)  # (the step's pick and the first tokens' (decode.Picker))
        a = ask(ContinuousEngine(model, tok, 8, max_slots=4, top_k=2, min_p=0.3), prompts[:3], 3, seed=5)
    assert sum(draws) >= 9
    assert a == ask(ContinuousEngine(model, tok, 8, max_slots=2, top_k=2, min_p=0.3), prompts[:3], 3, seed=5)
    assert a != ask(ContinuousEngine(model, tok, 8, max_slots=4), prompts[:3], 3, seed=5)
    r = load_config(str(ROOT / "configs" / "rft-tiny.yaml"), ["rft.top_k=7", "rft.min_p=0.1"]).rft
    made = [make_engine(r.__class__(**{**r.__dict__, "engine": x}), model, tok) for x in ("continuous", "static")]
    assert [(x.top_k, x.min_p) for x in (made[0], made[1].sampler)] == [(7, 0.1)] * 2
    for bad in ("rft.top_k=-1", "rft.min_p=1.5"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(str(ROOT / "configs" / "rft-tiny.yaml"), [bad])


def test_the_cache_holds_the_compute_dtype_bf16_under_autocast(setup):
    """Issue 52: the cache took the weights' dtype, fp32 under bf16 autocast (train.precision bf16 over fp32
    weights): twice the bytes, the keys cast back and forth each step. It holds what the projections give: bf16."""
    model, tok, prompts, static = setup
    e = ContinuousEngine(model, tok, NEW, max_slots=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ask(e, prompts[:4], 1, greedy=True)
        want = sample(gen.Sampler(model, tok, max_new_tokens=NEW, micro=64), prompts[:4], 1, greedy=True)
        assert e.slot_bytes(10) == 2 * 2 * 2 * 32 * 10 * 2  # keys and values, 2 layers, 2 heads of 32, 2 bytes
    assert e.cache.kv.dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.float32
    assert sum(a == b for a, b in zip(out, want)) >= 3, (out, want)  # bf16 argmax ties may flip one
    assert ask(e, prompts[:4], 1, greedy=True) == static[:4] and e.cache.kv.dtype == torch.float32


def test_repeated_steps_read_their_tokens_through_one_ring_of_host_buffers(setup):
    """Issue 52 (6): each step allocated a host buffer (pinned on CUDA) and an event for its tokens. They come from
    one ring, allocated once per engine; two whole generations (rows refilled, one step behind) reuse it."""
    model, tok, prompts, static = setup
    e = ContinuousEngine(model, tok, NEW, max_slots=3)
    e.runner.lag = 1  # as on CUDA: the most entries pending at once
    buffers = set()
    readable = e.runner.readable
    e.runner.readable = lambda *a, **k: readable(*a, **k) or buffers.add(
        e.runner.pending[-1][0].untyped_storage().data_ptr())
    assert ask(e, prompts, 1, greedy=True) == static
    ring, at = e.runner.ring, e.cache.at
    assert ask(e, prompts, 1, greedy=True) == static
    assert e.runner.ring is ring and e.cache.at is at and len(ring) == 6 and e.stats.steps > 2 * NEW
    assert buffers == {b.untyped_storage().data_ptr() for b, _ in ring}  # every buffer of the ring, no other


def test_rft_bench_repeats_build_the_engine_once(setup, monkeypatch):
    """Issue 52 (6): `rft bench --repeats` built each engine again each run: its cache allocated and its graphs
    captured again. Built once: one engine, one cache for the three runs and the greedy pass (eager here, for time:
    a second call on one compiled engine compiles nothing, test_the_compiled_step_runs_a_mixed_length_...)."""
    from harness.rft import bench

    model, tok, prompts, static = setup
    monkeypatch.setattr(bench, "load_for_generation", lambda path, device: (model, tok))
    made, built = [], []
    init, build = SlotCache.__init__, bench.build
    monkeypatch.setattr(SlotCache, "__init__", lambda self, *a: made.append(a[1]) or init(self, *a))
    monkeypatch.setattr(bench, "build", lambda *a: built.append(a[0]) or build(*a))
    r = load_config(str(ROOT / "configs" / "rft-tiny.yaml"),
                    ["rft.compile=false", "rft.max_new_tokens=12", "rft.oversample=2", "rft.micro_batch_sequences=4",
                     "rft.max_operand=12"]).rft
    got = bench.bench(r, None, questions=3, repeats=3, engines=("continuous",))
    row = got["rows"][0]
    assert built == ["continuous"] and made == [4] and row["recompiles"] == 0, (built, made, row)
    assert row["sequences"] == 6 and got["greedy"]["identical_to_static"] == {"continuous": True}


def _peak_bytes(fn) -> int:
    """The most bytes live at once on the CPU while `fn` runs, from the profiler's allocations and frees."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    timeline = sorted((e.time_range.start, e.cpu_memory_usage) if e.name == "[memory]" else
                      (e.time_range.end, e.self_cpu_memory_usage) for e in prof.events())
    live = top = 0
    for _, b in timeline:
        live += b
        top = max(top, live)
    return top


def test_the_planned_bytes_per_slot_cover_what_a_decode_step_allocates_for_its_logits():
    """Issue 52: the engine planned 12 bytes per slot and vocabulary entry for a step's logits (fp32 logits,
    probabilities, noise) where the pick, with the warpers on, holds about 33 (the sort's values and int64 order,
    softmax, cumulative sums, the float64 cdf): a memory-limited plan held more slots than fit. The planner's figure
    (stats.logit_bytes, which harness/tools/rl_plan.py uses too) covers the measured peak, within 25%."""
    from harness.rft.stats import logit_bytes

    rows, vocab = 32, 32000
    logits = torch.randn(rows, vocab)
    u = torch.rand(rows, 1, dtype=torch.float64)
    t = torch.tensor(0.7)
    full = _peak_bytes(lambda: pick(logits, u, t, torch.tensor(0.9), 50, torch.tensor(0.05)))
    plain = _peak_bytes(lambda: pick(logits, u, t, None))
    measured = 4 + full / (rows * vocab)  # + the fp32 logits the pick reads
    assert plain < full and measured <= logit_bytes(4) <= 1.25 * measured, (measured, plain / (rows * vocab))
