"""The test suite's CPU slots (tests/harness_launch.py cpu_slots): launches on 2 xdist workers share the cores."""

from __future__ import annotations

import subprocess
import sys
import time

import harness_launch
from harness_launch import ROOT, cpu_slots

TAKE_ONE = "import time, harness_launch\nwith harness_launch.cpu_slots(1): print(time.time())"  # when it got one


def test_a_run_waits_while_another_holds_every_slot_and_a_nested_launch_does_not(tmp_path, monkeypatch):
    monkeypatch.setattr(harness_launch, "SLOTS_DIR", tmp_path)  # this test's own slots, not the suite's
    monkeypatch.setenv("HARNESS_TEST_SLOTS", "2")
    env = {"HARNESS_TEST_SLOTS_DIR": str(tmp_path), "HARNESS_TEST_SLOTS": "2", "PYTHONPATH": str(ROOT / "tests")}
    with cpu_slots(None):
        with cpu_slots(1):  # nested (run_train inside a test that holds every slot): takes nothing more
            pass
        other = subprocess.Popen([sys.executable, "-c", TAKE_ONE], env=env, stdout=subprocess.PIPE, text=True)
        time.sleep(5)
        assert other.poll() is None  # waiting for a slot
        released = time.time()
    assert float(other.communicate(timeout=60)[0]) >= released
    with cpu_slots(1):  # one of two: another 1-slot run goes while this one holds its slot (a wait: TimeoutExpired)
        other = subprocess.run([sys.executable, "-c", TAKE_ONE], env=env, capture_output=True, text=True, timeout=60)
        assert other.returncode == 0, other.stderr
