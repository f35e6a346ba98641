# The two README commands. Both run scripts/setup.sh first (seconds when nothing changed).
.PHONY: setup serve test test-long bench gpu-check

setup:
	bash scripts/setup.sh

serve: setup
	bash scripts/serve.sh config.yaml

test: setup
	.venv/bin/python -m pytest -q -ra

# Tests that take more than a few minutes (load, faults, multi-node): not in CI.
test-long: setup
	HS_LONG_TESTS=1 .venv/bin/python -m pytest -q -ra -m long

bench:
	HS_EXTRAS=bench bash scripts/setup.sh
	.venv/bin/python -m bench $(BENCH_ARGS)

# On a machine with one NVIDIA GPU, after the set-up: bench/gpu_check.py (compiled, CUDA graphs; never run here).
gpu-check:
	bash scripts/gpu-check.sh
