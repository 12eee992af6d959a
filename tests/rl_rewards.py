"""Reward functions for tests/test_rl.py's runs (rl.reward=rl_rewards:NAME, tests/ on PYTHONPATH)."""


def digits(question, text: str) -> float:
    """A reward that varies among a random model's answers: the share of digits in the text."""
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def raises(question, text: str) -> float:
    raise ValueError("no score for this answer")


def raises_on_rank_1(question, text: str) -> float:
    """Fails on process 1 only, on a sampled answer (the start-up check's "The answer is 0." passes)."""
    import os

    if os.environ.get("RANK") == "1" and text != "The answer is 0.":
        raise ValueError("no score on process 1")
    return digits(question, text)


# TRL's signature (rl.rewards): fn(prompts, completions, **columns) -> list[float | None]; a chat prompt's completion
# is [{"role": "assistant", "content": text}] (TRL's conversational format)
def _text(c) -> str:
    return c[0]["content"] if isinstance(c, list) else c


def length_share(prompts, completions, **_) -> list[float]:
    """The answer's length in characters / 40 (varies among a random model's answers)."""
    return [len(_text(c)) / 40 for c in completions]


def target_digit(prompts, completions, target, **_) -> list:
    """Reads the prompt file's extra column `target`: 1 when the answer holds that digit; None for a record without
    one (no score from this function)."""
    return [None if t is None else float(str(t) in _text(c)) for c, t in zip(completions, target)]


def wrong_count(prompts, completions, **_) -> list[float]:
    return [0.0] * (len(completions) - 1)


def a_string(prompts, completions, **_) -> list:
    return ["high"] * len(completions)


def fails(prompts, completions, **_) -> list:
    raise RuntimeError("reward server down")


def a_nan(prompts, completions, **_) -> list:
    return [float("nan")] * len(completions)


def never_scores(prompts, completions, **_) -> list:
    """A column-name mistake: the column it reads is never there, so every value is None."""
    return [None] * len(completions)
