# The two README commands. Both run scripts/setup.sh first (seconds when nothing changed).
.PHONY: setup serve test test-unit test-fast lint test-long bench gpu-check

setup:
	bash scripts/setup.sh

serve: setup
	bash scripts/serve.sh config.yaml

test: setup lint
	.venv/bin/python -m pytest -q -ra --durations=25

# One tier: our own logic, no vLLM engine and no Ray (a few minutes).
test-unit: setup
	.venv/bin/python -m pytest -q -ra tests/unit

# The tiers without a vLLM engine: unit, the project's scaffolding, and Serve on a fake engine.
test-fast: setup
	.venv/bin/python -m pytest -q -ra tests/unit tests/scaffolding tests/fast

# ruff's format and check (pyproject.toml), and the vLLM/Ray drift check.
lint: setup
	.venv/bin/python -m ruff format --check .
	.venv/bin/python -m ruff check .
	.venv/bin/python -m hidden_states.vllm.patches --check

# Tests that take more than a few minutes (load, faults, multi-node): not in CI.
test-long: setup
	HS_LONG_TESTS=1 .venv/bin/python -m pytest -q -ra -m long

# The full benchmark (docs/benchmarks.md); the engine's per-feature benches are `python -m bench.arms BENCH`.
bench:
	HS_EXTRAS=bench bash scripts/setup.sh
	.venv/bin/python -m bench $(BENCH_ARGS)

# On a machine with one NVIDIA GPU, after the set-up: tests/gpu/gpu_check.py (compiled, CUDA graphs; never run here).
gpu-check:
	bash scripts/gpu-check.sh
