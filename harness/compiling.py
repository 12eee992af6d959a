"""torch.compile's one-off start-up costs, paid while the run sets up instead of inside the first step.

Before inductor compiles the first graph of a process it imports itself (about 2 s here), probes the CPU's vector
instruction sets by building and loading a small C++ library per candidate (about 6.5 s with an empty inductor cache,
1 s once the cache holds the probes; CPU devices only) and starts its pool of compile workers. None of that depends on
the model. `CompilerWarmup.start` does the imports at once in the calling thread (imports from two threads at once
can deadlock on the import locks) and runs the probe and the pool start-up in a background thread, where they overlap
the tokenizer, data and model set-up: the probe is mostly a C++ compiler in a subprocess, so it costs the main thread
nothing. `join()` waits for it before the first step, so the dynamo/inductor seconds counted in the first step are
the model's own compilation, and reports how long the background work took and how long the main thread waited.
"""

from __future__ import annotations

import threading
import time
from typing import Optional


class CompilerWarmup:
    def __init__(self, device_type: str):
        self.device_type = device_type
        self.import_s = 0.0
        self.background_s: Optional[float] = None
        self.error: Optional[str] = None
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def start(cls, device_type: str) -> "CompilerWarmup":
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
