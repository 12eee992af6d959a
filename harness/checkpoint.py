"""Saving and resuming: full training checkpoints, rotation, the final HF-format export, the run report.

    <output_dir>/checkpoints/step-N/   accelerate save_state (model, optimizer, scheduler, RNG of every rank, sampler)
                                       + harness_state.json (step, epoch, data position, elapsed time, ...)
                                       + COMPLETE, written last: a folder without it is never resumed from
    <output_dir>/final/                model (safetensors) + tokenizer, loadable with AutoModelForCausalLM / AutoTokenizer;
                                       with LoRA: the adapter (peft) + tokenizer, and final/merged/ the merged model

Checkpoints prove themselves: COMPLETE is a JSON manifest of what was written (every file's relative path, size and
checksum, read back from disk after the save). A resume verifies the checkpoint against it before loading
(`verify_checkpoint`): train.resume=auto falls back to the newest checkpoint that verifies, with a warning naming what
was wrong. Checksums are xxh3-128 from `xxhash` (a dependency of `datasets`, about 18 GiB/s on one core here, so the
cost of a verification is reading the files: docs/benchmarks.md), or blake2b from the standard library (about 0.5
GiB/s) where xxhash is missing; the manifest names its algorithm.

Disk space: a save first compares the free space of the checkpoints folder with the size of the newest checkpoint
(`make_room`), and the export with the size of the previous export (or of the weights); a write that fails for lack
of space (ENOSPC) is a one-line HarnessError on every process, its partial folder (never marked complete) removed.

The final export is written to a temporary sibling folder and renamed into place, so a crash never leaves a
half-written export under the final name.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from harness.errors import ConfigError, HarnessError

try:
    import xxhash
except ImportError:  # pragma: no cover - datasets depends on it
    xxhash = None

MARKER = "COMPLETE"
STATE_FILE = "harness_state.json"
MANIFEST_FORMAT = 1
LEGACY_MARKER = b"complete"  # what COMPLETE held before it carried a manifest
ALGORITHM = "xxh3_128" if xxhash is not None else "blake2b"
CHUNK = 4 << 20  # bytes per read when hashing, one reused buffer (1, 4 and 16 MiB measured the same here)
NEARLY_FULL = 64 << 20  # free bytes below which a failed write is taken for a full disk (see `_disk_full`)


# ----------------------------------------------------------------------------------------------- small helpers


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """'Type: message' on one line (messages of torch and others can span several), at most `limit` characters."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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


def _files(folder: Path) -> list[tuple[str, int]]:
    """(relative path, size) of every regular file under `folder` but the marker, sorted by path."""
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and not p.is_symlink() and rel not in (MARKER, MARKER + ".tmp"):
            out.append((rel, p.stat().st_size))
    return out


def _folder_size(folder: Path) -> int:
    return sum(size for _, size in _files(folder)) if folder.is_dir() else 0


def _free(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def _disk_full(exc: BaseException, folder: Path) -> bool:
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
        return _free(folder) < NEARLY_FULL
    except OSError:
        return False


# ----------------------------------------------------------------------------------------------- across processes
# accelerator=None (tests, tools) or one process: everything happens here. Under several processes the main process
# reads the folders and decides, and the others receive what it found (a shared filesystem is assumed, as for
# accelerate's own checkpoints).


def _world(accelerator) -> int:
    return 1 if accelerator is None else accelerator.num_processes


def _is_main(accelerator) -> bool:
    return accelerator is None or accelerator.is_main_process


def _broadcast(accelerator, obj):
    if _world(accelerator) == 1:
        return obj
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([obj], from_process=0)[0]


def _all_gather(accelerator, obj) -> list:
    if _world(accelerator) == 1:
        return [obj]
    from accelerate.utils import gather_object

    return gather_object([obj])


def on_main(accelerator, fn: Callable):
    """fn() on the main process only; every process returns its result or raises the HarnessError it raised (one
    broadcast), so an error there never leaves the other processes waiting in a collective. Any other exception keeps
    its traceback on the main process; the others stop with a one-line error."""
    outcome = None
    if _is_main(accelerator):
        try:
            outcome = ("ok", fn())
        except HarnessError as e:
            outcome = ("error", type(e), str(e))
        except Exception as e:
            _broadcast(accelerator, ("bug", _one_line(e)))
            raise
    outcome = _broadcast(accelerator, outcome)
    if outcome[0] == "error":
        raise outcome[1](outcome[2])
    if outcome[0] == "bug":
        raise HarnessError(f"the main process failed ({outcome[1]}); see its traceback")
    return outcome[1]


def share_by_size(items: list[tuple[str, int]], world: int) -> list[list[str]]:
    """Split (name, size) items into `world` lists of about equal total size: largest first, each to the least loaded
    (the same split on every process for the same items)."""
    loads, shares = [0] * world, [[] for _ in range(world)]
    for name, size in sorted(items, key=lambda x: (-x[1], x[0])):
        r = loads.index(min(loads))
        loads[r] += size + 1
        shares[r].append(name)
    return shares


def _spread(accelerator, items: list[tuple[str, int]], fn: Callable) -> dict:
    """{name: fn(name)} for every (name, size) in `items`, which must be the same list on every process. Under several
    processes each reads its share (`share_by_size`) and every process receives all the results (one all-gather)."""
    world = _world(accelerator)
    if world == 1:
        return {name: fn(name) for name, _ in items}
    mine = share_by_size(items, world)[accelerator.process_index]
    merged: dict = {}
    for part in _all_gather(accelerator, {name: fn(name) for name in mine}):
        merged.update(part)
    return merged


# ----------------------------------------------------------------------------------------------- final export


def _replace_dir(tmp: Path, dest: Path) -> None:
    """Move the finished `tmp` folder to `dest`, replacing an older `dest` (rename is atomic on one filesystem)."""
    old = dest.with_name(dest.name + ".old")
    if dest.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(dest, old)
    os.replace(tmp, dest)
    if old.exists():
        shutil.rmtree(old)


def export_final(accelerator, model, tokenizer, dest: str | Path, extra: Optional[dict] = None,
                 random_base: bool = False) -> Path:
    """Save the unwrapped model (weights gathered from every rank) and tokenizer in HF format to `dest`.

    Call on every process: under DeepSpeed ZeRO-3 gathering the weights is a collective operation. Before writing,
    the free space is compared with the size of the previous export (or, for the first, of the weights); too little,
    or a disk that fills up while writing: a HarnessError on every process, the previous export and the checkpoints
    untouched. random_base: the model was built with random weights (no folder or hub id holds its base): a LoRA
    export also writes the base to dest/base/, which its adapter_config.json names.
    """
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    state_dict = accelerator.get_state_dict(model)  # collective: every rank takes part

    def write() -> None:
        if tmp.exists():
            shutil.rmtree(tmp)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_dir():
            need, what = _folder_size(dest), f"the size of the previous export {dest.name}/"
        else:
            tensors = {(t.data_ptr(), t.numel() * t.element_size()) for t in state_dict.values()
                       if hasattr(t, "element_size")}  # tied weights (one tensor under two names) are saved once
            need, what = sum(n for _, n in tensors), "the size of the weights"
        free = _free(dest.parent)
        if free < need:
            raise HarnessError(f"not enough disk space for the final export in {dest.parent}: about {human_bytes(need)} "
                               f"needed ({what}), {human_bytes(free)} free; the checkpoints are intact: free some "
                               f"space, then run again with train.resume=auto")
        try:
            _write_export(accelerator, model, tokenizer, state_dict, tmp, extra, dest if random_base else None)
        except Exception as e:
            full = _disk_full(e, dest.parent)
            shutil.rmtree(tmp, ignore_errors=True)
            if not full:
                raise
            raise HarnessError(f"disk full while writing the final export to {dest.parent} ({_one_line(e)}): about "
                               f"{human_bytes(need)} needed ({what}), {human_bytes(_free(dest.parent))} free after "
                               f"removing the partial {tmp.name}/; the checkpoints are intact: free some space, then "
                               f"run again with train.resume=auto") from e
        _replace_dir(tmp, dest)

    on_main(accelerator, write)  # also where every rank waits for the main process
    return dest


def _write_export(accelerator, model, tokenizer, state_dict: dict, tmp: Path, extra: Optional[dict],
                  random_base_dest: Optional[Path] = None) -> None:
    from harness.model import is_peft, merged_copy, uses_trainable_tokens

    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    kwargs = {}
    if is_peft(unwrapped) and uses_trainable_tokens(unwrapped):
        # the added tokens' rows are in the adapter (trainable_tokens_delta); peft would otherwise also save the
        # whole resized embedding matrices because the vocabulary grew
        kwargs["save_embedding_layers"] = False
    unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True, **kwargs)
    tokenizer.save_pretrained(tmp)
    for name, obj in (extra or {}).items():  # small JSON side files, e.g. harness.json
        (tmp / name).write_text(json.dumps(obj, indent=2))

    if is_peft(unwrapped):  # LoRA: final/ holds the adapter, final/merged/ the model with the adapter merged in
        merged_copy(unwrapped, state_dict).save_pretrained(tmp / "merged", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "merged")
        if random_base_dest is not None:  # a random base exists nowhere else: final/base/, named by the adapter
            merged_copy(unwrapped, state_dict, merge=False).save_pretrained(tmp / "base", safe_serialization=True)
            tokenizer.save_pretrained(tmp / "base")
            adapter_config = json.loads((tmp / "adapter_config.json").read_text())
            adapter_config["base_model_name_or_path"] = str(Path(random_base_dest).resolve() / "base")
            (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
        for name, obj in (extra or {}).items():
            (tmp / "merged" / name).write_text(json.dumps(obj, indent=2))


def write_json(path: str | Path, obj: dict) -> None:
    """Write JSON atomically (temporary file + rename; a failed write leaves the previous file and no temporary)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2, default=str))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------- manifests


def build_manifest(folder: str | Path, accelerator=None, algorithm: str = ALGORITHM) -> dict:
    """The COMPLETE manifest of what `folder` holds now: {"format", "algorithm", "files": [{"path", "size",
    "checksum"}]}, the files read back from disk. Collective when `accelerator` runs several processes (the hashing is
    split between them by size). OSError when a file cannot be read back (the same on every process)."""
    folder = Path(folder)
    files = _broadcast(accelerator, _files(folder) if _is_main(accelerator) else None)

    def one(rel: str):
        try:
            return file_checksum(folder / rel, algorithm)
        except OSError as e:
            return f"{rel}: {e.strerror or e}"

    sums = _spread(accelerator, files, one)
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
    return sum(e["size"] for e in m["files"]) if m else _folder_size(Path(folder))


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
        for rel, _ in _files(folder):  # a file the save did not write (or the manifest lost) may be loaded: unproven
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

    problems, manifest = _broadcast(accelerator, first_look() if _is_main(accelerator) else None)
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

    found = _spread(accelerator, [(rel, e["size"]) for rel, e in entries.items()], one)
    return Verification(folder, [found[rel] for rel in entries if found[rel]], files=len(entries),
                        size=sum(e["size"] for e in entries.values()))


# ----------------------------------------------------------------------------------------------- checkpoints


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / STATE_FILE).is_file()


def _step(path: Path) -> int:
    return int(path.name[5:])


def list_checkpoints(output_dir: str | Path) -> tuple[list[tuple[int, Path]], list[Path]]:
    """(complete checkpoints as (step, path) oldest first, incomplete folders). Complete means marked complete;
    whether the files are intact is `verify_checkpoint`'s business."""
    root = checkpoints_root(output_dir)
    complete, incomplete = [], []
    if root.is_dir():
        for p in root.iterdir():
            if not (p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()):
                continue
            (complete.append((_step(p), p)) if is_complete(p) else incomplete.append(p))
    return sorted(complete), sorted(incomplete)


def save_checkpoint(accelerator, output_dir: str | Path, loop_state: dict, keep: int) -> Path:
    """Write checkpoints/step-N on every rank (collective), then the loop state, then the COMPLETE marker: the manifest
    of every file, read back from disk (the hashing split between the processes), written last and atomically.

    Before writing, `make_room` checks the free space (and may remove what rotation would remove anyway). A write that
    fails on any process (e.g. ENOSPC) ends in the same HarnessError on every process: the partial folder, which
    never got a marker, is removed and the older checkpoints are untouched. (Under DeepSpeed a rank that fails inside
    DeepSpeed's own collective save can leave the others waiting there; the launcher then stops them.)"""
    root = checkpoints_root(output_dir)
    path = root / f"step-{loop_state['step']}"

    def prepare() -> None:
        if path.exists():
            shutil.rmtree(path)  # a leftover of a crash at this same step: never mix two saves in one folder
        root.mkdir(parents=True, exist_ok=True)
        make_room(output_dir, path, keep, say=accelerator.print)

    on_main(accelerator, prepare)
    failure = None
    try:
        accelerator.save_state(str(path))
        if accelerator.is_main_process:
            write_json(path / STATE_FILE, loop_state)
    except Exception as e:  # noqa: BLE001 - sorted out in _agree
        failure = e
    _agree(accelerator, failure, path)
    failure, manifest = None, None
    try:
        manifest = build_manifest(path, accelerator)
    except OSError as e:
        failure = e
    _agree(accelerator, failure, path)

    def finish() -> None:
        try:
            write_marker(path, manifest)
        except OSError as e:
            (path / (MARKER + ".tmp")).unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)
            raise HarnessError(_write_failure(e, path)) from e
        rotate(output_dir, keep, protect=path)

    on_main(accelerator, finish)
    return path


def _write_failure(exc: BaseException, path: Path) -> str:
    """The one-line message for a checkpoint write that failed with `exc` (the partial folder is being removed)."""
    root = path.parent
    if not _disk_full(exc, root):
        return (f"could not write checkpoint {path} ({_one_line(exc)}); the partial folder is removed "
                f"(never marked complete), older checkpoints are intact")
    complete = [p for _, p in list_checkpoints(root.parent)[0] if p != path]
    need = (f"about {human_bytes(checkpoint_size(complete[-1]))} needed (the size of {complete[-1].name}), "
            if complete else "")
    try:
        free = human_bytes(_free(root))
    except OSError:
        free = "unknown"
    return (f"disk full while writing checkpoint {path.name} in {root} ({_one_line(exc)}): {need}{free} "
            f"free; the partial folder is removed (never marked complete), older checkpoints are intact: free some "
            f"space, then continue with train.resume=auto")


def _agree(accelerator, failure: Optional[BaseException], path: Path) -> None:
    """After a collective write step: nothing when it worked everywhere; else every process stops (one all-gather):
    the main process removes the partial folder, a process whose failure was a bug re-raises it (traceback), the
    others raise a one-line HarnessError."""
    mine = None
    if failure is not None:
        bug = not (isinstance(failure, OSError) or _disk_full(failure, path.parent))
        mine = (bug, _write_failure(failure, path) if not bug else _one_line(failure))
    everyone = _all_gather(accelerator, mine)
    failed = [(rank, f) for rank, f in enumerate(everyone) if f is not None]
    if not failed:
        return
    if _is_main(accelerator):
        shutil.rmtree(path, ignore_errors=True)
    if mine is not None and mine[0]:
        raise failure
    rank, (bug, message) = next(((r, f) for r, f in failed if not f[0]), failed[0])
    if bug:
        message = f"process {rank} failed while writing checkpoint {path} ({message}); see its traceback"
    elif _world(accelerator) > 1 and mine is None:
        message = f"process {rank}: {message}"
    raise HarnessError(message)


def make_room(output_dir: str | Path, path: Path, keep: int, say: Callable = print) -> None:
    """Before writing checkpoint `path`: make sure the checkpoints folder has free space for one the size of the
    newest complete checkpoint (nothing to compare with before the first), else raise a one-line HarnessError naming
    the folder, the space needed and the space free, with nothing deleted but garbage.

    When space is short, what would be deleted right after this save anyway goes first: incomplete folders older than
    the newest complete checkpoint (never resumed from), then the complete checkpoints that rotation would delete
    (beyond the newest `keep`), the latter only while the checkpoint this run continues from (the newest one older
    than `path`) stays and verifies now (so a crash during this save still finds a verified checkpoint). That trades
    the spare older checkpoint during the save for not needing room for keep + 1 checkpoints; it happens only when
    space is short, is announced, and never removes the checkpoint continued from (so with keep=1 nothing goes
    early but extras older than it)."""
    root = checkpoints_root(output_dir)
    complete, incomplete = list_checkpoints(output_dir)
    if not complete:
        return
    newest = complete[-1][1]
    need, free = checkpoint_size(newest), _free(root)
    if free >= need:
        return
    removed = []  # folder names
    for p in incomplete:  # stale partial folders: rotation would delete them after this save
        if _step(p) < complete[-1][0] and p != path:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(f"the partial {p.name}")
    free = _free(root)
    older = [(s, p) for s, p in complete if s < _step(path)]
    if free < need and keep > 0 and older:
        anchor = older[-1][1]
        after = sorted([*complete, (_step(path), path)])
        doomed = [p for s, p in after[:-keep] if s < _step(anchor)]  # beyond the limit once `path` exists
        reclaim = sum(checkpoint_size(p) for p in doomed)
        if doomed and free + reclaim >= need:
            check = verify_checkpoint(anchor)
            if check.ok and not check.legacy:
                for p in doomed:
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p.name)
                # (the estimate can be off when files changed since they were recorded: the check below decides)
                free = _free(root)
    if removed and free >= need:
        say(f"[harness] warning: little disk space in {root}: removed {', '.join(removed)} before writing "
            f"{path.name} instead of after it (now {human_bytes(free)} free, about {human_bytes(need)} needed)")
        return
    if free < need:
        raise HarnessError(
            f"not enough disk space for checkpoint {path.name} in {root}: about {human_bytes(need)} needed (the size "
            f"of {newest.name}), {human_bytes(free)} free; older checkpoints are intact"
            + (f" (removed only {', '.join(removed)})" if removed else "")
            + ": free some space or lower train.save_total_limit, then continue with train.resume=auto")


def rotate(output_dir: str | Path, keep: int, protect: Optional[Path] = None) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep` (0: keep all) and incomplete folders older than the
    newest complete one; returns what was deleted. Never deleted: `protect` (the checkpoint just written, which is
    not always the newest: a resume that fell back past a damaged checkpoint leaves that newer folder until the run
    overwrites it), and, when none of the kept checkpoints has a manifest, the newest one that has (a verifiable
    checkpoint is never given up for unverifiable ones of an older harness)."""
    complete, incomplete = list_checkpoints(output_dir)
    doomed = [p for _, p in complete[:-keep]] if keep > 0 else []
    if protect is not None:
        doomed = [p for p in doomed if p.name != Path(protect).name]
    kept = [p for _, p in complete if p not in doomed]
    if doomed and not any(has_manifest(p) for p in kept):
        spare = next((p for p in reversed(doomed) if has_manifest(p)), None)
        if spare is not None:
            doomed.remove(spare)
    if complete:
        newest = complete[-1][0]
        doomed += [p for p in incomplete if _step(p) < newest]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def resolve_resume(output_dir: str | Path, resume: Optional[str], accelerator=None,
                   older_than: Optional[int] = None) -> tuple[Optional[Path], list[Path]]:
    """The checkpoint to resume from (None: start fresh) and the incomplete folders that were passed over.

    resume: "auto" (the newest complete checkpoint that verifies, if any), a checkpoint folder (which must verify), or
    None/"none" (fresh start; refused when output_dir already holds complete checkpoints, so that a restart never
    overwrites a run by accident).

    Every candidate is checked with `verify_checkpoint` (sizes, then checksums). auto: a checkpoint that fails is
    passed over with a one-line warning naming what was wrong, and the next older one is tried; when checkpoints
    exist but none verifies: a one-line HarnessError. An explicit folder that fails: a one-line ConfigError. A
    checkpoint written by an older harness (marker without checksums) is accepted unverified, with a note.

    accelerator: pass it when it exists (it must, under several processes): the main process lists the folders and
    reads the markers, the checksum work is split between the processes, and every process gets the same results,
    hence the same choice. Warnings are printed with accelerator.print (else print).

    older_than: (auto) only checkpoints of earlier steps: those from step `older_than` on failed to load
    (`load_resumable`)."""
    say = accelerator.print if accelerator is not None else print

    def plan() -> tuple[list[Path], list[Path], bool]:
        complete, incomplete = list_checkpoints(output_dir)
        if resume in (None, "none", "null", ""):
            if complete:
                raise ConfigError(
                    f"config key 'train.resume': {checkpoints_root(output_dir)} already holds checkpoints "
                    f"(newest step-{complete[-1][0]}); use train.resume=auto to continue or another train.output_dir"
                )
            return [], incomplete, False
        if resume == "auto":
            return [p for s, p in reversed(complete) if older_than is None or s < older_than], incomplete, False
        path = Path(resume)
        if not path.is_dir():
            raise ConfigError(f"config key 'train.resume': {path} is not a folder")
        if not is_complete(path):
            raise ConfigError(f"config key 'train.resume': {path} is not a complete checkpoint (no {MARKER} marker "
                              f"or {STATE_FILE})")
        return [path], incomplete, True

    candidates, incomplete, explicit = on_main(accelerator, plan)
    failed: list[Verification] = []
    for path in candidates:
        t0 = time.perf_counter()
        check = verify_checkpoint(path, accelerator)
        if check.ok:
            if check.legacy:
                say(f"[harness] note: {path} has no checksums (marker of an older harness): resumed from unverified")
            else:
                say(f"[harness] checkpoint {path} verified: {check.files} files, {human_bytes(check.size)} in "
                    f"{time.perf_counter() - t0:.1f}s")
            return path, incomplete
        if explicit:
            raise ConfigError(f"config key 'train.resume': {path} fails verification: {check.describe()}")
        say(f"[harness] warning: checkpoint {path} fails verification ({check.describe()}): not resumed from, "
            f"trying an older one")
        failed.append(check)
    if failed:
        raise HarnessError(
            f"no checkpoint in {checkpoints_root(output_dir)} verifies ("
            + "; ".join(f"{c.path.name}: {c.describe(limit=2)}" for c in failed)
            + "): move the damaged folders away to start afresh, or use another train.output_dir")
    return None, incomplete


def load_checkpoint(accelerator, path: Path, quantized: bool = False) -> dict:
    """Restore the accelerate state (every rank) and return the loop state saved with it. A checkpoint that cannot be
    loaded (unverifiable and damaged, or written for another model) is a one-line HarnessError.

    `quantized` (QLoRA): the frozen base is loaded quantized from model.name_or_path again, and its quantization
    state entries (absmax, quant_map, ...) in the checkpoint do not load as parameters: the model is loaded
    non-strictly, after checking that the checkpoint holds every trainable parameter (adapters, added tokens)."""
    try:
        kwargs = {}
        if quantized:
            from safetensors import safe_open

            files = sorted(path.glob("model*.safetensors"))
            saved = set()
            for f in files:
                with safe_open(str(f), "pt") as st:
                    saved.update(st.keys())
            unwrapped = accelerator.unwrap_model(accelerator._models[0], keep_torch_compile=False)
            lacking = [n for n, p in unwrapped.named_parameters() if p.requires_grad and n not in saved]
            if not files or lacking:
                raise RuntimeError(f"the checkpoint lacks trainable parameters, e.g. {(lacking or ['model*.safetensors'])[0]}")
            kwargs["strict"] = False
        accelerator.load_state(str(path), **kwargs)
        return json.loads((path / STATE_FILE).read_text())
    except Exception as e:  # noqa: BLE001 - a damaged file or a user mistake, reported on one line
        error = HarnessError(f"could not load checkpoint {path} ({_one_line(e, 400)}); resume from another "
                             f"one with train.resume=<folder>, or check that the config matches the run that wrote it")
        error.cause = _one_line(e, 400)
        raise error from e


def load_resumable(accelerator, output_dir: str | Path, path: Path, auto: bool, quantized: bool = False
                   ) -> tuple[Path, dict]:
    """Load checkpoint `path` on every process: (the checkpoint loaded, its loop state). With train.resume=auto a
    checkpoint that verified but fails to load on any process (a file it should not hold, written for another model)
    is passed over like one that fails verification: a warning, and the next older one that verifies is loaded (it
    restores every loaded part, so what the failed attempt loaded does not remain). Every process takes the same
    decision (one all-gather per attempt). A named checkpoint that fails, or none left: a one-line HarnessError."""
    say = accelerator.print if accelerator is not None else print
    failed: list[str] = []
    while True:
        error, saved = None, None
        try:
            saved = load_checkpoint(accelerator, path, quantized)
        except HarnessError as e:
            error = (str(e), getattr(e, "cause", str(e)))
        errors = [e for e in _all_gather(accelerator, error) if e is not None]
        if not errors:
            return path, saved
        if not auto:
            raise HarnessError(errors[0][0])
        cause = errors[0][1]
        say(f"[harness] warning: checkpoint {path} verifies but cannot be loaded ({cause}): not resumed from, "
            f"trying an older one")
        failed.append(f"{path.name}: {cause}")
        path, _ = resolve_resume(output_dir, "auto", accelerator, older_than=_step(path))
        if path is None:
            raise HarnessError(f"no checkpoint in {checkpoints_root(output_dir)} loads ({'; '.join(failed)}): move the "
                               f"damaged folders away to start afresh, check that the config matches the run that "
                               f"wrote them, or use another train.output_dir")


class Checkpointer:
    """Decides when a checkpoint is due and writes it: every `train.save_every_steps` steps, when
    `train.save_every_minutes` have passed (a fact every process agrees on, see harness/stopping.py), and when the
    attempt stops early. Knows what its last save cost (the time window keeps room for one more)."""

    def __init__(self, accelerator, output_dir: Path, every_steps: int, every_minutes: float, keep: int,
                 say: Callable[[str], None], on_saved: Callable[[float], None]):
        self.accelerator, self.output_dir, self.keep, self.say, self.on_saved = accelerator, output_dir, keep, say, on_saved
        self.every_steps, self.every_minutes = every_steps, every_minutes
        self.last_save = time.time()
        self.cost_s = 10.0  # until the first save measures it

    def minutes_due(self) -> bool:
        """train.save_every_minutes have passed since the last save (or the loop's start), by this process's clock."""
        return self.every_minutes > 0 and time.time() - self.last_save >= 60 * self.every_minutes

    def due(self, step: int, forced: bool) -> bool:
        return forced or bool(self.every_steps and step % self.every_steps == 0)

    def save(self, loop_state: dict) -> Path:
        t = time.time()
        path = save_checkpoint(self.accelerator, self.output_dir, loop_state, self.keep)
        self.last_save = time.time()
        self.cost_s = self.last_save - t
        self.on_saved(self.cost_s)
        self.say(f"[harness] checkpoint: {path} ({self.cost_s:.1f}s)")
        return path
