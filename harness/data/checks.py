"""The data section's checks that need data/'s knowledge (the source mappings, the chat templates): called by the
build before anything is started (harness.build.build_run) and by train.py's early check, so a wrong entry is one
line before the run starts. The checks of the config alone (the lists the loss mode needs, data.eval_split) are
harness.config.checks'. Imports no torch.
"""

from __future__ import annotations

from harness.config import DataConfig
from harness.data.chat import check_choice
from harness.data.sources import parse_sources
from harness.errors import ConfigError


def check_data(d: DataConfig, rl_prompts: list = (), distill_prompts: list = ()) -> None:
    """`d` (cfg.data): each list's entries a path or a valid source mapping (harness.data.sources), weights on every
    source of a training list or on none (none on an eval list), and a data.chat_template file that exists;
    `rl_prompts` (cfg.rl.prompts), `distill_prompts` (cfg.distill.prompts): their entries valid source mappings too."""
    parse_sources(list(rl_prompts), "rl.prompts")
    parse_sources(list(distill_prompts), "distill.prompts")
    for key in ("train_files", "eval_files", "emb_train_files", "emb_eval_files"):
        weighted = [s.weight is not None for s in parse_sources(getattr(d, key), f"data.{key}")]
        if any(weighted) and "eval" in key:
            raise ConfigError(f"config key 'data.{key}[{weighted.index(True)}]': 'weight' mixes training data; an "
                              f"eval list is evaluated whole")
        if any(weighted) and not all(weighted):
            raise ConfigError(f"config key 'data.{key}[{weighted.index(False)}]': has no weight while other sources "
                              f"of the list have one; give every source a weight, or none")
    check_choice(d.chat_template)
