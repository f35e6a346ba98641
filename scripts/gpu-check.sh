#!/usr/bin/env bash
# `make gpu-check`: on a machine with one NVIDIA GPU, after the README's set-up (which installs the
# CUDA engine, vllm==0.32.0, into .venv there). NOT RUN by this project yet: its machines have no GPU.
#
#   bash scripts/gpu-check.sh [--dry-run] [--suites] [tests.gpu.gpu_check's arguments]
#
# 1. tests/gpu/gpu_check.py, in under 10 minutes: a compiled engine with CUDA graphs on the built-in
#    SmolLM2, its last-layer and intermediate-layer vectors, an SAE head and a steering entry against
#    transformers on the same GPU (one line per check with its error), the compile counts before and
#    after (no recompile, no new graph), then decode tokens/s with the features on and off beside an
#    eager engine. Exit 1 if a check failed.
# 2. With --suites: tests/engine/test_compiled.py, then the engine and serve suites with vLLM's GPU
#    defaults (CUDA graphs, async scheduling; HS_TEST_ACCELERATOR=gpu): an hour or more.
# `--dry-run` prints the commands and runs none (tests/scaffolding/test_setup.py runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0 SUITES=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --suites) SUITES=1; shift ;;
    *) break ;;
  esac
done
run() { echo "+ $*"; if [[ $DRY == 0 ]]; then "$@"; fi; }
if [[ $DRY == 0 ]] && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU visible (nvidia-smi -L failed); run this on a GPU machine" >&2
  exit 2
fi
export HS_TEST_ACCELERATOR=gpu
run env HS_ENGINE=gpu bash scripts/setup.sh
run .venv/bin/python -m tests.gpu.gpu_check "$@"
if [[ $SUITES == 1 ]]; then
  run .venv/bin/python -m pytest -q -ra tests/engine/test_compiled.py
  run .venv/bin/python -m pytest -q -ra tests/engine tests/serve --ignore=tests/engine/test_compiled.py
fi
