"""Everything about torch.compile in a run: the compiler's start-up overlapped with the set-up, the regions compiled,
the probe that proves compiled code ran, dynamo's counters and report.json's `compile` section.

`train.compile` (harness/config/profiles.py resolves `auto`): `none`, `regional` (accelerate's TorchDynamoPlugin with
`use_regional_compilation`: the repeated decoder blocks share one compiled graph) or `full`. The accelerator compiles
the model in `prepare()`; this module does the rest:

* `CompilerStartup`: before inductor compiles the first graph of a process it imports itself (about 2 s here), probes
  the CPU's vector instruction sets by building and loading a small C++ library per candidate (about 6.5 s with an
  empty inductor cache, 1 s once the cache holds the probes; CPU devices only) and starts its pool of compile workers.
  None of that depends on the model. `CompilerStartup.start` does the imports at once in the calling thread (imports
  from two threads at once can deadlock on the import locks) and runs the probe and the pool start-up in a background
  thread, where they overlap the tokenizer, data and model set-up: the probe is mostly a C++ compiler in a subprocess,
  so it costs the main thread nothing. `join()` waits for it before the first step, so the dynamo/inductor seconds
  counted in the first step are the model's own compilation, and reports how long the background work took and how
  long the main thread waited.
* `narrow_regional_compile`: keeps accelerate's compiled regions on the repeated blocks only.
* `CompileProbe`, `dynamo_counters`: whether decoder blocks ran compiled, graphs and compile seconds.
* `CompileWatch`: the above for one run, and its report.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Callable, Optional

import torch


class CompilerStartup:
    def __init__(self, device_type: str):
        self.device_type = device_type
        self.import_s = 0.0
        self.background_s: Optional[float] = None
        self.error: Optional[str] = None
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def start(cls, device_type: str) -> "CompilerStartup":
        warm = cls(device_type)
        t = time.perf_counter()
        import torch._inductor.async_compile  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
        import torch._inductor.cpu_vec_isa  # noqa: F401

        warm.import_s = time.perf_counter() - t
        warm._thread = threading.Thread(target=warm._background, name="harness-compiler-warmup", daemon=True)
        warm._thread.start()
        return warm

    def _background(self) -> None:
        t = time.perf_counter()
        try:
            from torch._inductor.async_compile import AsyncCompile
            from torch._inductor.cpu_vec_isa import pick_vec_isa

            if self.device_type == "cpu":
                pick_vec_isa()  # cached for the process (and its build products in the inductor cache dir)
            AsyncCompile.warm_pool()
        except Exception as e:  # a failed warm-up only means inductor does the same work later, in the first step
            self.error = f"{type(e).__name__}: {e}"
        self.background_s = time.perf_counter() - t

    def join(self) -> dict:
        """Wait for the background work; what it cost, for report.json's `compile` section."""
        t = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
        return {"toolchain_import_s": self.import_s, "toolchain_background_s": self.background_s,
                "toolchain_wait_s": time.perf_counter() - t, "toolchain_error": self.error}


def _probed_forward(probe: Optional["CompileProbe"], forward: Callable, *args, **kwargs):
    """A decoder block's forward with the probe's count in front, as one compiled function (see
    `compile_block_forwards`)."""
    if probe is not None:
        probe.count()
    return forward(*args, **kwargs)


def zero3_leaf_blocks(model: torch.nn.Module) -> list[str]:
    """Before `prepare()` under ZeRO-3 with compile: mark the decoder blocks as ZeRO-3 leaf modules
    (`deepspeed.utils.set_z3_leaf_modules`): the engine then gathers a block's parameters in the block's own hooks and
    puts no hooks on the modules inside it, so a compiled block forward contains no DeepSpeed code."""
    from deepspeed.utils import set_z3_leaf_modules

    blocks = repeated_blocks(model)
    if not blocks:
        return []
    set_z3_leaf_modules(model, [type(blocks[0])])
    return [type(blocks[0]).__name__]


def compile_block_forwards(model: torch.nn.Module, probe: Optional["CompileProbe"], compile_kwargs: dict) -> int:
    """ZeRO-3's regional compile: each decoder block's `forward` compiled, its `__call__` (the ZeRO-3 hooks: gather
    before, release after, the backward hooks) left eager.

    accelerate's `compile_regions_deepspeed` compiles each block's whole `_call_impl` in place, hooks included.
    dynamo then traces into ZeRO-3's per-module hooks (on every linear and norm inside the block), which guard on
    the module they serve: every hook recompiled for every submodule (default job, 2 processes, 20 steps: 126 graphs,
    dynamo's recompile limit hit in `_pre_backward_module_hook`). With the blocks as ZeRO-3 leaves
    (`zero3_leaf_blocks`) and only the forward compiled, no DeepSpeed code is inside a compiled region. The probe's
    count moves into the compiled function (its pre-hook would now run eagerly, outside it)."""
    compiled = torch.compile(_probed_forward, **compile_kwargs)
    blocks = repeated_blocks(model)
    if probe is not None:
        probe.remove()
    for block in blocks:
        block._compiled_call_impl = None  # accelerate's in-place compile of the whole call
        block.forward = functools.partial(compiled, probe, block.forward)
    return len(blocks)


class CompileProbe:
    """Counts how the repeated blocks (decoder layers) really ran: a forward pre-hook on each block records whether
    it executed inside compiled code (`torch.compiler.is_compiling()` is constant-folded to True in the compiled
    graph and its side effect replayed on every call) or eagerly. Catches compiled copies that never run.

    The counts live in a small tensor on the run's device, not in Python ints: dynamo guards on the value of an int it
    reads, so an int counter inside a compiled graph changes every step and forced a recompile of the whole model each
    step under `train.compile=full` (measured: 2 recompiles in 3 steps). The whole-tensor `add_` is part of the graph
    and its guard (shape, dtype, device) never changes. It must be a whole-tensor add: an indexed `counts[i] += 1`
    (select + in-place add on a view of a graph input, 8 times in an 8-layer graph) took the full compile of the
    8-layer benchmark model from 25 s to 220 s."""

    def __init__(self, blocks: list[torch.nn.Module], device: torch.device | str = "cpu"):
        self.counts = torch.zeros(2, dtype=torch.int64, device=device)  # [compiled, eager]
        self._inc = {True: torch.tensor([1, 0], device=device), False: torch.tensor([0, 1], device=device)}
        self.handles = [b.register_forward_pre_hook(self._hook) for b in blocks]

    def _hook(self, module, args):
        self.count()

    def count(self) -> None:
        self.counts.add_(self._inc[torch.compiler.is_compiling()])

    @property
    def calls(self) -> dict:
        compiled, eager = self.counts.tolist()
        return {"compiled": compiled, "eager": eager}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def dynamo_counters() -> dict:
    """Frames compiled, graphs produced and seconds spent compiling (dynamo + inductor, forward and backward
    graphs) so far by torch.compile in this process."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = sum(sum(compilation_time_metrics.get(k, [])) for k in
                  ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler"))
    return {"frames_compiled": int(counters["frames"]["ok"]), "graphs": int(counters["stats"]["unique_graphs"]),
            "compile_time_s": seconds}


class RecompileLimitWatch(logging.Handler):
    """Counts dynamo's "hit config.recompile_limit" warnings (a code object past its limit runs eagerly from then on,
    silently but for that warning): the functions that fell back, for report.json and a one-line warning."""

    LOGGER = "torch._dynamo.convert_frame"

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.functions: list[str] = []
        logging.getLogger(self.LOGGER).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith("torch._dynamo hit config.") and record.args:
            function = str(record.args[2]) if len(record.args) > 2 else "?"
            self.functions.append(f"{record.args[0]}={record.args[1]}: {function}")

    def close(self) -> None:
        logging.getLogger(self.LOGGER).removeHandler(self)
        super().close()


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: children of the largest ModuleList whose entries share one class (what regional
    compilation compiles)."""
    best: list[torch.nn.Module] = []
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > len(best) and len({type(c) for c in m}) == 1:
            best = list(m)
    return best

def narrow_regional_compile(model: torch.nn.Module) -> list[str]:
    """Keep accelerate's regional compilation on the repeated blocks only; returns the children put back to eager.

    accelerate's `compile_regions` (and `compile_regions_deepspeed`) compile the repeated decoder blocks, which share
    one compiled graph, and also every other leaf child (embeddings, rotary embedding, final norm, lm_head) as graphs
    of their own. Those are a lookup, an elementwise op and one matmul: compiling them gains next to nothing at run
    time but each costs a full dynamo + inductor compile (forward and backward) at start-up, which is most of the cold
    start of a shallow model. torch.compile is lazy, so undoing it after `prepare()` and before the first forward
    costs nothing: an `OptimizedModule` child is replaced by its original module, and a module compiled in place
    (DeepSpeed path) has its compiled call dropped."""
    from torch._dynamo.eval_frame import OptimizedModule

    from accelerate.utils.other import is_repeated_blocks

    restored = []
    for parent_name, parent in model.named_modules():
        if isinstance(parent, OptimizedModule) or is_repeated_blocks(parent):
            continue  # inside a compiled wrapper, or the decoder blocks themselves
        for name, child in list(parent.named_children()):
            if isinstance(child, OptimizedModule) and not has_blocks(child._orig_mod):
                setattr(parent, name, child._orig_mod)
                restored.append(f"{parent_name}.{name}".lstrip(".").removeprefix("module."))
            elif getattr(child, "_compiled_call_impl", None) is not None and not has_blocks(child):
                child._compiled_call_impl = None
                restored.append(f"{parent_name}.{name}".lstrip(".").removeprefix("module."))
    return sorted(restored)


def has_blocks(module: torch.nn.Module) -> bool:
    from accelerate.utils.other import has_repeated_blocks, is_repeated_blocks

    return is_repeated_blocks(module) or has_repeated_blocks(module)


class CompileWatch:
    """torch.compile in one run: started before the set-up (`CompilerStartup`), told when the model is built, prepared,
    the loop starts and the first step ends; `report()` is report.json's `compile` section."""

    def __init__(self, mode: str, device: torch.device, zero_stage: Optional[int] = None):
        self.mode, self.device, self.zero_stage = mode, device, zero_stage
        self.zero3_leaves: list[str] = []
        self.startup = CompilerStartup.start(device.type)
        self.probe: Optional[CompileProbe] = None
        self.limit = RecompileLimitWatch()
        self.left_eager: list[str] = []
        self.toolchain: dict = {}
        self.before_first = self.after_first = dynamo_counters()
        self.first_step_s = 0.0
        self.warmed: Optional[dict] = None  # harness.speed.buckets: embedding shapes run before step 1
        # graphs compiled apart from the training step (loss.mode=rl: the engine's decode step, its batch buckets and
        # its greedy form at the first evaluation; the objective's generation_graphs): reported on their own, not as
        # the step's recompiles
        self.apart_after_first = 0

    def model_built(self, model: torch.nn.Module) -> None:
        """Before `accelerator.prepare`."""
        self.probe = CompileProbe(repeated_blocks(model), self.device)
        if self.mode == "regional" and self.zero_stage == 3:
            self.zero3_leaves = zero3_leaf_blocks(model)

    def model_prepared(self, model: torch.nn.Module, say: Callable[[str], None], compile_kwargs: dict) -> None:
        """After `accelerator.prepare` and before the model first runs. compile_kwargs: accelerate's
        (`dynamo_plugin.to_kwargs()`)."""
        if self.mode == "regional":  # accelerate compiled every leaf too; keep the repeated blocks only
            self.left_eager = narrow_regional_compile(model)
            how = "decoder blocks compiled"
            if self.zero3_leaves:
                compile_block_forwards(model, self.probe, compile_kwargs)
                how = "decoder block forwards compiled (ZeRO-3 leaves: their hooks run eagerly)"
            say(f"[harness] regional compile: {how}; left eager: {', '.join(self.left_eager) or 'nothing'}")
        self.toolchain = self.startup.join()  # compile seconds from here on are the model's own

    def loop_starts(self) -> None:
        self.before_first = self.after_first = dynamo_counters()  # before: step-0 evaluation, batch-size trial

    def logged(self) -> dict:
        """metrics.jsonl's compile fields at a log line: graphs and compile seconds so far (scripts/gpu_check.py finds
        the step of the last recompile and the steady state after it from them)."""
        now = dynamo_counters()
        return {"compile_graphs": now["graphs"], "compile_s": now["compile_time_s"]}

    def first_step_done(self, seconds: float, apart: int = 0) -> None:
        """The first step of this process carries the (cold) compilation; `apart`: the graphs compiled apart from
        the training step so far."""
        self.first_step_s, self.after_first, self.apart_after_first = seconds, dynamo_counters(), apart

    def report(self, train_time_s: float, steps: int, say: Callable[[str], None], apart: int = 0) -> dict:
        """report.json's `compile` section at the end of the loop. The probe stays on the blocks until `close()`:
        code compiled over them (the RL engine's decode step traces the model whole) guards on the blocks' hooks,
        and removing them here made the final evaluation compile that code again."""
        now, calls = dynamo_counters(), self.probe.calls  # calls: read off the device once
        recompiles = now["graphs"] - self.after_first["graphs"] - (apart - self.apart_after_first)
        before, after = self.before_first["compile_time_s"], self.after_first["compile_time_s"]
        out = {
            "mode": self.mode, "first_step_s": self.first_step_s,
            "later_step_mean_s": (train_time_s - self.first_step_s) / max(1, steps - 1),
            "cold_compile_s": after, "compile_time_total_s": now["compile_time_s"],
            "graphs": now["graphs"], "frames_compiled": now["frames_compiled"],
            "recompiles_after_first_step": recompiles, "generation_graphs": apart,
            "block_calls_compiled": calls["compiled"], "block_calls_eager": calls["eager"],
            "ran_compiled": calls["compiled"] > 0, "left_eager": self.left_eager,
            "compile_before_first_step_s": before, "recompile_limit_hit": list(self.limit.functions),
            "warmed_embedding_shapes": self.warmed,
            **self.toolchain,
        }
        say(f"[harness] compile ({self.mode}): cold compile {after:.1f}s up to the end of the first step "
            f"({self.first_step_s:.1f}s)"
            + (f", {before:.1f}s of it before the loop (warm-up / step-0 evaluation / batch trial)" if before else "")
            + f", {now['compile_time_s']:.1f}s in all; {now['graphs']} graphs, {out['recompiles_after_first_step']} "
            f"recompiles after step 1; decoder-block calls compiled {calls['compiled']}, eager {calls['eager']}"
            + (f"; the generation's decode step: {apart} of the graphs (its batch buckets, sampled and greedy)"
               if apart else ""))
        t = self.toolchain
        if t:
            say(f"[harness] compiler start-up before the first step: imports {t['toolchain_import_s']:.1f}s, "
                f"ISA probe and workers {t['toolchain_background_s']:.1f}s in the background during set-up "
                f"(waited {t['toolchain_wait_s']:.1f}s)"
                + (f"; warm-up failed: {t['toolchain_error']}" if t["toolchain_error"] else ""))
        if self.limit.functions:
            say(f"[harness] warning: torch.compile hit dynamo's recompile limit {len(self.limit.functions)} time(s) "
                f"and runs those functions eagerly from then on (first: {self.limit.functions[0]}); the report's "
                f"compile.recompile_limit_hit lists them")
        if not out["ran_compiled"]:
            say("[harness] warning: torch.compile was requested but no compiled decoder block ever ran")
        return out

    def close(self) -> None:
        """At the run's exit (its ExitStack), after the final evaluation: the probe off the blocks, the recompile-limit
        watch off dynamo's logger."""
        if self.probe is not None:
            self.probe.remove()
        self.limit.close()
