"""The data pipeline: sources -> formats -> chat template -> tokenized samples -> mixing -> loaders."""

from harness import IGNORE_INDEX  # noqa: F401  (it lives in the package file, below every layer)
