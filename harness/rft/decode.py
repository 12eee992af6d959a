"""The continuous engine's decode step with fixed shapes: batch buckets, a static slot cache, sampling on the device.

    python -c "from harness.rft.decode import buckets; print(buckets(256))"

The sequences in flight sit at the front of the slot rows; a step runs the first `bucket` rows, the smallest of
1, 2, 4, 8, then multiples of 16 up to the slots, that holds them (rows past the last running one are padding: their
writes land in free rows and nothing reads their tokens). The cache is one tensor [layers, 2, slots, kv_heads, width,
head_dim] allocated once; every sequence starts at column 0 of its row and a step writes each row's column at its own
position (the mask: columns <= position), so the same step, of the same shapes, runs again and again: with
rft.compile it is compiled once (torch.compile, fullgraph; the batch dimension dynamic from the first step) and on
CUDA captured as CUDA graphs, one per bucket (mode="reduce-overhead"). Picking the next token is part of the step:
greedy (argmax) or sampled on the device, transformers' temperature and top-p warpers written as tensor operations
followed by a draw by the inverse CDF (one uniform number a row, a hash of the row's sample seed and the position of
the token drawn: `uniform`, so that a sample draws the same tokens whatever shares its batch).
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


def sample_seed(seed, i: int, j: int) -> int:
    """The 32-bit seed of sample j of prompt i: from `seed(i, j)` when seed is callable, else from (seed, i, j)."""
    import hashlib

    key = f"{seed(i, j)}" if callable(seed) else f"{seed},{i},{j}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")


def pick(logits: torch.Tensor, uniform: Optional[torch.Tensor], temperature: torch.Tensor,
         top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """The next token per row from fp32 logits [rows, vocab]: argmax when `uniform` is None, else the temperature
    warper (logits / t), the top-p warper (transformers' TopPLogitsWarper: the smallest set of most likely tokens
    whose probability reaches top_p, the most likely always kept) when top_p is given, then a draw from the
    probabilities by their inverse CDF with `uniform` [rows, 1] ~ U[0, 1) (float64, `uniform()`): the first token
    whose cumulative probability passes u (a token of probability 0 has an empty interval and is never drawn; the
    cumulative sum is in float64, where fp32's would drop tokens under ~6e-8 near its end). One random number a
    row, where the exponential race needs one per token (vocab x rows: 11 ms a step on this CPU at 256 x 32k)."""
    if uniform is None:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_p is not None:
        ordered, order = torch.sort(logits, descending=False, dim=-1)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[..., -1:] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    cdf = logits.softmax(-1).to(torch.float64).cumsum(-1)
    got = torch.searchsorted(cdf, uniform.to(torch.float64) * cdf[:, -1:], right=True)[:, 0]
    return got.clamp(max=logits.shape[-1] - 1)


class SlotCache:
    """Keys and values of every slot row (see the module docstring); `cur` and `pos` hold each row's next input token
    and its position, on the device. What a transformers attention layer calls: update(), get_seq_length()."""

    def __init__(self, layers: int, slots: int, heads: int, width: int, head_dim: int, dtype, device) -> None:
        self.kv = torch.zeros((layers, 2, slots, heads, width, head_dim), dtype=dtype, device=device)
        self.k = [self.kv[layer, 0] for layer in range(layers)]
        self.v = [self.kv[layer, 1] for layer in range(layers)]
        self.cur = torch.zeros(slots, dtype=torch.long, device=device)
        self.pos = torch.zeros(slots, dtype=torch.long, device=device)
        self.seed = torch.zeros(slots, dtype=torch.long, device=device)  # each row's sample's seed (`uniform`)
        self.slots, self.width = slots, width
        self.attend = width  # columns a step attends over (eager: the used ones rounded up; compiled: all)
        self.at: Optional[torch.Tensor] = None  # the positions the running step writes (set by the step)
        self.static = False  # marked as a static address for CUDA graphs

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.k[layer_idx], self.v[layer_idx]
        rows = torch.arange(key_states.shape[0], device=key_states.device)
        k[rows, :, self.at] = key_states[:, :, 0]
        v[rows, :, self.at] = value_states[:, :, 0]
        n = key_states.shape[0]
        return k[:n, :, :self.attend], v[:n, :, :self.attend]

    def get_seq_length(self, *args, **kwargs) -> int:
        return 0

    def move(self, src: list[int], dst: list[int], columns: int) -> None:
        """Rows src -> dst (keys and values of their first `columns` columns, next token, position, seed), one copy
        each."""
        s, d = (on(self.kv.device, x) for x in (src, dst))
        self.kv[:, :, d, :, :columns] = self.kv[:, :, s, :, :columns]
        self.cur[d] = self.cur[s]
        self.pos[d] = self.pos[s]
        self.seed[d] = self.seed[s]


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
        self.cuda = next(model.parameters()).device.type == "cuda"
        if compiled:
            import torch._dynamo

            # every bucket and both pick forms are guarded variants of one frame: room for all of them
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self.fn = torch.compile(self._run, fullgraph=True, mode="reduce-overhead" if self.cuda else None)

    def __call__(self, cache: SlotCache, n: int, sample: bool, temperature, top_p) -> torch.Tensor:
        """`sample`: draw (each row's uniform number from its seed and the position of the token drawn), else
        argmax."""
        ids, positions, seeds = cache.cur[:n], cache.pos[:n], cache.seed[:n] if sample else None
        if self.compiled:
            try:
                return self._compiled(cache, n, ids, positions, seeds, temperature, top_p)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as e:  # the step's writes are at fixed positions: running it again is the same step
                self.say(f"[rft] rft.compile: the decode step did not compile ({type(e).__name__}: "
                         f"{(str(e).strip().splitlines() or [''])[0][:200]}); it runs eagerly")
                self.compiled, self.fn = False, self._run
        return self.fn(ids, positions, cache, seeds, temperature, top_p)

    def _compiled(self, cache: SlotCache, n: int, ids, positions, seeds, temperature, top_p) -> torch.Tensor:
        if self.cuda and not cache.static:  # the cache stays put: CUDA graphs read and write it in place
            for t in (cache.kv, *cache.k, *cache.v):  # (the layers' views are the graph's inputs)
                torch._dynamo.mark_static_address(t)
            cache.static = True
        if n > 1:
            torch._dynamo.maybe_mark_dynamic(ids, 0)
            torch._dynamo.maybe_mark_dynamic(positions, 0)
            if seeds is not None:
                torch._dynamo.maybe_mark_dynamic(seeds, 0)
        if self.cuda:
            torch.compiler.cudagraph_mark_step_begin()
        return self.fn(ids, positions, cache, seeds, temperature, top_p)

    def _run(self, ids, positions, cache: SlotCache, seeds, temperature, top_p):
        at = positions.clamp(max=cache.attend - 1)  # padding rows: any column of their own free row
        cache.at = at
        mask = (torch.arange(cache.attend, device=ids.device)[None] <= at[:, None])[:, None, None]
        out = self.model(input_ids=ids[:, None], position_ids=at[:, None], attention_mask=mask, use_cache=True,
                         **self.keep, **{self.cache_arg: cache})
        noise = None if seeds is None else uniform(seeds, positions + 1)  # the token drawn sits at position + 1
        return pick(out.logits[:, -1, :].to(dtype=torch.float32), noise, temperature, top_p)


def graphs() -> int:
    """Graphs dynamo has compiled in this process (a recompilation adds one): the difference of two readings is
    what was compiled between them."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
