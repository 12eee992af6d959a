"""The generic objective: the face every loss mode shows the loop and train_step (`Objective`), and GritLM's
micro-step (generative, embedding and unified modes: forward passes, the weighted losses, their backward passes).
The other modes (harness/modes/: preference, rl, ...) are subclasses beside GritLM's, built by the registry; this
module knows none of them.

    loss = gen_weight * L_gen + emb_weight * L_emb          (loss.mode=unified; one term alone in the other modes)

A micro-step is one generative micro-batch and/or one embedding micro-batch on each process. Its backward passes
are "units", each a forward and the backward of its own loss: the generative unit first, then the embedding unit
(or, in cached-representation mode, one unit per chunk). Every unit but the last runs with the cross-process
gradient reduction deferred (DDP no_sync; DeepSpeed off the accumulation boundary), so a micro-step reduces once,
and the generative activations are freed before the embedding passes start.

Scales (see harness/losses.py): the generative sum is multiplied by W * A / N (token averaging) or 1 / n (mixed);
the contrastive loss, computed on the batch gathered from every process, by W. accelerate (or DeepSpeed) divides by
A and DDP/ZeRO average over W, so the update equals that of one process holding the whole global batch.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch

from harness import faults, losses
from harness.distributed.processes import is_deepspeed
from harness.config import LossConfig, ModelConfig
from harness import IGNORE_INDEX
from harness.data.samples import model_inputs, real_tokens
from harness.chunked_loss import ChunkedHeadLoss
from harness.model import embed
from harness.observe import metrics
from harness.state import StepSums, gritlm_figures
from harness import moe


@dataclass(frozen=True)
class Parts:
    """What the build hands a mode's `build(cfg, parts)`: the prepared model and what the run was built with."""

    accelerator: Any
    model: Any  # prepared
    tokenizer: Any = None
    data: Any = None  # harness.data.loaders.RunData (loaders not prepared; `source`: a mode's own stream's source)
    say: Callable[[str], None] = print
    zero_stage: Optional[int] = None
    sp: Any = None  # harness.distributed.sequence.SequenceParallel, or None
    flop_dims: tuple = (0, 0, 0)  # (matmul parameters, layers, hidden), for MFU accounting
    convert: Optional[Callable] = None  # what the build did to the model after building it (fp8's float8 blocks)

@contextlib.contextmanager
def deferred_sync(accelerator, model):
    """Backward passes inside add to the gradients without the cross-process reduction; the micro-step's last
    backward pass (outside) reduces everything accumulated."""
    if is_deepspeed(accelerator):
        # accelerate tells DeepSpeed whether a backward is on the accumulation boundary from sync_gradients.
        state = accelerator.gradient_state
        previous = state.sync_gradients
        state._set_sync_gradients(False)
        try:
            yield
        finally:
            state._set_sync_gradients(previous)
    else:
        with accelerator.no_sync(model):
            yield


def _rows(batch: dict, start: int, stop: int, widths=None) -> dict:
    """Rows start:stop of a padded batch, trimmed to its longest sequence (or to that one's width bucket: `widths`,
    data.embed_length_buckets)."""
    part = {k: v[start:stop] for k, v in batch.items()}
    width = int(part["attention_mask"].sum(1).max())
    if widths is not None:
        width = min(widths(width), part["input_ids"].shape[1])
    return {k: v[:, :width] for k, v in part.items()}


class _RngReplay:
    """Record the RNG state before each no-grad chunk pass and replay it for the chunk's gradient pass, so dropout
    masks match between the two (GradCache's RandContext)."""

    def __init__(self) -> None:
        self.states: list = []

    @staticmethod
    def _get():
        return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)

    @staticmethod
    def _set(state) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state_all(state[1])

    def record(self) -> None:
        self.states.append(self._get())

    @contextlib.contextmanager
    def replay(self, i: int):
        after = self._get()
        self._set(self.states[i])
        try:
            yield
        finally:
            self._set(after)


def generative_loss_sum(model, gen: dict, chunk_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """See Objective.generative_loss_sum (also the evaluation's, under no_grad). A sequence-parallel shard carries
    its targets already shifted (`shift_labels`: the next position may be on another process)."""
    if "shift_labels" in gen:
        inputs = {"input_ids": gen["input_ids"], "position_ids": gen["position_ids"]}
        if chunk_size is None:
            return losses.shifted_token_loss_sum(model(**inputs, use_cache=False).logits, gen["shift_labels"])
        with ChunkedHeadLoss(model, gen["shift_labels"], chunk_size=chunk_size, shifted=True) as head_loss:
            out = model(**inputs, use_cache=False)
        return head_loss.result(out)
    if chunk_size is None:
        logits = model(**model_inputs(gen), use_cache=False).logits
        return losses.token_loss_sum(logits, gen["labels"])
    with ChunkedHeadLoss(model, gen["labels"], chunk_size=chunk_size) as head_loss:
        out = model(**model_inputs(gen), use_cache=False)
    return head_loss.result(out)


@torch.no_grad()
def evaluate_generative(accelerator, model, loader, chunk_size: Optional[int] = None) -> float:
    """Per-token generative loss on the eval set (`loader`: the unprepared DataLoader), over all processes, each
    sample counted once whatever the process count. Process r evaluates rows r, r + W, r + 2W, ... in batches of the
    loader's size; a process left with fewer batches than the others runs a batch whose labels are all ignored
    (every process takes part in every forward: ZeRO-3). (accelerate's prepared loader would pad the last shards with
    repeated samples, which the sums would count twice.) chunk_size: loss.chunked_ce resolved (the output head's
    chunked loss, no [B, T, V] logits), or None for the full logits."""
    world, rank, size, ds = accelerator.num_processes, accelerator.process_index, loader.batch_size, loader.dataset
    rows = list(range(rank, len(ds), world))
    model.eval()
    totals = torch.zeros(2, device=accelerator.device, dtype=torch.float64)  # [loss sum, trained tokens]
    for i in range(math.ceil(math.ceil(len(ds) / world) / size)):
        samples = [ds[j] for j in rows[i * size:(i + 1) * size]]
        samples = samples or [{**ds[0], "labels": [IGNORE_INDEX] * len(ds[0]["labels"])}]  # counts nothing
        batch = {k: v.to(accelerator.device) for k, v in loader.collate_fn(samples).items()}
        loss_sum, count = generative_loss_sum(model, batch, chunk_size)
        totals += torch.stack([loss_sum.double(), count.double()])
    model.train()
    totals = accelerator.reduce(totals, "sum")
    return (totals[0] / totals[1].clamp(min=1)).item()


class LossCheck:
    """Every backward pass of a training step goes through `backward`. Outside DeepSpeed it is accelerator.backward
    (a non-finite loss gives a non-finite gradient norm and the loop skips the update). Under DeepSpeed the engine
    applies the update inside the step's last backward pass, so a non-finite loss is caught before it, agreed by all
    processes (one all-reduce of a 0/1 flag and a host read) before the step's first backward pass and before the
    one the engine steps in; nothing else of DeepSpeed is touched:

    - non-finite before the first backward pass: no backward pass at all this step (`skipped`): nothing accumulated,
      no engine step, so weights, optimizer state, the engine's counters and the schedule stay as they were;
    - non-finite only later (gradient accumulation): the earlier passes' gradients sit in ZeRO's buffers, which have no
      public reset; the last backward pass is not run (no update), and the run must stop (`stranded`) with a
      checkpoint of the unchanged state; the resumed run starts after this step's batches."""

    def __init__(self, accelerator, before_backward: bool):
        self.accelerator, self.before_backward = accelerator, before_backward
        self.step, self.micro = 0, 0  # where the loop is (1-based optimizer step, micro-step), for faults.poison
        self.new_step(0)

    def new_step(self, step: int) -> None:
        self.step, self.micro, self.passes, self.bad = step, 0, 0, None
        self.skipped = self.stranded = False

    def backward(self, loss: torch.Tensor) -> None:
        accelerator = self.accelerator
        loss = faults.poison(loss, self.step, self.micro, accelerator.process_index)
        if self.skipped:
            return
        if self.before_backward:
            flag = (~torch.isfinite(loss.detach())).any().reshape(1).float()
            self.bad = flag if self.bad is None else torch.maximum(self.bad, flag)  # on the device: no wait here
            if (self.passes == 0 or accelerator.sync_gradients) and self._agreed_bad():
                self.skipped, self.stranded = True, self.passes > 0
                return
        accelerator.backward(loss)
        self.passes += 1

    def _agreed_bad(self) -> bool:
        """Whether any process saw a non-finite loss in this step so far (collective)."""
        return bool(self.accelerator.reduce(self.bad.to(self.accelerator.device), "max").item() > 0)


class Objective:
    """A loss mode's face, what the loop and train_step call: `step_batches` (the step's micro-batches), `shard`,
    `gen_scale`, `micro_step` (its forward and backward passes), `check` (every backward pass), `figures` (the log
    line's losses), `evaluate` (its held-out figures), `describe_rows`, `generation_graphs`. This class is GritLM's
    objective (loss.mode generative, embedding, unified); the other modes subclass it (harness/modes/)."""

    def __init__(self, loss: LossConfig, m: ModelConfig, grad_accum: int, parts: Parts, chunk_size: int | None = None,
                 widths=None, combined: bool = False):
        """`loss`, `m`: cfg.loss, cfg.model; grad_accum: train.grad_accum; parts: the accelerator, the prepared model,
        sequence parallelism's group, the FLOP dimensions; widths: the (query, passage) widths of
        data.embed_length_buckets, or None (harness.speed.buckets); combined: the weighted sum of both losses
        (loss.mode=unified) is the logged loss."""
        self.accelerator, self.model = parts.accelerator, parts.model
        self.sp = parts.sp  # harness.distributed.sequence.SequenceParallel, or None
        self.chunk_size = chunk_size  # loss.chunked_ce resolved (resolve_chunked_ce): positions per chunk, or None
        self.loss = loss
        self.pooling = m.pooling
        self.bidirectional = m.embed_attention == "bidirectional"
        self.world = parts.accelerator.num_processes
        self.accum = grad_accum
        self.flop_dims = parts.flop_dims  # (matmul parameters, layers, hidden), for MFU accounting
        self.check = LossCheck(parts.accelerator, before_backward=is_deepspeed(parts.accelerator))
        self.widths, self.combined = widths, combined
        self.router_coef = m.router_aux_loss_coef  # MoE: null = the model's own (harness/moe/)

    # ---- the face's defaults (a mode overrides what it does differently)

    def step_batches(self, streams: dict, step: int, unlogged) -> tuple[list, list]:
        """(generative, embedding) micro-batches of optimizer step `step`: grad_accum of each stream (None where the
        run has no such stream); the wait for them is logged."""
        t = time.perf_counter()
        gen = [next(streams["gen"]) for _ in range(self.accum)] if "gen" in streams else [None] * self.accum
        emb = [next(streams["emb"]) for _ in range(self.accum)] if "emb" in streams else [None] * self.accum
        unlogged.add(StepSums(wait_s=time.perf_counter() - t))
        return gen, emb

    def figures(self, sums: StepSums) -> dict:
        """The log line's losses from the interval's summed step sums (MoE: the router's term in the loss, and
        aux_loss and expert_load apart)."""
        term, router = moe.router_figures(asdict(sums))
        out = gritlm_figures(sums, self.loss, self.combined)
        return {**out, "loss": out["loss"] + term, **router}

    def evaluate(self, data) -> dict:
        """The mode's held-out figures (`data`: the run's RunData): the generative loss on data.gen_eval."""
        if data.gen_eval is None:
            return {}
        return {"eval_loss": evaluate_generative(self.accelerator, self.model, data.gen_eval, self.chunk_size)}

    def describe_rows(self, sequences: int) -> str:
        """The generative part of the global batch, for the start-up line (`sequences`: rows per step)."""
        return f"{sequences} sequence{'s' if sequences != 1 else ''}"

    def generation_graphs(self) -> int:
        """Graphs compiled apart from the training step (the RL engine's decode step): not recompiles."""
        return 0

    def flops(self, batch: dict, backward: bool) -> float:
        """Model FLOPs of one pass over `batch`'s real tokens (attention over the padded row width)."""
        n, layers, hidden = self.flop_dims
        width = batch["input_ids"].shape[1]
        return real_tokens(batch) * metrics.flops_per_token(n, layers, hidden, width, backward)

    # ---- pieces

    def shard(self, gen_batches: list) -> list:
        """Sequence parallelism: this process's positions of each generative micro-batch (the group holds the same
        rows); without it the batches as they are."""
        if self.sp is None or gen_batches[0] is None:
            return gen_batches
        return [self.sp.shard(b) for b in gen_batches]

    def gen_scale(self, gen_batches: list[dict]) -> torch.Tensor | float:
        """Token averaging: W * A / N with N the step's trained tokens over every process (one all-reduce; the
        result stays a device tensor, so the host does not wait for the GPU here)."""
        if self.loss.gen_averaging != "token":
            return 0.0
        local = torch.stack([(b["shift_labels"] != IGNORE_INDEX).sum() if "shift_labels" in b else
                             losses.trained_tokens(b["labels"]) for b in gen_batches]).sum()
        total = self.accelerator.reduce(local.to(self.accelerator.device), "sum")
        return losses.step_scale(self.world, self.accum, total.double()).float()

    def contrastive(self, q: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(contrastive loss, factor to back-propagate it with): W with gathered negatives, else 1."""
        if self.loss.gather_negatives and self.world > 1:
            q, p = losses.gather_with_grad(q), losses.gather_with_grad(p)
            return losses.contrastive_loss(q, p, self.loss.temperature), self.world
        return losses.contrastive_loss(q, p, self.loss.temperature), 1

    def embed(self, batch: dict) -> torch.Tensor:
        return embed(self.model, batch, self.pooling, self.bidirectional)

    def generative_loss_sum(self, gen: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of next-token losses, trained tokens) of a generative batch: the full logits and token_loss_sum, or
        with loss.chunked_ce the output head's chunked loss (ChunkedHeadLoss: the model's forward, through its
        wrappers, returns the loss sum in place of the logits)."""
        return generative_loss_sum(self.model, gen, self.chunk_size)

    # ---- one micro-step

    def micro_step(self, gen: dict | None, emb: dict | None, gen_scale) -> StepSums:
        """Run the micro-step's forward and backward passes (`passes`); returns its sums for the log line, as numbers
        or device tensors: nothing here waits for the GPU."""
        if self.check.skipped:  # a non-finite loss earlier in this step: no more passes (on any process)
            return StepSums()
        return self.passes(gen, emb, gen_scale)

    def passes(self, gen: dict | None, emb: dict | None, gen_scale) -> StepSums:
        """GritLM's micro-step: the generative unit, then the embedding unit(s)."""
        accelerator, model = self.accelerator, self.model
        sums = StepSums()
        if gen is not None:
            deferred = deferred_sync(accelerator, model) if emb is not None else contextlib.nullcontext()
            with deferred, moe.RouterLoss(model, self.router_coef) as router:  # MoE: the router's aux loss
                total, count = self.generative_loss_sum(gen)
                scale = gen_scale if self.loss.gen_averaging == "token" else losses.mixed_scale(count)
                self.check.backward(self.loss.gen_weight * total * scale + router.term)
            total = total.detach()
            first = self.sp is None or self.sp.rank == 0  # a group's rows are counted once
            sums = StepSums(gen_sum=total, gen_count=count, gen_mean_sum=total / count.clamp(min=1),
                            gen_micro=int(first), tokens=real_tokens(gen), positions=gen["input_ids"].numel(),
                            samples=gen["input_ids"].shape[0] if first else 0, flops=self.flops(gen, backward=True),
                            **router.sums())
        if emb is not None:
            chunks = self.loss.grad_cache_chunks
            loss_emb = self._embedding_plain(emb) if chunks == 1 else self._embedding_cached(emb, chunks)
            sides = (emb["query"], emb["passage"])
            flops = sum(self.flops(b, backward=True) for b in sides)
            if chunks > 1:  # the extra forward without graph
                flops += sum(self.flops(b, backward=False) for b in sides)
            sums.emb_sum, sums.emb_count = loss_emb, 1
            sums.tokens = sums.tokens + sum(real_tokens(b) for b in sides)
            sums.positions = sums.positions + sum(b["input_ids"].numel() for b in sides)
            sums.samples = sums.samples + emb["query"]["input_ids"].shape[0]
            sums.flops = sums.flops + flops
        return sums

    def _embedding_plain(self, emb: dict) -> float:
        q, p = self.embed(emb["query"]), self.embed(emb["passage"])
        loss, factor = self.contrastive(q, p)
        self.check.backward(self.loss.emb_weight * loss * factor)
        return loss.detach()

    def _embedding_cached(self, emb: dict, chunks: int) -> float:
        """GradCache: embed the chunks without graph, take the loss and its gradient with respect to the
        embeddings on the whole batch, then re-embed chunk by chunk with graph and back-propagate
        sum(embedding * its gradient). Same loss and same gradient as one pass over the batch; activation memory
        of one chunk.

        Any batch size: the queries are split into `chunks` ranges of near-equal size (cache_chunks), so a short
        last batch (not divisible by the chunk count, or with fewer queries than chunks) loses no row. Every
        process runs exactly `chunks` forward passes of each kind and `chunks` backward passes, whatever its batch
        size: a range without queries runs its first query as a stand-in whose gradient is zero. So a process with a
        short batch takes part in as many collective operations (DDP's reduction, ZeRO's gathers and reductions)
        as the others and none waits for it."""
        accelerator = self.accelerator
        n_q = emb["query"]["input_ids"].shape[0]
        group = emb["passage"]["input_ids"].shape[0] // n_q
        bounds = cache_chunks(n_q, chunks)
        wq, wp = self.widths or (None, None)
        parts = [(_rows(emb["query"], a, b, wq), _rows(emb["passage"], a * group, b * group, wp)) if b > a
                 else (_rows(emb["query"], 0, 1, wq), _rows(emb["passage"], 0, group, wp)) for a, b in bounds]
        rng = _RngReplay()
        with torch.no_grad():
            reps_q, reps_p = [], []
            for (qb, pb), (a, b) in zip(parts, bounds):
                rng.record()
                q, p = self.embed(qb), self.embed(pb)
                reps_q.append(q[: b - a])  # a stand-in's embeddings are not part of the batch
                reps_p.append(p[: (b - a) * group])
        reps_q = torch.cat(reps_q).requires_grad_()
        reps_p = torch.cat(reps_p).requires_grad_()
        loss, factor = self.contrastive(reps_q, reps_p)
        grad_q, grad_p = torch.autograd.grad(self.loss.emb_weight * loss * factor, [reps_q, reps_p])
        for i, ((qb, pb), (a, b)) in enumerate(zip(parts, bounds)):
            last = i == chunks - 1
            with rng.replay(i), (contextlib.nullcontext() if last else deferred_sync(accelerator, self.model)):
                q, p = self.embed(qb), self.embed(pb)
                if b > a:
                    surrogate = (q * grad_q[a:b]).sum() + (p * grad_p[a * group:b * group]).sum()
                else:  # a stand-in: a backward pass like the others' that adds nothing
                    surrogate = (q * 0).sum() + (p * 0).sum()
                self.check.backward(surrogate)
        return loss.detach()


def cache_chunks(n: int, chunks: int) -> list[tuple[int, int]]:
    """GradCache's row ranges: `chunks` consecutive [start, stop) ranges covering 0..n, sizes differing by at most
    one, the larger ones last; with n < chunks the first chunks - n ranges are empty (the last one never is)."""
    small, extra = divmod(n, chunks)
    sizes = [small + (i >= chunks - extra) for i in range(chunks)]
    starts = [sum(sizes[:i]) for i in range(chunks)]
    return [(a, a + size) for a, size in zip(starts, sizes)]
