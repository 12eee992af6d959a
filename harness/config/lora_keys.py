"""The keys of `model.lora` (a mapping in ModelConfig, so that `model.lora.r=16` overrides one key). Light: no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from harness.config.coerce import help_field as _f, nested_section
from harness.errors import ConfigError


@dataclass
class LoraConfig:
    """The keys of `model.lora` (a mapping, so that `model.lora.r=16` overrides one key)."""

    enabled: bool = _f(False, "Train LoRA adapters instead of all weights (the base is frozen).")
    r: int = _f(8, "LoRA rank.")
    alpha: float = _f(16.0, "LoRA alpha (the update is scaled by alpha / r).")
    dropout: float = _f(0.0, "Dropout on the LoRA input.")
    target_modules: Union[str, list] = _f("all-linear", "Module names to adapt (list), or all-linear (every linear "
                                                       "layer but the output head).")
    experts: bool = _f(False, "Mixture of experts: adapters on the experts' weights too (transformers 5's 3-D "
                              "gate_up_proj / down_proj, through peft's target_parameters; docs/moe.md).")


def lora_config(model: "ModelConfig") -> LoraConfig:
    """`model.lora` checked key by key (unknown keys and wrong types name the key) with the defaults filled in."""
    cfg = nested_section(LoraConfig, model.lora, "model.lora")
    if cfg.r < 1 or not 0 <= cfg.dropout < 1:
        raise ConfigError("config key 'model.lora.r' must be >= 1" if cfg.r < 1
                          else "config key 'model.lora.dropout': must be in [0, 1)")
    return cfg
