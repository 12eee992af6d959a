"""A toy calculator environment for multi-turn GRPO (docs/agents.md; configs/agent-tiny.yaml): tools add, mul and
submit; a question is a sum, a product of a sum, or a product of two sums (episodes of 2, 3 or 4 tool calls); the
reward (get_reward) is 1 when the submitted answer is right, else 0.

    python -m harness.rl.calculator --prompts data/agents/calculator.jsonl --transcripts data/agents/calculator-sft.jsonl
"""

from __future__ import annotations

import argparse
import json
import random


class Calculator:
    """TRL's environment convention: reset(**record columns) starts an episode, the public methods are the tools,
    get_reward() scores it."""

    def reset(self, answer: float, **_) -> None:
        self.answer, self.submitted = float(answer), None
        return None

    def add(self, a: float, b: float) -> float:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return _num(a + b)

    def mul(self, a: float, b: float) -> float:
        """Multiply two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return _num(a * b)

    def submit(self, answer: float) -> str:
        """Submit the final answer; the episode's reward is 1 when it is right.

        Args:
            answer: The answer.
        """
        self.submitted = float(answer)
        return "submitted"

    def get_reward(self) -> float:
        return 1.0 if self.submitted is not None and abs(self.submitted - self.answer) < 1e-6 else 0.0


def _num(x: float):
    return int(x) if float(x).is_integer() else x


def question(rng: random.Random, high: int = 9) -> tuple[str, float, list[tuple[str, dict]]]:
    """(the question, its answer, the tool calls that solve it: 2 to 4 with submit)."""
    a, b, c, d = (rng.randint(0, high) for _ in range(4))
    kind = rng.randrange(3)
    if kind == 0:
        return f"What is {a} + {b}?", a + b, [("add", {"a": a, "b": b}), ("submit", {"answer": a + b})]
    if kind == 1:
        return (f"What is ({a} + {b}) * {c}?", (a + b) * c,
                [("add", {"a": a, "b": b}), ("mul", {"a": a + b, "b": c}), ("submit", {"answer": (a + b) * c})])
    return (f"What is ({a} + {b}) * ({c} + {d})?", (a + b) * (c + d),
            [("add", {"a": a, "b": b}), ("add", {"a": c, "b": d}), ("mul", {"a": a + b, "b": c + d}),
             ("submit", {"answer": (a + b) * (c + d)})])


def records(n: int, seed: int = 0) -> list[dict]:
    """rl.prompts records: {prompt, answer}."""
    rng = random.Random(seed)
    return [{"prompt": q, "answer": ans} for q, ans, _ in (question(rng) for _ in range(n))]


def transcript(q: str, calls: list[tuple[str, dict]]) -> list[dict]:
    """A solved episode as chat messages with tool calls and tool results (SFT data for the warm-up)."""
    env, messages = Calculator(), [{"role": "user", "content": q}]
    env.reset(answer=0)
    for name, args in calls:
        messages.append({"role": "assistant", "content": "",
                         "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]})
        messages.append({"role": "tool", "name": name, "content": str(getattr(env, name)(**args))})
    messages.append({"role": "assistant", "content": "Done."})
    return messages


def tools() -> list[dict]:
    """The tools' JSON schemas, as rl.environment offers them."""
    from transformers.utils import get_json_schema

    env = Calculator()
    return [get_json_schema(getattr(env, name)) for name in ("add", "mul", "submit")]


def transcripts(n: int, seed: int = 1) -> list[dict]:
    """SFT chat records {messages, tools} of solved episodes (other questions than `records`' by the seed)."""
    rng, offered = random.Random(seed), tools()
    return [{"messages": transcript(q, calls), "tools": offered} for q, _, calls in (question(rng) for _ in range(n))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", help="write rl.prompts records (JSONL) here")
    ap.add_argument("--transcripts", help="write solved episodes as SFT chat records (JSONL) here")
    ap.add_argument("-n", type=int, default=200)
    args = ap.parse_args()
    for path, rows in ((args.prompts, records(args.n)), (args.transcripts, transcripts(args.n))):
        if path:
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
