"""The output folder, in one place: what a run writes there and who may write it.

    <output_dir>/.lock            one run per folder (lock.py: staleness from the holder's start time, boot id and a
                                  heartbeat); taken by `hold`, released when the run ends however it ends
    <output_dir>/config.yaml      the resolved config, environment.json the environment (`write_run_files`)
    <output_dir>/checkpoints/     harness/checkpoint/ writes and reads them (checkpoint.store.checkpoints_root)
    metrics.jsonl, report.json, summary.md, plots/, tensorboard/, final/: RUN_OUTPUTS, deleted by train.overwrite=true
                                  (`start_over`), only in a folder that holds a harness run (`holds_run`)

A rerun of a finished run (finished.py) does nothing, or continues from its last checkpoint when it asks for more
steps.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Callable

from harness.config import Config, save_config
from harness.config.modes import facts
from harness.errors import ConfigError, HarnessError
from harness.files import write_json
from harness.rundir import lock
from harness.config import SECTIONS

# what a training run writes into its output folder and train.overwrite=true deletes (config.yaml, environment.json
# are rewritten anyway; plan.json (harness plan) and train.log (launch/train.sh) are the user's, kept)
RUN_OUTPUTS = ("checkpoints", "final", "metrics.jsonl", "report.json", "summary.md", "plots", "tensorboard")


def write_run_files(cfg: Config, out: Path, env: dict) -> None:
    """config.yaml and environment.json (main process); a full disk is one line, with nothing cut left behind."""
    read = facts(cfg.loss.mode).sections  # sections the run reads beyond the common ones (rl reads both)
    omit = tuple(name for name in ("rft", "rl", "distill") if name not in read)
    for name, write in (("config.yaml", lambda p: save_config(cfg, p, omit=omit)),
                        ("environment.json", lambda p: write_json(p, env))):
        try:
            write(out / name)
        except OSError as e:
            raise HarnessError(f"could not write {out / name} ({type(e).__name__}: {e}); nothing was trained: free "
                               f"some space, then rerun") from None


def hold(out: Path, accelerator, opened: contextlib.ExitStack) -> None:
    """The main process takes <output_dir>/.lock (released when the run ends, however it ends); a refusal stops every
    process with the same one-line error."""

    def take() -> None:
        # the lock and its release's registration as one step: a stop signal in between (the set-up's handler ends
        # the run through `opened`) would leave a lock that nothing removes; one that comes meanwhile waits
        with stop_signals_held():
            held = lock.acquire(out, accelerator.print)
            opened.callback(lock.release, held)

    from harness.distributed import collectives  # lazy: start-up time (rundir.finished's check runs before torch)

    collectives.on_main(accelerator, take)


@contextlib.contextmanager
def stop_signals_held():
    """SIGTERM / SIGINT arriving inside are noted and raised again when it ends, to the handlers in place then (the
    set-up's, train.main). Python runs signal handlers in the main thread whichever thread received the signal, so
    the handlers are swapped rather than the signal mask (blocking it in this thread alone let another thread take
    it). Outside the main thread: nothing is held."""
    from harness.stopping import stop_handlers  # lazy: start-up time (rundir.finished's check runs before torch)

    noted = []
    try:
        with stop_handlers(lambda signum, frame: noted.append(signum)):
            yield
    finally:
        if noted:
            signal.raise_signal(noted[0])




def start_over(out: Path, say: Callable[[str], None]) -> None:
    """train.overwrite=true: delete the previous run's outputs (main process, holding the lock). Only in a folder that
    holds a harness run (its config.yaml): what has those names in any other folder (the current one, when the
    folder was given as `.`) is not the run's, and nothing is deleted."""
    import shutil

    gone = [name for name in RUN_OUTPUTS if (out / name).exists()]
    if gone and not holds_run(out):
        raise ConfigError(f"config key 'train.overwrite': {out} holds {', '.join(gone)} but no harness run (no "
                          f"config.yaml written by harness train): nothing deleted; use another train.output_dir")
    for name in gone:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    if gone:
        say(f"[harness] train.overwrite=true: deleted the previous run's {', '.join(gone)} in {out}")


def holds_run(out: Path) -> bool:
    """Whether `out` holds the config.yaml a training run writes (a mapping of config sections with train:)."""
    import yaml

    try:
        written = yaml.safe_load((out / "config.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(written, dict) and "train" in written and set(written) <= set(SECTIONS)
