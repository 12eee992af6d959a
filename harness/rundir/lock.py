"""One run per output folder: `<output_dir>/.lock`, created atomically (O_CREAT|O_EXCL) by the main process at the
start of a run and removed when the run ends, however it ends (harness/rundir/__init__.py's `hold` registers the release with the
run's ExitStack). `harness rft generate` holds `<rft.output_dir>/shards/.lock` the same way (harness/rft/generate.py).

The lock names its holder: `{"host", "pid", "started", "proc_start", "boot_id"}` (proc_start: the process's start
time in clock ticks since boot, from /proc/<pid>/stat; boot_id: /proc/sys/kernel/random/boot_id), and its
modification time is a heartbeat: the holder touches it every HEARTBEAT_S seconds. A second run into the folder is
refused only while the lock can still be a live run's; otherwise the lock is stale and taken over with a one-line
warning:

- this host, the pid does not exist (a `kill -9`), or is this process itself (a container restarted: pid 1 again), or
  exists but is another process (a different start time or boot: the pid was reused; for a lock of an older harness
  without a start time: a command line that is no harness run);
- a lock that names no holder (empty or cut: the disk was full when it was written) and is older than a few seconds;
- another host's lock (which cannot be checked from here) whose heartbeat stopped STALE_S seconds ago.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from harness import faults
from harness.errors import HarnessError

LOCK_NAME = ".lock"
HEARTBEAT_S = 60.0  # the holder touches the lock this often
STALE_S = 600.0  # another host's lock untouched this long is stale (ten missed heartbeats)
UNNAMED_GRACE_S = 5.0  # a lock without a holder younger than this may be a run writing it right now


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (one we may not signal counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _proc_start(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (Linux /proc), or None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])  # field 22; the name in (...) may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def _boot_id() -> Optional[str]:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _cmdline(pid: int) -> Optional[list[str]]:
    try:
        return [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if a]
    except OSError:
        return None


def _is_run_command(args: list[str]) -> bool:
    """Whether a command line can be a harness training run (python -m harness.train / harness.cli, harness/train.py
    under a launcher, the `harness` command)."""
    return any(a in ("harness.train", "harness.cli") or a.endswith(("harness/train.py", "/harness")) or a == "harness"
               for a in args)


def identity(pid: int) -> dict:
    """What a lock records of process `pid` of this host."""
    return {"host": socket.gethostname(), "pid": pid, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "proc_start": _proc_start(pid), "boot_id": _boot_id()}


def read_holder(path: Path) -> Optional[dict]:
    """The lock's holder {host, pid, ...}, or None when the file is gone or does not name one."""
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int) or not holder.get("host"):
        return None
    return holder


def _age(path: Path) -> float:
    """Seconds since the lock was last written or touched (0 when it cannot be read)."""
    try:
        return max(0.0, time.time() - path.stat().st_mtime)
    except OSError:
        return 0.0


def stale_reason(path: Path, holder: Optional[dict], host: str) -> Optional[str]:
    """Why the lock at `path` cannot be a live run's (a phrase for the warning), or None: it may be one."""
    age = _age(path)
    if holder is None:
        return (f"names no holder (empty or cut, e.g. written when the disk was full) and is {age:.0f}s old"
                if age > UNNAMED_GRACE_S else None)
    pid = holder["pid"]
    if holder["host"] != host:
        return (f"names host {holder['host']}, whose run has not touched it for {age / 60:.0f} minutes"
                if age > STALE_S else None)
    if pid == os.getpid():
        return f"names pid {pid}, which is this process (left by an earlier run, e.g. before a container restart)"
    if not pid_alive(pid):
        return f"names pid {pid} of this host, which is no longer running (a run that was killed)"
    boot, start = holder.get("boot_id"), holder.get("proc_start")
    if start is not None:
        if boot is not None and _boot_id() is not None and boot != _boot_id():
            return f"names pid {pid} of an earlier boot of this host (that pid is now another process)"
        live = _proc_start(pid)
        if live is not None and live != start:
            return f"names pid {pid}, which is now another process (started later: the pid was reused)"
        return None
    args = _cmdline(pid)  # a lock of an older harness: no start time, judge by the command line
    if args is not None and not _is_run_command(args):
        return f"names pid {pid}, which is now another process ({os.path.basename(args[0]) if args else 'no command'}" \
               f", not a harness run: the pid was reused)"
    return None


def _create(path: Path, me: dict) -> bool:
    """Create the lock naming `me`; False when it exists already. A lock that cannot be written whole (a full disk)
    is removed again and the OSError raised."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    faults.signal_at("lock")  # test hook: a stop in the instant the lock exists
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(me) + "\n")
    except OSError:
        path.unlink(missing_ok=True)
        raise
    return True


def _refusal(path: Path, holder: Optional[dict], host: str, key: str = "train.output_dir") -> HarnessError:
    folder = path.parent
    if holder is None:
        return HarnessError(f"{folder} is locked by {path}, which does not name its holder: remove it if no run "
                            f"uses the folder, or use another {key}")
    who = f"host {holder['host']}, pid {holder['pid']}"
    if holder["host"] != host:
        return HarnessError(f"{folder} is in use by a run on another machine ({who}): if that machine is gone, "
                            f"remove {path} (it is taken over {STALE_S / 60:.0f} minutes after its run last touched "
                            f"it); else use another {key}")
    return HarnessError(f"{folder} is in use by another run ({who}): wait for it to end or use another {key}")


_heartbeats: dict[Path, threading.Event] = {}  # lock path -> the event that stops its heartbeat


def _beat(path: Path, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        try:
            os.utime(path)
        except OSError:
            pass


def acquire(output_dir: str | Path, say: Callable[[str], None] = print, key: str = "train.output_dir") -> Path:
    """Take `<output_dir>/.lock` for this process (the folder is created) and keep its heartbeat; returns its path.
    Raises a one-line HarnessError while the lock can be a live run's, when the folder cannot be created (a
    read-only parent) or the lock cannot be written (a full disk: nothing is left behind); takes over a stale lock
    with a warning. `key`: the config key that names the folder, for the messages (`harness rft generate`'s lock is
    its shards folder's)."""
    folder = Path(output_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HarnessError(f"could not create the output folder {folder} ({type(e).__name__}: {e.strerror or e}); "
                           f"nothing was started: fix the permissions of the folder above it, or use another "
                           f"{key}") from None
    path = folder / LOCK_NAME
    host = socket.gethostname()
    me = identity(os.getpid())

    def create() -> bool:
        try:
            return _create(path, me)
        except OSError as e:
            full = ": the disk is full" if e.errno == errno.ENOSPC else ""
            raise HarnessError(f"could not write the run lock {path} ({type(e).__name__}: {e}){full}; nothing was "
                               f"started: free some space (or fix the folder's permissions), then rerun") from None

    if not create():
        holder = read_holder(path)
        why = stale_reason(path, holder, host)
        if why is None:
            raise _refusal(path, holder, host, key)
        say(f"[harness] warning: {path} {why}: taking the folder over")
        path.unlink(missing_ok=True)
        if not create():
            raise _refusal(path, read_holder(path), host, key)  # another run took it over first
    stop = threading.Event()
    _heartbeats[path] = stop
    threading.Thread(target=_beat, args=(path, stop), name="harness-lock-heartbeat", daemon=True).start()
    return path


def release(path: Path) -> None:
    """Stop the heartbeat; remove the lock if it is still this process's."""
    stop = _heartbeats.pop(path, None)
    if stop is not None:
        stop.set()
    holder = read_holder(path)
    if holder is not None and holder["pid"] == os.getpid() and holder["host"] == socket.gethostname():
        path.unlink(missing_ok=True)
