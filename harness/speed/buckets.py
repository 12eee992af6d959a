"""Embedding passes in fixed width buckets, compiled once (data.embed_length_buckets).

Under torch.compile the queries and passages of a batch are padded up to one of a few fixed widths per side
(`embed_widths`) and, with packed generative rows, the blocks compile with static shapes
(harness.config.profiles.static_shapes). Every shape the embedding passes can take is then known before training:
(rows, width) for each bucket width, for the full micro-batch, the short last batch of an epoch on one process, and
GradCache's chunks, with and without gradients. `warm_embedding_shapes` runs each once before step 1 (and
`warm_generative_tail` the packed rows' short last micro-batch), so that no batch compiles anything later: on an H100
the dynamic-shape graphs of the GritLM objective recompiled 4 times after step 1 (issue 45).

The warm-up changes nothing the run keeps: its embedding inputs are pad tokens, the generative tail's the data set's
first rows read by index (the data order is untouched), its backward passes go through
`torch.autograd.grad` to the first decoder block's trainable parameters (the compiled backward graphs run; no
parameter's `.grad` is written and DDP's reduction hooks, on the gradient accumulators, which `autograd.grad` does
not run, do not fire), forward passes run outside the cross-process reduction (`deferred_sync`), and the RNG is put
back (dropout draws from it). DeepSpeed is left out (data.embed_length_buckets=auto is 0 there): its engine runs its
end-of-backward reduction after every backward pass through its output, with nothing queued (ZeRO-2, one process:
IndexError in reduce_ipg_grads), and ZeRO-3's hooks expect every pass's gradients; there an explicit bucket count
pads to the widths and each shape compiles on its first batch.

Padding to a wider bucket does not change an embedding: padded keys are masked (bidirectional_mask, or the causal
mask's padding), mean pooling counts the text tokens only (pool_mask) and last-token pooling takes the last real one
(tests/test_buckets.py).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from harness import moe
from harness.data.loaders import FixedWidths, embed_widths  # noqa: F401  (computed where the data is; re-exported)
from harness.data.samples import PackedCollator
from harness.objective import _RngReplay, cache_chunks, deferred_sync
from harness.speed.compiling import repeated_blocks


def row_counts(items: int, micro_batch: int, world: int) -> list[int]:
    """The query counts an embedding micro-batch can have: the micro-batch, and on one process the short last batch
    of an epoch (accelerate completes every process's last batch from the epoch's start when there are several)."""
    last = items % micro_batch if world == 1 and items > micro_batch else 0
    return sorted({min(items, micro_batch)} | ({last} if last else set()))


def embedding_shapes(rows: list[int], group: int, widths: tuple, chunks: int) -> list[tuple[int, int, bool]]:
    """(rows, width, with gradients) of every embedding pass: queries [n, wq] and passages [n * group, wp] for each
    query count n (`row_counts`); with GradCache (chunks > 1) the chunks' row counts, each without and with
    gradients (a range without queries runs one query as a stand-in)."""
    query_widths, passage_widths = widths
    shapes = set()
    for n in rows:
        sizes = {b - a for a, b in cache_chunks(n, chunks)} if chunks > 1 else {n}
        sizes = {s or 1 for s in sizes}
        for s in sizes:
            for grad in ((False, True) if chunks > 1 else (True,)):
                shapes |= {(s, w, grad) for w in query_widths.sizes}
                shapes |= {(s * group, w, grad) for w in passage_widths.sizes}
    return sorted(shapes)


def warm_embedding_shapes(objective, model, shapes: list, pad_id: int, zero_stage: int,
                          say: Callable[[str], None]) -> Optional[dict]:
    """Run each embedding shape once (forward, and backward where it has gradients) without changing the run.
    Returns {"shapes", "seconds"} for the compile report, or None where nothing was run (ZeRO-3, or no shapes)."""
    import time

    if not shapes:
        return None
    if zero_stage == 3:
        say("[harness] embedding width buckets: not warmed under ZeRO-3 (its hooks expect every pass's gradients); "
            "each bucket compiles on its first batch")
        return None
    accelerator = objective.accelerator
    targets = [p for p in repeated_blocks(accelerator.unwrap_model(model))[0].parameters() if p.requires_grad]
    t0, rng = time.perf_counter(), _RngReplay()
    rng.record()
    with rng.replay(0):  # the RNG as it was before, whatever the passes drew
        for rows, width, grad in shapes:
            ids = torch.full((rows, width), pad_id, dtype=torch.long, device=accelerator.device)
            mask = torch.ones_like(ids)
            mask[:, -1] = 0  # one padded position: a causal embedding mask stays a mask tensor, as in real batches
            batch = {"input_ids": ids, "attention_mask": mask, "pool_mask": mask}
            with deferred_sync(accelerator, model), (contextlib.nullcontext() if grad else torch.no_grad()):
                emb = objective.embed(batch)
                if grad and targets:
                    torch.autograd.grad(emb.float().sum(), targets, allow_unused=True)
    seconds = time.perf_counter() - t0
    say(f"[harness] embedding width buckets: queries {list(objective.widths[0].sizes)}, passages "
        f"{list(objective.widths[1].sizes)}; {len(shapes)} shapes run once before step 1 ({seconds:.1f}s): no later "
        f"embedding batch compiles")
    return {"shapes": len(shapes), "seconds": seconds}


def warm_generative_tail(objective, model, loader, say: Callable[[str], None]) -> int:
    """Packed generative rows on one process: the epoch's short last micro-batch ([rows % micro-batch, max_len], the
    one other shape the generative pass takes) run once like the embedding shapes, on the data set's first rows (read
    by index: the data order is not touched). Returns the shapes run (0 or 1). gritlm-tiny packed, 20 steps: its
    119 rows in micro-batches of 16 left 7 at step 8, 1 recompile after step 1 without this. A MoE model runs it
    with its router loss on (harness.moe.RouterLoss), as training does (a block traced without the router's outputs
    captured gave none later: IndexError in the model's aux loss). configs/moe-tiny.yaml packed, 20 steps: 111 rows
    in 8s left 7 at step 14, and the MoE blocks' graph pieces recompiled 7 times after step 1 without this; 0 with
    it (the routing itself never recompiled)."""
    accelerator = objective.accelerator
    rows = row_counts(len(loader.dataset), loader.batch_size, accelerator.num_processes)
    short = [n for n in rows if n < loader.batch_size]
    if not short:
        return 0
    batch = loader.collate_fn([loader.dataset[i] for i in range(short[0])])
    batch = {k: v.to(accelerator.device) for k, v in batch.items()}
    targets = [p for p in repeated_blocks(accelerator.unwrap_model(model))[0].parameters() if p.requires_grad]
    rng = _RngReplay()
    rng.record()
    with rng.replay(0), deferred_sync(accelerator, model), moe.RouterLoss(model, objective.router_coef) as router:
        total, _ = objective.generative_loss_sum(batch)
        if targets:
            torch.autograd.grad(total + router.term, targets, allow_unused=True)
    say(f"[harness] packed generative rows: the epoch's last micro-batch of {short[0]} rows run once before step 1")
    return 1


def warm_run(job, say: Callable[[str], None]) -> None:
    """The run's warm-up (train.run, before the step-0 evaluation): every embedding shape of its training passes, where
    the embedding passes are bucketed (objective.widths) and compiled, and with packed generative rows their short
    last micro-batch (the run compiles static shapes then: harness.config.profiles.static_shapes)."""
    objective = job.objective
    if job.compile is None:
        return
    if "emb" not in job.loaders:  # generative alone: packed rows compile static, their short tail is one more shape
        if _packed(job) and not job.is_deepspeed:
            job.compile.warmed = {"shapes": 0, "seconds": 0.0,
                                  "generative_shapes": warm_generative_tail(objective, job.model, job.data.gen, say)}
        return
    if objective.widths is None:
        return
    if job.is_deepspeed:  # its engine reduces at the end of every backward pass: nothing queued there (IndexError)
        say("[harness] embedding width buckets: not warmed under DeepSpeed; each shape compiles on its first batch")
        return
    loader = job.data.emb
    cfg = job.cfg
    rows = row_counts(len(loader.dataset), loader.batch_size, job.accelerator.num_processes)
    shapes = embedding_shapes(rows, cfg.data.train_group_size, objective.widths, cfg.loss.grad_cache_chunks)
    warmed = warm_embedding_shapes(objective, job.model, shapes, job.tokenizer.pad_token_id,
                                   job.zero["zero_stage"], say)
    if warmed is not None:
        if "gen" in job.loaders and cfg.data.packing:
            warmed["generative_shapes"] = warm_generative_tail(objective, job.model, job.data.gen, say)
        job.compile.warmed = warmed


def _packed(job) -> bool:
    """A training stream of packed generative rows read by index (not data.streaming, not preference pairs)."""
    loader = job.data.gen
    return "gen" in job.loaders and isinstance(getattr(loader, "collate_fn", None), PackedCollator) \
        and not hasattr(loader, "batches")
