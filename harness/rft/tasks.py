"""RFT tasks: questions with numeric answers, the prompt, answer extraction and a tolerant verifier.

A task gives each split as a list of `Question(qid, question, answer)`; a model's response is right when the number
after its last "The answer is" equals the reference within the tolerance. Two tasks ship:

  * `ArithmeticTask`: generated sums, differences, products and unit conversions ("What is 17 + 25?",
    "How many centimetres are in 3 metres?"), split into disjoint seeded sft / train / test sets;
  * `JsonlTask`: any JSONL file of {"question": str, "answer": number} (held-out file for the test split).

    python -c "from harness.rft.tasks import ArithmeticTask; t = ArithmeticTask(); print(t.split('test')[:3])"
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from harness.data.readers import text_lines
from harness.errors import ConfigError, DataError

ANSWER_RE = re.compile(r"answer is\s*:?\s*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)


@dataclass(frozen=True)
class Question:
    qid: str  # stable id: what a restarted generation run checks off
    question: str
    answer: float


def extract_answer(text: str) -> Optional[float]:
    """The number after the last 'The answer is' in `text`, or None when the response gives no answer."""
    found = ANSWER_RE.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def verify(text: str, reference: float, tolerance: float = 1e-6) -> bool:
    """True when the response's answer equals `reference` within tolerance * max(1, |reference|)."""
    got = extract_answer(text)
    return got is not None and math.isfinite(got) and abs(got - reference) <= tolerance * max(1.0, abs(reference))


def format_number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


class Task:
    """Questions per split, the chat prompt of a question, and the verifier."""

    name = "task"

    def __init__(self, tolerance: float = 1e-6) -> None:
        self.tolerance = tolerance

    def split(self, name: str) -> list[Question]:
        raise NotImplementedError

    def messages(self, q: Question) -> list[dict]:
        """The prompt as chat messages (the harness's chat layout turns it into `<|user|>\\n...\\n<|assistant|>\\n`)."""
        return [{"role": "user", "content": q.question}]

    def extract(self, text: str) -> Optional[float]:
        return extract_answer(text)

    def verify(self, text: str, q: Question) -> bool:
        return verify(text, q.answer, self.tolerance)


UNITS = [  # (from, to, factor)
    ("metres", "centimetres", 100), ("kilometres", "metres", 1000), ("kilograms", "grams", 1000),
    ("hours", "minutes", 60), ("minutes", "seconds", 60), ("days", "hours", 24), ("weeks", "days", 7),
    ("litres", "millilitres", 1000), ("dozens", "items", 12),
]


SUM = ["What is {a} + {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?"]
DIFFERENCE = ["What is {a} - {b}?", "Subtract {b} from {a}.", "What is {a} minus {b}?"]
PRODUCT = ["What is {a} times {b}?", "Multiply {a} by {b}.", "What is the product of {a} and {b}?"]
CONVERSION = ["How many {to} are in {n} {frm}?", "Convert {n} {frm} to {to}.", "{n} {frm} is how many {to}?"]


class ArithmeticTask(Task):
    """Generated arithmetic and unit conversions with worked answers ("17 + 25 = 42. The answer is 42.").

    Each fact (a sum, difference, product or conversion with operands in 0..max_operand) is asked in three
    wordings ("What is 3 + 5?", "Add 3 and 5.", "What is the sum of 3 and 5?"). All questions are shuffled with
    `seed` and cut into disjoint splits:
    test (first n_test), train (next n_train), sft (next n_sft)."""

    name = "arithmetic"

    def __init__(self, n_train: int = 200, n_test: int = 100, n_sft: int = 300, max_operand: int = 20, seed: int = 0,
                 tolerance: float = 1e-6) -> None:
        super().__init__(tolerance)
        facts = []  # (answer, worked step, question templates, operands)
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                facts.append((a + b, f"{a} + {b} = {a + b}.", SUM, a, b))
                if a >= b:
                    facts.append((a - b, f"{a} - {b} = {a - b}.", DIFFERENCE, a, b))
                if a <= 12 and b <= 12:
                    facts.append((a * b, f"{a} x {b} = {a * b}.", PRODUCT, a, b))
        for frm, to, factor in UNITS:
            for n in range(1, max_operand + 1):
                facts.append((n * factor, f"1 {frm[:-1]} is {factor} {to}, so {n} {frm} are {n} x {factor} = "
                                          f"{n * factor} {to}.", [t.replace("{frm}", frm).replace("{to}", to)
                                                                  for t in CONVERSION], n, 0))
        pool = []  # every wording of every fact is its own question: the splits share facts, not questions
        for ans, work, templates, a, b in facts:
            for t in templates:
                pool.append((t.format(a=a, b=b, n=a), ans, work))
        random.Random(seed).shuffle(pool)
        need = n_train + n_test + n_sft
        if need > len(pool):
            raise ConfigError(f"config key 'rft.max_operand': {max_operand} gives {len(pool)} distinct questions, "
                              f"fewer than the {need} asked for by the splits")
        cuts = {"test": (0, n_test), "train": (n_test, n_test + n_train), "sft": (n_test + n_train, need)}
        self._splits, self._worked = {}, {}
        for name, (lo, hi) in cuts.items():
            qs = []
            for i in range(lo, hi):
                text, ans, work = pool[i]
                q = Question(f"{name}-{i - lo}", text, float(ans))
                self._worked[q.qid] = f"{work} The answer is {format_number(ans)}."
                qs.append(q)
            self._splits[name] = qs

    def split(self, name: str) -> list[Question]:
        if name not in self._splits:
            raise ConfigError(f"arithmetic task: no split '{name}' (sft, train, test)")
        return self._splits[name]

    def worked_answer(self, q: Question) -> str:
        return self._worked[q.qid]

    def sft_records(self) -> list[dict]:
        """Chat records with worked answers for the supervised warm-up (the sft split)."""
        return [{"messages": self.messages(q) + [{"role": "assistant", "content": self.worked_answer(q)}]}
                for q in self.split("sft")]


class JsonlTask(Task):
    """Questions from JSONL files of {"question": str, "answer": number}; `train_file` feeds `rft generate`,
    `test_file` `rft test`."""

    name = "jsonl"

    def __init__(self, train_file: str, test_file: Optional[str] = None, tolerance: float = 1e-6) -> None:
        super().__init__(tolerance)
        self.files = {"train": train_file, "test": test_file}

    def split(self, name: str) -> list[Question]:
        path = self.files.get(name)
        if path is None:
            raise ConfigError(f"config key 'rft.test_file': the JSONL task has no '{name}' split; set rft.test_file")
        return read_questions(path, name)


def read_questions(path: str, prefix: str) -> list[Question]:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{path}: no such file")
    out = []
    for n, line in text_lines(str(p)):  # (a byte that is not UTF-8: named by line and column, as every reader)
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected an object with 'question' and 'answer'")
        q, a = obj.get("question"), obj.get("answer")
        if not isinstance(q, str) or not q.strip():
            raise DataError(f"{where}: field 'question' must be a non-empty string")
        if isinstance(a, str):
            try:
                a = float(a.replace(",", ""))
            except ValueError:
                raise DataError(f"{where}: field 'answer' must be a number, got {obj.get('answer')!r}") from None
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a):
            raise DataError(f"{where}: field 'answer' must be a number, got {obj.get('answer')!r}")
        out.append(Question(str(obj.get("id", f"{prefix}-{n}")), q, float(a)))
    if not out:
        raise DataError(f"{path}: no questions")
    if len({q.qid for q in out}) != len(out):
        raise DataError(f"{path}: question ids are not unique")
    return out




def check_context(lengths: dict, max_new_tokens: int, context: Optional[int]) -> None:
    """Before any sampling: every prompt (`lengths`: {qid: prompt tokens}) and rft.max_new_tokens answer tokens fit
    the model's context (`context`: its max_position_embeddings; None: unknown, not checked). Past it the positions
    have no trained embedding (or none at all): the answers would be sampled, scored and trained on silently."""
    if not context:
        return
    if max_new_tokens >= context:
        raise ConfigError(f"config key 'rft.max_new_tokens': {max_new_tokens} answer tokens do not fit the model's "
                          f"context of {context} positions (max_position_embeddings) after a prompt; lower it")
    qid, longest = max(lengths.items(), key=lambda kv: kv[1], default=(None, 0))
    if longest >= context:  # no answer token fits after it, whatever rft.max_new_tokens
        raise DataError(f"question {qid}'s prompt has {longest} tokens, the model's whole context of {context} "
                        f"positions (max_position_embeddings) or more, before any answer token: shorten the "
                        f"question, or use a model with a longer context")
    if longest + max_new_tokens > context:
        raise ConfigError(f"config key 'rft.max_new_tokens': question {qid}'s prompt has {longest} tokens, and with "
                          f"{max_new_tokens} answer tokens it exceeds the model's context of {context} positions "
                          f"(max_position_embeddings); lower rft.max_new_tokens to {context - longest} or less, or "
                          f"shorten the question")


def build_task(rft) -> Task:
    """The task named by the config section `rft` (harness.config.RftConfig)."""
    if rft.task == "arithmetic":
        return ArithmeticTask(rft.num_train_questions, rft.num_test_questions, rft.num_sft_questions,
                              rft.max_operand, rft.task_seed, rft.tolerance)
    if rft.task.endswith(".jsonl") or Path(rft.task).is_file():
        return JsonlTask(rft.task, rft.test_file, rft.tolerance)
    raise ConfigError(f"config key 'rft.task': expected 'arithmetic' or a JSONL file, got {rft.task!r}")


def prompt_text(task: Task, q: Question, tokenizer) -> str:
    """The question in the model's chat template (the one it was trained with, saved with its tokenizer), ending
    where the assistant's answer starts; bos included when the template writes it."""
    return tokenizer.apply_chat_template(task.messages(q), add_generation_prompt=True, tokenize=False)
