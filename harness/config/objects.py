"""Python objects a recipe names by a spec (a reward function, an environment class): found, or one line saying where
they were looked for.

A spec is one of
- `module:name` (a module importable from the launch folder or PYTHONPATH, e.g. `my_rewards:exact_match`),
- `path/to/file.py:name` (a file; a relative path from the folder of the recipe that names it: config/ rewrites it
  so when the recipe is read, `located`; an override's from the launch folder),
- a name `harness.train(...)` gave in this process (`give`: the functions and classes a Python caller passes, as
  TRL's `reward_funcs=[fn]`), under the `module:qualname` the object reports.
Light: no torch.
"""

from __future__ import annotations

import hashlib
import json
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from harness.errors import ConfigError, one_line

GIVEN: dict[str, Any] = {}  # spec -> the object harness.train(...) was given in this process


def give(obj: Any) -> str:
    """Keep `obj` (a function or class) under its spec for this process; returns the spec a recipe names it by."""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if not callable(obj) or not name:
        raise ConfigError(f"harness.train: expected a function or class, got {obj!r}")
    spec = f"{getattr(obj, '__module__', None) or '__main__'}:{name}"
    if GIVEN.get(spec, obj) is not obj:
        raise ConfigError(f"harness.train: two different objects are both named {spec}; give them different names")
    GIVEN[spec] = obj
    return spec


def reward_overrides(fns: Optional[Sequence], weights: Optional[Sequence[float]]) -> list[str]:
    """harness.train(reward_funcs=[...], reward_weights=[...]) as the override `rl.rewards=[...]` (none without them):
    functions given as objects are kept (`give`), specs (module:name, file.py:name) are named as they are."""
    if fns is None:
        if weights is not None:
            raise ConfigError("harness.train: reward_weights without reward_funcs")
        return []
    if isinstance(fns, (str, bytes)) or callable(fns) or not list(fns):
        raise ConfigError("harness.train: reward_funcs must be a non-empty list of functions (or specs)")
    fns = list(fns)
    weights = [1.0] * len(fns) if weights is None else list(weights)
    if len(weights) != len(fns):
        raise ConfigError(f"harness.train: {len(weights)} reward_weights for {len(fns)} reward_funcs")
    entries = [{"function": fn if isinstance(fn, str) else give(fn), "weight": float(w)} for fn, w in zip(fns, weights)]
    return ["rl.rewards=" + json.dumps(entries)]


def agent_overrides(tools: Optional[Sequence], environment: Any) -> list[str]:
    """harness.train(tools=[...], environment=Class or {name: Class}) as the overrides `rl.tools=[...]` and
    `rl.environment=...` (TRL's tools= and environment_factory=): objects given in this process are kept (`give`),
    specs (module:name, file.py:name) are named as they are."""
    def named(obj: Any) -> str:
        return obj if isinstance(obj, str) else give(obj)

    out = []
    if tools is not None:
        if isinstance(tools, (str, bytes)) or callable(tools):
            raise ConfigError("harness.train: tools must be a list of functions (or specs)")
        out.append("rl.tools=" + json.dumps([named(t) for t in tools]))
    if environment is not None:
        value = {str(k): named(v) for k, v in environment.items()} if isinstance(environment, dict) else \
            named(environment)
        out.append("rl.environment=" + json.dumps(value))
    return out


SPEC_KEYS = ("rl.reward", "rl.rewards", "rl.tools", "rl.environment")  # the config keys whose values name Python objects


def is_file_spec(spec: Any) -> bool:
    return isinstance(spec, str) and spec.rpartition(":")[0].endswith(".py")


def located(value: Any, folder: Path) -> Any:
    """A recipe's `path/to/file.py:name` specs (a string, a list, {function: spec} entries) with relative paths made
    absolute from the recipe's `folder` (load_config); the rest as it is."""
    if isinstance(value, list):
        return [located(v, folder) for v in value]
    if isinstance(value, dict):
        return {k: located(v, folder) if k == "function" or is_file_spec(v) else v for k, v in value.items()}
    if is_file_spec(value):
        file, _, name = value.rpartition(":")
        return value if Path(file).is_absolute() else f"{(folder / file).resolve()}:{name}"
    return value


def load(spec: str, key: str) -> Any:
    """The object `spec` names; a spec that names nothing is one line naming `key` and where it was looked for."""
    if spec in GIVEN:
        return GIVEN[spec]
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(f"config key '{key}': expected 'module:name' or 'path/to/file.py:name', got {spec!r}")
    module = _file_module(where, key, spec) if is_file_spec(spec) else _module(where, key, spec)
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"config key '{key}': {spec!r}: {module.__file__ or where} has no {name!r}")
        obj = getattr(obj, part)
    return obj


def _module(name: str, key: str, spec: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name and not name.startswith(f"{e.name}."):
            raise ConfigError(f"config key '{key}': importing {spec!r} failed: {one_line(e, 200)}") from None
        looked = ", ".join([str(Path.cwd()), *(p for p in sys.path[1:] if p)][:4])
        raise ConfigError(f"config key '{key}': no module {name!r} for {spec!r} (looked in {looked}, ...: put it on "
                          f"PYTHONPATH, or give 'path/to/file.py:name')") from None
    except Exception as e:  # noqa: BLE001 - a user's module that raises on import is one line naming it
        raise ConfigError(f"config key '{key}': importing {spec!r} raised {one_line(e, 200)}") from None


def _file_module(path: str, key: str, spec: str):
    file = Path(path).resolve()
    if not file.is_file():
        raise ConfigError(f"config key '{key}': no file {path} for {spec!r} (looked at {file}; a relative path is "
                          f"from the recipe's folder, or from the launch folder in an override)")
    name = f"harness_given_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    found = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = module  # before exec: dataclasses and pickling look a class's module up
    try:
        found.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - a user's file that raises on import is one line naming it
        del sys.modules[name]
        raise ConfigError(f"config key '{key}': importing {file} raised {one_line(e, 200)}") from None
    return module
