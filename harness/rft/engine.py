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

from harness.distributed.sequence import attention_heads
from harness.errors import HarnessError
from harness.rft.contract import Completion, OnDone, Sampling
from harness.rft.stats import Stats, eos_ids, logit_bytes
from harness.rft.decode import (PromptCache, SlotCache, Step, StopStrings, bucket_for, buckets, draws, on, pick,
                                sample_seed, width_buckets)


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


class _Seq:
    """One sample in flight: prompt i, sample j, its row, its tokens read so far and its position (host side)."""

    __slots__ = ("i", "j", "row", "tokens", "pos", "done")

    def __init__(self, i: int, j: int, row: int, pos: int) -> None:
        self.i, self.j, self.row, self.pos, self.tokens, self.done = i, j, row, pos, [], False


class ContinuousEngine:
    """Continuous batching over a SlotCache; `generate(prompts, n, ...)` returns n responses per prompt.
    `compile`: compile the decode step (CUDA graphs on CUDA); off unless asked (`rft generate | test | bench` ask
    for it on CUDA: rft.compile null, `compile_default`)."""

    name = "continuous"

    def __init__(self, model, tokenizer, max_new_tokens: int, max_slots: int, kv_cache_gb: Optional[float] = None,
                 stop_strings: tuple = (), say: Callable = print, compile: bool = False, top_k: int = 0,
                 min_p: float = 0.0) -> None:
        self.model, self.tok, self.max_new_tokens, self.say = model, tokenizer, max_new_tokens, say
        self.top_k, self.min_p = int(top_k), float(min_p)  # rft.top_k, rft.min_p: warpers of every sampled draw
        self.max_slots, self.kv_cache_gb, self.stop_strings = max_slots, kv_cache_gb, tuple(stop_strings)
        self.stopped = StopStrings(tokenizer, self.stop_strings)
        self.stats = Stats()
        self.eos = eos_ids(model, tokenizer)  # the ids that end an answer (a caller drops them from its text)
        self.dtype = next(model.parameters()).dtype  # the weights'; the cache's is the compute dtype (`compute_dtype`)
        self.device = next(model.parameters()).device
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}  # the last position's logits only
        self.step = Step(model, self.cache_arg, self.keep, bool(compile), say)
        self.lag = 1 if self.device.type == "cuda" else 0  # steps queued before the picked tokens are read
        self.stats.launches = self.device.type == "cuda"
        c = model.config.get_text_config()
        self.layers = c.num_hidden_layers
        _, self.heads, self.head_dim = attention_heads(c)  # the cache holds key/value heads
        self.vocab = c.vocab_size
        self.cache: Optional[SlotCache] = None  # kept between generate() calls: the compiled step reads it in place
        self.ring: list = []  # host buffers (pinned on CUDA) and events the tokens are read through (`_readable`)
        self.turn = 0

    @property
    def model(self):
        return self._model

    @model.setter
    def model(self, model) -> None:
        self._model = model
        if hasattr(self, "step"):
            self.step.model = model

    @contextlib.contextmanager
    def serving(self, model) -> Iterator[None]:
        """Within: the engine (its prefill and decode step) runs `model` (loss.mode=rl's weights gathered for the
        generation, train.eval_prompts' model as it is now); on leaving, its own model again and, where the decode
        step is eager, the KV cache freed (for the training pass; a compiled step reads its cache in place: kept)."""
        was, self.model = self.model, model
        try:
            yield
        finally:
            self.model = was
            if not self.compiled:
                self.cache = None

    @property
    def compiled(self) -> bool:
        """Whether the decode step is compiled (rft.compile; false after a failed compilation)."""
        return self.step.compiled

    # ------------------------------------------------------------------------------------------- sizing
    def compute_dtype(self) -> torch.dtype:
        """The dtype the keys and values come in: the autocast dtype under autocast over float weights (bf16 under
        train.precision bf16's autocast), else the weights' dtype. The cache holds them in it (an fp32 cache under
        bf16 autocast stored them at twice the bytes and cast them back each step)."""
        kind = self.device.type
        if self.dtype.is_floating_point and torch.is_autocast_enabled(kind):
            return torch.get_autocast_dtype(kind)
        return self.dtype

    def slot_bytes(self, width: int) -> int:
        return 2 * self.layers * self.heads * self.head_dim * width * self.compute_dtype().itemsize

    def plan_slots(self, width: int) -> int:
        """Slots that the KV-cache budget holds (rft.kv_cache_gb; null: 90% of the free GPU memory less the logits'
        room, 4 GiB on CPU), at most max_slots."""
        per_slot = self.slot_bytes(width) + logit_bytes(self.dtype.itemsize) * self.vocab  # + a step's logits
        if self.kv_cache_gb is not None:
            budget = self.kv_cache_gb * 2**30
        elif self.device.type == "cuda":
            budget = 0.9 * torch.cuda.mem_get_info(self.device)[0] + (self.cache.kv.nbytes if self.cache else 0)
        else:
            budget = 4 * 2**30
        slots = min(self.max_slots, int(budget // per_slot))
        if slots < 1:
            raise HarnessError(f"rft.kv_cache_gb: {budget / 2**30:.2f} GiB holds no sequence of {width} tokens "
                               f"({per_slot / 2**20:.1f} MiB each); raise it or lower rft.max_new_tokens")
        return slots

    def _slot_cache(self, width: int) -> SlotCache:
        """The cache for sequences of `width` tokens: the one kept from the last call when it is wide enough, else a
        new one (compiled: widths rounded up to 64 columns, so that calls with similar prompts share it). Planned
        once and kept: a later call does not plan again from the free memory of the moment (which the kept cache
        and what runs beside it lower: it shrank call after call, reallocated and captured its graphs again)."""
        if self.compiled:
            width = -(-width // 64) * 64
        c, dtype = self.cache, self.compute_dtype()
        if c is not None and c.width >= width and c.slots <= self.max_slots and c.kv.dtype == dtype:
            return c
        slots = self.plan_slots(width)  # (on CUDA the kept cache's bytes count as free: it is replaced)
        self.cache = None
        self.cache = SlotCache(self.layers, slots, self.heads, width, self.head_dim, dtype, self.device)
        return self.cache

    # ------------------------------------------------------------------------------------------- model calls
    def _prefill(self, prompts: list[list[int]]):
        """One batched pass over `prompts` (right-padded, each attending to its own tokens): (keys, values as
        [layers, prompts, heads, longest, head_dim], each prompt's last-position fp32 logits [prompts, vocab])."""
        dev, lens = self.device, [len(p) for p in prompts]
        width = max(lens)
        ids = on(dev, [p + [0] * (width - len(p)) for p in prompts])
        cols = torch.arange(width, device=dev)
        n = on(dev, lens)
        mask = (cols[None, None, :] <= cols[None, :, None]) & (cols[None, None, :] < n[:, None, None])
        last = sorted(set(x - 1 for x in lens))  # the positions whose logits are needed
        cache = PromptCache(self.layers)
        keep = {"logits_to_keep": on(dev, last)} if self.keep else {}
        out = self.model(input_ids=ids, position_ids=cols[None].expand(len(prompts), -1), attention_mask=mask[:, None],
                         use_cache=True, **keep, **{self.cache_arg: cache})
        at = on(dev, [last.index(x - 1) if keep else x - 1 for x in lens])
        logits = out.logits[torch.arange(len(prompts), device=dev), at].to(dtype=torch.float32)
        return torch.stack(cache.k), torch.stack(cache.v), logits

    # ------------------------------------------------------------------------------------------- the loop
    @torch.inference_mode()  # (no_grad keeps autograd's bookkeeping, version counters and views, on every operation)
    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling = Sampling(),
                 on_done: Optional[OnDone] = None) -> list[list[Completion]]:
        """n completions per prompt (its token ids), grouped by prompt (each group in sample order). `on_done(i,
        completions)` is called as soon as prompt i's n samples have ended (a resumable writer appends its record
        there). A sample's draws are a function of its seed (`sampling.seed`) and its token positions only
        (decode.uniform), the same drawn alone or with other prompts, whatever the slots."""
        dev, st = self.device, self.stats
        greedy, seed = sampling.greedy, sampling.seed
        temp = torch.tensor(float(sampling.temperature), device=dev)
        nucleus = torch.tensor(float(sampling.top_p), device=dev) if sampling.top_p < 1.0 and not greedy else None
        warp = (self.top_k, torch.tensor(self.min_p, device=dev) if self.min_p > 0 else None)  # top-k, min-p
        eos = set(self.eos)  # as the static path, which passes the same list to generate()
        # the tokens whose arrival can complete a stop string (None: any token): the check is inline, a set lookup
        stopped, limit = self.stopped, self.max_new_tokens
        enders = stopped.enders() if stopped.strings else frozenset()
        ids = [list(p) for p in prompts]
        cache = self._slot_cache(max(map(len, ids), default=0) + self.max_new_tokens)
        sizes = self._sizes(cache)
        results: list[list] = [[None] * n for _ in prompts]
        left = [n] * len(prompts)  # samples of each prompt not yet ended
        waiting = [(i, j) for i in range(len(prompts)) for j in range(n)]
        waiting.reverse()  # pop() takes the next in order
        prompt_kv: dict = {}  # prompt index -> (prefill, index in it) while some of its samples wait
        rows: list[_Seq] = []  # the sequences in flight, rows 0..len-1
        pending: list = []  # (picked tokens, the sequences of their rows, event, a decode step's) not yet read
        t0 = time.perf_counter()

        def finish(s: _Seq) -> None:
            s.done = True
            st.sequences += 1
            st.tokens += len(s.tokens)
            st.lengths.append(len(s.tokens))
            st.used_slot_steps += len(s.tokens) - 1  # the first token comes from the prefill
            results[s.i][s.j] = Completion(tuple(s.tokens))
            left[s.i] -= 1
            if left[s.i] == 0 and on_done is not None:
                on_done(s.i, results[s.i])

        def read(upto: int) -> None:
            """Read the picked tokens of all but the last `upto` entries; finished sequences leave their rows."""
            ended = []
            while len(pending) > upto:
                picked, seqs, event, _ = pending.pop(0)
                if (waiting or rows) and not any(p[3] for p in pending):
                    st.queue_drains += 1  # the device runs dry while the host reads: nothing queued behind
                w = time.perf_counter()
                if event is not None:
                    event.synchronize()
                values = picked.tolist()
                st.wait_seconds += time.perf_counter() - w
                for s, t in zip(seqs, values):
                    if s is None or s.done:
                        continue
                    s.tokens.append(t)
                    if t in eos or len(s.tokens) >= limit or \
                            ((enders is None or t in enders) and stopped.in_tail(s.tokens)):
                        finish(s)
                        ended.append(s)
            if ended:
                self._compact(cache, rows, ended)

        while waiting or rows or pending:
            try:
                if waiting and len(rows) < cache.slots:
                    # (not read here: step k+1 is queued first, behind the prefill, then step k is read)
                    self._admit(cache, rows, waiting, ids, prompt_kv, n, pending, greedy, seed, temp, nucleus, warp)
                if rows:
                    # compiled: a bucket of rows over a bucket of columns (fixed shapes, a graph per pair);
                    # eager: the rows and columns in use (32 at a time), the same step with less padding
                    b = bucket_for(len(rows), sizes) if self.compiled else len(rows)
                    used = max(s.pos for s in rows) + 1
                    cache.attend = bucket_for(used, width_buckets(cache.width)) if self.compiled else \
                        min(cache.width, -(-used // 32) * 32)
                    m = time.perf_counter()
                    picked = self.step(cache, b, not greedy, temp, nucleus, *warp)
                    cache.cur[:b] = picked
                    cache.pos[:b] += 1
                    st.model_seconds += time.perf_counter() - m
                    st.slot_steps += b
                    st.steps += 1
                    for s in rows:
                        s.pos += 1
                    pending.append(self._readable(picked, rows + [None] * (b - len(rows)), step=True))
                read(self.lag if rows else 0)  # on CUDA one step behind: the next step is queued before
            except torch.cuda.OutOfMemoryError:
                cache = self._shrink(rows, waiting, pending, prompt_kv, ids)
                sizes = self._sizes(cache)
        st.seconds += time.perf_counter() - t0
        return results

    def _sizes(self, cache: SlotCache) -> list[int]:
        """The batch buckets; compiled, a lone sequence runs in the bucket of 2, so that the batch dimension is
        dynamic from the first step (one graph per pick form: dynamo specializes a dimension of size 1)."""
        sizes = buckets(cache.slots)
        return sizes[1:] if self.compiled and len(sizes) > 1 else sizes

    def _readable(self, picked: torch.Tensor, seqs: list, step: bool = False):
        """A pending entry: the tokens copied to a host buffer of the engine's ring, on CUDA pinned and behind an
        event (no wait now). The ring (buffers of `slots` tokens, their events) is allocated once per cache: at most
        lag + 2 entries are pending at once (a step's and an admission's each turn, read down to `lag`), so a buffer
        is read before the ring comes back to it."""
        cuda, n = self.device.type == "cuda", picked.shape[0]
        if not self.ring or self.ring[0][0].shape[0] < n:
            size = max(n, self.cache.slots if self.cache else n)
            self.ring = [(torch.empty(size, dtype=torch.long, pin_memory=cuda), torch.cuda.Event() if cuda else None)
                         for _ in range(2 * self.lag + 4)]
        host, event = self.ring[self.turn % len(self.ring)]
        self.turn += 1
        host[:n].copy_(picked, non_blocking=cuda)
        if event is not None:
            event.record()
        return host[:n], seqs, event, step

    def _admit(self, cache: SlotCache, rows: list, waiting: list, ids: list, prompt_kv: dict, n: int, pending: list,
               greedy: bool, seed, temp, nucleus, warp: tuple) -> None:
        """Waiting samples take the free rows: the prompts not yet prefilled in one pass, their keys and values
        copied into the rows, each sample's first token picked from its prompt's last logits."""
        taken = []
        while waiting and len(rows) + len(taken) < cache.slots:
            taken.append(waiting.pop())
        new = sorted({i for i, _ in taken if i not in prompt_kv})
        m = time.perf_counter()
        if new:
            try:
                pre = self._prefill([ids[i] for i in new])
            except torch.cuda.OutOfMemoryError:
                waiting.extend(reversed(taken))
                raise
            for k, i in enumerate(new):
                prompt_kv[i] = (pre, k)
        groups: dict = {}  # prefill -> (rows, indices in it)
        for i, j in taken:
            pre, k = prompt_kv[i]
            if j == n - 1:
                del prompt_kv[i]
            s = _Seq(i, j, len(rows), len(ids[i]))
            rows.append(s)
            g = groups.setdefault(id(pre), (pre, [], []))
            g[1].append(s.row)
            g[2].append(k)
        firsts, at = [], []
        for (keys, values, logits), dst, src in groups.values():
            d, s = on(self.device, dst), on(self.device, src)
            width = keys.shape[3]
            cache.kv[:, 0, d, :, :width] = keys[:, s].to(cache.kv.dtype)  # (fp32 under autocast: after RoPE)
            cache.kv[:, 1, d, :, :width] = values[:, s].to(cache.kv.dtype)
            firsts.append(logits[s])
            at.append(d)
        logits, d = torch.cat(firsts), torch.cat(at)
        seqs = [rows[r] for g in groups.values() for r in g[1]]  # in the order of d
        cache.pos[d] = on(self.device, [s.pos for s in seqs])
        noise = None
        if not greedy:  # each sample's uniform numbers, from its seed (`draws`); the first token at the prompt's length
            table = draws(on(self.device, [sample_seed(seed, s.i, s.j) for s in seqs]), cache.draws.shape[1])
            cache.draws[d] = table
            noise = table.gather(1, cache.pos[d][:, None])
        first = pick(logits, noise, temp, nucleus, *warp)
        cache.cur[d] = first
        self.stats.model_seconds += time.perf_counter() - m
        pending.append(self._readable(first, seqs))

    def _compact(self, cache: SlotCache, rows: list, ended: list) -> None:
        """The rows of the running sequences move to the front (one copy for all), freed rows start at position 0."""
        keep = [s for s in rows if not s.done]
        holes = sorted(s.row for s in ended if s.row < len(keep))
        movers = [s for s in keep if s.row >= len(keep)]
        if movers:
            cache.move([s.row for s in movers], holes, min(cache.width, max(s.pos for s in movers) + 1))
            for s, h in zip(movers, holes):
                s.row = h
        cache.pos[len(keep):len(rows)] = 0
        rows[:] = sorted(keep, key=lambda s: s.row)

    def _shrink(self, rows: list, waiting: list, pending: list, prompt_kv: dict, ids: list) -> SlotCache:
        """Out of GPU memory: half the slots; the sequences in flight start again (nothing written is lost)."""
        slots = (self.cache.slots if self.cache else self.max_slots) // 2
        if slots < 1:
            raise HarnessError("out of GPU memory with one sequence in flight: lower rft.max_new_tokens or "
                               "rft.kv_cache_gb, or use a larger GPU")
        for s in rows:
            waiting.append((s.i, s.j))
        waiting.sort(reverse=True)
        prompt_kv.clear()  # prefilled again when their samples are admitted
        rows.clear()
        pending.clear()
        width = self.cache.width if self.cache else max(map(len, ids)) + self.max_new_tokens
        self.cache = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.max_slots = slots
        self.say(f"[rft] out of memory: {slots} sequences in flight at most; the sequences in flight start again")
        return self._slot_cache(width)
