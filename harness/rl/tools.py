"""Tools and environments of multi-turn loss.mode=rl (docs/agents.md), TRL's convention: `rl.tools` (type-hinted,
docstringed functions) and `rl.environment` (a class, or {name: class} chosen by each record's `environment` column:
one instance per episode, `reset(**record columns)` -> None or text appended to the last message, its public
methods the tools, `get_reward()` one more reward). What is text here: the tool calls of a sampled turn, parsed from
its decoded text (the sampled ids themselves are never re-encoded), and the tool results, rendered as the chat
template renders a `tool` message and encoded alone (`Toolbox.result_ids`).

    python -c "from harness.rl.tools import Toolbox; help(Toolbox)"
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from harness.config import objects
from harness.errors import ConfigError, HarnessError, one_line

HOOKS = ("reset", "get_reward")  # an environment's methods that are not tools
CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)  # the shipped template's (and Qwen's, Hermes') form


@dataclass(frozen=True)
class Call:
    """A parsed tool call: the tool's name and its arguments (a dict), or why the call could not be read."""

    name: str
    arguments: Any = None
    error: str = ""


def schema(fn: Callable, key: str) -> dict:
    """The tool's JSON schema (transformers' get_json_schema: what the chat template's `tools=` renders); a tool
    without type hints or a docstring is one line naming `key`."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - DocstringParsingException, TypeHintParsingException: one line
        raise ConfigError(f"config key '{key}': tool {getattr(fn, '__name__', fn)!r} cannot be offered to the model: "
                          f"{one_line(e, 200)} (a tool needs type hints and a docstring with an Args section)") from None


def env_tools(cls: type) -> list[str]:
    """An environment class's tools: its public methods but reset and get_reward."""
    return [n for n, v in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_") and n not in HOOKS]


def load_environments(spec, key: str = "rl.environment") -> dict[str, type]:
    """{name: class} of rl.environment (a spec: {class name: class})."""
    specs = spec if isinstance(spec, dict) else {None: spec}
    out = {}
    for name, s in specs.items():
        cls = objects.load(s, key if name is None else f"{key}.{name}")
        if not isinstance(cls, type) or not callable(getattr(cls, "reset", None)):
            raise ConfigError(f"config key '{key}': {s!r} is not a class with a reset() method (TRL's "
                              f"environment_factory convention)")
        out[cls.__name__ if name is None else str(name)] = cls
    return out


def parse_calls(text: str, tokenizer=None) -> list[Call]:
    """The tool calls of a turn's text: transformers' response parsing where the tokenizer has a response schema,
    else the <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks of the shipped template."""
    if tokenizer is not None and getattr(tokenizer, "response_schema", None):
        parsed = tokenizer.parse_response(text) or {}
        blocks = [c.get("function", c) for c in parsed.get("tool_calls") or []]
    else:
        blocks = []
        for raw in CALL_RE.findall(text):
            try:
                blocks.append(json.loads(raw))
            except ValueError:
                blocks.append(raw)
    calls = []
    for b in blocks:
        args = b.get("arguments", {}) if isinstance(b, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(b, dict) or not isinstance(b.get("name"), str) or not isinstance(args, dict):
            calls.append(Call("", None, f"malformed tool call {str(b)[:80]!r}"))
        else:
            calls.append(Call(b["name"], args))
    return calls


class Toolbox:
    """A run's tools: rl.tools' functions and the environment classes; `start(columns)` makes an episode's
    environment (fresh, reset) and `run(env, call)` runs a call; `result_ids(calls, results)` is what the template
    appends after a turn's tool calls (the tool messages and the next assistant header), encoded alone."""

    def __init__(self, rl, tokenizer) -> None:
        self.tok = tokenizer
        self.functions = {}
        for i, spec in enumerate(rl.tools):
            fn = objects.load(spec, f"rl.tools[{i}]")
            if not callable(fn):
                raise ConfigError(f"config key 'rl.tools[{i}]': {spec!r} is a {type(fn).__name__}, not a function")
            self.functions[fn.__name__] = fn
        self.environments = load_environments(rl.environment) if rl.environment else {}
        offered = [schema(fn, f"rl.tools[{i}]") for i, fn in enumerate(self.functions.values())]
        self.schemas = {None: offered} if not self.environments else {
            name: offered + [schema(getattr(cls(), t), f"rl.environment ({cls.__name__}.{t})") for t in env_tools(cls)]
            for name, cls in self.environments.items()}
        if not any(self.schemas.values()):
            raise ConfigError("config key 'rl.environment': no tools (rl.tools, or the environment's public methods)")
        self.check_template()

    @property
    def reward_name(self) -> Optional[str]:
        """The environment's reward as logged (reward/<name>): its class's name (`environment` for several), None
        when no environment has get_reward()."""
        if not any(callable(getattr(c, "get_reward", None)) for c in self.environments.values()):
            return None
        return next(iter(self.environments.values())).__name__ if len(self.environments) == 1 else "environment"

    def pick(self, columns: dict) -> Optional[str]:
        """The environment a record names (its `environment` column), the only one, or None without any."""
        if not self.environments:
            return None
        if len(self.environments) == 1 and "environment" not in columns:
            return next(iter(self.environments))
        name = columns.get("environment")
        if name not in self.environments:
            raise HarnessError(f"config key 'rl.environment': a record names environment {name!r}, which is not one "
                               f"of {', '.join(map(str, self.environments))}")
        return name

    def start(self, columns: dict) -> tuple[Any, Optional[str]]:
        """(a fresh environment reset with the record's columns (None without rl.environment), reset's text)."""
        name = self.pick(columns)
        if name is None:
            return None, None
        cls = self.environments[name]
        env = cls()
        kw = {k: v for k, v in columns.items() if k != "environment"}
        try:
            text = env.reset(**kw)
        except Exception as e:  # noqa: BLE001 - a user's reset that raises is one line naming it
            raise HarnessError(f"config key 'rl.environment': {cls.__name__}.reset() raised {one_line(e, 200)}") \
                from None
        if text is not None and not isinstance(text, str):
            raise HarnessError(f"config key 'rl.environment': {cls.__name__}.reset() returned a "
                               f"{type(text).__name__}: None or text (appended to the last message) is needed")
        return env, text

    def tools_of(self, env) -> dict[str, Callable]:
        tools = dict(self.functions)
        if env is not None:
            tools.update({t: getattr(env, t) for t in env_tools(type(env))})
        return tools

    def run(self, env, call: Call) -> tuple[str, bool]:
        """(the call's result as text, whether it failed): an unknown tool, a malformed call or a tool that raises
        is a failure whose text says so (the episode goes on)."""
        if call.error:
            return f"Error: {call.error}", True
        fn = self.tools_of(env).get(call.name)
        if fn is None:
            return f"Error: unknown tool {call.name!r}", True
        try:
            return str(fn(**call.arguments)), False
        except Exception as e:  # noqa: BLE001 - a tool's failure is the model's to see
            return f"Error: {one_line(e, 200)}", True

    def prompt_text(self, messages: list[dict], env_name: Optional[str], appended: Optional[str]) -> str:
        """The episode's prompt: the record's messages, reset's text appended to the last message, rendered
        with the tools' schemas, ending where the assistant's turn starts."""
        messages = [dict(m) for m in messages]
        if appended:  # (TRL's: the last message's content + the text, as it is)
            messages[-1]["content"] = messages[-1]["content"] + appended
        return self.tok.apply_chat_template(messages, tools=self.schemas.get(env_name) or None,
                                            add_generation_prompt=True, tokenize=False)

    def result_text(self, calls: list[Call], results: list[str]) -> str:
        """What the template writes after an assistant turn of `calls` (ended at its end-of-turn token, the last
        token the policy sampled): the template's tail of the turn after that token, the tool messages, the next
        assistant header."""
        turn = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": c.name or "unknown", "arguments": c.arguments or {}}}
                    for c in calls]}]
        tool = [{"role": "tool", "name": c.name or "unknown", "content": r} for c, r in zip(calls, results)]
        head = self.tok.apply_chat_template(turn, tokenize=False)
        full = self.tok.apply_chat_template(turn + tool, tokenize=False, add_generation_prompt=True)
        eos = self.tok.eos_token or ""
        end = head.rfind(eos) + len(eos) if eos and eos in head else len(head)
        if not full.startswith(head[:end]):
            raise HarnessError("the chat template renders an assistant turn differently once a tool message follows "
                               "it: tool results cannot be appended to the sampled sequence")
        return full[end:]

    def result_ids(self, calls: list[Call], results: list[str]) -> list[int]:
        return self.tok(self.result_text(calls, results), add_special_tokens=False)["input_ids"]

    def check_template(self) -> None:
        """A chat template that cannot render the tools or a tool message (it drops them or raises): one line."""
        mark = "harness-tool-result-7d1"
        names = [s["function"]["name"] if "function" in s else s["name"] for s in next(iter(self.schemas.values()))]
        try:
            text = self.result_text([Call(names[0] if names else "f", {})], [mark])
            listed = self.tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                                  tools=next(iter(self.schemas.values())) or None)
        except Exception as e:  # noqa: BLE001 - the template's raise_exception or a Jinja error: one line
            text, listed = f"({one_line(e, 120)})", ""
        if mark not in text or (names and names[0] not in listed):
            raise ConfigError(f"config key 'data.chat_template': the model's chat template cannot render tools or a "
                              f"tool message {text[:120]!r}: rl.tools / rl.environment need one that does (e.g. "
                              f"data.chat_template=harness/assets/chat_templates/tools.jinja)")
