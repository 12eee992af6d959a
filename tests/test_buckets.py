"""Embedding passes in fixed width buckets (harness/speed/buckets.py, data.embed_length_buckets): the widths, that
padding up to a bucket leaves every embedding as it was, and that the warm-up compiles every shape before step 1
while changing nothing the run keeps. The end-to-end check (a compiled GritLM run: 0 recompiles after step 1, losses
equal to eager's) is tests/test_compile.py::test_unified_gradcache_compiled_equals_eager."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from harness.data.samples import pad_embed
from harness.model import embed
from harness.speed.buckets import FixedWidths, embed_widths, embedding_shapes, row_counts, warm_embedding_shapes

ROOT = Path(__file__).resolve().parent.parent


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                                        attention_dropout=0.1, attn_implementation="sdpa"))


def test_widths_double_up_to_the_max_length_and_stop_at_the_longest_text():
    assert embed_widths(96, 4, longest=96).sizes == (16, 24, 48, 96)  # 12 rounded up to 8's multiple
    assert embed_widths(96, 4, longest=40).sizes == (16, 24, 48)  # 96 can hold no text of this data
    assert embed_widths(512, 4, longest=2000).sizes == (64, 128, 256, 512)
    assert embed_widths(64, 1, longest=10).sizes == (64,)
    widths = FixedWidths((16, 24, 48))
    assert [widths(n) for n in (1, 16, 17, 48)] == [16, 16, 24, 48]
    assert widths(60) == 60  # longer than every bucket: its own width (not cut)


def test_shapes_cover_full_and_short_batches_and_gradcache_chunks():
    assert row_counts(480, 64, world=1) == [32, 64]  # 480 = 7 x 64 + 32: the epoch's last batch on one process
    assert row_counts(480, 64, world=2) == [64]  # accelerate completes the last batch of each process
    assert row_counts(10, 64, world=1) == [10]
    widths = (FixedWidths((16, 32)), FixedWidths((24,)))
    plain = embedding_shapes([8], group=3, widths=widths, chunks=1)
    assert plain == [(8, 16, True), (8, 32, True), (24, 24, True)]  # queries [8, wq], passages [8 x 3, wp]
    cached = embedding_shapes([5], group=2, widths=widths, chunks=2)  # chunks of 2 and 3 queries, both passes
    assert {(r, w) for r, w, _ in cached} == {(2, 16), (2, 32), (3, 16), (3, 32), (4, 24), (6, 24)}
    assert len(cached) == 2 * 6
    assert (1, 16, False) in embedding_shapes([1], group=1, widths=widths, chunks=2)  # a stand-in's single row


@pytest.mark.parametrize("pooling, bidirectional", [("mean", True), ("lasttoken", False), ("weightedmean", True)])
def test_padding_up_to_a_bucket_leaves_the_embeddings_as_they_were(pooling, bidirectional):
    """Padded keys are masked and pooling reads the text tokens only, so a batch padded to its bucket's width embeds
    as the same batch padded to its longest text."""
    model = tiny_llama().eval()
    g = torch.Generator().manual_seed(1)
    items = [(torch.randint(3, 64, (n,), generator=g).tolist(), 2) for n in (5, 11, 7)]  # 2 instruction tokens
    tight, wide = pad_embed(items, 0), pad_embed(items, 0, FixedWidths((16, 32)))
    assert tight["input_ids"].shape[1] == 11 and wide["input_ids"].shape[1] == 16
    with torch.no_grad():
        a = embed(model, tight, pooling, bidirectional)
        b = embed(model, wide, pooling, bidirectional)
    # fp32, the same positions summed in the same order: only the attention's matmul over more (masked) keys differs
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_warm_up_compiles_every_shape_and_changes_nothing():
    """Static shapes, regional compile (backend eager: dynamo's graphs without inductor's time): after the warm-up
    no batch of any bucket compiles again, and the weights, their .grad and the RNG are as before it."""
    from accelerate import Accelerator
    from accelerate.utils import compile_regions
    from torch._dynamo.utils import counters

    from harness.config import load_config
    from harness.objective import Objective, Parts
    from harness.speed.compiling import dynamo_counters

    accelerator = Accelerator(cpu=True)
    cfg = load_config(ROOT / "configs" / "gritlm-tiny.yaml", ["loss.grad_cache_chunks=1"])
    model = tiny_llama().train()
    torch._dynamo.reset()
    counters.clear()
    compiled = compile_regions(model, backend="eager", dynamic=False)
    objective = Objective(cfg.loss, cfg.model, cfg.train.grad_accum, Parts(accelerator, compiled))
    objective.widths = (FixedWidths((8, 16)), FixedWidths((16, 32)))
    shapes = embedding_shapes([4], group=2, widths=objective.widths, chunks=1)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    said = []
    warmed = warm_embedding_shapes(objective, compiled, shapes, pad_id=0, zero_stage=0, say=said.append)
    assert warmed["shapes"] == 4 and "4 shapes run once before step 1" in said[0]
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)  # dropout (attention_dropout 0.1) drew from it in between
    graphs = dynamo_counters()["graphs"]
    assert graphs > 0
    g = torch.Generator().manual_seed(2)
    for _ in range(4):  # batches of varying lengths, as training would see them: nothing new compiles
        n_q = [int(torch.randint(3, 17, (1,), generator=g)) for _ in range(4)]
        n_p = [int(torch.randint(3, 33, (1,), generator=g)) for _ in range(8)]
        q = pad_embed([(torch.randint(3, 64, (n,)).tolist(), 0) for n in n_q], 0, objective.widths[0])
        p = pad_embed([(torch.randint(3, 64, (n,)).tolist(), 0) for n in n_p], 0, objective.widths[1])
        loss, _ = objective.contrastive(objective.embed(q), objective.embed(p))
        loss.backward()
    assert dynamo_counters()["graphs"] == graphs, "a bucketed batch compiled after the warm-up"
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None  # the real passes did reach the weights


def test_without_the_warm_up_a_new_bucket_compiles():
    """The reference for the test above: with static shapes each bucket is a graph of its own, compiled at its first
    batch (what a run would do after step 1 without the warm-up)."""
    from accelerate.utils import compile_regions
    from torch._dynamo.utils import counters

    from harness.speed.compiling import dynamo_counters

    model = tiny_llama().train()
    torch._dynamo.reset()
    counters.clear()
    compiled = compile_regions(model, backend="eager", dynamic=False)
    seen = []
    for width in (8, 16, 8):
        batch = pad_embed([(list(range(3, 3 + width - 1)), 0)] * 4, 0, FixedWidths((8, 16)))
        embed(compiled, batch, "mean", True).sum().backward()
        seen.append(dynamo_counters()["graphs"])
    assert seen[1] > seen[0] and seen[2] == seen[1]


def test_the_packed_rows_short_last_batch_is_warmed_too():
    """Regression (gritlm-tiny packed, 20 steps: 1 recompile after step 1): with static shapes the generative
    stream's short last micro-batch of an epoch (here 5 rows in 2s: 1 left) is a graph of its own; the warm-up runs
    it, on the data set's first rows, and keeps nothing."""
    from accelerate import Accelerator
    from accelerate.utils import compile_regions
    from torch._dynamo.utils import counters
    from torch.utils.data import DataLoader

    from harness.config import load_config
    from harness.data.samples import PackedCollator
    from harness.objective import Objective, Parts
    from harness.speed.buckets import warm_generative_tail
    from harness.speed.compiling import dynamo_counters

    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(5):
        ids = torch.randint(3, 64, (12,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": ids, "position_ids": list(range(7)) + list(range(5))})
    loader = DataLoader(rows, batch_size=2, collate_fn=PackedCollator(0, 16))
    model = tiny_llama().train()
    torch._dynamo.reset()
    counters.clear()
    compiled = compile_regions(model, backend="eager", dynamic=False)
    cfg = load_config(ROOT / "configs" / "gritlm-tiny.yaml", ["data.packing=true"])
    objective = Objective(cfg.loss, cfg.model, cfg.train.grad_accum, Parts(Accelerator(cpu=True), compiled))
    rng = torch.get_rng_state()
    said = []
    assert warm_generative_tail(objective, compiled, loader, said.append) == 1 and "of 1 rows" in said[0]
    assert all(p.grad is None for p in model.parameters()) and torch.equal(torch.get_rng_state(), rng)
    for batch in loader:  # 2, 2, then the 1-row tail: its shape was warmed
        if len(batch["input_ids"]) == 2 and dynamo_counters()["graphs"] and "full" not in said:
            objective.generative_loss_sum(batch)[0].backward()  # the full batch: step 1 compiles it
            said.append("full")
            graphs = dynamo_counters()["graphs"]
        else:
            objective.generative_loss_sum(batch)[0].backward()
    assert dynamo_counters()["graphs"] == graphs, "the short last batch compiled after step 1"


def test_auto_buckets_only_where_every_pass_gets_a_fixed_shape_and_no_deepspeed():
    """data.embed_length_buckets=auto: 4 under compile with packed rows (static shapes then); 0 with unpacked rows
    (dynamic shapes: buckets would only pad), without compile, and under DeepSpeed: there the warm-up's backward
    passes ran the engine's end-of-backward reduction with nothing queued (gritlm-tiny packed under ZeRO-2, one
    process: IndexError in reduce_ipg_grads before step 1)."""
    from harness.config import load_config
    from harness.config.profiles import embed_buckets, static_shapes

    def cfg(*over):
        return load_config(ROOT / "configs" / "gritlm-tiny.yaml", list(over))

    def ds(c):  # what embed_buckets / static_shapes read: cfg.data and loss.mode
        return c.data, c.loss.mode

    packed = cfg("data.packing=true")
    assert embed_buckets(*ds(packed), "regional") == 4 and static_shapes(*ds(packed), "regional")
    assert embed_buckets(*ds(packed), "none") == 0 and not static_shapes(*ds(packed), "none")
    assert embed_buckets(*ds(packed), "regional", deepspeed=True) == 0
    assert not static_shapes(*ds(packed), "regional", deepspeed=True)
    assert embed_buckets(*ds(cfg()), "regional") == 0 and not static_shapes(*ds(cfg()), "regional")  # unpacked rows
    explicit = cfg("data.embed_length_buckets=2")
    assert embed_buckets(*ds(explicit), "regional") == 2
    assert not static_shapes(*ds(explicit), "regional")  # padded, dynamic
    assert embed_buckets(*ds(cfg("data.packing=true", "loss.mode=generative")), "regional") == 0
