#!/usr/bin/env bash
# Usage: bash scripts/setup.sh
#   Creates .venv/ at the repository root if it is missing and installs harness (editable) with its test tools
#   and DeepSpeed, in one pip command with torch pinned so that nothing resolves another torch build.
# Environment:
#   PYTHON      interpreter for the venv (default: python3)
#   TORCH_SPEC  the torch requirement (default: torch==2.13.0, the tested version). On a GPU box whose image
#               already has a CUDA torch, use launch/setup.sh instead or set TORCH_SPEC to that version.
#   EXTRAS      pip extras to install (default: dev)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS:-dev}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv
fi
echo "[setup] installing $TORCH_SPEC and harness[$EXTRAS] into .venv"
.venv/bin/python -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC" -e ".[$EXTRAS]"
.venv/bin/python -c "import torch, accelerate, transformers, harness; print('[setup] ok: torch', torch.__version__, '| accelerate', accelerate.__version__, '| transformers', transformers.__version__)"
