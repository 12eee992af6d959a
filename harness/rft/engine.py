"""The continuous generation engine of `harness rft generate | test | bench` (rft.engine=continuous, the default).

    python -c "from harness.rft.engine import ContinuousEngine; help(ContinuousEngine.generate)"

A fixed number of slots (sequences in flight: rft.micro_batch_sequences at most, fewer when the KV-cache budget
rft.kv_cache_gb holds fewer) is decoded one token a step; a sequence that ends (EOS, a stop string,
rft.max_new_tokens) leaves its slot and the next waiting sample takes it. The prompts admitted at a step are
prefilled together (one batched pass, each prompt once for all its samples); their last logits give each sample's
first token and their keys and values are copied into the samples' slot rows. The decode step has fixed shapes
(harness/rft/decode.py: batch buckets, a slot cache of fixed width, the next token picked on the device), so it can be
compiled and, on CUDA, captured as CUDA graphs (rft.compile). The host reads the picked tokens one step behind: step
t+1 is queued before step t's tokens are read (admissions included), finished sequences are found there (an EOS id of
the tokenizer or of generation_config, max_new_tokens, a stop string: decode.StopStrings) and their rows refilled; a
finished sequence is decoded once more, for nothing. The slot cache is planned once per engine and kept. Attention gets
an explicit 4D mask and explicit positions, so any transformers decoder whose layers call `cache.update(k, v,
layer_idx)` and attend over all the positions returned is served; others fall back (`servable`).

The parts, as a small engine is built: the scheduler (scheduler.py: the samples waiting and the rows running, the
admissions, the ends, the rows given back), the slot cache (slots.py: planned from the KV budget and kept;
decode.SlotCache), the model runner (runner.py: the prefill, the decode step compiled and on CUDA captured as CUDA
graphs, the tokens read back one step behind) and the picker (decode.Picker: argmax, or the warpers and each sample's
draws). `ContinuousEngine.generate` is the loop over steps that ties them.

What is exact: greedy decoding gives the text that model.generate gives (the same argmax of the same model, computed
on other batch shapes: tests/test_rft_engine.py); sampling draws from the same distribution as the static path
(logits in fp32, transformers' temperature, top-k, top-p and min-p warpers: rft.top_k, rft.top_p, rft.min_p), with
other random draws: each sample's draws are a hash of its own seed and its token positions (decode.uniform), so a
fixed seed gives the same samples run to run, alone or batched with other prompts, at any slot count (a restart draws
what the uninterrupted run would), not the static path's samples.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from typing import Callable, Iterator, Optional

import torch

from harness.rft.contract import Completion, OnDone, Sampling
from harness.rft.decode import Picker, SlotCache, StopStrings, bucket_for, on, width_buckets
from harness.rft.runner import ModelRunner
from harness.rft.scheduler import Ends, Scheduler
from harness.rft.slots import Slots
from harness.rft.stats import Stats, eos_ids


def servable(model) -> Optional[str]:
    """None when the continuous engine can serve `model`, else the reason (one phrase) it cannot."""
    c = model.config
    if getattr(c, "quantization_config", None) is not None or getattr(model, "is_quantized", False):
        return "a quantized model"
    if c.is_encoder_decoder:
        return "an encoder-decoder model"
    kinds = set(getattr(c, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or (getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True)):
        return f"{c.model_type}: layers other than full attention ({', '.join(sorted(kinds))})"
    if model.config._attn_implementation not in ("eager", "sdpa"):
        return f"attention '{model.config._attn_implementation}' (eager or sdpa needed)"
    if "cache" not in inspect.signature(model.forward).parameters and \
            "past_key_values" not in inspect.signature(model.forward).parameters:
        return f"{type(model).__name__}: no cache argument"
    return None


def compile_default(setting: Optional[bool], model) -> bool:
    """rft.compile: null compiles the decode step on CUDA (CUDA graphs) and not on CPU (docs/rft.md)."""
    return next(model.parameters()).device.type == "cuda" if setting is None else bool(setting)




class ContinuousEngine:
    """Continuous batching over a SlotCache; `generate(prompts, n, sampling)` returns n completions per prompt.
    `compile`: compile the decode step (CUDA graphs on CUDA); off unless asked (`rft generate | test | bench` ask
    for it on CUDA: rft.compile null, `compile_default`)."""

    name = "continuous"

    def __init__(self, model, tokenizer, max_new_tokens: int, max_slots: int, kv_cache_gb: Optional[float] = None,
                 stop_strings: tuple = (), say: Callable = print, compile: bool = False, top_k: int = 0,
                 min_p: float = 0.0) -> None:
        self.tok, self.max_new_tokens, self.say = tokenizer, max_new_tokens, say
        self.top_k, self.min_p = int(top_k), float(min_p)  # rft.top_k, rft.min_p: warpers of every sampled draw
        self.stop_strings = tuple(stop_strings)
        self.stopped = StopStrings(tokenizer, self.stop_strings)
        self.stats = Stats()
        self.eos = eos_ids(model, tokenizer)  # the ids that end an answer (a caller drops them from its text)
        self.ends = Ends(self.eos, max_new_tokens, self.stopped)  # the static path passes generate() the same ids
        self.dtype = next(model.parameters()).dtype  # the weights'; the cache's is the compute dtype (slots.py)
        self.device = next(model.parameters()).device
        self.runner = ModelRunner(model, compile, say)
        self.slots = Slots(model, max_slots, kv_cache_gb, say)
        self.stats.launches = self.device.type == "cuda"

    # ------------------------------------------------------------------------------------------- what callers read
    @property
    def model(self):
        return self.runner.model

    @property
    def step(self):
        """The decode step (decode.Step: compiled or eager)."""
        return self.runner.step

    @property
    def compiled(self) -> bool:
        """Whether the decode step is compiled (rft.compile; false after a failed compilation)."""
        return self.runner.step.compiled

    @property
    def compiled_graphs(self) -> int:
        """Graphs dynamo compiled in this engine's decode steps (the compile report counts them apart)."""
        return self.runner.step.compiled_graphs

    @property
    def cache(self) -> Optional[SlotCache]:
        return self.slots.cache

    @property
    def max_slots(self) -> int:
        return self.slots.max_slots

    def slot_bytes(self, width: int) -> int:
        return self.slots.slot_bytes(width)

    def plan_slots(self, width: int) -> int:
        return self.slots.plan(width)

    @contextlib.contextmanager
    def serving(self, model) -> Iterator[None]:
        """Within: the engine (its prefill and decode step) runs `model` (loss.mode=rl's weights gathered for the
        generation, train.eval_prompts' model as it is now); on leaving, its own model again and, where the decode
        step is eager, the KV cache freed (for the training pass; a compiled step reads its cache in place: kept)."""
        was, self.runner.model = self.runner.model, model
        try:
            yield
        finally:
            self.runner.model = was
            if not self.compiled:
                self.slots.cache = None

    # ------------------------------------------------------------------------------------------- the loop
    @torch.inference_mode()  # (no_grad keeps autograd's bookkeeping, version counters and views, on every operation)
    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling = Sampling(),
                 on_done: Optional[OnDone] = None) -> list[list[Completion]]:
        """n completions per prompt (its token ids), grouped by prompt (each group in sample order). `on_done(i,
        completions)` is called as soon as prompt i's n samples have ended (a resumable writer appends its record
        there). A sample's draws are a function of its seed (`sampling.seed`) and its token positions only
        (decode.uniform), the same drawn alone or with other prompts, whatever the slots."""
        picker = Picker(sampling, self.top_k, self.min_p, self.device)
        sched = Scheduler(prompts, n, self.ends, self.stats, on_done)
        cache = self.slots.cache_for(max(map(len, sched.ids), default=0) + self.max_new_tokens, self.compiled)
        self.runner.pending.clear()  # (a call that raised may have left some)
        t0 = time.perf_counter()
        while sched.busy() or self.runner.pending:
            try:
                if sched.wants_rows(cache.slots):
                    # (not read here: step k+1 is queued first, behind the prefill, then step k is read)
                    self._admit(cache, sched, picker)
                if sched.rows:
                    self._decode(cache, sched, picker)
                self._read(cache, sched)  # on CUDA one step behind: the next step is queued before
            except torch.cuda.OutOfMemoryError:
                cache = self._shrink(sched)
        self.stats.seconds += time.perf_counter() - t0
        return sched.results

    def _admit(self, cache: SlotCache, sched: Scheduler, picker: Picker) -> None:
        """Waiting samples take the free rows: the prompts not yet prefilled in one pass, their keys and values
        copied into the rows, each sample's first token picked from its prompt's last logits."""
        taken = sched.take(cache.slots)
        new = sched.unprefilled(taken)
        m = time.perf_counter()
        if new:
            try:
                pre = self.runner.prefill([sched.ids[i] for i in new])
            except torch.cuda.OutOfMemoryError:
                sched.put_back(taken)
                raise
            sched.prefilled(new, pre)
        firsts, at, seqs = [], [], []
        for (keys, values, logits), group, src in sched.place(taken):
            d, s = on(self.device, [x.row for x in group]), on(self.device, src)
            cache.fill(d, keys[:, s], values[:, s])
            firsts.append(logits[s])
            at.append(d)
            seqs += group
        d = torch.cat(at)
        cache.pos[d] = on(self.device, [x.pos for x in seqs])
        first = picker.first(torch.cat(firsts), seqs, cache, d)
        cache.cur[d] = first
        self.stats.model_seconds += time.perf_counter() - m
        self.runner.readable(first, seqs, cache)

    def _decode(self, cache: SlotCache, sched: Scheduler, picker: Picker) -> None:
        """One decode step of the running rows. Compiled: a bucket of rows over a bucket of columns (fixed shapes,
        a graph per pair); eager: the rows and columns in use (32 at a time), the same step with less padding."""
        rows, st = sched.rows, self.stats
        b = bucket_for(len(rows), self.slots.sizes) if self.compiled else len(rows)
        used = max(s.pos for s in rows) + 1
        cache.attend = bucket_for(used, width_buckets(cache.width)) if self.compiled else \
            min(cache.width, -(-used // 32) * 32)
        m = time.perf_counter()
        picked = self.runner.step(cache, b, picker)
        cache.cur[:b] = picked
        cache.pos[:b] += 1
        st.model_seconds += time.perf_counter() - m
        st.slot_steps += b
        st.steps += 1
        for s in rows:
            s.pos += 1
        self.runner.readable(picked, rows + [None] * (b - len(rows)), cache, step=True)

    def _read(self, cache: SlotCache, sched: Scheduler) -> None:
        """The picked tokens of all but the last `lag` queued entries read (all of them once no row runs); the
        sequences that ended leave their rows."""
        ended = []
        for seqs, values in self.runner.read(self.runner.lag if sched.rows else 0, sched.busy(), self.stats):
            ended += sched.read(seqs, values)
        if ended:
            sched.compact(cache, ended)

    def _shrink(self, sched: Scheduler) -> SlotCache:
        """Out of GPU memory: half the slots; the sequences in flight start again (nothing written is lost)."""
        sched.restart()
        self.runner.pending.clear()
        return self.slots.halve(max(map(len, sched.ids)) + self.max_new_tokens, self.compiled)
