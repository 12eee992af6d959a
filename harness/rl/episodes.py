"""Multi-turn episodes of loss.mode=rl with rl.tools / rl.environment (docs/agents.md), token in and token out.

Per episode (a question's answer g): a fresh environment reset with the record's columns (reset's text appended to
the last message), the prompt rendered with the tools' schemas and encoded once. The engine samples a turn from
the episode's whole id sequence; the turn's tool calls are parsed from its text (the ids are kept as sampled, never
re-encoded); each tool runs; the tool results, rendered as the template renders `tool` messages, are encoded alone
and appended; sampling goes on from the sequence. An episode ends at a turn without a tool call (or not ended by an
end-of-turn token), after rl.max_tool_calls tool-calling turns, or when its completion (sampled and tool tokens)
reaches rft.max_new_tokens. `mask`: 1 on the tokens the policy sampled, 0 on the tool results' (no loss, not
counted). Each turn's draws are seeded by (rft.seed, step, question, answer index, turn): the same episodes on any
process count. Each turn is one engine call with every live episode's whole sequence as its prompt (prefilled
again: the engine does not keep a sequence's cache across turns yet).

    python -c "from harness.rl.episodes import run_episodes; help(run_episodes)"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from harness import IGNORE_INDEX
from harness.errors import HarnessError, one_line
from harness.rft.contract import Sampling, encode
from harness.rl.tools import Toolbox, parse_calls


@dataclass
class Episode:
    q: int  # the question's place in the batch
    g: int  # its answer index
    env: Any
    prompt: list[int]
    ids: list[int] = field(default_factory=list)  # the completion: sampled and tool-result tokens
    mask: list[int] = field(default_factory=list)  # 1 sampled, 0 a tool result's
    calls: int = 0
    failures: int = 0
    turns: int = 0
    tool_turns: int = 0
    done: bool = False


def columns_of(q) -> dict:
    """A record's columns handed to reset() (TRL hands the whole row): rl.prompts' record, or an rft question's
    question and answer."""
    return {"prompt": q.prompt, **q.columns} if hasattr(q, "columns") else {"question": q.question, "answer": q.answer}


def records(task, questions: list) -> list[tuple[list[dict], dict]]:
    """(the prompt's messages, the columns reset() is given) of each question."""
    return [(task.messages(q), columns_of(q)) for q in questions]


def start(toolbox: Toolbox, recs: list, G: int) -> tuple[list[list[int]], list[Episode]]:
    """(each record's prompt ids, its G episodes in order): G fresh environments per record, reset alike."""
    prompts, episodes = [], []
    for k, (messages, columns) in enumerate(recs):
        started = [toolbox.start(columns) for _ in range(G)]
        texts = {text for _, text in started}
        if len(texts) > 1:
            raise HarnessError(f"config key 'rl.environment': reset() gave different texts for the same record "
                               f"({messages[-1]['content'][:60]!r}): an episode's prompt must follow from the "
                               f"record's columns")
        ids = encode(toolbox.tok, [toolbox.prompt_text(messages, toolbox.pick(columns), texts.pop())])[0]
        prompts.append(ids)
        episodes += [Episode(k, g, env, ids) for g, (env, _) in enumerate(started)]
    return prompts, episodes


def take_turn(ep: Episode, sampled: list[int], toolbox: Toolbox, eos: set, budget: int, max_tool_calls: int) -> None:
    """Append a sampled turn to the episode; run its tool calls and append their results, or end the episode."""
    sampled = sampled[:budget - len(ep.ids)]
    ep.ids += sampled
    ep.mask += [1] * len(sampled)
    ep.turns += 1
    ended = bool(sampled) and sampled[-1] in eos
    calls = parse_calls(toolbox.tok.decode(sampled, skip_special_tokens=True), toolbox.tok) if ended else []
    if not calls or ep.tool_turns >= max_tool_calls or len(ep.ids) >= budget:
        ep.done = True
        return
    ep.tool_turns += 1
    results = []
    for call in calls:
        text, failed = toolbox.run(ep.env, call)
        results.append(text)
        ep.calls += 1
        ep.failures += failed
    piece = toolbox.result_ids(calls, results)[:budget - len(ep.ids)]
    ep.ids += piece
    ep.mask += [0] * len(piece)
    ep.done = len(ep.ids) >= budget


def env_reward(ep: Episode) -> float:
    """The episode's get_reward() (NaN without one: no score from the environment)."""
    fn = getattr(ep.env, "get_reward", None)
    if fn is None:
        return float("nan")
    try:
        value = fn()
        return float("nan") if value is None else float(value)
    except Exception as e:  # noqa: BLE001 - a user's get_reward that fails is one line naming it
        raise HarnessError(f"config key 'rl.environment': {type(ep.env).__name__}.get_reward() raised or returned no "
                           f"number: {one_line(e, 200)}") from None


def run_episodes(generation, toolbox: Toolbox, recs: list, index: list[int], rl, sampling,
                 step: int) -> tuple[list[list[int]], list[Episode]]:
    """(each record's prompt ids, its rl.num_generations finished episodes in order). `generation`: rl's Generation
    (answer(prompts, n, Sampling), its accelerator); `recs`: `records`; `index`: each record's index in the train
    split (its seed); `rl`: cfg.rl; `sampling`: the SamplingSettings. Every process calls the engine once a turn
    while any process has an episode running (ZeRO-3 gathers)."""
    G, max_tool_calls, accelerator = rl.num_generations, rl.max_tool_calls, getattr(generation, "accelerator", None)
    prompts, episodes = start(toolbox, recs, G) if recs else ([], [])
    eos, budget, turn = set(generation.engine.eos), sampling.max_new_tokens, 0
    draw = Sampling(sampling.temperature, sampling.top_p, seed=lambda i, j: (sampling.seed, step, index[i], j, 0))
    for k, group in enumerate(generation.answer(prompts, G, draw)):
        for g, c in enumerate(group):
            take_turn(episodes[k * G + g], list(c.ids), toolbox, eos, budget, max_tool_calls)
    while running(episodes, accelerator):
        turn += 1
        live = [ep for ep in episodes if not ep.done]
        draw = Sampling(sampling.temperature, sampling.top_p,
                        seed=lambda i, j, t=turn: (sampling.seed, step, index[live[i].q], live[i].g, t))
        got = generation.answer([ep.prompt + ep.ids for ep in live], 1, draw)
        for ep, group in zip(live, got):
            take_turn(ep, list(group[0].ids), toolbox, eos, budget, max_tool_calls)
    return prompts, episodes


def running(episodes: list[Episode], accelerator: Optional[Any]) -> bool:
    """Whether an episode on any process is still running (one all-reduce a turn with several processes)."""
    live = sum(not ep.done for ep in episodes)
    if accelerator is None or accelerator.num_processes == 1:
        return live > 0
    return bool(accelerator.reduce(torch.tensor([live], device=accelerator.device), "sum").item())


def tool_sums(episodes: list[Episode]) -> list[float]:
    """[episodes, tool calls, failed calls, turns, most turns] of a batch (the log line's tools/ and turns)."""
    return [float(len(episodes)), float(sum(e.calls for e in episodes)), float(sum(e.failures for e in episodes)),
            float(sum(e.turns for e in episodes)), float(max((e.turns for e in episodes), default=0))]


def tool_figures(sums: list[float]) -> dict:
    """tools/calls_per_episode, tools/failure_rate, turns (mean) and turns_max from tool_sums summed over processes
    and steps (the max taken apart)."""
    n, calls, failed, turns, most = sums
    return {"tools/calls_per_episode": calls / n if n else 0.0, "tools/failure_rate": failed / calls if calls else 0.0,
            "turns": turns / n if n else 0.0, "turns_max": most}


def mask_tool_results(labels: torch.Tensor, prompt_lens: list[int], masks: list[Optional[list[int]]]) -> None:
    """The training rows' labels (`rows`) set to IGNORE_INDEX on every tool-result token (mask 0), in place: the
    loss, its gradient and its token counts skip them as they skip the prompt."""
    for row, (p, m) in enumerate(zip(prompt_lens, masks)):
        if m is not None:
            off = torch.tensor([p + k for k, v in enumerate(m) if not v], dtype=torch.long)
            labels[row, off] = IGNORE_INDEX


def sampled_count(answer: list[int], mask: Optional[list[int]]) -> int:
    """The tokens of an answer the loss counts: the sampled ones."""
    return len(answer) if mask is None else sum(mask)


def marked_text(tokenizer, ids: list[int], mask: Optional[list[int]]) -> str:
    """An episode as text for rl.log_completions, each tool result between [tool] and [/tool]."""
    if mask is None:
        return tokenizer.decode(ids, skip_special_tokens=True)
    out, k = [], 0
    while k < len(ids):
        end = k
        while end < len(ids) and mask[end] == mask[k]:
            end += 1
        text = tokenizer.decode(ids[k:end], skip_special_tokens=True)
        out.append(text if mask[k] else f"[tool]{text}[/tool]")
        k = end
    return "".join(out)
