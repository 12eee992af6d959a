"""User-facing errors: each carries a one-line message and the exit status the entry points use.

The entry points (`harness ...`, `python -m harness.train`, `accelerate launch harness/train.py`) catch
`HarnessError` and print `harness: error: <message>` on one line, without a traceback: these are mistakes in
the user's config or data, not bugs. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class HarnessError(Exception):
    exit_code = 1


class ConfigError(HarnessError):
    """A wrong, unknown or conflicting config key (exit 2, like argparse)."""

    exit_code = 2


class ConfigErrors(ConfigError):
    """Several config problems found in one pass (load_config reports every one, not the first): one line each. Its
    text is the lines joined with the entry points' own `harness: error: ` prefix, so that each printer, which writes
    `harness: error: <message>`, shows every problem as its own line."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\nharness: error: ".join(self.problems))


def problems_of(e: ConfigError) -> list[str]:
    """The one-line problems an error holds (ConfigErrors: each of them)."""
    return list(getattr(e, "problems", None) or [str(e)])


def raise_all(problems: list[str]) -> None:
    """Nothing when `problems` is empty; a ConfigError for one, ConfigErrors for several."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigErrors(problems)


class DataError(HarnessError):
    """A missing, empty or malformed data file; the message names file:line and the field."""

    exit_code = 1


class RunFailed(HarnessError):
    """harness.train(...) (the Python API) of a run that failed: its one line is printed; `status`, the exit status
    `harness train` would have ended with."""

    def __init__(self, status: int):
        super().__init__(f"harness.train: the run ended with exit status {status} (its reason is printed above)")
        self.status = status


def one_line(exc: BaseException, limit: int = 300) -> str:
    """'Type: message' on one line (messages of torch and others can span several), at most `limit` characters."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
