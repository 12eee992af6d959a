"""The continuous engine's model runner: the model calls (a batched prefill, the decode step compiled and on CUDA
captured as CUDA graphs: decode.Step) and the picked tokens read back one step behind on CUDA.

    python -c "from harness.rft.runner import ModelRunner; help(ModelRunner)"

The prefill runs the admitted prompts right-padded in one pass, each attending to its own tokens (an explicit 4D mask
and positions), and keeps the keys and values (decode.PromptCache) and each prompt's last logits. A step's picked
tokens are copied to a host buffer of a ring (pinned on CUDA, behind an event: no wait when queued) and read later
(`read`): on CUDA step t+1 is queued before step t's tokens are read (`lag` 1), on CPU at once (`lag` 0).
"""

from __future__ import annotations

import inspect
import time
from typing import Callable, Iterator

import torch

from harness.rft.decode import PromptCache, SlotCache, Step, on
from harness.rft.stats import Stats


class ModelRunner:
    """The model calls of one engine: `prefill(prompts)`, `step(cache, rows, *pick)` (decode.Step), and the queue of
    picked tokens not yet read (`readable`, `read`)."""

    def __init__(self, model, compile: bool, say: Callable = print) -> None:
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}  # the last position's logits only
        self.step = Step(model, self.cache_arg, self.keep, bool(compile), say)
        self._model = model
        self.device = next(model.parameters()).device
        self.layers = model.config.get_text_config().num_hidden_layers
        self.lag = 1 if self.device.type == "cuda" else 0  # steps queued before the picked tokens are read
        self.ring: list = []  # host buffers (pinned on CUDA) and events the tokens are read through (`readable`)
        self.turn = 0
        self.pending: list = []  # (picked tokens, the sequences of their rows, event, a decode step's) not yet read

    @property
    def model(self):
        return self._model

    @model.setter
    def model(self, model) -> None:
        """Another model object (`ContinuousEngine.serving`): the prefill and the step run it."""
        self._model = self.step.model = model

    def prefill(self, prompts: list[list[int]]):
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

    # ------------------------------------------------------------------------------------------- reading back
    def readable(self, picked: torch.Tensor, seqs: list, cache: SlotCache, step: bool = False) -> None:
        """Queue `picked` to be read: the tokens copied to a host buffer of the ring, on CUDA pinned and behind an
        event (no wait now). The ring (buffers of the cache's slots, their events) is allocated once per cache: at
        most lag + 2 entries are pending at once (a step's and an admission's each turn, read down to `lag`), so a
        buffer is read before the ring comes back to it."""
        cuda, n = self.device.type == "cuda", picked.shape[0]
        if not self.ring or self.ring[0][0].shape[0] < n:
            size = max(n, cache.slots)
            self.ring = [(torch.empty(size, dtype=torch.long, pin_memory=cuda), torch.cuda.Event() if cuda else None)
                         for _ in range(2 * self.lag + 4)]
        host, event = self.ring[self.turn % len(self.ring)]
        self.turn += 1
        host[:n].copy_(picked, non_blocking=cuda)
        if event is not None:
            event.record()
        self.pending.append((host[:n], seqs, event, step))

    def read(self, upto: int, busy: bool, st: Stats) -> Iterator[tuple[list, list[int]]]:
        """(sequences, their tokens) of all but the last `upto` pending entries, oldest first (waiting for each);
        `busy`: sequences wait or run (a read with no decode step queued behind then drains the device's queue)."""
        while len(self.pending) > upto:
            picked, seqs, event, _ = self.pending.pop(0)
            if busy and not any(p[3] for p in self.pending):
                st.queue_drains += 1  # the device runs dry while the host reads: nothing queued behind
            w = time.perf_counter()
            if event is not None:
                event.synchronize()
            values = picked.tolist()
            st.wait_seconds += time.perf_counter() - w
            yield seqs, values
