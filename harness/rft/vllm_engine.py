"""rft.engine=vllm: generation through vLLM when it is installed (one line saying so when it is not).

    harness rft generate configs/rft-tiny.yaml rft.engine=vllm

vLLM loads the model folder itself (the harness's copy is not used) with its own scheduler, paged KV cache and
sampler: the same temperature and top-p, other random draws; greedy is temperature 0. It takes the prompts' ids and
gives the completions' ids (vLLM's TokensPrompt; its text is not read). No test runs it (no vLLM in
the test environment); the shards, merge and report are the harness's, as for the other engines.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from harness.errors import ConfigError
from harness.rft.contract import Completion, OnDone, Sampling
from harness.rft.stats import Stats


class VllmEngine:
    name = "vllm"
    dtype = "auto (vllm)"
    eos: list = []  # the ids that end an answer: its tokenizer's (sampling.load_engine)

    def __init__(self, model_path: Optional[str], max_new_tokens: int, stop_strings: tuple = (),
                 say: Callable = print) -> None:
        try:
            import vllm
        except ImportError:
            raise ConfigError("config key 'rft.engine': vllm is not installed (pip install vllm); use "
                              "rft.engine=continuous or static") from None
        self.vllm, self.max_new_tokens, self.stop = vllm, max_new_tokens, list(stop_strings)
        self.llm = vllm.LLM(model=model_path, dtype="auto")  # a folder or hub id (a LoRA final/: its merged/)
        self.stats = Stats()
        say(f"[rft] vllm {vllm.__version__} serving {model_path}")

    def serving(self, model):
        """vLLM serves the folder it loaded: another model object cannot be handed to it."""
        raise ConfigError("config key 'rft.engine': vllm serves the model folder it loaded, not the model in training")

    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling = Sampling(),
                 on_done: Optional[OnDone] = None) -> list[list[Completion]]:
        seed = sampling.seed(0, 0) if callable(sampling.seed) else sampling.seed
        params = self.vllm.SamplingParams(n=n, temperature=0.0 if sampling.greedy else sampling.temperature,
                                          top_p=sampling.top_p, max_tokens=self.max_new_tokens,
                                          stop=self.stop or None, seed=seed)
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params)  # (vllm's TokensPrompt)
        self.stats.seconds += time.perf_counter() - t0
        results = []
        for i, o in enumerate(outs):
            got = [Completion(tuple(c.token_ids)) for c in o.outputs]
            self.stats.sequences += len(got)
            self.stats.tokens += sum(len(c.ids) for c in got)
            results.append(got)
            if on_done is not None:
                on_done(i, got)
        return results
