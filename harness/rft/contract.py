"""What every generation engine takes and gives: prompt ids in, completions (token ids) out; text is the caller's.

    python -c "from harness.rft.contract import Engine; help(Engine)"

The continuous engine (engine.py), the static one and model.generate (sampling.py), transformers' continuous
batching (hf_engine.py) and vLLM (vllm_engine.py) share `Engine`: `generate(prompts, n, sampling, on_done)` takes each
prompt as the token ids the caller encoded (`encode`: the chat template's text, no special tokens added, once) and
returns n `Completion`s per prompt, grouped by prompt in sample order; a caller that wants text decodes it
(`text`: without the ending ids). A caller that trains on the sampled tokens (loss.mode=rl) reads them from the
completions, and hands the engine the model to run for a while with `serving(model)` (the weights gathered for the
generation, a LoRA model's base module), never setting the engine's model or cache itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol, Union

from harness.rft.stats import Stats

Seed = Union[int, Callable[[int, int], object]]  # an int, or seed(i, j): the seed of sample j of prompt i


@dataclass(frozen=True)
class Sampling:
    """How a call samples: temperature and top-p (rft.temperature, rft.top_p), greedy (argmax; the others unused),
    `seed` (an int: sample j of prompt i seeded from (seed, i, j); or a callable seed(i, j)). rft.top_k and
    rft.min_p are the engine's (every sampled draw of a run warps with them)."""

    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    seed: Seed = 0


GREEDY = Sampling(greedy=True)


@dataclass(frozen=True)
class Completion:
    """One sampled answer: its token ids as drawn (an ending EOS kept; cut after a stop string's last token) and,
    where the engine computes them, their log-probs (None otherwise)."""

    ids: tuple[int, ...]
    logprobs: Optional[tuple[float, ...]] = None


OnDone = Callable[[int, list[Completion]], None]  # on_done(i, prompt i's n completions), as soon as they have ended


class Engine(Protocol):
    """The face of every generation engine (see the module docstring)."""

    name: str
    stats: Stats

    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling = Sampling(),
                 on_done: Optional[OnDone] = None) -> list[list[Completion]]:
        """n completions per prompt (token ids in), grouped by prompt in sample order; `on_done(i, completions)` as
        soon as prompt i's have all ended (a resumable writer appends its record there)."""

    def serving(self, model) -> contextlib.AbstractContextManager:
        """Within: the engine runs `model` (another object with the same weights' layout: loss.mode=rl's gathered
        weights, train.eval_prompts' model as it is now); what the engine holds for its calls (its KV cache, where
        nothing compiled reads it in place) is freed on leaving."""


def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Prompt texts as the ids an engine takes: the chat template writes bos where it wants one, so no special
    tokens are added."""
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def text(tokenizer, completion: Completion, eos) -> str:
    """A completion's text: its ids less the ending ones (`eos`: stats.eos_ids), special tokens skipped, stripped."""
    return tokenizer.decode([t for t in completion.ids if t not in eos], skip_special_tokens=True).strip()


def texts(tokenizer, groups: list[list[Completion]], eos) -> list[list[str]]:
    """Every prompt's completions as text (`text`), grouped as given."""
    eos = set(eos)
    return [[text(tokenizer, c, eos) for c in group] for group in groups]


@contextlib.contextmanager
def holding(engine, model) -> Iterator[None]:
    """`serving` for an engine whose model is a plain attribute (static, transformers): `model` is run within,
    the engine's own model again after."""
    was, engine.model = engine.model, model
    try:
        yield
    finally:
        engine.model = was
