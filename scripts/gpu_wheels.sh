#!/usr/bin/env bash
# Wheels for a lent GPU machine, which reaches no registry. Two steps:
#
#   here (a machine with a registry):   bash scripts/gpu_wheels.sh            -> .whl/main, .whl/qlora (git-ignored)
#   on the GPU machine, in each call:   bash scripts/gpu_wheels.sh --install  (then python scripts/gpu_check.py ...)
#
# The device tool carries ignored folders named in `carry` (64 MiB in all per call, the working tree included):
# carry [".whl/main"] for every preset, and ".whl/qlora" (bitsandbytes, 43 MB) only in the call that runs the QLoRA
# preset. torch stays the one the machine has (its CUDA build; harness is installed with --no-deps, since pyproject
# pins the CPU-tested torch>=2.13.0, which the machine cannot download). deepspeed is an sdist: the lent H100 had its
# wheel in pip's cache (2026-11-23); --install takes it from there or says it is missing. The machine's own Python
# stack (numpy, regex, packaging, fsspec, ...) was enough for these wheels then; --install ends by importing harness
# and the libraries, so a missing one shows in the first call's output.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MAIN=(transformers==5.23.0 accelerate==1.15.0 peft==0.21.2 datasets==5.2.0 huggingface-hub tokenizers safetensors
      tensorboard nvidia-ml-py pyyaml tqdm xxhash torchao==0.18.0)  # torchao: train.precision=fp8 (3.4 MB)

if [ "${1:-}" != --install ]; then
  rm -rf .whl && mkdir -p .whl/main .whl/qlora
  "$PY" -m pip download --quiet --no-deps --only-binary :all: -d .whl/main "${MAIN[@]}"
  "$PY" -m pip download --quiet --no-deps --only-binary :all: -d .whl/qlora bitsandbytes==0.50.2
  du -sh .whl/main .whl/qlora
  exit 0
fi

# on the GPU machine: each carried wheel, one at a time (a wheel built for another Python version is skipped: the
# machine's own copy of that package, if any, stays)
for whl in .whl/main/*.whl .whl/qlora/*.whl; do
  [ -f "$whl" ] || continue
  "$PY" -m pip install --quiet --no-index --no-deps "$whl" 2>/dev/null || echo "gpu_wheels: skipped $(basename "$whl")"
done
"$PY" -c "import deepspeed" 2>/dev/null || "$PY" -m pip install --quiet --no-index deepspeed==0.19.8 ||
  "$PY" -m pip install --quiet deepspeed==0.19.8 || echo "gpu_wheels: deepspeed is not installed (not in pip's cache)"
"$PY" -m pip install --quiet --no-deps --no-build-isolation -e .
"$PY" -c "import torch, transformers, accelerate, peft, datasets, harness; print('gpu_wheels: torch', torch.__version__,
'cuda', torch.cuda.is_available(), '| transformers', transformers.__version__, '| accelerate', accelerate.__version__)"
