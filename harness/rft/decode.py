"""The continuous engine's decode step with fixed shapes: batch buckets, a static slot cache, sampling on the device.

    python -c "from harness.rft.decode import buckets; print(buckets(256))"

The sequences in flight sit at the front of the slot rows; a step runs the first `bucket` rows, the smallest of
1, 2, 4, 8, then multiples of 16 up to the slots, that holds them (rows past the last running one are padding: their
writes land in free rows and nothing reads their tokens). The cache is one tensor [layers, 2, slots, kv_heads, width,
head_dim] allocated once; every sequence starts at column 0 of its row and a step writes each row's column at its own
position (the mask: columns <= position), so the same step, of the same shapes, runs again and again: with
rft.compile it is compiled once (torch.compile, fullgraph; the batch dimension dynamic from the first step) and on
CUDA captured as CUDA graphs, one per bucket (mode="reduce-overhead"); compiled, a step attends over a width bucket
(64, 128, 256, ... columns: `width_buckets`), and a grouped-query model's attention reads the cache's key/value heads
as stored (`grouped_attention`, no repeat_kv). Picking the next token is part of the step:
greedy (argmax) or sampled on the device, transformers' temperature and top-p warpers written as tensor operations
followed by a draw by the inverse CDF (one uniform number a row, a hash of the row's sample seed and the position of
the token drawn: `uniform`, so that a sample draws the same tokens whatever shares its batch; every position's number
is computed when the sample takes its row, `draws`, and the step gathers its own).
"""

from __future__ import annotations

from typing import Optional

import torch


def buckets(slots: int) -> list[int]:
    """Batch sizes a step runs at: 1, 2, 4, 8, then multiples of 16, ending at `slots`."""
    return [b for b in (1, 2, 4, 8) if b < slots] + list(range(16, slots, 16)) + [slots]


def on(device: torch.device, values: list) -> torch.Tensor:
    """A host list as a tensor on `device` without a wait: on CUDA through pinned memory, copied behind the queued
    work (a copy from pageable memory would wait for the queued steps first)."""
    t = torch.tensor(values, pin_memory=device.type == "cuda")
    return t.to(device, non_blocking=True) if device.type == "cuda" else t


def bucket_for(n: int, sizes: list[int]) -> int:
    return next(b for b in sizes if b >= n)


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """x * m mod 2^32 for x in [0, 2^32) held in int64, without overflowing int64 (16-bit halves: < 2^49)."""
    return ((x & 0xFFFF) * m + ((((x >> 16) * m) & 0xFFFF) << 16)) & _M32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (lowbias32, Wellons) on int64 lanes holding values in [0, 2^32): the shifts are
    of non-negative values, so arithmetic and logical shifts agree."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """U[0, 1) per row as float64 [rows, 1], a pure function of the row's seed (int64 in [0, 2^32)) and counter
    (its token's position): counter-based, computed on the device with fixed shapes (CUDA-graph safe), so that a
    sample's draws do not depend on what shares its batch, its row, or the slot count. 48 bits: the high 32 from
    the hash of (seed, counter), the low 16 from a second round."""
    h = _mix(_mix(seeds & _M32) ^ _mix((counters + 0x9E3779B9) & _M32))
    low = _mix(h ^ 0x85EBCA6B) >> 16
    return ((h << 16) | low).to(torch.float64)[:, None] * 2.0**-48


def draws(seeds: torch.Tensor, columns: int) -> torch.Tensor:
    """[rows, columns] float64: `uniform(seed, c)` of each row's seed for every counter c in [0, columns), the same
    values computed once (a sample's row of the slot cache holds them from its admission; a step gathers one a
    row: one operation where the hash is ~90, which eagerly cost ~0.65 ms a step whatever the rows)."""
    rows = seeds.shape[0]
    counters = torch.arange(columns, device=seeds.device)
    return uniform(seeds.repeat_interleave(columns), counters.repeat(rows)).view(rows, columns)


def sample_seed(seed, i: int, j: int) -> int:
    """The 32-bit seed of sample j of prompt i: from `seed(i, j)` when seed is callable, else from (seed, i, j)."""
    import hashlib

    key = f"{seed(i, j)}" if callable(seed) else f"{seed},{i},{j}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")


def pick(logits: torch.Tensor, uniform: Optional[torch.Tensor], temperature: torch.Tensor,
         top_p: Optional[torch.Tensor], top_k: int = 0, min_p: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The next token per row from fp32 logits [rows, vocab]: argmax when `uniform` is None, else transformers'
    warpers in generate()'s order: temperature (logits / t), top-k (TopKLogitsWarper: the k most likely and their
    ties) when top_k > 0, top-p (TopPLogitsWarper: the smallest set of most likely tokens whose probability reaches
    top_p, the most likely always kept) when top_p is given, min-p (MinPLogitsWarper: the tokens of probability
    under min_p x the most likely one's dropped) when min_p is given, then a draw from the
    probabilities by their inverse CDF with `uniform` [rows, 1] ~ U[0, 1) (float64, `uniform()`): the first token
    whose cumulative probability passes u (a token of probability 0 has an empty interval and is never drawn; the
    cumulative sum is in float64, where fp32's would drop tokens under ~6e-8 near its end). One random number a
    row, where the exponential race needs one per token (vocab x rows: 11 ms a step on this CPU at 256 x 32k)."""
    if uniform is None:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        ordered, order = torch.sort(logits, descending=False, dim=-1)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[..., -1:] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    if min_p is not None:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    cdf = torch.cumsum(logits.softmax(-1), -1, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    got = torch.searchsorted(cdf, uniform.to(torch.float64) * total, right=True)[:, 0]
    # u x total rounded up to total finds no token (or, clamped, the last, which top-p may have masked): the last
    # token of positive probability instead, the first whose cumulative sum reaches the total (the ones after it add
    # nothing; no [rows, vocab] index tensor)
    return torch.minimum(got, torch.searchsorted(cdf, total, right=False)[:, 0])


class Picker:
    """How one generate() call picks its tokens on the device: argmax (greedy), or drawn under the call's temperature
    and top-p (`contract.Sampling`) and the engine's top-k and min-p (rft.top_k, rft.min_p), each sample's uniform
    numbers from its own seed (`sample_seed`, `draws`). `args`: what decode.Step's pick takes."""

    def __init__(self, sampling, top_k: int, min_p: float, device) -> None:
        self.greedy, self.seed, self.device = sampling.greedy, sampling.seed, device
        self.temperature = torch.tensor(float(sampling.temperature), device=device)
        self.top_p = torch.tensor(float(sampling.top_p), device=device) \
            if sampling.top_p < 1.0 and not sampling.greedy else None
        self.warp = (top_k, torch.tensor(min_p, device=device) if min_p > 0 else None)  # top-k, min-p
        self.args = (not self.greedy, self.temperature, self.top_p, *self.warp)

    def first(self, logits: torch.Tensor, seqs: list, cache: "SlotCache", rows: torch.Tensor) -> torch.Tensor:
        """The first token of each admitted sample (`seqs`, in `rows` of the cache, their positions set) from its
        prompt's last logits; sampled, each row's uniform numbers written to the cache first (the token at the
        prompt's length draws the number of that position)."""
        noise = None
        if not self.greedy:
            table = draws(on(self.device, [sample_seed(self.seed, s.i, s.j) for s in seqs]), cache.draws.shape[1])
            cache.draws[rows] = table
            noise = table.gather(1, cache.pos[rows][:, None])
        return pick(logits, noise, self.temperature, self.top_p, *self.warp)


GROUPED = "harness_grouped_sdpa"  # the attention a decode step of an sdpa model runs (registered by `Step`)


def grouped_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention of one query token per row over the slot cache for grouped-query models, without repeating the
    cache's key/value heads: the query heads [rows, heads, 1, dim] are grouped as [rows, kv_heads, group, dim]
    (heads h of kv head h // group, transformers' order) and SDPA runs on the cache's own [rows, kv_heads, width,
    dim] (transformers' SDPA integration falls back to repeat_kv under torch.compile: a copy of every layer's cache
    each step). Anything else (a prefill, one head a group, a softcap or a position bias) is transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1 or kwargs.get("softcap") is not None or \
            kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows, heads, _, dim = query.shape
    q = query.reshape(rows, heads // groups, groups, dim)  # the mask [rows, 1, 1, width] broadcasts over both
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(rows, 1, heads, value.shape[-1]), None  # [rows, 1 token, heads, dim], as transformers'


def _register_grouped() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED, grouped_attention)
    AttentionMaskInterface.register(GROUPED, sdpa_mask)


class _Attention:
    """Within: the model's sdpa attention is `grouped_attention` (its config's implementation swapped, then
    restored: the prefill and training keep transformers' own)."""

    def __init__(self, model) -> None:
        self.configs = [c for c in {id(c): c for c in (model.config, model.config.get_text_config())}.values()
                        if c._attn_implementation == "sdpa"]

    def __enter__(self):
        for c in self.configs:
            c._attn_implementation = GROUPED

    def __exit__(self, *exc):
        for c in self.configs:
            c._attn_implementation = "sdpa"


def width_buckets(width: int) -> list[int]:
    """Columns a compiled step attends over: 64, 128, 256, ... (doubling) below `width`, then `width`; the step
    runs the smallest that holds every running row's position (one graph per bucket)."""
    sizes, w = [], 64
    while w < width:
        sizes.append(w)
        w *= 2
    return sizes + [width]


class SlotCache:
    """Keys and values of every slot row (see the module docstring); `cur` and `pos` hold each row's next input token
    and its position, on the device. What a transformers attention layer calls: update(), get_seq_length()."""

    def __init__(self, layers: int, slots: int, heads: int, width: int, head_dim: int, dtype, device) -> None:
        self.kv = torch.zeros((layers, 2, slots, heads, width, head_dim), dtype=dtype, device=device)
        self.k = [self.kv[layer, 0] for layer in range(layers)]
        self.v = [self.kv[layer, 1] for layer in range(layers)]
        self.cur = torch.zeros(slots, dtype=torch.long, device=device)
        self.pos = torch.zeros(slots, dtype=torch.long, device=device)
        # each row's sample's uniform numbers (`draws`): column c is the draw of the token at position c
        self.draws = torch.zeros((slots, width + 1), dtype=torch.float64, device=device)
        self.slots, self.width = slots, width
        self.attend = width  # columns a step attends over (eager: the used ones rounded up; compiled: a bucket)
        # the column each row's step writes (its position, clamped for padding rows): filled in place before each
        # step, outside the compiled region, which reads it (no Python state set within it)
        self.at = torch.zeros(slots, dtype=torch.long, device=device)
        self.static = False  # marked as a static address for CUDA graphs

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.k[layer_idx], self.v[layer_idx]
        n = key_states.shape[0]
        rows, at = torch.arange(n, device=key_states.device), self.at[:n]
        k[rows, :, at] = key_states[:, :, 0].to(k.dtype)  # (the compute dtype: keys after RoPE may be fp32)
        v[rows, :, at] = value_states[:, :, 0].to(v.dtype)
        return k[:n, :, :self.attend], v[:n, :, :self.attend]

    def get_seq_length(self, *args, **kwargs) -> int:
        return 0

    def fill(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A prefill's keys and values [layers, len(rows), heads, width, head_dim] into the first columns of `rows`
        (in the cache's dtype: fp32 under autocast after RoPE)."""
        width = keys.shape[3]
        self.kv[:, 0, rows, :, :width] = keys.to(self.kv.dtype)
        self.kv[:, 1, rows, :, :width] = values.to(self.kv.dtype)

    def move(self, src: list[int], dst: list[int], columns: int) -> None:
        """Rows src -> dst (keys and values of their first `columns` columns, next token, position, draws), one
        copy each."""
        s, d = (on(self.kv.device, x) for x in (src, dst))
        self.kv[:, :, d, :, :columns] = self.kv[:, :, s, :, :columns]
        self.cur[d] = self.cur[s]
        self.pos[d] = self.pos[s]
        self.draws[d] = self.draws[s]


class PromptCache:
    """What a prefill leaves: the keys and values of the prompts' tokens (no cache before them)."""

    def __init__(self, layers: int) -> None:
        self.k: list = [None] * layers
        self.v: list = [None] * layers

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.k[layer_idx], self.v[layer_idx] = key_states, value_states
        return key_states, value_states

    def get_seq_length(self, *args, **kwargs) -> int:
        return 0


class Step:
    """One decode step over the first `bucket` rows of a SlotCache: the model on each row's next token at its
    position, then the pick; returns the picked tokens [bucket] on the device. `compiled`: torch.compile(fullgraph)
    with CUDA graphs on CUDA; `graphs()` counts what dynamo compiled. A step that fails to compile (a model whose
    forward dynamo cannot trace whole) runs eagerly from then on, with one line saying why."""

    def __init__(self, model, cache_arg: str, keep: dict, compiled: bool, say=print) -> None:
        self.model, self.cache_arg, self.keep, self.compiled, self.say = model, cache_arg, keep, compiled, say
        self.fn = self._run
        self.compiled_graphs = 0  # graphs dynamo compiled in this step's calls (its buckets, both pick forms)
        self.cuda = next(model.parameters()).device.type == "cuda"
        _register_grouped()
        if compiled:
            import torch._dynamo

            # every bucket and both pick forms are guarded variants of one frame: room for all of them
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self.fn = torch.compile(self._run, fullgraph=True, mode="reduce-overhead" if self.cuda else None)

    def __call__(self, cache: SlotCache, n: int, picker: Picker) -> torch.Tensor:
        """Sampled (`picker.greedy` false): a draw (each row's uniform number for the position of the token drawn,
        from its row of `cache.draws`) under the warpers `pick` applies, else argmax."""
        sample, *warpers = picker.args  # (temperature, top_p, top_k, min_p: the compiled function's inputs)
        ids, positions, table = cache.cur[:n], cache.pos[:n], cache.draws[:n] if sample else None
        torch.clamp(positions, max=cache.attend - 1, out=cache.at[:n])  # padding rows: a column of their free row
        with _Attention(self.model):
            return self._call(cache, n, ids, positions, table, *warpers)

    def _call(self, cache: SlotCache, n: int, ids, positions, table, *warpers) -> torch.Tensor:
        if self.compiled:
            before = graphs()
            try:
                return self._compiled(cache, n, ids, positions, table, *warpers)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as e:  # the step's writes are at fixed positions: running it again is the same step
                self.say(f"[rft] rft.compile: the decode step did not compile ({type(e).__name__}: "
                         f"{(str(e).strip().splitlines() or [''])[0][:200]}); it runs eagerly")
                self.compiled, self.fn = False, self._run
            finally:
                self.compiled_graphs += graphs() - before
        return self.fn(ids, positions, cache, table, *warpers)

    def _compiled(self, cache: SlotCache, n: int, ids, positions, table, *warpers) -> torch.Tensor:
        if self.cuda and not cache.static:  # the cache stays put: CUDA graphs read and write it in place
            for t in (cache.kv, cache.at, cache.draws, *cache.k, *cache.v):  # (the layers' views: graph inputs)
                torch._dynamo.mark_static_address(t)
            cache.static = True
        if n > 1:
            torch._dynamo.maybe_mark_dynamic(ids, 0)
            torch._dynamo.maybe_mark_dynamic(positions, 0)
            if table is not None:
                torch._dynamo.maybe_mark_dynamic(table, 0)
        if self.cuda:
            torch.compiler.cudagraph_mark_step_begin()
        return self.fn(ids, positions, cache, table, *warpers)

    def _run(self, ids, positions, cache: SlotCache, table, temperature, top_p, top_k: int = 0, min_p=None):
        at = cache.at[:ids.shape[0]]  # (filled by __call__)
        mask = (torch.arange(cache.attend, device=ids.device)[None] <= at[:, None])[:, None, None]
        out = self.model(input_ids=ids[:, None], position_ids=at[:, None], attention_mask=mask, use_cache=True,
                         **self.keep, **{self.cache_arg: cache})
        noise = None if table is None else table.gather(1, positions[:, None] + 1)  # the token drawn: position + 1
        return pick(out.logits[:, -1, :].to(dtype=torch.float32), noise, temperature, top_p, top_k, min_p)


def graphs() -> int:
    """Graphs dynamo has compiled in this process (a recompilation adds one): the difference of two readings is
    what was compiled between them."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class StopStrings:
    """`stopped(tokens)`: whether a sequence's newest token completes one of `stop_strings` (the text keeps it). Only
    a token that can end one (`enders`: its text holds a stop string's last character, or is not whole text on its
    own) has the tail decoded: a few new tokens' text, not every sequence's every step."""

    def __init__(self, tokenizer, stop_strings: tuple) -> None:
        self.tok, self.strings = tokenizer, tuple(stop_strings)
        self.longest = max(map(len, self.strings), default=0)
        self._enders: Optional[frozenset] = None
        self.decoded = False
        self.enders()  # decoded now, with the engine, not within a generation's time

    def __call__(self, tokens: list[int]) -> bool:
        if not self.strings:
            return False
        enders = self.enders()
        return (enders is None or tokens[-1] in enders) and self.in_tail(tokens)

    def in_tail(self, tokens: list[int]) -> bool:
        """Whether the decoded tail of `tokens` holds a stop string (the engine calls it for an `enders` token)."""
        tail = self.tok.decode(tokens[-(self.longest + 2):], skip_special_tokens=True)
        return any(s in tail for s in self.strings)

    def enders(self) -> Optional[frozenset]:
        """The token ids whose arrival can complete a stop string (decoded once): those whose text holds the last
        character of a stop string, and, when one of those characters is not ASCII, those whose text alone is not
        what they add to a sequence (a partial UTF-8 character, empty text: completing a multi-byte character; an
        ASCII character is a whole byte, in the text of the token that brings it). None (decode at every token) when
        a stop string ends in whitespace, which a tokenizer may add with the next token (SentencePiece's leading
        space)."""
        if not self.decoded and self.strings:
            self.decoded = True
            lasts = {x[-1] for x in self.strings}
            partial = not all(c.isascii() for c in lasts)
            if not any(c.isspace() for c in lasts):
                texts = self.tok.batch_decode([[i] for i in range(len(self.tok))], skip_special_tokens=True)
                self._enders = frozenset(i for i, t in enumerate(texts) if any(c in t for c in lasts) or
                                         (partial and (not t or "\ufffd" in t)))
        return self._enders

