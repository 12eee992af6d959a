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
