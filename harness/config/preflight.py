"""What a training process checks before its heavy imports, and how every process reports a user error once.

`python -m harness.train` and `accelerate launch harness/train.py` run `early_check` before torch, transformers and
the rest are imported: the launch (FSDP is refused) and the config (load_config) are checked in a second or two, so a
mistake costs no model build, writes nothing, and is found the same way by every process.

`report`: a user error (HarnessError) is printed by the main process alone, `harness: error: <message>` on one line.
Every process finds it (config and data errors are found identically, or agreed between processes before they are
raised), so the other processes wait for the launcher to end them once the main process has exited: a worker that
exited first would make torch elastic SIGTERM the main process before its line is out (the user then saw only the
launcher's ChildFailedError traceback). The wait is bounded (`WAIT_S`), so no worker is left behind.
This module imports neither torch nor accelerate.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Optional

from harness.errors import ConfigError, HarnessError
from harness.config import describe, load_config, recipe_args

WAIT_S = 30.0  # how long a non-main process waits for the launcher to end it after a user error


def refuse_fsdp() -> None:
    """accelerate's FSDP (`--use_fsdp`, a config with distributed_type: FSDP: both set ACCELERATE_USE_FSDP) is a
    path the harness does not support (its checkpoints, resume, objective and memory plan are DDP and DeepSpeed's)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true", "yes"):
        raise ConfigError("the launch asks for FSDP (accelerate's --use_fsdp or distributed_type: FSDP, "
                          "ACCELERATE_USE_FSDP=true), which the harness does not support: shard with DeepSpeed ZeRO "
                          "instead, launch/train.sh --zero N (1, 2, 3, 3-offload or auto) or train.deepspeed=zero3")


def is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def report(e: HarnessError) -> int:
    """Print `e` on the main process; on the others wait (bounded) for the launcher to end this one. The exit code."""
    if is_main_process():
        print(f"harness: error: {e}", file=sys.stderr, flush=True)
    elif "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        # the main process prints and exits; the launcher then stops this one (SIGTERM) at once
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.1)
    return e.exit_code


def early_check(argv: list[str], checks: tuple = (), done: Optional[Callable] = None) -> None:
    """The launch and the config, before the heavy imports (the caller is train.py's `__main__`), and `checks` (each
    called with the loaded config: the layers above config/ hand theirs in): a user error exits here through `report`.
    `done(cfg)` true (a finished run asked nothing more: it says so) exits 0 here. --help and --help-config are
    answered here too; anything argparse refuses is left to the entry point."""
    import argparse

    p = argparse.ArgumentParser(add_help=False)
    recipe_args.add(p)
    p.add_argument("--help-config", action="store_true")
    p.add_argument("-h", "--help", action="store_true")
    try:
        args, unknown = p.parse_known_args(argv)
        recipe_args.resolve(args, None, required=False)
    except SystemExit:
        return
    if args.help and not unknown:
        recipe_args.train_parser().print_help()
        sys.exit(0)
    if args.help_config and not unknown:
        print(describe())
        sys.exit(0)
    if args.help or args.help_config or unknown or any(o.startswith("-") for o in args.overrides):
        return
    try:
        refuse_fsdp()
        cfg = load_config(args.config, args.overrides)
        for check in checks:
            check(cfg)
        finished = done is not None and done(cfg)
    except HarnessError as e:
        code = report(e)
        sys.stdout.flush()
        os._exit(code)
    if finished:
        sys.stdout.flush()
        os._exit(0)
