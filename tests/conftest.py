"""Shared test setup: never touch the Hugging Face Hub; give tests the repository root without chdir."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def repo_root() -> Path:
    """The repository root (where configs/ and harness/ live)."""
    return REPO_ROOT
