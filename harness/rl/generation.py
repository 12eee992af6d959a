"""loss.mode=rl's questions and their answers: the task's prompts encoded once (`Prompts`), and the continuous engine
that answers them from the current weights (`Generation`), with its sampling settings as one value (`SamplingSettings`).

    python -c "from harness.rl.generation import Generation; help(Generation)"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from harness.distributed.zero import gathered_for_generation
from harness.errors import HarnessError
from harness.rft.contract import Completion, Sampling, encode
from harness.rft.engine import ContinuousEngine, compile_default, servable
from harness.rft.tasks import Question, Task, check_context, prompt_text


@dataclass(frozen=True)
class SamplingSettings:
    """How a run samples its answers (the rft section's keys, read once where the mode is built): each call's
    temperature, top-p and seed, the engine's top-k, min-p, stop strings, answer length, slots, KV budget, compile."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 256
    seed: int = 0
    stop_strings: tuple = ()
    compile: Any = "auto"
    micro_batch_sequences: int = 64
    kv_cache_gb: Optional[float] = None

    @classmethod
    def of(cls, rft) -> "SamplingSettings":
        """From cfg.rft."""
        return cls(temperature=rft.temperature, top_p=rft.top_p, top_k=rft.top_k, min_p=rft.min_p,
                   max_new_tokens=rft.max_new_tokens, seed=rft.seed, stop_strings=tuple(rft.stop_strings),
                   compile=rft.compile, micro_batch_sequences=rft.micro_batch_sequences, kv_cache_gb=rft.kv_cache_gb)

    def call(self, seed) -> Sampling:
        """A sampled call's settings, `seed(i, j)` the seed of answer j to prompt i."""
        return Sampling(self.temperature, self.top_p, seed=seed)


def served(model):
    """What the engine runs: a peft model's base module (its LoRA layers injected, adapters active), else the model."""
    return model.get_base_model() if hasattr(model, "disable_adapter") and hasattr(model, "get_base_model") else model


class Prompts:
    """The task's train and test questions, each prompt written in the model's chat template and encoded once (the
    engine's ids and the training rows' prompt: nothing is tokenized again)."""

    def __init__(self, task: Task, tokenizer, say) -> None:
        self.task, self.tok = task, tokenizer
        self.train = task.split("train")
        # the test split read now, not after the last step: a bad rft.test_file is one line before any training
        self.test = None if getattr(task, "files", {}).get("test", "") is None else task.split("test")
        if self.test is None:
            say("[harness] rl: the JSONL task has no rft.test_file: no eval_accuracy in this run")
        every = [*self.train, *(self.test or [])]
        self._ids = dict(zip((id(q) for q in every), encode(tokenizer, [self.text(q) for q in every])))

    def text(self, q: Question) -> str:
        """The question in the model's chat template, ending where the answer starts (as `rft generate` asks)."""
        return prompt_text(self.task, q, self.tok)

    def ids(self, questions: list[Question]) -> list[list[int]]:
        return [self._ids[id(q)] for q in questions]

    def check_context(self, config, max_new_tokens: int) -> None:
        """Every prompt and its answer within the model's context (before step 1)."""
        lengths = {q.qid: len(self._ids[id(q)]) for q in [*self.train, *(self.test or [])]}
        check_context(lengths, max_new_tokens,
                      getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None))


class Generation:
    """The continuous engine that answers a run's questions from the current weights: one call per generation batch,
    its cache sized for this process's answers of the batch (`slots`), compiled when rft.compile says so (not under
    ZeRO-3: the gathered weights move between batches, where CUDA graphs read them in place; not with bitsandbytes'
    layers); ZeRO-3's weights gathered for the call as TRL does; a LoRA model's base module served, its LoRA layers in
    place (the adapted model, no merged copy)."""

    def __init__(self, sampling: SamplingSettings, slots: int, parts) -> None:
        """`parts`: the build's harness.objective.Parts (the accelerator, the prepared model, the tokenizer, the ZeRO
        stage, say)."""
        self.sampling, self.accelerator, self.model = sampling, parts.accelerator, parts.model
        self.zero_stage = parts.zero_stage
        unwrapped = parts.accelerator.unwrap_model(parts.model, keep_torch_compile=False)
        self.peft = hasattr(unwrapped, "disable_adapter") and hasattr(unwrapped, "get_base_model")
        why = servable(served(unwrapped))
        quantized = why == "a quantized model" and self.peft  # bitsandbytes' quantized layers run eagerly
        if why is not None and not quantized:
            raise HarnessError(f"loss.mode=rl generates with the continuous engine, which cannot serve {why}")
        compiled = compile_default(sampling.compile, unwrapped) and self.zero_stage != 3 and not quantized
        if compile_default(sampling.compile, unwrapped) and self.zero_stage == 3:
            parts.say("[harness] rl: rft.compile is off under ZeRO-3 (the gathered weights move between generations)")
        self.engine = ContinuousEngine(served(unwrapped), parts.tokenizer, sampling.max_new_tokens,
                                       min(sampling.micro_batch_sequences, slots), sampling.kv_cache_gb,
                                       sampling.stop_strings, parts.say, compile=compiled, top_k=sampling.top_k,
                                       min_p=sampling.min_p)

    def answer(self, prompts: list[list[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        """n completions to each prompt (ids) from the current weights, the model in eval mode for the call. Every
        process calls it, with prompts or without (ZeRO-3's gathering is collective)."""
        with gathered_for_generation(self.accelerator, self.model, self.zero_stage) as model:
            was = model.training
            model.eval()
            with self.engine.serving(served(model)):  # (its eager KV cache freed after, for the training pass)
                got = self.engine.generate(prompts, n, sampling) if prompts else []
            model.train(was)
        return got
