"""One run per output folder (harness/rundir/lock.py): the lock in process, and a second run refused end to end.

    .venv/bin/python -m pytest tests/test_runlock.py
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from harness.rundir import lock as runlock
from harness.errors import HarnessError
from harness_launch import FAST, run_train


def _write_lock(folder, pid, host=None, **holder):
    """A lock naming `pid` (of an older harness: host and pid only, unless `holder` adds fields)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".lock").write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid, **holder}))


def _age(path, seconds):
    os.utime(path, (time.time() - seconds, time.time() - seconds))


@pytest.fixture
def live_holder(tmp_path):
    """A live process of this host holding tmp_path/held/.lock as a run does (start time, boot id)."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; from harness.rundir import lock as runlock; "
                             "runlock.acquire(sys.argv[1]); print('held', flush=True); time.sleep(60)",
                             str(tmp_path / "held")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def sleeper():
    """A live process of this host that is no run (what a reused pid names)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


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


def test_lock_held_by_a_live_process_is_refused(tmp_path, live_holder):
    path = tmp_path / "held" / ".lock"
    _age(path, 3600)  # a run's own lock is never stale while its process lives, whatever its heartbeat says
    with pytest.raises(HarnessError) as e:
        runlock.acquire(tmp_path / "held")
    assert str(e.value) == (f"{tmp_path}/held is in use by another run (host {socket.gethostname()}, pid "
                            f"{live_holder.pid}): wait for it to end or use another train.output_dir")
    assert json.loads(path.read_text())["pid"] == live_holder.pid  # untouched


def test_lock_of_a_live_process_that_is_not_the_run_is_taken_over(tmp_path, sleeper):
    """A reused pid: the lock's start time is not the live process's; a lock of an older harness (no start time)
    naming a process whose command line is no harness run; this process's own pid (a container restarted)."""
    folder = tmp_path / "run"
    for holder, why in [
        ({"pid": sleeper.pid, "proc_start": 1}, f"names pid {sleeper.pid}, which is now another process (started "
                                                 "later: the pid was reused)"),
        ({"pid": sleeper.pid}, f"names pid {sleeper.pid}, which is now another process (sleep, not a harness run: "
                               "the pid was reused)"),
        ({"pid": os.getpid()}, f"names pid {os.getpid()}, which is this process (left by an earlier run, e.g. "
                               "before a container restart)")]:
        _write_lock(folder, **holder)
        said = []
        path = runlock.acquire(folder, said.append)
        assert said == [f"[harness] warning: {path} {why}: taking the folder over"]
        assert json.loads(path.read_text())["proc_start"] == runlock._proc_start(os.getpid())
        runlock.release(path)


def test_empty_lock_is_taken_over_once_it_cannot_be_a_run_writing_it(tmp_path):
    """An empty .lock (left when the disk was full at the start) is refused only for its first seconds."""
    (tmp_path / ".lock").write_text("")
    with pytest.raises(HarnessError, match="which does not name its holder"):
        runlock.acquire(tmp_path)
    _age(tmp_path / ".lock", 60)
    said = []
    path = runlock.acquire(tmp_path, said.append)
    assert said == [f"[harness] warning: {path} names no holder (empty or cut, e.g. written when the disk was full) "
                    "and is 60s old: taking the folder over"]
    runlock.release(path)


def test_lock_of_another_host_is_taken_over_when_its_heartbeat_stopped(tmp_path, monkeypatch):
    _write_lock(tmp_path, 1234, host="elsewhere")
    _age(tmp_path / ".lock", runlock.STALE_S - 60)
    with pytest.raises(HarnessError, match="another machine"):
        runlock.acquire(tmp_path)
    _age(tmp_path / ".lock", runlock.STALE_S + 60)
    said = []
    path = runlock.acquire(tmp_path, said.append)
    assert said == [f"[harness] warning: {path} names host elsewhere, whose run has not touched it for 11 minutes: "
                    "taking the folder over"]
    # the holder's heartbeat keeps its lock fresh
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.05)
    runlock.release(path)
    path = runlock.acquire(tmp_path)
    _age(path, 3600)
    time.sleep(0.3)
    assert runlock._age(path) < 5
    runlock.release(path)


def test_lock_that_cannot_be_written_is_one_line_and_left_nowhere(tmp_path, monkeypatch):
    """A full disk at the start: the lock file is created but its holder cannot be written."""
    import errno

    def full(fd, mode):
        os.close(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runlock.os, "fdopen", full)
    with pytest.raises(HarnessError) as e:
        runlock.acquire(tmp_path)
    assert str(e.value) == (f"could not write the run lock {tmp_path}/.lock (OSError: [Errno 28] No space left on "
                            "device): the disk is full; nothing was started: free some space (or fix the folder's "
                            "permissions), then rerun")
    assert not (tmp_path / ".lock").exists()


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
    """Through the run's ExitStack, as rundir.hold registers it."""
    import contextlib

    with pytest.raises(RuntimeError), contextlib.ExitStack() as opened:
        lock = runlock.acquire(tmp_path)
        opened.callback(runlock.release, lock)
        raise RuntimeError("a step failed")
    assert not (tmp_path / ".lock").exists()


def test_second_run_into_a_held_folder_exits_1_with_one_line(tmp_path):
    out = tmp_path / "run"
    lock = runlock.acquire(out)  # this test process holds it, as a run does: alive
    try:
        proc = run_train([f"train.output_dir={out}", "train.max_steps=3", *FAST], check=False)
    finally:
        runlock.release(lock)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"harness: error: {out} is in use by another run (host {socket.gethostname()}, pid {os.getpid()}): wait for "
        "it to end or use another train.output_dir")
    assert not (out / "config.yaml").exists()


def test_run_takes_over_a_lock_whose_pid_is_now_another_process(tmp_path, sleeper):
    """The lock of a killed run whose pid now belongs to a live process that is no run: the restart trains."""
    out = tmp_path / "run"
    _write_lock(out, sleeper.pid, proc_start=1, boot_id=runlock._boot_id())
    proc = run_train([f"train.output_dir={out}", "train.max_steps=1", "train.save_final=false", *FAST])
    assert (f"[harness] warning: {out}/.lock names pid {sleeper.pid}, which is now another process (started later: "
            "the pid was reused): taking the folder over") in proc.stdout
    assert "[harness] done: step 1" in proc.stdout and not (out / ".lock").exists()


def test_sigterm_during_the_set_up_releases_the_lock_with_one_line(tmp_path):
    """SIGTERM right after the run took its lock (the set-up, before the loop handles signals): exit 143, one line,
    no traceback, no lock left."""
    from harness_launch import DEFAULT, ROOT

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "harness.train", "--config", DEFAULT, f"train.output_dir={out}",
                             "train.max_steps=3", *FAST], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / ".lock").exists():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.002)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == ("[harness] stopped by signal 15 outside the training loop (set-up, export "
                                            "or a step's data still being read): nothing saved since the last "
                                            "checkpoint; run the same command to continue")
    assert not (out / ".lock").exists()


def test_sigterm_in_the_instant_the_lock_exists_releases_it(tmp_path):
    """A stop signal between the lock file's creation and its holder being written (HARNESS_FAULT_SIGNAL_AT=lock): it
    waits until the lock's release is registered, so the run ends with its one line and no lock left (before, the
    lock stayed: the CI's timing hit that instant once in the test above)."""
    from harness_launch import DEFAULT, ROOT

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HARNESS_FAULT_SIGNAL_AT": "lock"}
    proc = subprocess.run([sys.executable, "-m", "harness.train", "--config", DEFAULT, f"train.output_dir={out}",
                           "train.max_steps=3", *FAST], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("[harness] stopped by signal 15 outside the training loop")
    assert not (out / ".lock").exists()


def test_sigterm_during_the_step_0_evaluation_stops_at_once(tmp_path):
    """A fresh run's step-0 evaluation (a long one here): a stop ends it at once (nothing is trained yet, so there
    is nothing to save), instead of waiting for the evaluation and a first step."""
    from harness_launch import DEFAULT, ROOT

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "harness.train", "--config", DEFAULT, f"train.output_dir={out}",
                             "train.max_steps=3", *FAST, "data.eval_files=[data/sample/gen.jsonl]",
                             "train.micro_batch_size=1"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / "environment.json").exists():  # written last in the set-up: the evaluation follows
        assert time.time() < deadline and proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.002)
    time.sleep(0.3)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    assert time.time() - t0 < 1.5 and not (out / "checkpoints").exists() and not (out / ".lock").exists()


def test_an_output_folder_that_cannot_be_created_is_one_line(tmp_path):
    """A new output_dir under a parent that cannot hold it (a file here; a read-only folder fails the same mkdir
    with EACCES/EROFS) was a traceback from rundir/lock.py."""
    parent = tmp_path / "a-file"
    parent.write_text("")
    with pytest.raises(HarnessError, match=f"could not create the output folder {parent}/run .*NotADirectoryError.*"
                                           f"use another train.output_dir"):
        runlock.acquire(parent / "run")
    if os.geteuid() != 0:  # (root writes into read-only folders)
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        with pytest.raises(HarnessError, match="PermissionError"):
            runlock.acquire(ro / "run")
