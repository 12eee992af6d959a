"""`accelerate launch` whose exit status is the training processes' own, with no launcher traceback.

    python -m harness.tools.launcher --config_file accelerate_configs/cpu.yaml harness/train.py --config CONFIG ...

accelerate's launcher answers a failed worker with a traceback of its own (CalledProcessError from one process or
DeepSpeed's runner, torch elastic's ChildFailedError under several) and exit status 1 whatever the worker's status
(its --quiet exits 1 as well). launch/train.sh runs this instead: the same arguments through accelerate's own parser
and launch_command; a failed worker's status (a harness error: 2 for a config, 1 for data; a signal N: 128+N) is the
exit status, and the launcher adds no traceback (the worker printed its one line, or its own traceback for a crash).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Optional

from accelerate.commands.launch import launch_command, launch_command_parser
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError


def worker_status(exc: BaseException) -> Optional[int]:
    """The exit status of the worker a launcher exception reports (the first to fail); None for any other error."""
    if isinstance(exc, subprocess.CalledProcessError):
        code = exc.returncode
    elif isinstance(exc, ChildFailedError):
        code = exc.get_first_failure()[1].exitcode
    else:
        return None
    return 128 - code if code < 0 else code  # Popen and torch elastic give a signal N as -N; shells say 128+N


def main(argv: Optional[list[str]] = None) -> int:
    args = launch_command_parser().parse_args(argv)
    try:
        launch_command(args)
    except (subprocess.CalledProcessError, ChildFailedError) as e:  # torch elastic has logged which rank failed
        return worker_status(e) or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
