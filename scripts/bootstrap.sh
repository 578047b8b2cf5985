#!/usr/bin/env bash
# Create .venv (if needed) and install llmserve with the worker stack, the model converter and test tools.
# torch is pinned to 2.13.0 in pyproject: that is the CPU wheel here; an unpinned torch would pull
# a multi-GB CUDA build. On a GPU host, install your CUDA torch 2.13.0 first and pip keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[worker,test,models]'
# Compile the AVX2 CPU kernels once, here, rather than inside the first worker or test that needs them.
.venv/bin/python -m worker_svc.kernels.cpu_ext \
  || echo "bootstrap: AVX2 CPU kernels unavailable here; workers use the torch/aten kernels" >&2
