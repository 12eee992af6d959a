"""Device facts: what the hardware supports, peak FLOP/s by GPU name, the environment report.

    harness env        # print the environment report

Facts only; the one policy here is `resolve_precision`, the documented mapping from `train.precision: auto`
to a concrete precision.
"""

from __future__ import annotations

import ctypes
import os
import platform
from importlib import metadata
from typing import Optional

import torch

from harness.errors import ConfigError

# Dense (no sparsity) peak tensor-core FLOP/s for bf16/fp16 with fp32 accumulation, per GPU, from the vendors'
# data sheets. Matched on the lower-cased device name, most specific pattern first (a pattern that contains another,
# like gh200 and h200, must come before it).
PEAK_FLOPS_BF16: list[tuple[tuple[str, ...], float, str]] = [
    (("gh200",), 989e12, "GH200"),
    (("h200",), 989e12, "H200"),
    (("h100", "nvl"), 835e12, "H100 NVL"),
    (("h100", "pcie"), 756e12, "H100 PCIe"),
    (("h100",), 989e12, "H100 SXM"),
    (("h800",), 989e12, "H800"),
    (("a100",), 312e12, "A100"),
    (("a800",), 312e12, "A800"),
    (("l40s",), 362e12, "L40S"),
    (("l40",), 181e12, "L40"),
    (("6000", "ada"), 364e12, "RTX 6000 Ada"),
    (("a6000",), 155e12, "RTX A6000"),
    (("a10g",), 70e12, "A10G"),
    (("a10",), 125e12, "A10"),
    (("4090",), 165e12, "RTX 4090"),
    (("3090",), 71e12, "RTX 3090"),
    (("v100",), 125e12, "V100 (fp16)"),
    (("t4",), 65e12, "T4 (fp16)"),
]


def peak_flops(device_name: str) -> tuple[Optional[float], str]:
    """(peak bf16/fp16 FLOP/s, matched name) for a CUDA device name; (None, reason) when unknown."""
    name = device_name.lower()
    for keys, flops, label in PEAK_FLOPS_BF16:
        if all(k in name for k in keys):
            return flops, label
    return None, f"unknown GPU '{device_name}': MFU not reported"


def bf16_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def resolve_precision(requested: str) -> str:
    """`auto` -> bf16 on GPUs with bf16, fp16 on older GPUs, fp32 on CPU. Explicit requests are checked."""
    cuda = torch.cuda.is_available()
    if requested == "auto":
        if not cuda:
            return "fp32"
        return "bf16" if bf16_supported() else "fp16"
    if requested == "fp16" and not cuda:
        raise ConfigError("config key 'train.precision': fp16 needs a CUDA GPU; use fp32 or bf16 on CPU")
    if requested == "bf16" and cuda and not bf16_supported():
        raise ConfigError(
            f"config key 'train.precision': {torch.cuda.get_device_name()} has no bf16; use fp16 or auto"
        )
    return requested


def check_attention(attn_implementation: str) -> None:
    """model.attn_implementation that this machine cannot run: flash-attention kernels need a CUDA GPU and the
    flash_attn package, flex attention's backward pass a GPU (checked before any model is built)."""
    import importlib.util

    if attn_implementation == "flex_attention" and not torch.cuda.is_available():
        raise ConfigError("config key 'model.attn_implementation': flex_attention trains on a GPU only (torch has no "
                          "backward pass for it on CPUs); use sdpa or auto on this machine")
    if attn_implementation.startswith("flash_attention"):
        if not torch.cuda.is_available():
            raise ConfigError(f"config key 'model.attn_implementation': {attn_implementation} needs a CUDA GPU; use "
                              f"sdpa on this machine")
        if attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            raise ConfigError("config key 'model.attn_implementation': flash_attention_2 needs the flash-attn package "
                              "(pip install flash-attn); sdpa uses flash kernels through PyTorch without it")


def compute_precision(precision: str) -> str:
    """The autocast dtype of a resolved precision: fp8 computes in bf16 outside its float8 Linear layers."""
    return "bf16" if precision == "fp8" else precision


def accelerate_mixed_precision(precision: str) -> str:
    return {"fp32": "no", "bf16": "bf16", "fp16": "fp16", "fp8": "bf16"}[precision]


def enable_tf32(enabled: bool) -> bool:
    """Allow TF32 matmuls/convolutions on Ampere or newer; returns whether TF32 is now in use."""
    if not torch.cuda.is_available():
        return False
    ampere = torch.cuda.get_device_capability()[0] >= 8
    on = bool(enabled and ampere)
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    return on


# glibc's mallopt parameters (malloc.h) and the values reuse_freed_memory sets
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 * 2**20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: 2 GiB of free heap top kept, in effect never trimmed
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def reuse_freed_memory(enabled: bool) -> str:
    """train.malloc_reuse: make glibc's malloc keep the memory a step frees for the next step. By default glibc
    hands a block above its (adaptive) mmap threshold back to the kernel when it is freed, and trims the heap's free
    top above its trim threshold; a CPU training step allocates and frees the same activations every step, so the
    next step faults every page in again and the kernel zeroes it (measured on the default job, 2 cores: 25-85k
    minor page faults a second, 7-17% of the time in the kernel, the harness's step 5% slower than the same loop in
    a process that happened to fault less; none with this). Fixed thresholds (32 MiB mmap, 2 GiB trim, mallopt)
    keep blocks under 32 MiB in the heap and never trim it: the process's resident size stays at its peak, which
    every step reaches anyway. Left alone where the user tuned malloc (its environment variables, another allocator
    preloaded) or the C library is not glibc. Returns what was done, for the start-of-run log."""
    if not enabled:
        return "default (train.malloc_reuse=false)"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "default (not glibc)"
    tuned = [k for k in _MALLOC_ENV if os.environ.get(k)]
    preload = os.environ.get("LD_PRELOAD", "")
    if tuned or any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return f"default (left as set: {', '.join(tuned) or 'LD_PRELOAD'})"
    libc = ctypes.CDLL(None)
    ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    return "freed memory reused (mmap threshold 32 MiB, no trim)" if ok else "default (mallopt refused)"


def sdpa_backends() -> dict:
    """Which scaled-dot-product-attention kernels torch may pick (flash and memory-efficient need CUDA)."""
    b = torch.backends.cuda
    cuda = torch.cuda.is_available()
    return {
        "flash": bool(cuda and b.flash_sdp_enabled()),
        "memory_efficient": bool(cuda and b.mem_efficient_sdp_enabled()),
        "cudnn": bool(cuda and getattr(b, "cudnn_sdp_enabled", lambda: False)()),
        "math": bool(b.math_sdp_enabled()),
    }


def describe(env: dict) -> str:
    """One line for the start-of-run log."""
    gpus = ", ".join(f"{g['name']} ({g['memory_gb']} GB)" for g in env["gpus"]) or f"CPU, {env['cpu_count']} cores"
    v = env["versions"]
    sdpa = "+".join(k for k, on in env["sdpa"].items() if on)
    return (f"{gpus}; torch {env['torch']} (CUDA {env['cuda']}), accelerate {v['accelerate']}, transformers "
            f"{v['transformers']}, deepspeed {v['deepspeed']}; SDPA {sdpa}" +
            (f"; malloc {env['malloc']}" if env.get("malloc") else ""))


def _version(pkg: str) -> Optional[str]:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def environment_report() -> dict:
    """Versions, devices and memory, for report.json and the start-of-run log."""
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            flops, label = peak_flops(p.name)
            gpus.append({
                "name": p.name,
                "memory_gb": round(p.total_memory / 2**30, 1),
                "capability": f"{p.major}.{p.minor}",
                "peak_bf16_tflops": flops / 1e12 if flops else None,
                "matched": label,
            })
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": gpus,
        "bf16_supported": bf16_supported(),
        "sdpa": sdpa_backends(),
        "versions": {
            p: _version(p)
            for p in ("harness", "accelerate", "transformers", "deepspeed", "peft", "datasets", "tensorboard", "tokenizers")
        },
    }


def process_start_time() -> float:
    """Unix time at which this process started (Linux: from /proc; elsewhere: now). A time window counts from
    here, so interpreter start-up and imports are part of it."""
    import os
    import time

    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime: clock ticks after boot
        uptime = float(open("/proc/uptime").read().split()[0])
        return time.time() - (uptime - started)
    except (OSError, ValueError, IndexError):
        return time.time()
