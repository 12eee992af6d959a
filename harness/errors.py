"""User-facing errors: each carries a one-line message and the exit status the entry points use.

The entry points (`harness ...`, `python -m harness.train`, `accelerate launch harness/train.py`) catch
`HarnessError` and print `harness: error: <message>` on one line, without a traceback: these are mistakes in
the user's config or data, not bugs. Anything else is a bug and keeps its traceback.
"""


class HarnessError(Exception):
    exit_code = 1


class ConfigError(HarnessError):
    """A wrong, unknown or conflicting config key (exit 2, like argparse)."""

    exit_code = 2


class DataError(HarnessError):
    """A missing, empty or malformed data file; the message names file:line and the field."""

    exit_code = 1
