"""rft.engine=transformers: transformers' own continuous batching (model.generate_batch's manager, paged attention;
CUDA graphs on CUDA) behind the engine interface of `rft generate | test | bench`.

    harness rft bench configs/rft-tiny.yaml --engines continuous,transformers

The requests (each prompt once, n samples as num_return_sequences; greedy: the prompt n times) go to the manager of
`model.continuous_batching_context_manager`; results are read as they finish, and a prompt's `on_done` comes as soon as
its n samples have ended, as with rft.engine=continuous. EOS and rft.max_new_tokens end a sequence in the manager;
rft.stop_strings end a sequence during generation: with stop strings the requests stream their tokens, each new token is
checked as it arrives (decode.StopStrings: only the tokens that can complete one have a tail decoded), and a request
that completed one is cancelled in the manager (its answer cut at that token, as the other engines end there; the few
tokens the manager computed before it read the cancellation are counted in `computed`, not kept). What differs from
rft.engine=continuous: the random draws are the manager's (seeded with torch.manual_seed(seed), drawn on its own
thread), so samples are not the same run to run on every device.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional

import torch

from harness.errors import HarnessError
from harness.rft.contract import Completion, OnDone, Sampling, holding
from harness.rft.decode import StopStrings
from harness.rft.stats import Stats, eos_ids


class TransformersEngine:
    """`generate(prompts, n, ...)` through transformers' continuous batching manager; n completions per prompt."""

    name = "transformers"

    def __init__(self, model, tokenizer, max_new_tokens: int, max_slots: int = 256, stop_strings: tuple = (),
                 say: Callable = print, top_k: int = 0, min_p: float = 0.0) -> None:
        self.model, self.tok, self.max_new_tokens, self.say = model, tokenizer, max_new_tokens, say
        self.top_k, self.min_p = int(top_k), float(min_p)
        self.max_slots = max_slots
        self.stop_strings = tuple(stop_strings)
        self.stopped = StopStrings(tokenizer, self.stop_strings)
        self.stats = Stats()
        self.eos = eos_ids(model, tokenizer)  # the ids that end an answer (a caller drops them from its text)
        self.computed = 0  # new tokens the manager computed (a cancelled request's last few included)
        self.dtype = next(model.parameters()).dtype

    def serving(self, model) -> contextlib.AbstractContextManager:
        """Within: the manager runs `model` (`contract.Engine.serving`)."""
        return holding(self, model)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling = Sampling(),
                 on_done: Optional[OnDone] = None) -> list[list[Completion]]:
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        tok, st = self.tok, self.stats
        eos = self.eos  # the tokenizer's and every one of generation_config.eos_token_id
        ids, greedy = [list(p) for p in prompts], sampling.greedy
        if not ids:
            return []
        copies = n if greedy else 1  # greedy: each prompt n times; sampling: n return sequences per request
        kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=sampling.temperature,
                                                       top_p=sampling.top_p,
                                                       top_k=self.top_k, min_p=self.min_p or None,
                                                       num_return_sequences=n)
        config = GenerationConfig(max_new_tokens=self.max_new_tokens, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                                  **kw)
        seed = sampling.seed(0, 0) if callable(sampling.seed) else sampling.seed
        torch.manual_seed(seed)
        cpu = next(self.model.parameters()).device.type == "cpu"
        page = 256  # tokens per cache block (transformers' default); on CPU the cache sized for the sequences in
        blocks = self.max_slots * -(-(max(map(len, ids)) + self.max_new_tokens) // page)  # flight, not the memory
        cb = ContinuousBatchingConfig(max_requests_per_batch=self.max_slots, seed=seed, page_size=page,
                                      **(dict(num_blocks=blocks, max_batch_tokens=4096) if cpu else {}))
        results: list[list] = [[None] * n for _ in prompts]
        left = [n] * len(prompts)
        longest: dict = {}  # request id -> the most tokens the manager gave it
        t0 = time.perf_counter()
        with self.model.continuous_batching_context_manager(
                generation_config=config, continuous_batching_config=cb, block=True, timeout=30,
                warmup=not cpu) as manager:
            streaming = bool(self.stop_strings)  # every token delivered, so that a stop string ends the request
            rids = manager.add_requests(inputs=[x for x in ids for _ in range(copies)],
                                        max_new_tokens=self.max_new_tokens, streaming=streaming)
            where = {}  # request id -> (prompt, sample)
            for k, rid in enumerate(rids):
                i, j = divmod(k, copies)
                if greedy:
                    where[rid] = (i, j)
                else:  # transformers names the children <id>__child#c and the parent is the last sample
                    where.update({f"{rid}__child#{c}": (i, c) for c in range(n - 1)}, **{rid: (i, n - 1)})
            seen: dict = {}  # request id -> its tokens checked so far; None once it has ended
            done = 0
            while done < len(prompts) * n:
                out = manager.get_result(timeout=1)
                if out is None:
                    if not manager.is_running():
                        raise HarnessError("rft.engine=transformers: transformers' continuous batching stopped "
                                           "before the last request ended (see its log above)")
                    continue
                if out.error is not None:
                    raise HarnessError(f"rft.engine=transformers: request {out.request_id} failed: {out.error}")
                rid, tokens = out.request_id, list(out.generated_tokens)
                longest[rid] = max(longest.get(rid, 0), len(tokens))
                if rid in seen and seen[rid] is None:  # ended at a stop string: computed before the cancellation
                    continue
                end = next((k for k in range(seen.get(rid, 0) + 1, len(tokens) + 1)
                            if self.stopped(tokens[:k])), None)
                seen[rid] = len(tokens)
                if end is None and not out.is_finished():
                    continue
                if end is not None:
                    tokens = tokens[:end]
                    if not out.is_finished():
                        manager.cancel_request(rid)
                seen[rid] = None
                i, j = where[rid]
                results[i][j] = Completion(tuple(tokens))
                st.sequences += 1
                st.tokens += len(tokens)
                st.lengths.append(len(tokens))
                done += 1
                left[i] -= 1
                if left[i] == 0 and on_done is not None:
                    on_done(i, results[i])
        self.computed += sum(longest.values())
        st.seconds += time.perf_counter() - t0
        return results
