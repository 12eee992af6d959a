"""The settings a checkpoint's run trained with that its files do not show, saved in harness_state.json (`settings`)
and compared on resume (issue 55): a resume takes this config, so a changed value would act silently.

- `model.name_or_path`: the checkpoint's weights continue whatever it names (a LoRA run loads its base from it
  again): another model is refused in one line;
- `data.max_len` (and `data.max_len_percentile` with max_len=auto): it decides the row list the data position counts
  (rows cut, packed): a change is a change of the training data (checkpoint/datafiles.py: refused, or with
  train.resume_changed_data=true the new rows from the start of a new epoch);
- loss.mode=rl's `rl.*` and sampling settings: taken from this config, each said in one line and recorded in
  report.json's resumed_changes (as optim.lr); a half-used generation batch they cannot continue is dropped by
  harness/rl/rollout.py (`Rollouts.load_state_dict`), which says so.

    current(cfg.model, cfg.data, cfg.loss.mode, {"rl": cfg.rl, "rft": cfg.rft}) -> {key: value}
    compare(saved, now) -> {key: (old, new)} (keys a checkpoint lacks are not compared)
"""

from __future__ import annotations

from pathlib import Path

from harness.config.modes import facts
from harness.errors import ConfigError

RL_KEYS = ("rl.num_generations", "rl.reward", "rl.rewards", "rl.beta", "rl.iterations", "rl.loss_type",
           "rl.scale_rewards", "rl.importance_sampling", "rl.mask_truncated_completions", "rl.epsilon",
           "rl.epsilon_high", "rl.rows", "rl.tools", "rl.environment", "rl.max_tool_calls", "rft.temperature",
           "rft.top_p", "rft.top_k", "rft.min_p", "rft.max_new_tokens")


def current(model, data, loss_mode: str, sections: dict) -> dict:
    """This run's values of the compared settings (`model`, `data`: cfg.model, cfg.data; sections: {"rl": cfg.rl,
    "rft": cfg.rft})."""
    name = None if model.random_init else model.name_or_path
    if name is not None and Path(name).exists():  # a local folder: the same one however it is written
        name = str(Path(name).resolve())
    out = {"model.name_or_path": name}
    mode = facts(loss_mode)
    if "rl" in mode.sections:  # the sampling and GRPO settings of a mode that reads them
        for key in RL_KEYS:
            section, name = key.split(".")
            value = getattr(sections[section], name)
            out[key] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    elif mode.reads_data:  # sequences or pairs of data.train_files (embedding rows: data.query/passage_max_len)
        out["data.max_len"] = data.max_len
        if data.max_len == "auto":
            out["data.max_len_percentile"] = data.max_len_percentile
    return out


def compare(saved: dict, now: dict) -> dict:
    """{key: (checkpoint's value, this config's)} for every compared setting that changed."""
    return {k: (saved[k], v) for k, v in now.items() if k in saved and saved[k] != v}


def check_model(path: Path, changed: dict) -> None:
    """Another model.name_or_path than the checkpoint's run: refused (its weights would continue, the named model
    ignored)."""
    if "model.name_or_path" in changed:
        was, now = (repr(v) if v is not None else "a random init (null)" for v in changed["model.name_or_path"])
        raise ConfigError(f"config key 'model.name_or_path': the run to resume ({path}) trained {was}, this config "
                          f"names {now}; the checkpoint's weights would continue and {now} be ignored: rerun with "
                          f"model.name_or_path={changed['model.name_or_path'][0] or 'null'}, or train {now} in another "
                          f"train.output_dir (or start over with train.overwrite=true)")


def data_changes(changed: dict) -> list[str]:
    """The changed settings that change the rows the data position counts, as datafiles.compare's phrases."""
    return [f"{k}: {a} -> {b} (it decides the rows the data position counts)" for k, (a, b) in changed.items()
            if k.startswith("data.")]


def taken(changed: dict, path: Path, step: int, say) -> dict:
    """The changed rl settings this resume takes, each said in one line: their resumed_changes records."""
    out = {}
    for k, (a, b) in changed.items():
        if k.startswith(("rl.", "rft.")):
            out[k] = {"from": a, "to": b, "from_step": step}
            say(f"[harness] {k} changed since {path}: {a} -> {b}, applied from step {step}")
    return out
