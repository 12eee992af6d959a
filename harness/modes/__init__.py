"""The loss modes, each a component, and their registry: the one place outside config/ that reads a mode's name.

A mode is an object with the face of `harness.objective.Objective` (what the loop and train_step call: the step's
micro-batches, the scale, the micro-step, the log line's figures, the held-out evaluation) built by its module's
`build(cfg, parts)`, which owns the mode's own set-up (preference's reference log-probs, RL's rollouts, the GritLM
widths). The shipped modes are siblings: gritlm.py (generative, embedding, unified), preference.py, rl.py, distill.py. A mode
with a stream of its own in place of data.train_files (rl: question indices) gives `stream(cfg, accelerator) ->
(source, loader)`; the source reaches its build as `parts.data.source`.

Adding a mode (see docs/architecture.md): write its Objective subclass and `build`, then

    from harness.config.modes import ModeFacts
    from harness import modes
    modes.register(ModeFacts("toy", gen_rows="sequences"), build)

`ModeFacts` (harness/config/modes.py) answers what the parts below the run ask of a mode (its data streams, config
sections, packing, the model card), so no other module needs an edit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from harness.config import Config
from harness.config.modes import ModeFacts, facts, register_facts
from harness.modes import distill, gritlm, preference, rl
from harness.objective import Objective, Parts


@dataclass(frozen=True)
class Entry:
    build: Callable[[Config, Parts], Objective]
    stream: Optional[Callable] = None  # (cfg, accelerator) -> (source, unprepared loader) of the mode's own stream


REGISTRY: dict[str, Entry] = {
    "generative": Entry(gritlm.build),
    "embedding": Entry(gritlm.build),
    "unified": Entry(gritlm.build),
    "preference": Entry(preference.build),
    "rl": Entry(rl.build, stream=rl.question_stream),
    "distill": Entry(distill.build, stream=distill.prompt_stream),
}


def register(row: ModeFacts, build: Callable[[Config, Parts], Objective], stream: Optional[Callable] = None) -> None:
    """Add a mode: its facts (loss.mode accepts its name from now on) and its build."""
    register_facts(row)
    REGISTRY[row.name] = Entry(build, stream)


def entry(cfg: Config) -> Entry:
    facts(cfg.loss.mode)  # an unknown name: one line naming loss.mode
    return REGISTRY[cfg.loss.mode]


def build(cfg: Config, parts: Parts) -> Objective:
    """The run's mode object, built once (after prepare(), before a checkpoint is loaded)."""
    return entry(cfg).build(cfg, parts)


def own_stream(cfg: Config, accelerator):
    """(source, loader) of the mode's own training stream, or None where it reads data.train_files."""
    stream = entry(cfg).stream
    return stream(cfg, accelerator) if stream is not None else None
