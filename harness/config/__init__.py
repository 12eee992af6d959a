"""Run configuration: typed sections, YAML files, dotted command-line overrides.

Precedence (lowest to highest), written down once:

    dataclass defaults  <  the profile named by train.profile  <  the YAML file given with --config
                        <  `section.key=value` overrides

Every key is declared in sections.py with a type and a help text. An unknown key, a value of the wrong type or an
invalid choice raises `ConfigError`, whose message names the key; the entry points turn it into one line
on stderr and exit status 2. The fully resolved config (every default filled in) is written to
`<output_dir>/config.yaml` by the training run, and loading that file reproduces the run.

    python -c "from harness.config import load_config; print(load_config('configs/default.yaml', ['train.max_steps=5']))"

This module must stay light: it imports neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from pathlib import Path
from typing import Any, Optional

import yaml

from harness.config.best import EARLY_STOPPING_HELP, EarlyStoppingConfig
from harness.config import objects
from harness.config.coerce import coerce, section_fields, type_name, unknown
from harness.config.modes import MODES
from harness.config.sections import (NO_RESUME, SECTIONS, Config, DataConfig, LoraConfig, LossConfig, ModelConfig, OptimConfig,
                                     RftConfig, RlConfig, TrainConfig, lora_config)
from harness.config.yaml_loader import TooLong, key_lines, read_yaml
from harness.errors import ConfigError, problems_of, raise_all
from harness.config.checks import validate
from harness.config.profiles import profile_overrides

__all__ = ["NO_RESUME", "SECTIONS", "Config", "DataConfig", "LoraConfig", "LossConfig", "ModelConfig", "OptimConfig", "RftConfig",
           "RlConfig", "TrainConfig", "lora_config", "load_config", "save_config", "parse_override", "describe"]

def _apply(raw: dict, key: str, value: Any) -> None:
    """Set `raw[section][name] = value` after checking that section.name exists and the type fits."""
    parts = key.split(".")
    section = parts[0]
    if section not in SECTIONS:
        raise unknown("section", section, list(SECTIONS), _keys())
    if len(parts) == 1:
        raise ConfigError(f"config key '{key}': give section.key=value")
    fields = section_fields(SECTIONS[section])
    name = parts[1]
    if name not in fields:
        raise unknown("key", key, list(fields), {s: k for s, k in _keys().items() if s != section})
    if len(parts) > 2:  # a key inside a dict-valued field, e.g. model.config.hidden_size=64
        if fields[name] is not dict:
            raise ConfigError(f"config key '{key}': '{section}.{name}' has no sub-keys")
        d = raw.setdefault(section, {}).setdefault(name, {})
        for i, p in enumerate(parts[2:-1], start=2):
            d = d.setdefault(p, {})
            if not isinstance(d, dict):
                raise ConfigError(f"config key '{key}': '{'.'.join(parts[:i + 1])}' is {d!r}, not a mapping")
        d[parts[-1]] = value
        return
    raw.setdefault(section, {})[name] = coerce(key, value, fields[name])


# loss.mode=rl samples with the rft section's keys; TRL's GRPOConfig names are read from rl: as well (the same setting)
RL_SAMPLING = {"rl.temperature": "rft.temperature", "rl.top_p": "rft.top_p", "rl.top_k": "rft.top_k",
               "rl.min_p": "rft.min_p", "rl.max_completion_length": "rft.max_new_tokens"}


def _trl_sampling(pairs: list, n_file: int, lines: dict, path, problems: list) -> list:
    """RL_SAMPLING's names as the rft keys they name (a later one wins, as for any key; a recipe that gives both names
    two values is a problem on the line of TRL's)."""
    for key, value in pairs[:n_file]:
        target = RL_SAMPLING.get(key)
        if target is None:
            continue
        other = next((v for k, v in pairs[:n_file] if k == target), value)
        if other != value:
            problems.append(f"{path}:{lines.get(key, '?')}: config key '{key}': {value!r}, and {target} {other!r}: "
                            f"{key} is TRL's name for {target} (the same setting); give one")
        if key in lines:
            lines.setdefault(target, lines[key])
    return [(RL_SAMPLING.get(k, k), v) for k, v in pairs]


def _keys() -> dict[str, list[str]]:
    """Every section's keys (where a name given in the wrong section is found)."""
    return {s: list(section_fields(cls)) for s, cls in SECTIONS.items()}


# ----------------------------------------------------------------------------------------------- loading


def parse_override(text: str) -> tuple[str, Any]:
    """`train.max_steps=20` -> ("train.max_steps", 20); the value is read as YAML (numbers, bools, lists)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected section.key=value")
    key, _, value = text.partition("=")
    key = key.strip().lstrip("-")
    try:
        parsed = read_yaml(value) if value.strip() else ""
    except TooLong as e:
        raise ConfigError(f"config key '{key}': {e.problem}") from None
    except (yaml.YAMLError, RecursionError):
        parsed = value  # a plain string such as a path with a colon
    return key, parsed


def load_config(path: Optional[str | Path] = None, overrides: list[str] | None = None) -> Config:
    """Build a Config from defaults, then the YAML file at `path`, then `overrides` (see module docstring). Every
    problem is found before any is raised: each unknown key, wrong value and failed check across keys is one line
    (the file's lines prefixed `file:line:`), raised together (errors.ConfigErrors)."""
    problems: list[str] = []
    pairs, lines = _read_recipe(Path(path), problems) if path is not None else ([], {})
    if path is not None:  # a file named in the recipe is found from the recipe's folder (harness/objects.py)
        pairs = [(k, objects.located(v, Path(path).parent) if k in objects.SPEC_KEYS else v) for k, v in pairs]
    n_file = len(pairs)
    for text in overrides or []:
        try:
            pairs.append(parse_override(text))
        except ConfigError as e:
            problems.append(str(e))
    pairs = _trl_sampling(pairs, n_file, lines, path, problems)
    overridden = {k for k, _ in pairs[n_file:]}

    def at(key: str) -> str:  # where `key` was written: its line in the recipe, or nothing (an override, a default)
        return f"{path}:{lines[key]}: " if key in lines and key not in overridden else ""

    raw: dict[str, dict] = {}
    profile = next((v for k, v in reversed(pairs) if k == "train.profile"), None)
    if profile is not None:
        mode = next((v for k, v in reversed(pairs) if k == "loss.mode"), None)
        row = MODES.get(mode) if isinstance(mode, str) else None  # an unknown name is reported with the rest
        try:
            for key, value in profile_overrides(str(profile)).items():
                if key == "data.packing" and row is not None and not row.profile_packs:
                    continue  # pairs, answers are scored one sequence a row: a profile's packing is for the modes that pack
                _apply(raw, key, value)
        except ConfigError as e:
            problems.append(at("train.profile") + str(e))
    for i, (key, value) in enumerate(pairs):
        try:
            _apply(raw, key, value)
        except ConfigError as e:
            problems.append((at(key) if i < n_file else "") + str(e))
    cfg = Config(**{s: SECTIONS[s](**raw.get(s, {})) for s in SECTIONS})
    try:
        # the keys set for this run: the overrides', and the recipe's where the recipe names its own loss.mode (a
        # recipe of another mode switched by an override keeps the settings that mode reads, e.g. its micro-batch)
        file_keys = {k for k, _ in pairs[:n_file]}
        validate(cfg, frozenset(overridden | (file_keys if "loss.mode" in file_keys else set())))
    except ConfigError as e:
        problems += [at(m.group(1)) + p if (m := re.match(r"config key '([\w.]+)", p)) else p for p in problems_of(e)]
    raise_all(problems)
    return cfg


def _read_recipe(p: Path, problems: list[str]) -> tuple[list[tuple[str, Any]], dict[str, int]]:
    """A recipe's (key, value) pairs in file order and each key's line; an unknown section or one that is not a
    mapping is a problem added to `problems`; a file that cannot be read as a recipe at all is raised."""
    if p.is_dir():
        recipes = sorted(p.glob("*.yaml"), key=lambda r: r.name != "default.yaml")
        raise ConfigError(f"config file {p} is a folder; give a recipe file"
                          + (f", e.g. {recipes[0]}" if recipes else ""))
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        raw_bytes = p.read_bytes()
        text = raw_bytes.decode("utf-8")
        loaded = read_yaml(text) or {}
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the config file ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        line = raw_bytes.count(b"\n", 0, e.start) + 1
        column = e.start - (raw_bytes.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"{p}:{line}: not UTF-8 text (byte 0x{raw_bytes[e.start]:02x} at column {column}); "
                          f"convert the file, e.g. iconv -f latin1 -t utf-8") from None
    except RecursionError:
        raise ConfigError(f"{p}: invalid YAML (nested too deeply: more than about {sys.getrecursionlimit()} "
                          f"levels)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark else str(p)
        raise ConfigError(f"{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{p}: expected a mapping of sections (model:, data:, optim:, train:)")
    lines = key_lines(text)
    pairs: list[tuple[str, Any]] = []
    for section, values in loaded.items():
        where = f"{p}:{lines[str(section)]}: " if str(section) in lines else f"{p}: "
        if section not in SECTIONS:
            problems.append(where + str(unknown("section", str(section), list(SECTIONS), _keys())))
        elif not isinstance(values, dict):
            problems.append(f"{where}section '{section}' must be a mapping of keys")
        else:
            pairs += [(f"{section}.{name}", value) for name, value in values.items()]
    return pairs, lines


def save_config(cfg: Config, path: str | Path, omit: tuple = ()) -> None:
    """Write the resolved config, without the sections named in `omit` (a training run omits `rft`, which it does not
    read); `load_config(path)` gives the same Config back (an omitted section: its defaults). Atomically (a temporary
    file renamed over it): a full disk leaves the previous file whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(yaml.safe_dump({k: v for k, v in cfg.to_dict().items() if k not in omit}, sort_keys=False))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def describe() -> str:
    """Every key with its type, default and help, for `harness train --help-config`."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"{section}:")
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            tp = type_name(typing.get_type_hints(cls)[f.name])
            lines.append(f"  {f.name} ({tp}, default {default!r}): {f.metadata.get('help', '')}")
            if (section, f.name) == ("model", "lora"):  # the keys of the model.lora mapping
                for k in dataclasses.fields(LoraConfig):
                    ktp = type_name(typing.get_type_hints(LoraConfig)[k.name])
                    lines.append(f"    lora.{k.name} ({ktp}, default {k.default!r}): {k.metadata.get('help', '')}")
            if (section, f.name) == ("train", "early_stopping"):  # the keys of the train.early_stopping mapping
                for k in dataclasses.fields(EarlyStoppingConfig):
                    ktp = type_name(typing.get_type_hints(EarlyStoppingConfig)[k.name])
                    lines.append(f"    early_stopping.{k.name} ({ktp}, default {k.default!r}): "
                                 f"{EARLY_STOPPING_HELP[k.name]}")
        if section == "rl":  # TRL's names of the sampling keys
            lines += [f"  {a.partition('.')[2]}: TRL's name of {t} (the same setting)" for a, t in RL_SAMPLING.items()]
    return "\n".join(lines)
