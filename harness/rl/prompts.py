"""Prompt data and reward functions of loss.mode=rl (docs/rl.md): `rl.prompts` and `rl.rewards`.

`rl.prompts` is a data list as data.train_files takes it (JSONL, parquet, CSV, a saved or hub data set; `columns`
renames): one `prompt` per record, a string (one user message) or chat messages, put through the model's chat
template; every other column is handed to the reward functions. Without it the prompts are the rft task's questions.

`rl.rewards` is a list of {function: module:name | verifier, weight} called as TRL calls its reward functions:
fn(prompts=[...], completions=[...], completion_ids=[...], **columns) -> list[float | None], one call per function
and generation batch (each process its own answers); None is "no score from this function" (TRL's NaN: left out of
its mean and of the weighted sum). Each function is logged as reward/<name> and reward/<name>_std, the weighted sum
as reward. `rl.reward` (one function of (question, text), or the verifier) is the one-function form of before.

    python -c "from harness.rl.prompts import Rewards; help(Rewards)"
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from harness.config import objects
from harness.config.checks import parse_rewards
from harness.data import formats, sources
from harness.errors import ConfigError, DataError, HarnessError, one_line
from harness.rft.tasks import Question, Task, build_task, verify



@dataclass(frozen=True)
class Prompt:
    """One record of rl.prompts: `prompt` as given (a string or messages), the other columns, where it was read."""

    qid: str
    prompt: Any
    columns: dict = field(default_factory=dict, hash=False, compare=False)


def _short(value: Any, limit: int) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _prompt(value: Any, where: str) -> Any:
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise DataError(f"{where}: field 'prompt' must be a non-empty string or a list of {{role, content}} messages, "
                    f"got {_short(value, 80)}")


class PromptTask(Task):
    """The records of rl.prompts (or distill.prompts) as a task: split('train') all of them, no test split (no
    evaluation); the verifier reads a numeric `answer` column."""

    name = "prompts"

    def __init__(self, entries, cache_dir: Optional[str] = None, tolerance: float = 1e-6,
                 key: str = "rl.prompts") -> None:
        """`key`: the config key the sources are (rl.prompts, distill.prompts), named by their errors."""
        super().__init__(tolerance)
        self.records: list[Prompt] = []
        for src in sources.parse_sources(entries, key):
            if src.weight is not None or src.format is not None:
                raise ConfigError(f"config key '{key}': {src.path}: 'weight' and 'format' are not read here "
                                  f"(every record is one prompt)")
            for unit in sources.source_units(src, key, cache_dir)[0]:
                try:
                    for origin, obj in unit.records():
                        obj = formats.apply_columns(obj, src.columns, origin)
                        if "prompt" not in obj:
                            raise DataError(f"{origin}: no field 'prompt' (keys: {', '.join(obj) or 'none'}; "
                                            f"`columns: {{prompt: <column>}}` renames one)")
                        cols = {k: v for k, v in obj.items() if k != "prompt"}
                        self.records.append(Prompt(origin, _prompt(obj["prompt"], origin), cols))
                except DataError as e:
                    raise unit.explain(e) from None
        if not self.records:
            raise DataError(f"{key}: no records")

    def split(self, name: str) -> list:
        return self.records if name == "train" else []

    def messages(self, q: Prompt) -> list[dict]:
        return q.prompt if isinstance(q.prompt, list) else [{"role": "user", "content": q.prompt}]

    def verify(self, text: str, q: Prompt) -> bool:
        answer = q.columns.get("answer")
        if isinstance(answer, bool) or not isinstance(answer, (int, float)):
            raise HarnessError(f"{q.qid}: the verifier reward reads a numeric column 'answer', got "
                               f"{_short(answer, 60)}")
        return verify(text, float(answer), self.tolerance)


def verifier_reward(task: Task) -> Callable[[Question, str], float]:
    return lambda q, text: 1.0 if task.verify(text, q) else 0.0


def load_reward(spec: str, task: Task) -> Callable[[Question, str], float]:
    """rl.reward (`spec`): 'verifier' (the task's: 1 for a verified answer, 0 otherwise) or 'module:function', called
    as fn(question, answer_text) -> float; checked once on the first train question before any step."""
    if spec == "verifier":
        fn = verifier_reward(task)
    else:
        fn = _load(spec, "rl.reward")
    q = task.split("train")[0]
    score(fn, spec, q, "The answer is 0.")
    return fn


def score(fn, spec: str, q: Question, text: str) -> float:
    """One reward as a float; a function that raises or returns no finite number stops the run in one line."""
    try:
        value = float(fn(q, text))
    except Exception as e:  # noqa: BLE001 - any failure of a user's function is one line naming it
        raise HarnessError(f"config key 'rl.reward': {spec} raised {one_line(e, 200)} "
                           f"(question {q.qid})") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise HarnessError(f"config key 'rl.reward': {spec} returned {value} for question {q.qid}")
    return value


def rl_task(rl, rft, cache_dir: Optional[str] = None) -> Task:
    """The prompts of loss.mode=rl: rl.prompts when given, else the rft task (`rl`, `rft`: cfg.rl, cfg.rft)."""
    return PromptTask(rl.prompts, cache_dir, rft.tolerance) if rl.prompts else build_task(rft)


def _load(spec: str, key: str) -> Callable:
    fn = objects.load(spec, key)
    if not callable(fn):
        raise ConfigError(f"config key '{key}': {spec!r} is a {type(fn).__name__}, not a function")
    return fn


NO_SCORE_BATCHES = 3  # generation batches without one score, from the start, that stop a run (Rewards)


class Rewards:
    """The rewards of a generation batch: `score(questions, texts, ids)` -> (weighted sum [answers], each function's
    [answers, functions], NaN where it gave None). `names`: each function's logged name (empty for rl.reward)."""

    def __init__(self, rl, task: Task, env_name: Optional[str] = None) -> None:
        """`env_name`: the environment's reward (get_reward(), weight 1) as logged, one more function (None: none);
        with it and no rl.rewards, the environment's is the only reward."""
        self.task, self.env_name = task, env_name
        if rl.rewards and rl.reward != "verifier":
            raise ConfigError("config key 'rl.reward': give the reward functions in rl.rewards (a list) or one in "
                              "rl.reward, not both")
        self.legacy = not rl.rewards and not env_name
        if self.legacy:
            self.fns = [(rl.reward, "reward", 1.0, load_reward(rl.reward, task))]
            self.names: list[str] = []
            return
        self.fns = [(spec, name, w, self._verifier if spec == "verifier" else _load(spec, f"rl.rewards[{i}].function"))
                    for i, (spec, name, w) in enumerate(parse_rewards(rl.rewards))]
        self.names = [name for _, name, _, _ in self.fns] + ([env_name] if env_name else [])

    def _verifier(self, prompts, completions, questions, **_) -> list[float]:
        return [1.0 if self.task.verify(c if isinstance(c, str) else c[0]["content"], q) else 0.0
                for c, q in zip(completions, questions)]

    def score(self, questions: list, texts: list[str], ids: list[list[int]],
              env: Optional[list[float]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`questions` one per answer (repeated per answer of a group), `texts` and `ids` the answers; `env` the
        environment's reward of each (NaN: none), the last column."""
        if self.legacy:
            spec, _, _, fn = self.fns[0]
            r = torch.tensor([score(fn, spec, q, t) for q, t in zip(questions, texts)], dtype=torch.float64)
            return r, r[:, None]
        prompts = [q.prompt if isinstance(q, Prompt) else q.question for q in questions]
        chat = [isinstance(p, list) for p in prompts]
        completions = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)]
        names = sorted({k for q in questions if isinstance(q, Prompt) for k in q.columns})
        columns = {k: [q.columns.get(k) if isinstance(q, Prompt) else None for q in questions] for k in names}
        if not any(isinstance(q, Prompt) for q in questions):  # the rft task: its reference answer as a column
            columns = {"answer": [q.answer for q in questions]}
        per = torch.full((len(texts), len(self.names)), float("nan"), dtype=torch.float64)
        if self.env_name:
            per[:, -1] = torch.tensor(env, dtype=torch.float64)
        for j, (spec, name, _, fn) in enumerate(self.fns):
            kw = {**columns, "questions": questions} if spec == "verifier" else columns
            per[:, j] = torch.tensor(self._call(fn, spec, j, prompts, completions, ids, kw), dtype=torch.float64)
        weights = torch.tensor([w for _, _, w, _ in self.fns] + [1.0] * bool(self.env_name), dtype=torch.float64)
        weighted = torch.nansum(per * weights, dim=1)
        weighted[torch.isnan(per).all(1)] = float("nan")  # no function scored it: out of its group's baseline (TRL)
        self._none_scored(bool(torch.isnan(per).all()))
        return weighted, per

    def _none_scored(self, none: bool) -> None:
        """A generation batch no function scored (every value None: a column-name mistake trains nothing at full
        price): said once, with the functions' names; NO_SCORE_BATCHES of them before any score stops the run."""
        self.scored = getattr(self, "scored", False) or not none
        self.unscored = getattr(self, "unscored", 0) + none
        names = ", ".join(spec for spec, _, _, _ in self.fns)
        if none and not self.scored and self.unscored >= NO_SCORE_BATCHES:
            raise HarnessError(f"config key 'rl.rewards': {names} scored none of the answers (every value None) of "
                               f"{self.unscored} generation batches: nothing trains; check the columns they read")
        if none and self.unscored == 1:
            print(f"[harness] warning: rl.rewards: {names} scored none of this generation batch's answers (every "
                  f"value None): its answers train nothing", flush=True)

    @staticmethod
    def _call(fn, spec: str, j: int, prompts, completions, ids, columns: dict) -> list[float]:
        where = f"config key 'rl.rewards[{j}]': {spec}"
        try:
            out = fn(prompts=prompts, completions=completions, completion_ids=ids, **columns)
        except Exception as e:  # noqa: BLE001 - any failure of a user's function is one line naming it
            raise HarnessError(f"{where} raised {one_line(e, 200)}") from None
        if isinstance(out, torch.Tensor):
            out = out.tolist()
        if not isinstance(out, (list, tuple)) or len(out) != len(completions):
            got = f"{len(out)} values" if isinstance(out, (list, tuple)) else f"a {type(out).__name__}"
            raise HarnessError(f"{where} returned {got} for {len(completions)} completions (one float or None each)")
        values = []
        for k, v in enumerate(out):
            if v is None:
                values.append(float("nan"))
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                values.append(float(v))
            else:
                raise HarnessError(f"{where} returned {_short(v, 60)} ({type(v).__name__}) for completion "
                                   f"{k}: a finite float or None is needed")
        return values


def function_sums(per: torch.Tensor) -> list[float]:
    """[sum, sum of squares, count] of each function's scores (None left out): what the log line averages."""
    out = []
    for j in range(per.shape[1]):
        col = per[:, j][~torch.isnan(per[:, j])]
        out += [float(col.sum()), float((col ** 2).sum()), float(col.numel())]
    return out


def function_figures(names: list[str], sums: list[float]) -> dict:
    """{reward/<name>: mean, reward/<name>_std: std} from function_sums summed over processes and steps."""
    out = {}
    for j, name in enumerate(names):
        s, sq, n = sums[3 * j:3 * j + 3]
        mean = s / n if n else float("nan")
        out[f"reward/{name}"] = mean
        out[f"reward/{name}_std"] = max(sq / n - mean * mean, 0.0) ** 0.5 if n else float("nan")
    return out
