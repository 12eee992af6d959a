"""train.malloc_reuse (harness/hardware.py reuse_freed_memory): glibc keeps the memory a step frees for the next
step instead of handing it back to the kernel, so the next step does not fault every page in again.

    python -m pytest tests/test_malloc.py
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from harness import hardware

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# In a fresh process (mallopt is process-wide): where glibc serves a 30 MiB block (a layer's activations), and
# whether the heap keeps it once freed. By default a block above the adaptive mmap threshold (128 KiB at start) is
# its own mapping, handed back to the kernel by free(), and faulted in (zeroed) again at the next step's malloc;
# with reuse every block under 32 MiB comes from the heap, whose top is never trimmed.
WHERE = """
import ctypes, json, sys
from harness import hardware
got = hardware.reuse_freed_memory(sys.argv[1] == "reuse")
libc = ctypes.CDLL(None)
libc.sbrk.restype = libc.malloc.restype = ctypes.c_void_p
libc.sbrk.argtypes, libc.free.argtypes = [ctypes.c_ssize_t], [ctypes.c_void_p]
block = libc.malloc(30 << 20)
in_heap = block < libc.sbrk(0)  # the heap ends at the program break; mappings lie far above it
brk = libc.sbrk(0)
libc.free(block)
print(json.dumps({"malloc": got, "in_heap": in_heap, "kept": libc.sbrk(0) == brk}))
"""


def _where(mode: str) -> dict:
    root = Path(__file__).resolve().parent.parent
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(root)}  # no MALLOC_* of the caller's
    proc = subprocess.run([sys.executable, "-c", WHERE, mode], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="mallopt's thresholds are glibc's")
def test_a_freed_block_stays_with_the_process_for_the_next_step():
    default, reuse = _where("default"), _where("reuse")
    assert default == {"malloc": "default (train.malloc_reuse=false)", "in_heap": False, "kept": True}  # a mapping
    assert reuse == {"malloc": "freed memory reused (mmap threshold 32 MiB, no trim)", "in_heap": True, "kept": True}


def test_left_alone_when_off_or_tuned_by_the_user(monkeypatch):
    # each returns before mallopt: nothing of this pytest process changes
    assert hardware.reuse_freed_memory(False) == "default (train.malloc_reuse=false)"
    if not GLIBC:
        assert hardware.reuse_freed_memory(True) == "default (not glibc)"
        return
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    assert hardware.reuse_freed_memory(True) == "default (left as set: MALLOC_TRIM_THRESHOLD_)"
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert hardware.reuse_freed_memory(True) == "default (left as set: LD_PRELOAD)"
