"""harness: a training harness for language models (generative and GritLM-style embedding objectives).

Train the default job:  python -m harness.train --config configs/default.yaml
From Python:            import harness; harness.train("configs/grpo-tiny.yaml", ["train.max_steps=5"], reward_funcs=[fn])
See README.md for the quickstarts and docs/multi-gpu.md for CPU, single-GPU, multi-GPU and multi-node launches.
"""

import logging
import os
import sys

__version__ = "0.1.0"

IGNORE_INDEX = -100  # the label of positions the loss skips (torch cross_entropy's ignore_index)

# Start-up noise of the libraries the harness imports, said on every command and meaningless to its users: each
# (logger, text) is one known message, dropped on that library logger alone; every other message of those libraries,
# and all of the harness's own, is left as it is.
QUIET = {
    "torchao": ("Failed to load ",),  # its CUDA-only .so files (mxfp8, cutlass) on a machine they do not load on
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),  # torchao's register_constant
    "transformers.integrations.hub_kernels": ("`kernels` is either not installed",),  # the `pip install kernels` notice
    "DeepSpeed": ("Setting accelerator to CPU",),  # DeepSpeed's import on a machine without a GPU
    "accelerate.utils.other": ("Removed shared tensor",),  # tied weights saved once, as intended
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),  # `import peft` on a CPU machine
    # the kernel hub's note on every LoRA run under HF_HUB_OFFLINE (bitsandbytes' kernel read from the local cache)
    "kernels._internals.hf_hub": ("Skipping publisher trust check for ",),
    # accelerate's launcher on a CPU when its one default is the threads per process (launch/train.sh, every run); the
    # message with any other default left out is left as it is
    "accelerate.commands.launch": ("had defaults used instead:\n\t`--num_cpu_threads_per_process` was set to",),
    # torch elastic's banner on every launch of several processes per node (launch/train.sh, accelerate's launcher)
    "torch.distributed.run": ("Setting OMP_NUM_THREADS environment variable for each process to be 1 in default",),
}

# Progress bars of the libraries (transformers' "Writing model shards" at every export, the hub's downloads) only where
# someone watches them, on a terminal (or a notebook): in a log file or launch/train.sh's train.log every redraw is
# another run of carriage returns. The harness's own bar follows the same rule (harness.observe.metrics.progress_bar).
if not (getattr(sys.stderr, "isatty", lambda: False)() or "ipykernel" in sys.modules):
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


class _KnownNoise(logging.Filter):
    def __init__(self, texts: tuple):
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(t in message for t in self.texts)


for _name, _texts in QUIET.items():
    logging.getLogger(_name).addFilter(_KnownNoise(_texts))


def __getattr__(name: str):
    """`harness.train`, the Python API (harness/api.py), imported when first asked for: `import harness` stays light."""
    if name == "train":
        import harness.train  # lazy: start-up time (the API's torch only when it is called; the import sets the name)

        return harness.train
    raise AttributeError(f"module 'harness' has no attribute {name!r}")
