"""The continuous generation engine of `harness rft generate | test | bench` (rft.engine=continuous, the default).

    python -c "from harness.rft.engine import ContinuousEngine; help(ContinuousEngine.generate)"

A fixed number of slots (sequences in flight: rft.micro_batch_sequences at most, fewer when the KV-cache budget
rft.kv_cache_gb holds fewer) is decoded one token a step; a sequence that ends (EOS, a stop string,
rft.max_new_tokens) leaves its slot at once and the next waiting sample takes it. A question's prompt is computed
once (one prefill), its last logits give the first token of each of its N samples, and its keys and values are copied
into the N slots. The cache is ours: per layer one [slots, kv_heads, width, head_dim] tensor per K and V, every
sequence right-aligned on a shared write column, so that one decode step writes one column for every slot and
attends over a view (no copy); the active slots are kept at the front (a finished slot takes the last one's row).
When the column reaches the width, the columns no active sequence uses are cut (a shift, every `margin` steps at
most). Attention gets an explicit 4D mask and explicit positions, so any transformers decoder whose layers call
`cache.update(k, v, layer_idx)` and attend over all the positions returned is served; others fall back
(`servable`).

What is exact: greedy decoding gives the text that model.generate gives (the same argmax of the same model, computed
on other batch shapes: tests/test_rft_engine.py); sampling draws from the same distribution as the static path
(logits in fp32, transformers' temperature and top-p warpers, top-k off), with other random draws: a fixed seed gives
the same samples run to run for the same settings and slot count, not the static path's samples.
"""

from __future__ import annotations

import inspect
import time
from typing import Callable, Optional

import torch

from harness.distributed.sequence import attention_heads
from harness.errors import HarnessError


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


class SlotCache:
    """Keys and values of every slot, right-aligned on a shared write column (see the module docstring)."""

    def __init__(self, layers: int, slots: int, heads: int, width: int, head_dim: int, dtype, device) -> None:
        shape = (slots, heads, width, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.n = self.lo = 0  # rows in use (the front), first column any of them uses
        self.col = 0  # the column the next step writes

    # what a transformers attention layer calls
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.k[layer_idx], self.v[layer_idx]
        k[:self.n, :, self.col] = key_states[:, :, 0]
        v[:self.n, :, self.col] = value_states[:, :, 0]
        return k[:self.n, :, self.lo:self.col + 1], v[:self.n, :, self.lo:self.col + 1]

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.col - self.lo

    def put(self, row: int, keys: list, values: list) -> None:
        """A prompt's keys and values ([heads, p, head_dim] per layer) into `row`, ending before the write column."""
        p = keys[0].shape[1]
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.k[layer][row, :, self.col - p:self.col] = k
            self.v[layer][row, :, self.col - p:self.col] = v

    def move(self, src: int, dst: int) -> None:
        for t in (*self.k, *self.v):
            t[dst, :, self.lo:self.col] = t[src, :, self.lo:self.col]

    def shift(self, by: int) -> None:
        """Cut `by` columns on the left (no active sequence uses them)."""
        for t in (*self.k, *self.v):
            t[:, :, self.lo - by:self.col - by] = t[:, :, self.lo:self.col].clone()
        self.col -= by
        self.lo -= by


class PromptCache:
    """What a prefill leaves: the keys and values of the prompt's tokens (no cache before them)."""

    def __init__(self, layers: int) -> None:
        self.k: list = [None] * layers
        self.v: list = [None] * layers

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.k[layer_idx], self.v[layer_idx] = key_states, value_states
        return key_states, value_states

    def get_seq_length(self, *args, **kwargs) -> int:
        return 0


class Stats:
    """Counters of one engine: sequences and new tokens (EOS included), seconds generating, decode steps, and the
    slot-steps computed (sequences in the batch, summed over the decode steps) against the ones a running sequence
    used: 1 - used / computed is the share wasted on padding (a static batch decodes its finished rows until its
    longest ends); computed / steps is the mean batch."""

    def __init__(self) -> None:
        self.sequences = self.tokens = self.slot_steps = self.used_slot_steps = self.steps = 0
        self.seconds = 0.0
        self.lengths: list[int] = []  # new tokens of each sequence

    def waste(self) -> float:
        return 1 - self.used_slot_steps / max(self.slot_steps, 1)

    def mean_batch(self) -> float:
        return self.slot_steps / max(self.steps, 1)


class ContinuousEngine:
    """Continuous batching over a SlotCache; `generate(prompts, n, ...)` returns n responses per prompt."""

    name = "continuous"

    def __init__(self, model, tokenizer, max_new_tokens: int, max_slots: int, kv_cache_gb: Optional[float] = None,
                 stop_strings: tuple = (), say: Callable = print) -> None:
        self.model, self.tok, self.max_new_tokens, self.say = model, tokenizer, max_new_tokens, say
        self.max_slots, self.kv_cache_gb, self.stop_strings = max_slots, kv_cache_gb, tuple(stop_strings)
        self.stats = Stats()
        self.dtype = next(model.parameters()).dtype
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}  # the last position's logits only
        c = model.config.get_text_config()
        self.layers = c.num_hidden_layers
        _, self.heads, self.head_dim = attention_heads(c)  # the cache holds key/value heads
        self.vocab = c.vocab_size

    # ------------------------------------------------------------------------------------------- sizing
    def slot_bytes(self, width: int) -> int:
        dtype = next(self.model.parameters()).dtype
        return 2 * self.layers * self.heads * self.head_dim * width * dtype.itemsize

    def plan_slots(self, width: int) -> int:
        """Slots that the KV-cache budget holds (rft.kv_cache_gb; null: 90% of the free GPU memory less the logits'
        room, 4 GiB on CPU), at most max_slots."""
        dev = next(self.model.parameters()).device
        per_slot = self.slot_bytes(width) + 3 * 4 * self.vocab  # + fp32 logits, probabilities, sort
        if self.kv_cache_gb is not None:
            budget = self.kv_cache_gb * 2**30
        elif dev.type == "cuda":
            budget = 0.9 * torch.cuda.mem_get_info(dev)[0]
        else:
            budget = 4 * 2**30
        slots = min(self.max_slots, int(budget // per_slot))
        if slots < 1:
            raise HarnessError(f"rft.kv_cache_gb: {budget / 2**30:.2f} GiB holds no sequence of {width} tokens "
                               f"({per_slot / 2**20:.1f} MiB each); raise it or lower rft.max_new_tokens")
        return slots

    # ------------------------------------------------------------------------------------------- model calls
    def _forward(self, ids, positions, mask, cache):
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                         **self.keep, **{self.cache_arg: cache})
        return out.logits[:, -1, :].to(dtype=torch.float32)

    def _prefill(self, ids: list[int]):
        """(keys, values per layer as [heads, p, head_dim], the last position's fp32 logits) of one prompt."""
        dev = next(self.model.parameters()).device
        p = len(ids)
        cache = PromptCache(self.layers)
        mask = torch.ones(p, p, dtype=torch.bool, device=dev).tril()[None, None]
        logits = self._forward(torch.tensor([ids], device=dev), torch.arange(p, device=dev)[None], mask, cache)
        return [k[0] for k in cache.k], [v[0] for v in cache.v], logits[0]

    def _pick(self, logits, greedy: bool, warpers, gen) -> torch.Tensor:
        if greedy:
            return logits.argmax(-1)
        for w in warpers:
            logits = w(None, logits)
        return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen).squeeze(1)

    # ------------------------------------------------------------------------------------------- the loop
    @torch.no_grad()
    def generate(self, prompts: list[str], n: int, temperature: float = 1.0, top_p: float = 1.0,
                 greedy: bool = False, seed=0,
                 on_done: Optional[Callable[[int, list[str]], None]] = None) -> list[list[str]]:
        """n responses per prompt, grouped by prompt (each group in sample order). `on_done(i, responses)` is
        called as soon as prompt i's n samples have ended (a resumable writer appends its record there)."""
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

        tok, dev = self.tok, next(self.model.parameters()).device
        warpers = [] if greedy else [TemperatureLogitsWarper(temperature)] + (
            [TopPLogitsWarper(top_p)] if top_p < 1.0 else [])
        gen = torch.Generator(device=dev).manual_seed(seed(0) if callable(seed) else seed)
        eos = {tok.eos_token_id}  # as the static path, which passes the tokenizer's to generate()
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        longest = max(map(len, ids), default=0)
        margin = max(16, self.max_new_tokens // 2)
        width = longest + self.max_new_tokens + margin
        slots = self.plan_slots(width)
        cache = self._new_cache(slots, width, longest)
        results: list[list] = [[None] * n for _ in prompts]
        left = [n] * len(prompts)  # samples of each prompt not yet ended
        waiting = [(i, j) for i in range(len(prompts)) for j in range(n)]
        waiting.reverse()  # pop() takes the next in order
        prompt_kv: dict = {}  # prompt index -> (keys, values, logits) while some of its samples wait
        rows: list[dict] = []  # per active row: prompt, sample, tokens, start column, position
        t0 = time.perf_counter()

        def finish(i: int, j: int, tokens: list[int]) -> None:
            self.stats.sequences += 1
            self.stats.tokens += len(tokens)
            self.stats.lengths.append(len(tokens))
            results[i][j] = tok.decode([t for t in tokens if t not in eos], skip_special_tokens=True).strip()
            left[i] -= 1
            if left[i] == 0 and on_done is not None:
                on_done(i, results[i])

        while waiting or rows:
            # admit: waiting samples take the free slots; a prompt is prefilled once, for all its samples
            while waiting and cache.n < len(cache.k[0]):
                i, j = waiting.pop()
                if i not in prompt_kv:
                    try:
                        prompt_kv[i] = self._prefill(ids[i])
                    except torch.cuda.OutOfMemoryError:
                        waiting.append((i, j))
                        cache = self._shrink(cache, rows, waiting, prompt_kv)
                        continue
                keys, values, logits = prompt_kv[i]
                if j == n - 1:
                    del prompt_kv[i]
                first = int(self._pick(logits[None], greedy, warpers, gen)[0])
                if first in eos or self.max_new_tokens == 1 or self._stopped([first]):
                    finish(i, j, [first])
                    continue
                cache.put(cache.n, keys, values)
                rows.append({"i": i, "j": j, "tokens": [first], "start": cache.col - len(ids[i]),
                             "pos": len(ids[i])})
                cache.n += 1
            if not rows:
                continue
            cache.lo = min(r["start"] for r in rows)
            # one decode step for every active slot
            inp = torch.tensor([[r["tokens"][-1]] for r in rows], device=dev)
            pos = torch.tensor([[r["pos"]] for r in rows], device=dev)
            starts = torch.tensor([r["start"] for r in rows], device=dev)
            mask = (torch.arange(cache.lo, cache.col + 1, device=dev)[None] >= starts[:, None])[:, None, None]
            try:
                nxt = self._pick(self._forward(inp, pos, mask, cache), greedy, warpers, gen).tolist()
            except torch.cuda.OutOfMemoryError:
                cache = self._shrink(cache, rows, waiting, prompt_kv)
                continue
            self.stats.slot_steps += len(rows)  # only the running sequences are computed
            self.stats.used_slot_steps += len(rows)
            self.stats.steps += 1
            cache.col += 1
            for r, t in zip(rows, nxt):
                r["tokens"].append(t)
                r["pos"] += 1
            # ended sequences leave: the last active row moves into the freed one
            for idx in range(len(rows) - 1, -1, -1):
                r = rows[idx]
                if r["tokens"][-1] in eos or len(r["tokens"]) >= self.max_new_tokens or self._stopped(r["tokens"]):
                    finish(r["i"], r["j"], r["tokens"])
                    last = len(rows) - 1
                    if idx != last:
                        cache.move(last, idx)
                        rows[idx] = rows[last]
                    rows.pop()
                    cache.n -= 1
            if cache.col == width and rows:  # no room on the right: cut the columns nobody uses
                lo = min(r["start"] for r in rows)
                cache.lo = lo
                by = min(lo, cache.col - longest)
                cache.shift(by)
                for r in rows:
                    r["start"] -= by
            elif not rows:
                cache.col = cache.lo = longest
        self.stats.seconds += time.perf_counter() - t0
        return results

    def _new_cache(self, slots: int, width: int, longest: int) -> SlotCache:
        p = next(self.model.parameters())
        cache = SlotCache(self.layers, slots, self.heads, width, self.head_dim, p.dtype, p.device)
        cache.col = cache.lo = cache.longest = longest
        return cache

    def _shrink(self, cache: SlotCache, rows: list, waiting: list, prompt_kv: dict) -> SlotCache:
        """Out of GPU memory: half the slots; the sequences in flight start again (nothing written is lost)."""
        slots = len(cache.k[0]) // 2
        if slots < 1:
            raise HarnessError("out of GPU memory with one sequence in flight: lower rft.max_new_tokens or "
                               "rft.kv_cache_gb, or use a larger GPU")
        for r in sorted(rows, key=lambda r: (r["i"], r["j"]), reverse=True):
            waiting.append((r["i"], r["j"]))
        waiting.sort(reverse=True)
        prompt_kv.clear()  # prefilled again when their samples are admitted
        rows.clear()
        width, longest = cache.k[0].shape[2], cache.longest
        del cache
        torch.cuda.empty_cache()
        self.max_slots = slots
        self.say(f"[rft] out of memory: {slots} sequences in flight at most; the sequences in flight start again")
        return self._new_cache(slots, width, longest)

    def _stopped(self, tokens: list[int]) -> bool:
        if not self.stop_strings:
            return False
        longest = max(map(len, self.stop_strings))
        tail = self.tok.decode(tokens[-(longest + 2):], skip_special_tokens=True)
        return any(s in tail for s in self.stop_strings)
