"""train.micro_batch_size=auto: the largest micro-batch that fits in memory, found by trying.

accelerate's `find_executable_batch_size` retries the whole run with a smaller micro-batch when a try runs out of
memory (its documented pattern). Each try starts with `memory_trial`, a forward and backward pass of the longest
micro-batch the data can produce, so that a micro-batch that does not fit fails before the first real step (under
DeepSpeed the first step is the trial). `train.grad_accum` follows, so the global batch stays as configured.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Callable

import torch

from harness.config import Config
from harness.errors import HarnessError


def memory_trial(job) -> None:
    """train.micro_batch_size=auto: one forward and backward of the longest micro-batch the data can produce, with
    gradients discarded and the RNG put back (the run is unchanged). Every process takes part and they agree: when
    one ran out of memory, all raise the out-of-memory error that find_executable_batch_size reacts to."""
    accelerator, model, optimizer, objective = job.accelerator, job.model, job.optimizer, job.objective
    loader = job.data.gen
    lengths = loader.dataset["length"]
    longest = sorted(range(len(lengths)), key=lambda i: -lengths[i])[: loader.batch_size]
    batch = {k: v.to(accelerator.device) for k, v in loader.collate_fn([loader.dataset[i] for i in longest]).items()}
    rng, failed = torch.random.get_rng_state(), ""
    try:
        with accelerator.no_sync(model):
            objective.micro_step(batch, None, objective.gen_scale([batch]))
    except RuntimeError as e:
        from accelerate.utils.memory import should_reduce_batch_size

        if not should_reduce_batch_size(e):
            raise
        failed = str(e).splitlines()[0]
    optimizer.zero_grad(set_to_none=True)
    torch.random.set_rng_state(rng)
    if accelerator.reduce(torch.tensor([float(bool(failed))], device=accelerator.device), "max").item():
        accelerator.free_memory()
        raise RuntimeError(f"micro-batch {loader.batch_size} ran out of memory. ({failed or 'on another process'})")


def run_auto_batch(cfg: Config, run: Callable[..., dict]) -> dict:
    """train.micro_batch_size=auto: the largest micro-batch that fits, from the per-process share of
    train.global_batch_size down (accelerate's find_executable_batch_size; each retry takes the largest divisor of
    the share at most half the last size), with grad_accum = share / micro-batch so the global batch is kept.
    `run(cfg, auto_batch=...)` is the training run (harness.train.run), retried whole with each size."""
    import gc

    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import find_executable_batch_size

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.train.global_batch_size % world:
        raise HarnessError(f"config key 'train.global_batch_size': {cfg.train.global_batch_size} does not divide "
                           f"over {world} processes")
    share = cfg.train.global_batch_size // world
    tried: list[int] = []
    environ = dict(os.environ)  # accelerate records its DeepSpeed choice in the environment: start each try afresh

    def smaller() -> int:
        return max((d for d in range(1, tried[-1] // 2 + 1) if share % d == 0), default=0)

    @find_executable_batch_size(starting_batch_size=share, reduce_batch_size_fn=smaller)
    def attempt(micro: int) -> dict:
        if tried:  # a fresh accelerator state (DeepSpeed's filled-in batch values) for the retry
            AcceleratorState._reset_state(reset_partial_state=False)
            GradientState._reset_state()
            os.environ.clear()
            os.environ.update(environ)
            gc.collect()
            print(f"[harness] micro-batch {tried[-1]} did not fit: trying {micro}", flush=True)
        tried.append(micro)
        sub = replace(cfg, train=replace(cfg.train, micro_batch_size=micro, grad_accum=share // micro))
        return run(sub, auto_batch={"global_batch_size": cfg.train.global_batch_size, "tried": list(tried),
                                    "micro_batch_size": micro, "grad_accum": share // micro})

    try:
        return attempt()
    except RuntimeError as e:
        if "No executable batch size found" in str(e):
            raise HarnessError(f"train.micro_batch_size=auto: even a micro-batch of 1 does not fit in memory (tried "
                               f"{tried}); use model.gradient_checkpointing=true, a shorter data.max_len or ZeRO-3") from None
        raise
