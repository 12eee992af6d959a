# Shared by the launch/ scripts (sourced, not run): repository root, interpreter, caches, GPU facts, printing.
#   source "$(dirname "$0")/common.sh"
# Environment (defaults in brackets):
#   PYTHON        interpreter with harness installed [.venv/bin/python if present, else python3]
#   PERSIST_DIR   a persistent disk for caches [/workspace when it exists and is writable (Vast.ai), else none;
#                 'none' disables]: HF_HOME, TORCH_EXTENSIONS_DIR, TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR and
#                 PIP_CACHE_DIR go under $PERSIST_DIR/.cache unless already set
#   NUM_GPUS      GPUs on this node [CUDA_VISIBLE_DEVICES's count if set, else nvidia-smi -L, else 0]
#   GPU_MEM_GB    memory per GPU in GiB [the smallest GPU's, from nvidia-smi]
#   DRY_RUN=1     print the commands instead of running them (the same as --dry-run)
# shellcheck shell=bash

LAUNCH_SCRIPT=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")  # absolute: the cd below breaks a relative $0
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
LAUNCH_NAME=$(basename "$0")

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
DRY_RUN=${DRY_RUN:-0}

say() { printf '[%s] %s\n' "$LAUNCH_NAME" "$*"; }
# The calling script's header comment (its lines 2 up to `set -euo`), without the leading '# ': its --help.
usage() { sed -n '2,/^set -euo/p' "$LAUNCH_SCRIPT" | sed '$d; s/^# \{0,1\}//'; }
die() { printf '%s: error: %s\n' "$LAUNCH_NAME" "$1" >&2; exit "${2:-2}"; }

# Print a command exactly as it runs ("$ ..."), then run it unless this is a dry run.
show() { printf '$'; printf ' %q' "$@"; printf '\n'; }
run() {
  show "$@"
  if [ "$DRY_RUN" = 1 ]; then return 0; fi
  "$@"
}

# Caches on the persistent disk, so that a restarted or re-rented box keeps compiled ops and downloads.
if [ -z "${PERSIST_DIR:-}" ] && [ -d /workspace ] && [ -w /workspace ]; then PERSIST_DIR=/workspace; fi
if [ -n "${PERSIST_DIR:-}" ] && [ "$PERSIST_DIR" != none ]; then
  export HF_HOME=${HF_HOME:-$PERSIST_DIR/.cache/huggingface}
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PERSIST_DIR/.cache/torch_extensions}
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PERSIST_DIR/.cache/triton}
  export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PERSIST_DIR/.cache/inductor}
  export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$PERSIST_DIR/.cache/pip}
fi

# GPUs on this node: NUM_GPUS, else the CUDA_VISIBLE_DEVICES list, else nvidia-smi -L, else 0.
count_gpus() {
  if [ -n "${NUM_GPUS:-}" ]; then echo "$NUM_GPUS"; return; fi
  if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
    local ids
    IFS=, read -r -a ids <<< "$CUDA_VISIBLE_DEVICES"
    echo "${#ids[@]}"; return
  fi
  if command -v nvidia-smi > /dev/null 2>&1; then
    nvidia-smi -L 2> /dev/null | grep -c '^GPU ' || true; return
  fi
  echo 0
}

# Memory of the smallest GPU in GiB: GPU_MEM_GB, else nvidia-smi.
gpu_mem_gb() {
  if [ -n "${GPU_MEM_GB:-}" ]; then echo "$GPU_MEM_GB"; return; fi
  command -v nvidia-smi > /dev/null 2>&1 || return 0
  nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2> /dev/null \
    | sort -n | head -n 1 | awk '{printf "%.1f\n", $1 / 1024}' || true
}

# The run folder of CONFIG [overrides] (train.output_dir), through harness.config.load_config; bad input -> one line.
output_dir_of() {
  "$PYTHON" - "$@" << 'PY'
import importlib.util
import sys
try:
    from harness.config import load_config
    from harness.errors import HarnessError
    missing = [m for m in ("torch", "accelerate") if importlib.util.find_spec(m) is None]
except ImportError as err:
    missing = [str(err)]
if missing:
    sys.exit(f"harness: error: {sys.executable} lacks {', '.join(missing)}: run launch/setup.sh first (or set PYTHON)")
try:
    print(load_config(sys.argv[1], sys.argv[2:]).train.output_dir)
except HarnessError as err:
    print(f"harness: error: {err}", file=sys.stderr)
    sys.exit(err.exit_code)
PY
}

# The ZeRO stage the newest complete checkpoint in a run folder was written with (0: DDP / one process), empty when
# there is none or it does not say: a checkpoint resumes under its own stage, on any number of GPUs.
checkpoint_stage() {
  "$PYTHON" - "$1" << 'PY' 2> /dev/null || true
import sys
from harness.checkpoint.resume import checkpoint_stage
stage = checkpoint_stage(sys.argv[1])
print("" if stage is None else stage)
PY
}

# Direct children of a process (the training workers of an accelerate launcher).
children_of() {
  if command -v pgrep > /dev/null 2>&1; then pgrep -P "$1" || true; return; fi
  local f stat fields
  for f in /proc/[0-9]*/stat; do
    read -r stat < "$f" 2> /dev/null || continue
    read -r -a fields <<< "${stat##*) }"
    if [ "${fields[1]}" = "$1" ]; then f=${f#/proc/}; echo "${f%/stat}"; fi
  done
}

# The training processes of an accelerate launcher: its children except the tee of train.sh's log (made in the
# same fork before the launcher's exec, so it is the launcher's child too; it ignores the stop signals anyway).
workers_of() {
  local pid
  for pid in $(children_of "$1"); do
    if [ "$(cat "/proc/$pid/comm" 2> /dev/null || true)" != tee ]; then echo "$pid"; fi
  done
}
