"""Checkpoint manifests: COMPLETE is a JSON manifest of what a save wrote (every file's relative path, size and
checksum, read back from disk after the save), written last and atomically; a resume verifies the checkpoint against
it before loading (`verify_checkpoint`). Checksums are xxh3-128 from `xxhash` (a dependency of `datasets`, about 18
GiB/s on one core here, so the cost of a verification is reading the files: docs/benchmarks.md), or blake2b from the
standard library (about 0.5 GiB/s) where xxhash is missing; the manifest names its algorithm. The hashing is split
between the processes by file size (`distributed.spread`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from harness.distributed.collectives import broadcast, is_main, spread

try:
    import xxhash
except ImportError:  # pragma: no cover - datasets depends on it
    xxhash = None

MARKER = "COMPLETE"
STATE_FILE = "harness_state.json"  # the loop state saved with every checkpoint (harness.checkpoint.store)
MANIFEST_FORMAT = 1
LEGACY_MARKER = b"complete"  # what COMPLETE held before it carried a manifest
ALGORITHM = "xxh3_128" if xxhash is not None else "blake2b"
CHUNK = 4 << 20  # bytes per read when hashing, one reused buffer (1, 4 and 16 MiB measured the same here)


def _hasher(algorithm: str):
    if algorithm == "xxh3_128" and xxhash is not None:
        return xxhash.xxh3_128()
    if algorithm == "blake2b":
        return hashlib.blake2b()
    raise ValueError(f"checksum algorithm {algorithm} is not available (pip install xxhash)")


def file_checksum(path: str | Path, algorithm: str = ALGORITHM) -> tuple[int, str]:
    """(bytes read, hex digest) of a file, read in CHUNK-sized pieces into one reused buffer."""
    h = _hasher(algorithm)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total = 0
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
            total += n
    return total, h.hexdigest()


def manifest_files(folder: Path) -> list[tuple[str, int]]:
    """(relative path, size) of every regular file under `folder` but the marker, sorted by path."""
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and not p.is_symlink() and rel not in (MARKER, MARKER + ".tmp"):
            out.append((rel, p.stat().st_size))
    return out


def folder_size(folder: Path) -> int:
    return sum(size for _, size in manifest_files(folder)) if folder.is_dir() else 0


def build_manifest(folder: str | Path, accelerator=None, algorithm: str = ALGORITHM) -> dict:
    """The COMPLETE manifest of what `folder` holds now: {"format", "algorithm", "files": [{"path", "size",
    "checksum"}]}, the files read back from disk. Collective when `accelerator` runs several processes (the hashing is
    split between them by size). OSError when a file cannot be read back (the same on every process)."""
    folder = Path(folder)
    files = broadcast(accelerator, manifest_files(folder) if is_main(accelerator) else None)

    def one(rel: str):
        try:
            return file_checksum(folder / rel, algorithm)
        except OSError as e:
            return f"{rel}: {e.strerror or e}"

    sums = spread(accelerator, files, one)
    bad = [r for r in sums.values() if isinstance(r, str)]
    if bad:
        raise OSError(f"could not read back {folder}: {'; '.join(bad)}")
    return {"format": MANIFEST_FORMAT, "algorithm": algorithm,
            "files": [{"path": rel, "size": sums[rel][0], "checksum": sums[rel][1]} for rel, _ in files]}


def write_marker(folder: str | Path, manifest: dict) -> None:
    """COMPLETE, atomically (temporary file, fsync, rename): a crash leaves either no marker or the whole one."""
    folder = Path(folder)
    tmp = folder / (MARKER + ".tmp")
    head = json.dumps({k: v for k, v in manifest.items() if k != "files"})[:-1]
    rows = ",\n".join("  " + json.dumps(e) for e in manifest["files"])
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(f'{head}, "files": [\n{rows}\n]}}\n')  # one line per file
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, folder / MARKER)


def read_manifest(folder: str | Path) -> Optional[dict]:
    """The manifest in `folder`'s COMPLETE marker, or None for the marker of an older harness (the text "complete",
    no checksums): such a checkpoint is unverifiable but accepted, i.e. resumed from without verification (with a
    note), kept by rotation like any other, and never preferred to a verifiable one when rotation must choose.
    ValueError when the marker is not one of the two (cut, zeroed, edited); OSError when it cannot be read."""
    raw = (Path(folder) / MARKER).read_bytes()
    if raw.strip() == LEGACY_MARKER:
        return None
    try:
        m = json.loads(raw.decode("utf-8"))
        ok = (isinstance(m, dict) and isinstance(m.get("algorithm"), str) and isinstance(m.get("files"), list)
              and all(isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("size"), int)
                      and isinstance(e.get("checksum"), str) for e in m["files"]))
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        ok = False
    if not ok:
        raise ValueError(f"{MARKER} marker unreadable ({len(raw)} bytes, neither a manifest nor an older marker)")
    return m


def has_manifest(folder: str | Path) -> bool:
    try:
        return read_manifest(folder) is not None
    except (OSError, ValueError):
        return False


def checkpoint_size(folder: str | Path) -> int:
    """Bytes of a checkpoint: what its manifest recorded, else what is on disk."""
    try:
        m = read_manifest(folder)
    except (OSError, ValueError):
        m = None
    return sum(e["size"] for e in m["files"]) if m else folder_size(Path(folder))


@dataclass
class Verification:
    """What `verify_checkpoint` found: `problems` (empty: intact), one per file, e.g. 'optimizer.bin: checksum
    differs'; legacy: a marker without checksums (accepted unverified, see `read_manifest`)."""

    path: Path
    problems: list[str] = field(default_factory=list)
    legacy: bool = False
    files: int = 0  # files checked
    size: int = 0  # their bytes

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self, limit: int = 3) -> str:
        more = len(self.problems) - limit
        return "; ".join(self.problems[:limit]) + (f"; and {more} more" if more > 0 else "")


def verify_checkpoint(folder: str | Path, accelerator=None) -> Verification:
    """Check a checkpoint against its manifest: every file present with its recorded size (cheap, all files first),
    then every checksum (reads everything). Collective when `accelerator` runs several processes: the main process
    reads the marker and checks the sizes, the checksums are split between the processes by size, and every process
    gets the same result."""
    folder = Path(folder)

    def first_look():
        try:
            m = read_manifest(folder)
        except (OSError, ValueError) as e:
            return [str(e) if isinstance(e, ValueError) else f"{MARKER} marker unreadable ({e.strerror or e})"], None
        if m is None:
            return [], None
        problems = []
        listed = {e["path"] for e in m["files"]}
        for rel, _ in manifest_files(folder):  # a file the save did not write (or the manifest lost) may be loaded
            if rel not in listed and rel != STATE_FILE + ".tmp":
                problems.append(f"{rel}: not in the manifest")
        for e in m["files"]:
            p = folder / e["path"]
            if not p.is_file():
                problems.append(f"{e['path']}: missing")
            elif p.stat().st_size != e["size"]:
                problems.append(f"{e['path']}: size differs ({e['size']} bytes recorded, {p.stat().st_size} on disk)")
        try:
            _hasher(m["algorithm"])
        except ValueError as err:
            problems.append(str(err))
        return problems, m

    problems, manifest = broadcast(accelerator, first_look() if is_main(accelerator) else None)
    if problems:
        return Verification(folder, problems)
    if manifest is None:
        return Verification(folder, legacy=True)
    entries = {e["path"]: e for e in manifest["files"]}

    def one(rel: str) -> Optional[str]:
        try:
            n, digest = file_checksum(folder / rel, manifest["algorithm"])
        except OSError as err:
            return f"{rel}: unreadable ({err.strerror or err})"
        return None if (n, digest) == (entries[rel]["size"], entries[rel]["checksum"]) else f"{rel}: checksum differs"

    found = spread(accelerator, [(rel, e["size"]) for rel, e in entries.items()], one)
    return Verification(folder, [found[rel] for rel in entries if found[rel]], files=len(entries),
                        size=sum(e["size"] for e in entries.values()))
