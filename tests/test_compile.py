"""torch.compile through accelerate's TorchDynamoPlugin: the compiled code really runs, in every launch path.

The probe (harness.speed.compiling.CompileProbe) counts decoder-block calls made inside compiled code vs eagerly; a
compiled copy that is never called (accelerate's known case with bf16 autocast) would show 0 compiled calls.
"""

from __future__ import annotations

import pytest

from harness_launch import FAST, ROOT, metrics, report, run_train

pytestmark = pytest.mark.slow

SMALL = ["model.config.num_hidden_layers=2", "train.max_steps=3", "data.packing=true", "train.micro_batch_size=4",
         *FAST, "train.save_final=false"]


# bf16 autocast (accelerate's known case of a compiled copy that never runs) under DDP; regional compile in one process
# fp32: test_unified_gradcache_compiled_equals_eager (with the GritLM objective); ZeRO-3: test_zero3_compiled_...
@pytest.mark.parametrize("name, nproc, accel, extra", [
    ("single-full", 1, None, ["train.compile=full"]),
    ("ddp-regional-bf16", 2, "ddp", ["train.compile=regional", "train.precision=bf16"]),
    ("zero2-regional", 2, "zero2", ["train.compile=regional"]),
])
def test_compiled_blocks_run(name, nproc, accel, extra, tmp_path):
    out = tmp_path / name
    proc = run_train([f"train.output_dir={out}", *SMALL, *extra], nproc=nproc, accel=accel, timeout=900)
    rep = report(out)["compile"]
    assert rep["mode"] == extra[0].split("=")[1]
    assert rep["ran_compiled"] and rep["block_calls_compiled"] == 2 * 3, rep  # 2 layers x 3 steps
    assert rep["block_calls_eager"] == 0, rep
    assert rep["cold_compile_s"] > 0 and rep["graphs"] >= 1
    assert "recompiles_after_first_step" in rep
    # the compiler's start-up ran in the background during set-up and was finished before the model first ran
    assert rep["toolchain_error"] is None and rep["toolchain_background_s"] > 0, rep
    assert rep["compile_before_first_step_s"] == 0, rep
    assert "compiler start-up before the first step" in proc.stdout
    assert "compiled decoder block ever ran" not in proc.stdout
    if rep["mode"] == "regional":  # only the decoder blocks are compiled; the other leaves run eagerly
        assert set(rep["left_eager"]) == {"lm_head", "model.embed_tokens", "model.norm", "model.rotary_emb"}, rep


def test_compile_none_reports_nothing(unified_runs):
    assert report(unified_runs["none"])["compile"] is None  # the eager reference of the GritLM runs below


def test_compiler_warmup_failure_is_reported_not_raised(monkeypatch):
    """A warm-up that fails leaves the work to inductor's first compile; the run goes on and the report says why."""
    import torch._inductor.async_compile

    from harness.speed.compiling import CompilerStartup

    def broken():
        raise OSError("no compiler")

    monkeypatch.setattr(torch._inductor.async_compile.AsyncCompile, "warm_pool", staticmethod(broken))
    got = CompilerStartup.start("cuda").join()  # "cuda": skips the CPU ISA probe; warm_pool is the only work
    assert got["toolchain_error"] == "OSError: no compiler"
    assert got["toolchain_background_s"] >= 0 and got["toolchain_wait_s"] >= 0


def test_probe_counts_without_recompiling_the_graph_it_sits_in():
    """The probe's counter must not be a guarded value: with Python ints, each step changed the value dynamo had
    guarded on and `train.compile=full` recompiled the whole model at every step."""
    import torch
    from torch._dynamo.utils import counters

    from harness.speed.compiling import CompileProbe, dynamo_counters

    torch._dynamo.reset()
    counters.clear()
    blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = blocks

        def forward(self, x):
            for b in self.blocks:
                x = torch.relu(b(x))
            return x.sum()

    net = Net()
    probe = CompileProbe(list(blocks))
    net(torch.randn(2, 8)).backward()  # eager
    compiled = torch.compile(net)
    for _ in range(4):
        compiled(torch.randn(2, 8)).backward()
    assert probe.calls == {"compiled": 3 * 4, "eager": 3}
    assert dynamo_counters()["graphs"] == 1  # one graph, no recompile after the first call
    probe.remove()
    compiled(torch.randn(2, 8))
    assert probe.calls == {"compiled": 12, "eager": 3}


def test_code_compiled_over_the_blocks_runs_on_after_the_report_without_compiling_again():
    """The run's report comes before its final evaluation; code compiled over the whole model (the RL engine's
    decode step) guards on the blocks' forward hooks, so the probe stays on them until the run's exit (`close()`).
    Before, the report removed it and the final evaluation compiled the decode step again (on CUDA: a new graph and
    new CUDA graph captures for every batch bucket)."""
    import torch
    import torch._dynamo

    from torch._dynamo.utils import counters

    from harness.speed.compiling import CompileWatch, dynamo_counters

    torch._dynamo.reset()
    counters.clear()
    blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
    watch = CompileWatch("full", torch.device("cpu"))
    watch.model_built(torch.nn.Sequential(blocks))
    watch.toolchain = watch.startup.join()

    @torch.compile(backend="eager", fullgraph=True)
    def step(x):  # the model called inside a compiled function: its hooks are traced and guarded
        for b in blocks:
            x = torch.relu(b(x))
        return x

    step(torch.randn(2, 8))
    watch.first_step_done(1.0)
    rep = watch.report(1.0, 1, lambda line: None)
    assert rep["block_calls_compiled"] == 2, rep
    step(torch.randn(2, 8))  # the final evaluation
    assert dynamo_counters()["graphs"] == watch.after_first["graphs"] == 1  # no second graph
    watch.close()  # the run's exit: the blocks as they were
    assert all(not b._forward_pre_hooks for b in blocks)


def test_graphs_compiled_apart_from_the_training_step_are_not_its_recompiles():
    """loss.mode=rl with rft.compile (the CUDA default): the engine's decode step compiles graphs of its own after
    step 1 (its greedy form at the first evaluation, a batch bucket first reached later). report.json gives them as
    `generation_graphs`; `recompiles_after_first_step` stays the training step's (it said 1 for every such run)."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from harness.speed.compiling import CompileWatch

    torch._dynamo.reset()
    counters.clear()
    watch = CompileWatch("full", torch.device("cpu"))
    watch.model_built(torch.nn.Linear(2, 2))
    watch.toolchain = watch.startup.join()
    made = {"graphs": 0}

    @torch.compile(backend="eager", dynamic=False)
    def train(x):
        return x * 2

    @torch.compile(backend="eager", dynamic=False)
    def decode(x):
        return x + 1

    def generate(n):  # the engine: counts what its calls compiled
        before = counters["stats"]["unique_graphs"]
        decode(torch.ones(n))
        made["graphs"] += counters["stats"]["unique_graphs"] - before

    generate(2)
    train(torch.ones(2))
    watch.first_step_done(1.0, made["graphs"])  # the objective's generation_graphs(), as train.py passes it
    generate(3)  # a new bucket, after step 1
    train(torch.ones(2))
    rep = watch.report(2.0, 2, lambda line: None, made["graphs"])
    assert rep["recompiles_after_first_step"] == 0 and rep["generation_graphs"] == 2 and rep["graphs"] == 3, rep
    train(torch.ones(5))  # the training step's own new shape: a recompile
    assert watch.report(3.0, 3, lambda line: None, made["graphs"])["recompiles_after_first_step"] == 1
    watch.close()


def test_recompile_limit_hit_is_counted_and_said():
    """A code object past dynamo's recompile limit runs eagerly from then on with no more than a log warning; the
    run's compile watch catches that warning, names the function in the report and says so in one line."""
    import torch
    import torch._dynamo

    from harness.speed.compiling import CompileWatch

    torch._dynamo.reset()
    watch = CompileWatch("regional", torch.device("cpu"))
    watch.model_built(torch.nn.Linear(2, 2))
    watch.toolchain = watch.startup.join()

    @torch.compile(backend="eager", dynamic=False)
    def double(x):
        return x * 2

    with torch._dynamo.config.patch(recompile_limit=1):
        for n in (2, 3, 4):  # each new size recompiles; the second one is over the limit
            double(torch.ones(n))
    said = []
    rep = watch.report(1.0, 1, said.append)
    assert len(rep["recompile_limit_hit"]) == 1 and "double" in rep["recompile_limit_hit"][0], rep
    assert sum("hit dynamo's recompile limit" in line for line in said) == 1, said
    watch.close()  # at the run's exit
    double(torch.ones(5))  # the watch is closed: nothing more is counted
    assert len(watch.limit.functions) == 1


def test_regional_blocks_compile_whole_in_unified_passes():
    """An embedding pass must leave no output-capturing hooks behind (transformers installs them on every decoder
    layer and attention module for `output_hidden_states=True`; under regional compile each one was a graph break
    in every later pass, generative ones too): a block compiles to one graph per kind of pass, no breaks."""
    import torch
    from accelerate.utils import compile_regions
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM

    from harness.model import bidirectional_mask, embed

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    ids = torch.randint(3, 64, (2, 7))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pool_mask": torch.ones_like(ids)}
    with torch.no_grad():  # the reference: transformers' own hidden states (on a copy: it installs the hooks)
        import copy
        ref_model = copy.deepcopy(model)
        ref = ref_model(input_ids=ids, attention_mask=bidirectional_mask(batch["attention_mask"], "sdpa"),
                        output_hidden_states=True).hidden_states[-1].mean(1)
    emb = embed(model, batch, "mean", bidirectional=True)
    torch.testing.assert_close(emb, torch.nn.functional.normalize(ref, dim=-1), rtol=1e-5, atol=1e-6)
    assert not any(getattr(m, "_output_capturing_hooks_installed", False) for m in model.modules())

    torch._dynamo.reset()
    counters.clear()
    compiled = compile_regions(model, backend="eager")
    for _ in range(2):
        embed(compiled, batch, "mean", bidirectional=True).sum().backward()
        compiled(input_ids=ids, labels=ids).loss.backward()
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_zero3_compiled_equals_eager(tmp_path):
    """Regional compile under 2-process ZeRO-3 (real DeepSpeed): the block forwards compile once (the blocks are
    ZeRO-3 leaves, their hooks run eagerly), never hit the recompile limit, and train exactly as eager does (losses
    and gradient norms, step by step). Before: accelerate compiled the hooks in, 126 graphs in 20 steps and the
    recompile limit hit in `_pre_backward_module_hook`."""
    runs = {}
    for mode in ("regional", "none"):
        runs[mode] = tmp_path / mode
        run_train([f"train.output_dir={runs[mode]}", *SMALL, f"train.compile={mode}"], nproc=2, accel="zero3",
                  timeout=900)
    rep = report(runs["regional"])
    assert rep["zero_stage"] == 3, rep["zero_stage"]
    c = rep["compile"]
    assert c["recompile_limit_hit"] == [] and c["recompiles_after_first_step"] <= 2, c
    assert c["graphs"] <= 3 and c["block_calls_eager"] == 0 and c["block_calls_compiled"] == 2 * 3, c
    compiled, eager = metrics(runs["regional"]), metrics(runs["none"])
    assert len(compiled) == len(eager) == 3
    for a, b in zip(compiled, eager):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-3 * abs(b[key]), (key, a, b)


@pytest.fixture(scope="module")
def unified_runs(tmp_path_factory):
    """configs/gritlm-tiny.yaml (2 layers, GradCache in 2 chunks, packed generative rows, 2 embedding width buckets
    per side), 6 steps compiled regionally and eagerly."""
    gritlm = ["model.config.num_hidden_layers=2", "train.max_steps=6", "train.micro_batch_size=4",
              "data.packing=true", "data.embed_length_buckets=2",
              "train.emb_micro_batch_size=8", "loss.grad_cache_chunks=2", "train.eval_at_start=false",
              "train.eval_every=0", "data.eval_files=[]", "data.emb_eval_files=[]", "train.save_final=false",
              "train.progress_bar=false", "train.log_every=1", "train.report_to=[]", "train.summary=false"]
    root = tmp_path_factory.mktemp("unified")
    for mode in ("regional", "none"):
        run_train([f"train.output_dir={root / mode}", f"train.compile={mode}", *gritlm],
                  config=str(ROOT / "configs/gritlm-tiny.yaml"), timeout=900)
    return {mode: root / mode for mode in ("regional", "none")}


def test_unified_gradcache_compiled_equals_eager(unified_runs):
    """The GritLM objective compiled (one process): generative, GradCache's no-grad and gradient passes of queries
    and passages through the same compiled blocks. Issue 45: the embedding passes are padded to fixed width buckets,
    every shape runs once before step 1, and the blocks compile with static shapes: nothing compiles after step 1
    although the batches' lengths change every step; the losses and gradient norms equal eager's (padded to each
    batch's longest) step by step."""
    runs = unified_runs
    c = report(runs["regional"])["compile"]
    assert c["recompiles_after_first_step"] == 0 and c["recompile_limit_hit"] == [], c
    assert c["compile_time_total_s"] == c["cold_compile_s"], c  # not a second of compiling after step 1
    # 2 widths x (queries + passages) x (no-grad + gradient), one chunk size (8 queries in 2 chunks of 4); and the
    # packed rows' short last micro-batch (119 rows in 4s: 3 left)
    warmed = c["warmed_embedding_shapes"]
    assert warmed["shapes"] == 8 and warmed["generative_shapes"] == 1, c
    # 2 layers x (the warm-up's passes + 6 steps x (generative + 2 chunks x (no-grad + gradient) x 2 sides))
    assert c["block_calls_compiled"] == 2 * (8 + 1 + 6 * (1 + 2 * 2 * 2)) and c["block_calls_eager"] == 0, c
    compiled, eager = metrics(runs["regional"]), metrics(runs["none"])
    assert len(compiled) == len(eager) == 6
    assert len({round(r["padding_share"], 6) for r in eager}) > 1  # batch lengths change from step to step
    assert all(a["padding_share"] >= b["padding_share"] for a, b in zip(compiled, eager))  # padded up to buckets
    # fp32 on both sides; inductor's fused kernels sum in another order (~1e-7 relative per op) and the compiled
    # run's batches are wider (masked positions: ~1e-6, tests/test_buckets.py); over 6 updates the gap measured
    # 2.5e-6 relative at most (2026-11-27, this machine), so 1e-4 leaves a 40x margin, while a padded key or position
    # that leaked into attention or pooling moves the embedding loss by far more
    for a, b in zip(compiled, eager):
        for key in ("loss", "loss_gen", "loss_emb", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-4 * abs(b[key]), (key, a, b)
    assert all(r["compile_graphs"] == compiled[0]["compile_graphs"] for r in compiled)  # metrics.jsonl: none added
