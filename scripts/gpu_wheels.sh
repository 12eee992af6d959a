#!/usr/bin/env bash
# Wheels for a lent GPU machine, which reaches no registry. Two steps:
#
#   here (a machine with a registry):   bash scripts/gpu_wheels.sh            -> .whl/main, .whl/qlora (git-ignored)
#   on the GPU machine, in each call:   bash scripts/gpu_wheels.sh --install  (then python scripts/gpu_check.py ...)
#
# The device tool carries ignored folders named in `carry` (64 MiB in all per call, the working tree included):
# carry [".whl/main"] for every preset (23 MB), and ".whl/qlora" (bitsandbytes, 43 MB) only in the call that runs
# the QLoRA preset. torch stays the one the machine has (its CUDA build; harness is installed with --no-deps, since
# pyproject pins the CPU-tested torch>=2.13.0, which the machine cannot download). The machine's Python is 3.12
# whatever this one is, so binary wheels are fetched for cp312 manylinux. DeepSpeed is an sdist: its wheel is built
# here (pure Python, DS_BUILD_OPS=0; the ops it needs are built just in time there, which the recipes' torch AdamW
# does not) with the project's venv, which has torch. The fresh H100 of 2026-11-26 had no deepspeed, pydantic, hjson,
# dill or multiprocess (DeepSpeed's and datasets' needs), so they travel too; the rest of the stack (numpy, regex,
# tokenizers 0.23, safetensors 0.8, huggingface-hub 1.33, pyarrow, ...) is the machine's. --install takes 8-24 s
# (one pip command) and ends by importing harness and the libraries, so a missing one shows in the first output.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MAIN=(transformers==5.23.0 accelerate==1.15.0 peft==0.21.2 datasets==5.2.0 torchao==0.18.0 nvidia-ml-py
      pydantic==2.13.4 pydantic-core==2.46.4 annotated-types typing-inspection hjson dill multiprocess)
PLATFORM=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
          --platform manylinux_2_24_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

if [ "${1:-}" != --install ]; then
  VENV_PY=${VENV_PY:-.venv/bin/python}  # has torch: DeepSpeed's setup.py imports it
  [ -x "$VENV_PY" ] || { echo "gpu_wheels: $VENV_PY is missing: run bash scripts/setup.sh first" >&2; exit 1; }
  rm -rf .whl && mkdir -p .whl/main .whl/qlora .whl/build
  "$PY" -m pip download --quiet --no-deps --only-binary :all: "${PLATFORM[@]}" -d .whl/main "${MAIN[@]}"
  "$PY" -m pip download --quiet --no-deps --only-binary :all: "${PLATFORM[@]}" -d .whl/qlora bitsandbytes==0.50.2
  "$PY" -m pip download --quiet --no-deps --no-binary :all: -d .whl/build deepspeed==0.19.8
  DS_BUILD_OPS=0 "$VENV_PY" -m pip wheel --quiet --no-deps --no-build-isolation -w .whl/main .whl/build/deepspeed-*.tar.gz
  rm -rf .whl/build
  du -sh .whl/main .whl/qlora
  exit 0
fi

# on the GPU machine: every carried wheel in one pip command (a wheel for another Python stops it: fetch them again)
"$PY" -m pip install --quiet --no-index --no-deps --no-compile .whl/main/*.whl $(ls .whl/qlora/*.whl 2>/dev/null)
"$PY" -m pip install --quiet --no-deps --no-build-isolation --no-compile -e .
"$PY" -c "import torch, transformers, accelerate, peft, datasets, deepspeed, torchao, harness; print('gpu_wheels: torch',
torch.__version__, 'cuda', torch.cuda.is_available(), '| transformers', transformers.__version__, '| accelerate',
accelerate.__version__, '| deepspeed', deepspeed.__version__, '| torchao', torchao.__version__)"
