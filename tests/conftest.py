"""Shared fixtures: the built-in model, the transformers reference, an event loop thread.

Tests are marked by folder: unit (no vLLM), engine (real vLLM), serve (real Ray
Serve over HTTP), cluster. Engines start once per module, not once per test.
"""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Engine arguments every test engine uses on a CPU-only machine.
TEST_ENGINE_ARGS = dict(
    dtype="float32",
    enforce_eager=True,
    gpu_memory_utilization=0.08,
    max_model_len=4096,
    max_num_batched_tokens=256,  # long prompts prefill in several chunks
    max_num_seqs=64,
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = item.nodeid.split("/")
        if len(parts) > 2 and parts[0] == "tests":
            item.add_marker(getattr(pytest.mark, parts[1]))


class LoopThread:
    """An asyncio loop in a thread, so engines outlive single tests."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="session")
def model_dir() -> str:
    from hidden_states.tiny_model import build

    return str(build("tiny-llama"))


class Reference:
    """Hugging Face transformers on the same weights: the oracle."""

    def __init__(self, path: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def last_hidden(self, token_ids, layer: int = -1) -> np.ndarray:
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([list(token_ids)]), output_hidden_states=True)
        return out.hidden_states[layer][0, -1].float().numpy()

    def assert_matches(self, token_ids, vector, layer: int = -1, atol: float = 1e-4):
        assert vector is not None, "no hidden states returned"
        vector = np.asarray(vector, dtype=np.float32)
        ref = self.last_hidden(token_ids, layer)
        assert vector.shape == ref.shape, (vector.shape, ref.shape)
        diff = float(np.abs(vector - ref).max())
        assert diff <= atol, f"max abs diff {diff} > {atol} over {len(token_ids)} tokens"
        return diff


@pytest.fixture(scope="session")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="session")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


def long_text(words: int, seed: int = 0) -> str:
    from pathlib import Path

    import hidden_states

    lines = (Path(hidden_states.__file__).parent / "data" / "corpus.txt").read_text().split()
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(lines, size=words))
