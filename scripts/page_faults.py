"""Page faults and kernel time of the training step: the harness with and without train.malloc_reuse, and the bench's
raw loop, each in its own process with `harness bench`'s settings (its forced overrides, threads, environment).

    python scripts/page_faults.py --rounds 2 > docs/bench/page-faults-cpu.txt     # about 4 minutes on 2 cores

Each process trains the default job for up to 400 steps; from /proc/<pid>/stat, the minor page faults and the user and
system CPU time between `--start` and `--start + --window` seconds after its launch (the steps, past the start-up:
the default job's 10 warm-up steps end before 15 s on 2 cores), then it is stopped. Linux only. Not a test: what
glibc's malloc hands back to the kernel shows as page faults and system time (docs/speed.md, train.malloc_reuse).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.tools.bench import _child_env, forced_overrides  # noqa: E402

STEPS = 400


def command(kind: str, config: str, out: str) -> list[str]:
    extra = forced_overrides(10, STEPS - 10, plain=True)
    if kind == "raw":
        return [sys.executable, "-m", "harness.tools.bench", "--worker", "raw", config, *extra, "--steps",
                str(STEPS - 10), "--warmup", "10", "--threads", "2"]
    reuse = "true" if kind == "harness" else "false"
    return [sys.executable, "-m", "harness.train", "--config", config, *extra, f"train.output_dir={out}",
            f"train.malloc_reuse={reuse}"]


def sample(pid: int) -> tuple[int, float, float]:
    """(minor faults, user s, system s) of the process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[7]), int(fields[11]) / tick, int(fields[12]) / tick


def measure(kind: str, config: str, start: float, window: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="faults-") as out:
        proc = subprocess.Popen(command(kind, config, out), cwd=ROOT, env=_child_env(2), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            time.sleep(start)
            if proc.poll() is not None:
                raise SystemExit(f"{kind}: the run ended before {start} s (exit {proc.returncode})")
            a = sample(proc.pid)
            time.sleep(window)
            b = sample(proc.pid)
        finally:
            proc.kill()
            proc.wait()
    return {"faults_per_s": (b[0] - a[0]) / window, "user": (b[1] - a[1]) / window,
            "sys": (b[2] - a[2]) / window}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--start", type=float, default=18.0)
    p.add_argument("--window", type=float, default=10.0)
    a = p.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {a.config}, 2 threads, seconds "
          f"{a.start:.0f}-{a.start + a.window:.0f} of each run, load average {os.getloadavg()[0]:.1f} before")
    print(f"{'round':<6} {'process':<34} {'minor faults/s':>14} {'user (cores)':>12} {'system (cores)':>14}")
    names = {"harness": "harness (train.malloc_reuse=true)", "harness_off": "harness (train.malloc_reuse=false)",
             "raw": "raw loop (harness bench's)"}
    for r in range(1, a.rounds + 1):
        for kind in ("harness_off", "harness", "raw"):
            m = measure(kind, a.config, a.start, a.window)
            print(f"{r:<6} {names[kind]:<34} {m['faults_per_s']:>14,.0f} {m['user']:>12.2f} {m['sys']:>14.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
