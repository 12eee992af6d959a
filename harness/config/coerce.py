"""The config's types as the user meets them: a value checked against its declared type (coerce), the type's name in
an error (type_name), a section's keys and types (section_fields), an unknown key with what it may mean (unknown).
Light: no torch."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import field
from typing import Any, Literal, Optional

from harness.config.foreign import hint
from harness.errors import ConfigError


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        null = " or null" if type(None) in typing.get_args(tp) else ""
        return " or ".join(type_name(a) for a in args) + null
    return getattr(tp, "__name__", str(tp))


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the declared type `tp`; return it (ints are accepted where floats are)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(key, value, a)
            except ConfigError:
                pass
        raise ConfigError(f"config key '{key}': expected {type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"config key '{key}': expected {type_name(tp)}, got {value!r}")
        return value
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
        list: lambda v: isinstance(v, list),
        dict: lambda v: isinstance(v, dict),
    }[tp]
    if not ok(value):
        raise ConfigError(f"config key '{key}': expected {type_name(tp)}, got {value!r}")
    return float(value) if tp is float else value


def section_fields(section_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def unknown(kind: str, key: str, known: list[str], elsewhere: Optional[dict[str, list[str]]] = None) -> ConfigError:
    """An unknown section or key, with a suggestion only from names close in meaning (config/foreign.py's hint: the
    name another tool uses, the same name in another section (`elsewhere`), a typo)."""
    return ConfigError(f"unknown config {kind} '{key}'{hint(key, known, elsewhere)}")


def nested_section(section_cls: type, values: dict, prefix: str):
    """A mapping key of the config (model.lora, train.early_stopping) as its dataclass, checked key by key: an unknown
    key is named with its closest match, a wrong type names the key (`prefix`: the mapping's own key)."""
    fields = section_fields(section_cls)
    out = {}
    for key, value in values.items():
        if key not in fields:
            raise unknown("key", f"{prefix}.{key}", list(fields))
        out[key] = coerce(f"{prefix}.{key}", value, fields[key])
    return section_cls(**out)


def help_field(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with a help text (mutable defaults go through a factory)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})
