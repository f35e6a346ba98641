#!/usr/bin/env bash
# `make gpu-check`: the engine and serve suites on an NVIDIA GPU, with vLLM's GPU
# defaults on (CUDA graphs, async scheduling). NOT RUN by this project yet: its
# machines have no GPU. Installs the CUDA engine (vllm==0.32.0) into .venv-gpu,
# leaving the CPU .venv alone. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU visible (nvidia-smi -L failed); run this on a GPU machine" >&2
  exit 2
fi
VENV=.venv-gpu HS_ENGINE=gpu bash scripts/setup.sh
HS_TEST_ACCELERATOR=gpu .venv-gpu/bin/python -m pytest -q -ra tests/engine tests/serve "$@"
