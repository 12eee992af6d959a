"""Writing files safely: JSON written atomically, a finished folder renamed into place, a failed write told apart as
a full disk, byte counts for messages; a file's fingerprint (size and its first and last 64 KiB). Imports no torch.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

from harness.errors import one_line

NEARLY_FULL = 64 << 20  # free bytes below which a failed write is taken for a full disk (see `disk_full`)


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def write_json(path: str | Path, obj: dict) -> None:
    """Write JSON atomically (temporary file + rename; a failed write leaves the previous file and no temporary)."""
    write_text(path, json.dumps(obj, indent=2, default=str))


def write_text(path: str | Path, text: str) -> None:
    """Write a text file (UTF-8) atomically, as `write_json`."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def replace_dir(tmp: Path, dest: Path) -> None:
    """Move the finished `tmp` folder to `dest`, replacing an older `dest` (rename is atomic on one filesystem)."""
    old = dest.with_name(dest.name + ".old")
    if dest.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(dest, old)
    os.replace(tmp, dest)
    if old.exists():
        shutil.rmtree(old)


def free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def disk_full(exc: BaseException, folder: Path) -> bool:
    """Whether a failed write ran out of space. ENOSPC / EDQUOT anywhere in the exception's chain, or a message that
    says so (safetensors: 'No space left on device (os error 28)'); torch.save reports ENOSPC only as 'unexpected pos
    ... vs ...', so a failure while the folder's filesystem has under NEARLY_FULL bytes free counts as well."""
    seen, e = 0, exc
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(s in str(e) for s in ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    try:
        return free_bytes(folder) < NEARLY_FULL
    except OSError:
        return False


def lost_errno(exc: BaseException) -> bool:
    """A failed write whose exception lost the OS error: torch.save's zip writer says only 'unexpected pos ... vs ...'
    or 'PytorchStreamWriter failed writing file' (its errno, EFBIG, EDQUOT or ENOSPC, is dropped); safetensors
    raises its own SafetensorError, the errno only in its words ('File too large (os error 27)', 122: a quota)."""
    if type(exc).__name__ == "SafetensorError":
        return any(f"(os error {n})" in str(exc) for n in (errno.EFBIG, errno.EDQUOT, errno.ENOSPC))
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in ("unexpected pos", "failed writing file"))


def write_cause(exc: BaseException, folder: Path) -> str:
    """The cause of a failed write into `folder`, with its errno where the exception lost it (`lost_errno`): the
    process's file-size limit (RLIMIT_FSIZE: EFBIG), or the error a small probe write into the folder gets now (a
    quota: EDQUOT; a full disk: ENOSPC); else the exception's own words."""
    if not lost_errno(exc):
        return one_line(exc)
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return (f"[Errno {errno.EFBIG}] {os.strerror(errno.EFBIG)}: this process's file-size limit (ulimit -f) is "
                f"{human_bytes(limit)}")
    probe = Path(folder) / ".write-probe"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return f"[Errno {e.errno}] {e.strerror}"
    finally:
        probe.unlink(missing_ok=True)
    return f"{one_line(exc)}: torch.save names no cause, and a 1 MiB write there works now"


def json_beyond_limits(exc: BaseException) -> str:
    """What a JSON text that is valid but beyond Python's reader holds (RecursionError: nesting; ValueError: an
    integer of more than sys.get_int_max_str_digits() digits), as the end of a one-line error."""
    if isinstance(exc, RecursionError):
        return f"JSON nested too deeply (more than about {sys.getrecursionlimit()} levels of arrays or objects)"
    digits = re.search(r"value has (\d+) digits", str(exc))
    if digits:
        return (f"an integer of {digits.group(1)} digits (Python reads at most {sys.get_int_max_str_digits()}); "
                f"write it as a string")
    return f"unreadable JSON ({' '.join(str(exc).split())[:200]})"


FINGERPRINT_BLOCK = 64 << 10  # bytes hashed at each end of a file by `fingerprint`


def fingerprint(path: str | Path, block: int = FINGERPRINT_BLOCK) -> dict:
    """{"size", "ends"}: the file's size and a hash of its first and last `block` bytes: what tells a data file that
    changed (rows appended, edited at either end, replaced) without reading it all (128 KiB a file)."""
    size = os.path.getsize(path)
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        digest.update(f.read(block))
        if size > block:
            f.seek(max(block, size - block))
            digest.update(f.read(block))
    return {"size": size, "ends": digest.hexdigest()}


def prefix_fingerprint(path: str | Path, size: int, block: int = FINGERPRINT_BLOCK) -> str:
    """A hash of the file's first `size` bytes as `fingerprint` hashes a file (its first and last `block` bytes of
    them): what a streamed checkpoint read of a file (data.streaming: its byte offset), compared on resume."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        digest.update(f.read(min(block, size)))
        if size > block:
            f.seek(max(block, size - block))
            digest.update(f.read(size - max(block, size - block)))
    return digest.hexdigest()


def fingerprint_change(old: dict, new: dict) -> str:
    """What differs between two fingerprints of one source, in a few words: `fingerprint`'s (size, ends) of a file, or
    the settings of a task made from settings (harness.checkpoint.datafiles.task_fingerprint)."""
    if "settings" in old or "settings" in new:  # the arithmetic task (checkpoint/datafiles.py task_fingerprint): what differs
        a, b = (dict(kv.split("=", 1) for kv in str(fp.get("settings", "")).split(", ") if "=" in kv)
                for fp in (old, new))
        return ", ".join(f"{k} {a.get(k)} -> {b.get(k)}" for k in [*a, *(k for k in b if k not in a)]
                         if a.get(k) != b.get(k))
    if old["size"] != new["size"]:
        return f"{old['size']} -> {new['size']} bytes"
    return f"same size, {old['ends'][:8]} -> {new['ends'][:8]} at its first or last 64 KiB"
