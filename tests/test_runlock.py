"""One run per output folder (harness/runlock.py): the lock in process, and a second run refused end to end.

    .venv/bin/python -m pytest tests/test_runlock.py
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from harness import runlock
from harness.errors import HarnessError
from harness_launch import FAST, run_train


def _write_lock(folder, pid, host=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".lock").write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid}))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_lock_names_its_holder_and_is_released(tmp_path):
    path = runlock.acquire(tmp_path / "run")
    holder = json.loads(path.read_text())
    assert path == tmp_path / "run" / ".lock"
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    runlock.release(path)
    assert not path.exists()


def test_lock_held_by_a_live_process_is_refused(tmp_path):
    _write_lock(tmp_path, os.getppid())
    with pytest.raises(HarnessError) as e:
        runlock.acquire(tmp_path)
    assert str(e.value) == (f"{tmp_path} is in use by another run (host {socket.gethostname()}, pid {os.getppid()}): "
                            "wait for it to end or use another train.output_dir")
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getppid()  # untouched


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path):
    dead = _dead_pid()
    _write_lock(tmp_path, dead)
    said = []
    path = runlock.acquire(tmp_path, said.append)
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert said == [f"[harness] warning: {path} names pid {dead} of this host, which is no longer running (a run that "
                    "was killed): taking the folder over"]


def test_lock_of_another_host_is_refused_with_how_to_remove_it(tmp_path):
    _write_lock(tmp_path, 1234, host="elsewhere")
    with pytest.raises(HarnessError, match=r"another machine \(host elsewhere, pid 1234\): if that machine is gone, "
                                           rf"remove {tmp_path}/.lock"):
        runlock.acquire(tmp_path)


def test_release_leaves_a_lock_that_is_not_ours(tmp_path):
    _write_lock(tmp_path, os.getppid())
    runlock.release(tmp_path / ".lock")
    assert (tmp_path / ".lock").exists()


def test_lock_is_released_when_the_run_fails(tmp_path):
    """Through the run's ExitStack, as build.start_processes registers it."""
    import contextlib

    with pytest.raises(RuntimeError), contextlib.ExitStack() as opened:
        lock = runlock.acquire(tmp_path)
        opened.callback(runlock.release, lock)
        raise RuntimeError("a step failed")
    assert not (tmp_path / ".lock").exists()


def test_second_run_into_a_held_folder_exits_1_with_one_line(tmp_path):
    out = tmp_path / "run"
    _write_lock(out, os.getpid())  # this test process: alive
    proc = run_train([f"train.output_dir={out}", "train.max_steps=3", *FAST], check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"harness: error: {out} is in use by another run (host {socket.gethostname()}, pid {os.getpid()}): wait for "
        "it to end or use another train.output_dir")
    assert not (out / "config.yaml").exists() and (out / ".lock").exists()
