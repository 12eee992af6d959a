"""Reward functions for tests/test_rl.py's runs (rl.reward=rl_rewards:NAME, tests/ on PYTHONPATH)."""


def digits(question, text: str) -> float:
    """A reward that varies among a random model's answers: the share of digits in the text."""
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def raises(question, text: str) -> float:
    raise ValueError("no score for this answer")
