"""A rerun into a folder that holds a finished run (train.py's entry): nothing is started or rewritten, unless the
config asks for more steps than the run planned; then it continues from its last checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import yaml

from harness.errors import HarnessError

# stopping.TIME_BUDGET and stopping.EARLY_STOPPING (tests/test_rerun.py holds them equal): this module is read before
# torch is imported (train.py's entry answers "nothing to do" in a second), and stopping.py imports torch
STOPPED_BY_TIME, STOPPED_EARLY = "time_budget", "early_stopping"
TIME_BUDGET, EARLY_STOPPING = STOPPED_BY_TIME, STOPPED_EARLY


def finished_run(output_dir: str | Path) -> Optional[dict]:
    """The report of the run that finished in `output_dir` (report.json says it ran to its end or to its time
    budget, and its final/ export, if it made one, is there), else None: nothing there, or a run to continue."""
    try:
        rep = json.loads(Path(output_dir, "report.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(rep, dict) or "stopped_by" not in rep or \
            rep["stopped_by"] not in (None, TIME_BUDGET, EARLY_STOPPING):
        return None
    final = rep.get("final_dir")
    return rep if final is None or Path(final).is_dir() else None


def more_steps(t, rep: dict) -> Optional[str]:
    """What in the train section `t` (cfg.train) asks the finished run of report `rep` for more steps than it planned
    (e.g. "train.max_steps=6 (it planned 3)"), or None: its rerun has nothing to do. With train.max_steps=-1, more
    epochs than its config.yaml names. An early-stopped run asks nothing more: its patience is spent, so a step more
    would stop it again after one step (each rerun replacing final/ and report.json)."""
    if rep.get("stopped_by") == EARLY_STOPPING:
        return None
    planned = rep.get("planned_steps") or 0
    if t.max_steps > 0:
        return f"train.max_steps={t.max_steps} (it planned {planned})" if t.max_steps > max(planned, rep["steps"]) \
            else None
    try:
        before = yaml.safe_load(Path(t.output_dir, "config.yaml").read_text())["train"]
        old_steps, old_epochs = int(before["max_steps"]), float(before["epochs"])
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return None
    if old_steps > 0 or t.epochs > old_epochs:
        return f"train.max_steps=-1 with train.epochs={t.epochs:g} (it planned {planned} steps)"
    return None


def continue_finished(output_dir: str | Path, rep: dict, asks: str) -> str:
    """The one line of a finished run asked for more steps: it continues from its last checkpoint with the new
    schedule; a one-line HarnessError when it has none."""
    out = Path(output_dir)
    done = f"{out} holds a finished run (step {rep.get('steps')}/{rep.get('planned_steps')})"
    from harness.checkpoint.store import list_checkpoints  # lazy: start-up time (the check runs before torch)

    saved, _ = list_checkpoints(out)
    if not saved:
        raise HarnessError(f"{done} and {asks} asks for more, but it has no checkpoint to continue from: train a new "
                           f"folder from its final weights (model.name_or_path={out}/final) or start over with "
                           f"train.overwrite=true")
    step, path = saved[-1]
    return (f"[harness] {done}; {asks} asks for more: continuing from its last checkpoint {path} (step {step}) with "
            f"the new schedule; final/ and report.json are replaced at the end")


STOPPED = {TIME_BUDGET: ", stopped by its time budget", EARLY_STOPPING: ", stopped early: its evaluations stopped "
           "improving (train.early_stopping)"}


def describe_finished(output_dir: str | Path, rep: dict) -> str:
    """The rerun's one line: where the finished run's outputs are."""
    out = Path(output_dir)
    final = f"final model {rep['final_dir']}, " if rep.get("final_dir") else ""
    return (f"[harness] {out} holds a finished run (step {rep.get('steps')}/{rep.get('planned_steps')}"
            f"{STOPPED.get(rep['stopped_by'], '')}): {final}report {out / 'report.json'}, "
            f"metrics {out / 'metrics.jsonl'}; nothing to do (train.overwrite=true trains it again)")


def nothing_to_do(t) -> bool:
    """train.py's first question (`t`: cfg.train): True when the folder holds a finished run that the config asks
    nothing more of (said once, by the main process: nothing is started or rewritten). When it asks for more steps,
    that is said and the run goes on from the finished run's last checkpoint (False)."""
    done = None if t.overwrite else finished_run(t.output_dir)
    asks = more_steps(t, done) if done is not None else None
    line = None if done is None else describe_finished(t.output_dir, done) if asks is None else \
        continue_finished(t.output_dir, done, asks)
    if line is not None and os.environ.get("RANK", "0") == "0":
        print(line, flush=True)
    return done is not None and asks is None


def finished_nothing_asked(settings: dict) -> bool:
    """The entry points' answer before torch is imported (`settings`: the resolved config as a dict,
    Config.to_dict()): True, with the finished run's one line (main process), when the folder holds a finished run
    whose config.yaml is this config (the same command again: its machine checks passed when it ran, and nothing
    will run); else False, saying nothing: a changed config (a bad override included) is checked in full first, and
    `nothing_to_do` answers after the machine checks."""
    t = settings["train"]
    done = None if t["overwrite"] else finished_run(t["output_dir"])
    try:
        saved = yaml.safe_load(Path(t["output_dir"], "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return False
    if done is None or not isinstance(saved, dict) or any(settings.get(k) != v for k, v in saved.items()):
        return False
    if os.environ.get("RANK", "0") == "0":
        print(describe_finished(t["output_dir"], done), flush=True)
    return True
