"""Named speed profiles and hardware-aware defaults.

A profile is a named set of config values chosen with `train.profile=NAME`. Precedence (harness/config/__init__.py):
defaults < profile < the recipe file < command-line overrides, so any key a profile sets can still be overridden.

    conservative      no compile, no packing, no workers: the most compatible, slowest path
    balanced          compile where it pays (regional on CUDA), packing, 2 workers, pinned memory
    aggressive        regional compile everywhere, packing, 4 persistent workers with deeper prefetch, rarer logging
    memory_efficient  activation checkpointing, packing, regional compile on CUDA, one worker

`auto` values are resolved here for the hardware at hand: `resolve_compile`, `resolve_pin_memory`.

    harness bench configs/default.yaml --profiles conservative,balanced,aggressive,memory_efficient
"""

from __future__ import annotations

PROFILES: dict[str, dict[str, object]] = {
    "conservative": {
        "train.compile": "none", "data.packing": False, "data.num_workers": 0, "data.persistent_workers": False,
        "model.gradient_checkpointing": False,
    },
    "balanced": {
        "train.compile": "auto", "data.packing": True, "data.num_workers": 2, "data.prefetch_factor": 2,
        "data.pin_memory": "auto", "model.gradient_checkpointing": False,
    },
    "aggressive": {
        "train.compile": "regional", "data.packing": True, "data.num_workers": 4, "data.prefetch_factor": 4,
        "data.persistent_workers": True, "data.pin_memory": "auto", "train.log_every": 50,
        "model.gradient_checkpointing": False,
    },
    "memory_efficient": {
        "model.gradient_checkpointing": True, "data.packing": True, "train.compile": "auto", "data.num_workers": 1,
    },
}


def profile_overrides(name: str) -> dict[str, object]:
    from harness.errors import ConfigError

    if name not in PROFILES:
        raise ConfigError(f"config key 'train.profile': unknown profile '{name}' (known: {', '.join(PROFILES)})")
    return PROFILES[name]


def resolve_compile(value: str, cuda: bool, mode: str = "generative") -> str:
    """`auto` -> regional on CUDA for generative runs (cold start grows little with depth), none on CPU (compile time
    rarely pays) and for runs with embedding passes: their batches change shape from step to step (queries and
    passages padded to each batch's longest), and every new shape recompiled the blocks (H100, the 1B unified
    recipe: 74 s for the first 5 steps against 5 s eager; CPU, gritlm-tiny: 4 recompiles in 20 steps, 76 s
    against 26 s eager). Asking for regional explicitly still compiles them."""
    if value == "auto":
        return "regional" if cuda and mode == "generative" else "none"
    return value


def resolve_pin_memory(value, cuda: bool) -> bool:
    return cuda if value == "auto" else bool(value) and cuda
