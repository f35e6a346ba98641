#!/usr/bin/env bash
# `make gpu-check`: the engine and serve suites on an NVIDIA GPU, with vLLM's GPU
# defaults on (torch.compile, CUDA graphs, async scheduling). NOT RUN by this
# project yet: its machines have no GPU. Installs the CUDA engine (vllm==0.32.0)
# into .venv-gpu, leaving the CPU .venv alone. Extra arguments go to pytest.
#
# In order, each a pytest run that stops the check if it fails:
#   1. tests/engine/test_compiled.py: the layer, head and steering exactness tests
#      on a compiled engine with `capture_layers` (worker/traced.py), whose entries
#      CUDA graphs now replay, and the compile counts before and after requests
#      (no new graph, no recompile);
#   2. tests/engine tests/serve: everything else, compiled, CUDA graphs, async
#      scheduling (tests/conftest.py, HS_TEST_ACCELERATOR=gpu).
# `--dry-run` prints the commands and runs none (tests/unit/test_setup.py runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
run() { echo "+ $*"; if [[ $DRY == 0 ]]; then "$@"; fi; }
if [[ $DRY == 0 ]] && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU visible (nvidia-smi -L failed); run this on a GPU machine" >&2
  exit 2
fi
export HS_TEST_ACCELERATOR=gpu
run env VENV=.venv-gpu HS_ENGINE=gpu bash scripts/setup.sh
run .venv-gpu/bin/python -m pytest -q -ra tests/engine/test_compiled.py "$@"
run .venv-gpu/bin/python -m pytest -q -ra tests/engine tests/serve --ignore=tests/engine/test_compiled.py "$@"
