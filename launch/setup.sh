#!/usr/bin/env bash
# Usage: launch/setup.sh [--dry-run]
#
# Sets up a fresh GPU box (a CUDA image with or without torch) to train; safe to run again (idempotent).
#   1. Python environment: .venv/ at the repository root. When the system python already imports torch (a
#      PyTorch/CUDA image), the venv is made with --system-site-packages and that torch is kept: torch is never
#      reinstalled when one is importable. Otherwise TORCH_SPEC is installed in the same pip command as harness.
#      USE_VENV=0 installs into the system python instead.
#   2. pip install -e ".[$EXTRAS]" (default extras: deepspeed), torch held at the version found.
#   3. GPUs: nvidia-smi (none: a CPU-only box, which is fine for the default job).
#   4. The environment report: harness env.
#   5. DeepSpeed ops compiled ahead (CUDA only): the CPU Adam used by ZeRO offload and FusedAdam, cached in
#      TORCH_EXTENSIONS_DIR, so the first training start does not spend minutes compiling.
#   6. Caches (HF_HOME, TORCH_EXTENSIONS_DIR, TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, PIP_CACHE_DIR) on the
#      persistent disk when there is one (PERSIST_DIR; /workspace on Vast.ai): launch/train.sh uses the same ones.
#
# Environment (defaults in brackets):
#   PYTHON_BASE   interpreter that creates the venv [python3]
#   USE_VENV      1: .venv/ at the repository root; 0: the current python3 [1]
#   TORCH_SPEC    torch to install when none is importable [torch==2.13.0, the tested version]
#   TORCH_INDEX_URL  extra index for torch, e.g. https://download.pytorch.org/whl/cu128 [none: PyPI]
#   EXTRAS        pip extras [deepspeed]; dev adds the test tools
#   PREBUILD_OPS  DeepSpeed op builders to compile when CUDA is present [CPUAdamBuilder FusedAdamBuilder]; '' skips
#   PERSIST_DIR, DRY_RUN: see launch/common.sh
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "$0")/common.sh"

case ${1:-} in
  -h | --help) usage; exit 0 ;;
  --dry-run) DRY_RUN=1 ;;
  '') ;;
  *) die "unknown argument $1 (see --help)" ;;
esac
PYTHON_BASE=${PYTHON_BASE:-python3}
USE_VENV=${USE_VENV:-1}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS:-deepspeed}
PREBUILD_OPS=${PREBUILD_OPS-CPUAdamBuilder FusedAdamBuilder}

if [ -n "${PERSIST_DIR:-}" ] && [ "$PERSIST_DIR" != none ]; then
  say "caches on the persistent disk $PERSIST_DIR/.cache (HF_HOME=$HF_HOME)"
  run mkdir -p "$HF_HOME" "$TORCH_EXTENSIONS_DIR" "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR" "$PIP_CACHE_DIR"
else
  say "no persistent disk (set PERSIST_DIR to one): caches stay in their default places"
fi

# 1. the Python environment; an importable torch is kept
torch_version() { "$1" -c 'import torch; print(torch.__version__)' 2> /dev/null || true; }
if [ "$USE_VENV" = 1 ]; then
  PY=.venv/bin/python
  if [ -x "$PY" ]; then
    say "using the existing .venv"
  elif [ -n "$(torch_version "$PYTHON_BASE")" ]; then
    say "$PYTHON_BASE has torch $(torch_version "$PYTHON_BASE"): making .venv with --system-site-packages to keep it"
    run "$PYTHON_BASE" -m venv --system-site-packages .venv
  else
    run "$PYTHON_BASE" -m venv .venv
  fi
else
  PY=$PYTHON_BASE
fi
# (a venv about to be made sees the system torch through --system-site-packages)
if [ -x "$PY" ] || [ "$USE_VENV" != 1 ]; then HAVE_TORCH=$(torch_version "$PY"); else HAVE_TORCH=$(torch_version "$PYTHON_BASE"); fi

# 2. install harness; torch held where it is
PIP=("$PY" -m pip install --disable-pip-version-check)
if [ -n "$HAVE_TORCH" ]; then
  say "torch $HAVE_TORCH is importable: keeping it (not reinstalled)"
  TORCH_REQ="torch==${HAVE_TORCH%%+*}"
  # a local build tag (+cu128) is kept by asking for the version that is there; pip sees it satisfied
  PIP+=("$TORCH_REQ")
else
  say "no torch found: installing $TORCH_SPEC"
  PIP+=("$TORCH_SPEC")
  if [ -n "${TORCH_INDEX_URL:-}" ]; then PIP+=(--extra-index-url "$TORCH_INDEX_URL"); fi
fi
run "${PIP[@]}" -e ".[$EXTRAS]"
if [ "$DRY_RUN" != 1 ] && [ -n "$HAVE_TORCH" ] && [ "$(torch_version "$PY")" != "$HAVE_TORCH" ]; then
  die "torch changed from $HAVE_TORCH to $(torch_version "$PY") during the install; please report this" 1
fi

# 3. GPUs
if command -v nvidia-smi > /dev/null 2>&1; then
  run nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  CUDA_OK=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2> /dev/null || echo 0)
  if [ "$DRY_RUN" != 1 ] && [ "$CUDA_OK" != 1 ]; then
    say "WARNING: nvidia-smi sees GPUs but torch.cuda.is_available() is False: torch $(torch_version "$PY") is not a"
    say "CUDA build for this driver; set TORCH_SPEC/TORCH_INDEX_URL and recreate .venv"
  fi
else
  CUDA_OK=0
  say "no nvidia-smi: no GPU on this box; training runs on the CPU (launch/train.sh says so)"
fi

# 4. environment report
run "$PY" -m harness.cli env

# 5. DeepSpeed ops, compiled once into TORCH_EXTENSIONS_DIR
if [ "$CUDA_OK" = 1 ] && [ -n "$PREBUILD_OPS" ]; then
  for op in $PREBUILD_OPS; do
    if ! run "$PY" -c "from deepspeed.ops.op_builder import $op; $op().load()"; then
      say "WARNING: $op did not build here (a CUDA toolkit with nvcc is needed); DeepSpeed builds it at first use"
    fi
  done
fi

say "ready. Next: launch/train.sh configs/default.yaml   (see README.md)"
if [ -n "${PERSIST_DIR:-}" ] && [ "$PERSIST_DIR" != none ]; then
  say "the caches are set by launch/*.sh; for your own shell: export HF_HOME=$HF_HOME TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR"
fi
