"""What checkpoint checksums cost per GiB (issue 17): the hash alone in memory, and harness.checkpoint.store's own
build_manifest (a save) and verify_checkpoint (a resume) on a synthetic checkpoint, page cache warm and cold.

    .venv/bin/python scripts/bench_verify.py --size-gb 4 --rounds 3 --out docs/bench/verify-cpu.json

The checkpoint folder (default: a temporary folder beside --dir) holds a weights file (1/3 of the size) and an
optimizer file (2/3) of random bytes, like accelerate's model.safetensors + optimizer.bin. Warm: the files were just
written or read (what a save's read-back sees). Cold: each file fsync'ed and dropped from the page cache with
posix_fadvise(DONTNEED) before the pass (what a resume after a restart sees; the figure then is the disk's).
One process: under several, the files are split between the processes by size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.checkpoint import store  # noqa: E402
from harness.checkpoint.manifest import _hasher, ALGORITHM, build_manifest, CHUNK, verify_checkpoint, write_marker  # noqa: E402

GiB = 2**30


def in_memory(algorithm: str, mib: int = 512, chunk: int = CHUNK) -> float:
    """Seconds per GiB for the hash alone over `mib` MiB already in memory, fed in `chunk`-sized pieces."""
    data = memoryview(os.urandom(mib * 2**20))
    h = hashlib.sha256() if algorithm == "sha256" else _hasher(algorithm)
    t = time.perf_counter()
    for i in range(0, len(data), chunk):
        h.update(data[i:i + chunk])
    return (time.perf_counter() - t) / (len(data) / GiB)


def write_checkpoint(folder: Path, size: int) -> None:
    folder.mkdir(parents=True)
    block = os.urandom(64 * 2**20)
    for name, part in (("model.safetensors", size // 3), ("optimizer.bin", size - size // 3)):
        with open(folder / name, "wb") as fh:
            left = part
            while left > 0:
                fh.write(block[:min(left, len(block))])
                left -= len(block)
    (folder / store.STATE_FILE).write_text(json.dumps({"step": 1}))


def drop_cache(folder: Path) -> None:
    for p in folder.iterdir():
        with open(p, "rb") as fh:
            os.fsync(fh.fileno())
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=4.0, help="checkpoint size in GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the synthetic checkpoint (its disk is measured)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    size = int(args.size_gb * GiB)
    load0 = os.getloadavg()[0]
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
              "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "python": platform.python_version(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "size_gib": size / GiB, "chunk_mib": CHUNK / 2**20, "algorithm": ALGORITHM}
    try:
        import xxhash
        result["xxhash"] = xxhash.VERSION
    except ImportError:
        pass
    result["memory_s_per_gib"] = {a: statistics.median(in_memory(a) for _ in range(args.rounds))
                                  for a in ("xxh3_128", "blake2b", "sha256")}
    rows = {"build_manifest_warm": [], "verify_warm": [], "verify_cold": [], "read_only_cold": [],
            "verify_warm_blake2b": []}
    with tempfile.TemporaryDirectory(prefix="bench-verify-", dir=args.dir) as tmp:
        folder = Path(tmp, "step-1")
        write_checkpoint(folder, size)
        for _ in range(args.rounds):
            manifest = {}
            rows["build_manifest_warm"].append(timed(lambda: manifest.update(build_manifest(folder))))
            write_marker(folder, manifest)
            rows["verify_warm"].append(timed(lambda: verify_checkpoint(folder)))
            drop_cache(folder)
            rows["verify_cold"].append(timed(lambda: verify_checkpoint(folder)))
            drop_cache(folder)

            def read_only():
                buf = bytearray(CHUNK)
                for p in folder.iterdir():
                    with open(p, "rb", buffering=0) as fh:
                        while fh.readinto(buf):
                            pass
            rows["read_only_cold"].append(timed(read_only))
            blake = build_manifest(folder, algorithm="blake2b")
            write_marker(folder, blake)
            rows["verify_warm_blake2b"].append(timed(lambda: verify_checkpoint(folder)))
            assert verify_checkpoint(folder).ok
    gib = size / GiB
    result["s_per_gib"] = {k: statistics.median(v) / gib for k, v in rows.items()}
    result["rounds_s"] = rows
    result["load_1min"] = [load0, os.getloadavg()[0]]
    print(f"{gib:.1f} GiB checkpoint, {args.rounds} rounds (median), load {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    for k, v in result["memory_s_per_gib"].items():
        print(f"  hash in memory, {k:9s} {v:6.3f} s/GiB  ({1 / v:5.2f} GiB/s)")
    for k, v in result["s_per_gib"].items():
        print(f"  {k:22s} {v:6.3f} s/GiB  ({1 / v:5.2f} GiB/s)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
