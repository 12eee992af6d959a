"""rft.engine=vllm: generation through vLLM when it is installed (one line saying so when it is not).

    harness rft generate configs/rft-tiny.yaml rft.engine=vllm

vLLM loads the model folder itself (the harness's copy is not used) with its own scheduler, paged KV cache and
sampler: the same temperature and top-p, other random draws; greedy is temperature 0. No test runs it (no vLLM in
the test environment); the shards, merge and report are the harness's, as for the other engines.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from harness.errors import ConfigError
from harness.rft.stats import Stats


class VllmEngine:
    name = "vllm"
    dtype = "auto (vllm)"

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

    def generate(self, prompts: list[str], n: int, temperature: float = 1.0, top_p: float = 1.0,
                 greedy: bool = False, seed=0, on_done: Optional[Callable] = None) -> list[list[str]]:
        params = self.vllm.SamplingParams(n=n, temperature=0.0 if greedy else temperature, top_p=top_p,
                                          max_tokens=self.max_new_tokens, stop=self.stop or None,
                                          seed=seed(0, 0) if callable(seed) else seed)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params)
        self.stats.seconds += time.perf_counter() - t0
        results = []
        for i, o in enumerate(outs):
            texts = [c.text.strip() for c in o.outputs]
            self.stats.sequences += len(texts)
            self.stats.tokens += sum(len(c.token_ids) for c in o.outputs)
            results.append(texts)
            if on_done is not None:
                on_done(i, texts)
        return results
