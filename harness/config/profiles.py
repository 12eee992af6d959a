"""Named speed profiles and hardware-aware defaults.

A profile is a named set of config values chosen with `train.profile=NAME`. Precedence (harness/config/__init__.py):
defaults < profile < the recipe file < command-line overrides, so any key a profile sets can still be overridden.

    conservative      no compile, no packing, no workers: the most compatible, slowest path
    balanced          compile where it pays (regional on CUDA), packing, 2 workers, pinned memory
    aggressive        regional compile everywhere, packing, 4 persistent workers with deeper prefetch, rarer logging
    memory_efficient  activation checkpointing, packing, regional compile on CUDA, one worker

`auto` values are resolved here for the hardware at hand: `resolve_compile`, `resolve_pin_memory`; `shapes_vary`
decides whether compiled shapes are dynamic.

    harness bench configs/default.yaml --profiles conservative,balanced,aggressive,memory_efficient
"""

from __future__ import annotations

from harness.errors import ConfigError

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
    if name not in PROFILES:
        raise ConfigError(f"config key 'train.profile': unknown profile '{name}' (known: {', '.join(PROFILES)})")
    return PROFILES[name]


def resolve_compile(value: str, cuda: bool) -> str:
    """`auto` -> regional on CUDA, none on CPU (compile time rarely pays there). Runs with embedding passes compile
    too: `shapes_vary` runs compile with dynamic shapes, so a new batch length reuses the compiled blocks."""
    if value == "auto":
        return "regional" if cuda else "none"
    return value


def shapes_vary(mode: str, packing: bool) -> bool:
    """Whether micro-batches change shape from step to step: embedding passes (queries and passages padded to each
    batch's longest, or to a bucket) and unpacked generative rows do; packed rows are always [B, max_len].

    Such runs compile with `dynamic=True` (accelerate's TorchDynamoPlugin): the blocks' graphs take the batch and
    sequence sizes as symbols from the first step. With dynamo's default (static first, dynamic after a size
    changes) every kind of pass compiled twice, the second time after step 1 (gritlm-tiny, GradCache, no step-0
    evaluation: 7 graphs, 1 recompile after step 1, against 5 and 0); padding up to buckets instead
    (`data.pad_buckets`) adds padding and a graph per bucket. Measured in docs/speed.md."""
    return mode != "generative" or not packing


def embed_buckets(d, mode: str, compile_mode: str, deepspeed: bool = False) -> int:
    """data.embed_length_buckets resolved: the fixed widths per embedding side (0: each batch padded to its longest).
    auto: 4 under torch.compile where the generative rows have a fixed shape too (packed, or no generative pass), so
    that every pass is one of a few static shapes, all compiled before step 1 (on an H100 the dynamic-shape graphs of
    the GritLM objective recompiled 4 times after step 1); else 0: with unpacked rows the run compiles dynamic shapes,
    where buckets only add padding (docs/benchmarks.md, compiled shapes), and without compile padding only costs.
    Under DeepSpeed auto is 0 too: the warm-up's backward passes (harness.speed.buckets) would run the engine's
    end-of-backward reduction with nothing queued (ZeRO-2, one process: IndexError in reduce_ipg_grads)."""
    value = d.embed_length_buckets  # d: cfg.data, mode: loss.mode
    if mode not in ("embedding", "unified") or compile_mode == "none":
        return 0
    if value == "auto":
        return 4 if (mode == "embedding" or d.packing) and not deepspeed else 0
    return value


def static_shapes(d, mode: str, compile_mode: str, deepspeed: bool = False) -> bool:
    """Whether every pass of the run has one of a few fixed shapes, so that torch.compile takes them static: embedding
    passes in width buckets (`embed_buckets`) and generative rows packed (always [B, max_len]) or none (`d`:
    cfg.data, `mode`: loss.mode)."""
    return not deepspeed and bool(embed_buckets(d, mode, compile_mode)) and (mode == "embedding" or d.packing)


def resolve_pin_memory(value, cuda: bool) -> bool:
    return cuda if value == "auto" else bool(value) and cuda
