"""harness.objective: GradCache (loss.grad_cache_chunks) gives the plain contrastive loss and gradient for every
batch size, in process and under 2-process DDP (gloo on the CPU), including a last batch that the chunk count does
not divide and one with fewer queries than chunks (issue 27).

    python -m pytest tests/test_objective.py
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from harness.config import ModelConfig, load_config
from harness.data.samples import pad_embed
from harness.model import build_model, load_tokenizer
from harness.objective import Objective, Parts, cache_chunks

DEFAULT = os.path.join(os.path.dirname(__file__), "..", "configs", "default.yaml")
TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64}
GROUP = 2  # passages per query


class _Accelerator:
    """What Objective uses of accelerate's Accelerator: one process, or a DDP process group (gloo)."""

    device = torch.device("cpu")

    def __init__(self):
        import torch.distributed as dist
        from accelerate.utils import DistributedType

        self.distributed_type = DistributedType.NO
        on = dist.is_initialized()
        self.num_processes, self.process_index = (dist.get_world_size(), dist.get_rank()) if on else (1, 0)

    def reduce(self, tensor, op):
        return tensor

    def backward(self, loss):
        loss.backward()

    def no_sync(self, model):
        return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


def _model():
    cfg = ModelConfig(config=TINY, attn_implementation="eager")
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    return build_model(cfg, tok), tok.pad_token_id


@pytest.fixture(scope="module")
def model():
    return _model()


def _batch(n: int, seed: int, pad_id: int) -> dict:
    """n queries and n * GROUP passages of different lengths, a 3-token prefix each."""
    g = torch.Generator().manual_seed(seed)

    def side(rows):
        return pad_embed([(torch.randint(10, 200, (int(torch.randint(5, 12, (1,), generator=g)),),
                                         generator=g).tolist(), 3) for _ in range(rows)], pad_id)
    return {"query": side(n), "passage": side(n * GROUP)}


def _loss_and_grads(model, chunks: int, emb: dict, gather: bool):
    over = ["loss.mode=embedding", "data.emb_train_files=[x.jsonl]", f"loss.grad_cache_chunks={chunks}",
            f"train.emb_micro_batch_size={2 * chunks}", f"data.train_group_size={GROUP}",
            f"loss.gather_negatives={str(gather).lower()}"]
    cfg = load_config(DEFAULT, over)
    obj = Objective(cfg.loss, cfg.model, cfg.train.grad_accum, Parts(_Accelerator(), model))
    model.zero_grad(set_to_none=True)
    sums = obj.micro_step(None, emb, 0.0)
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return sums.emb_sum.item(), grads


def _assert_same(loss, grads, ref_loss, ref_grads, what):
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (what, loss, ref_loss)
    assert grads.keys() == ref_grads.keys(), what
    scale = max(g.abs().max().item() for g in ref_grads.values())
    worst = max((grads[k] - ref_grads[k]).abs().max().item() for k in grads)
    assert worst <= 1e-5 * scale, (what, worst, scale)


def test_cache_chunks_cover_every_row_once():
    assert cache_chunks(4, 2) == [(0, 2), (2, 4)]
    assert cache_chunks(3, 2) == [(0, 1), (1, 3)]
    assert cache_chunks(1, 2) == [(0, 0), (0, 1)]
    for n in range(1, 12):
        for k in range(1, 6):
            bounds = cache_chunks(n, k)
            assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == n and bounds[-1][1] > bounds[-1][0]
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1


@pytest.mark.parametrize("n, chunks", [(4, 2), (3, 2), (1, 2), (5, 4), (2, 4)])
def test_grad_cache_equals_the_plain_loss_for_any_batch_size(n, chunks, model):
    """4/2 divides; 3/2 and 5/4 do not; 1/2 and 2/4 have fewer queries than chunks (issue 27: rows were left out,
    and a batch shorter than the chunk count crashed)."""
    model, pad_id = model
    emb = _batch(n, seed=n, pad_id=pad_id)
    ref = _loss_and_grads(model, 1, emb, gather=True)
    _assert_same(*_loss_and_grads(model, chunks, emb, gather=True), *ref, (n, chunks))


def _ddp_worker(rank: int, init_file: str, out: str):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model, pad_id = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    results = {}
    # same short batch on both ranks (negatives gathered: every rank must hold the same number of rows), and a
    # batch of 3 queries on rank 0 against 1 on rank 1 (shorter than the chunk count; negatives not gathered)
    for name, n, gather in (("gathered", 3, True), ("uneven", 3 if rank == 0 else 1, False)):
        emb = _batch(n, seed=10 * rank + n, pad_id=pad_id)
        ref_loss, ref_grads = _loss_and_grads(ddp, 1, emb, gather)
        loss, grads = _loss_and_grads(ddp, 2, emb, gather)
        results[name] = (loss, ref_loss, {k: (grads[k], ref_grads[k]) for k in ref_grads})
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def test_grad_cache_equals_the_plain_loss_under_ddp_with_a_short_batch(tmp_path):
    """2 processes under DDP: the same loss and the same (reduced) gradient with and without GradCache, and a rank
    whose batch is shorter than the chunk count runs as many passes as the other (no hang)."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "result")
    mp.start_processes(_ddp_worker, args=(str(tmp_path / "init"), out), nprocs=2, start_method="spawn", join=True)
    for rank in range(2):
        for name, (loss, ref_loss, pairs) in torch.load(f"{out}.{rank}").items():
            grads = {k: g for k, (g, _) in pairs.items()}
            ref = {k: r for k, (_, r) in pairs.items()}
            _assert_same(loss, grads, ref_loss, ref, (rank, name))
