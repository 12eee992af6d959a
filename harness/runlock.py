"""One run per output folder: `<output_dir>/.lock`, created atomically (O_CREAT|O_EXCL) by the main process at the
start of a run and removed when the run ends, however it ends (build.start_processes registers the release with the
run's ExitStack).

The lock names its holder: `{"host": ..., "pid": ..., "started": ...}`. A second run into the folder is refused while
the holder lives. A lock left by a process of this host that no longer exists (a `kill -9`, a lost machine that
came back) is stale: taken over with a one-line warning. A lock from another host cannot be checked from here:
refused, with how to remove it if that host is gone.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Callable, Optional

from harness.errors import HarnessError

LOCK_NAME = ".lock"


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


def read_holder(path: Path) -> Optional[dict]:
    """The lock's holder {host, pid, ...}, or None when the file is gone or does not name one."""
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int) or not holder.get("host"):
        return None
    return holder


def _create(path: Path, me: dict) -> bool:
    """Create the lock naming `me`; False when it exists already."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(me) + "\n")
    return True


def _refusal(path: Path, holder: Optional[dict], host: str) -> HarnessError:
    folder = path.parent
    if holder is None:
        return HarnessError(f"{folder} is locked by {path}, which does not name its holder: remove it if no run "
                            f"uses the folder, or use another train.output_dir")
    who = f"host {holder['host']}, pid {holder['pid']}"
    if holder["host"] != host:
        return HarnessError(f"{folder} is in use by a run on another machine ({who}): if that machine is gone, "
                            f"remove {path}; else use another train.output_dir")
    return HarnessError(f"{folder} is in use by another run ({who}): wait for it to end or use another "
                        f"train.output_dir")


def acquire(output_dir: str | Path, say: Callable[[str], None] = print) -> Path:
    """Take `<output_dir>/.lock` for this process (the folder is created); returns its path. Raises a one-line
    HarnessError while another live run holds it; takes over a stale lock of this host with a warning."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    host = socket.gethostname()
    me = {"host": host, "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if _create(path, me):
        return path
    holder = read_holder(path)
    if holder is None or holder["host"] != host or pid_alive(holder["pid"]):
        raise _refusal(path, holder, host)
    say(f"[harness] warning: {path} names pid {holder['pid']} of this host, which is no longer running (a run "
        f"that was killed): taking the folder over")
    path.unlink(missing_ok=True)
    if _create(path, me):
        return path
    raise _refusal(path, read_holder(path), host)  # another run took it over first


def release(path: Path) -> None:
    """Remove the lock if it is still this process's."""
    holder = read_holder(path)
    if holder is not None and holder["pid"] == os.getpid() and holder["host"] == socket.gethostname():
        path.unlink(missing_ok=True)
