"""The continuous engine's slot cache, planned: how many sequences the KV-cache budget holds, the cache kept between
calls, halved when the GPU runs out of memory.

    python -c "from harness.rft.slots import Slots; help(Slots.plan)"

Per slot: keys and values of every layer at the cache's width in the compute dtype (`compute_dtype`), plus a step's
logits and the pick's peak per vocabulary entry (stats.logit_bytes). The budget is rft.kv_cache_gb, else 90% of the
free GPU memory (the kept cache counted as free: it is replaced), 4 GiB on CPU; at most rft.micro_batch_sequences.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from harness.distributed.sequence import attention_heads
from harness.errors import HarnessError
from harness.rft.decode import SlotCache, buckets
from harness.rft.stats import logit_bytes


class Slots:
    """The engine's SlotCache (`cache`: None until a call needs one, or once freed) and the batch buckets a step runs
    at (`sizes`)."""

    def __init__(self, model, max_slots: int, kv_cache_gb: Optional[float] = None, say: Callable = print) -> None:
        c = model.config.get_text_config()
        self.layers, self.vocab = c.num_hidden_layers, c.vocab_size
        _, self.heads, self.head_dim = attention_heads(c)  # the cache holds key/value heads
        self.dtype = next(model.parameters()).dtype  # the weights'; the cache's is the compute dtype
        self.device = next(model.parameters()).device
        self.max_slots, self.kv_cache_gb, self.say = max_slots, kv_cache_gb, say
        self.cache: Optional[SlotCache] = None  # kept between generate() calls: the compiled step reads it in place
        self.sizes: list[int] = []

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

    def plan(self, width: int) -> int:
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

    def cache_for(self, width: int, compiled: bool) -> SlotCache:
        """The cache for sequences of `width` tokens: the one kept from the last call when it is wide enough, else a
        new one (compiled: widths rounded up to 64 columns, so that calls with similar prompts share it). Planned
        once and kept: a later call does not plan again from the free memory of the moment (which the kept cache
        and what runs beside it lower: it shrank call after call, reallocated and captured its graphs again).
        `sizes`: the batch buckets; compiled, a lone sequence runs in the bucket of 2, so that the batch dimension is
        dynamic from the first step (one graph per pick form: dynamo specializes a dimension of size 1)."""
        if compiled:
            width = -(-width // 64) * 64
        c, dtype = self.cache, self.compute_dtype()
        if c is None or c.width < width or c.slots > self.max_slots or c.kv.dtype != dtype:
            slots = self.plan(width)  # (on CUDA the kept cache's bytes count as free: it is replaced)
            self.cache = None
            self.cache = SlotCache(self.layers, slots, self.heads, width, self.head_dim, dtype, self.device)
        sizes = buckets(self.cache.slots)
        self.sizes = sizes[1:] if compiled and len(sizes) > 1 else sizes
        return self.cache

    def halve(self, width: int, compiled: bool) -> SlotCache:
        """Out of GPU memory: a cache of half the slots (`width`: the kept cache's, when there is one)."""
        slots = (self.cache.slots if self.cache else self.max_slots) // 2
        if slots < 1:
            raise HarnessError("out of GPU memory with one sequence in flight: lower rft.max_new_tokens or "
                               "rft.kv_cache_gb, or use a larger GPU")
        width = self.cache.width if self.cache else width
        self.cache = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.max_slots = slots
        self.say(f"[rft] out of memory: {slots} sequences in flight at most; the sequences in flight start again")
        return self.cache_for(width, compiled)
