"""Shared fixtures: the built-in model, the transformers reference, an event loop thread, engines
(`engine_fixture`: started, checked when they stop, shut down).

Tests are marked by folder: unit (no vLLM, no Ray), scaffolding (the project's docs, set-up,
bench and configs), fast (Serve on a fake engine), engine (real vLLM), serve (real Ray Serve over
HTTP), batch, cluster. Engines start once per module, not once per test.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading

import numpy as np
import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TEST_MODEL = "builtin:tiny-llama"  # random weights, seconds to build and start: the fast tests' model

# Engine arguments every test engine uses on a CPU-only machine. The KV cache is
# sized in bytes (1 KiB a token on the tiny model: 131k tokens), so no test depends
# on how much RAM the machine has.
TEST_ENGINE_ARGS = dict(
    dtype="float32",
    enforce_eager=True,
    kv_cache_memory_bytes=128 * 2**20,
    max_model_len=4096,
    max_num_batched_tokens=256,  # long prompts prefill in several chunks
    max_num_seqs=64,
)
# `make gpu-check` (never run here): the same tests on a GPU with vLLM's GPU defaults
# on, CUDA graphs and async scheduling; float32 so the transformers oracle still holds.
ON_GPU = os.environ.get("HS_TEST_ACCELERATOR") == "gpu"
if ON_GPU:
    TEST_ENGINE_ARGS.update(enforce_eager=False, async_scheduling=True)
cpu_only = pytest.mark.skipif(ON_GPU, reason="a CPU engine's start-up step (prefault, warm-up, 32-token blocks)")
eager_only = pytest.mark.skipif(ON_GPU, reason="intermediate layers need an eager engine; the GPU check runs compiled")


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = item.nodeid.split("/")
        if len(parts) > 2 and parts[0] == "tests":
            item.add_marker(getattr(pytest.mark, parts[1]))
    # Serve tests run grouped by the app they use, so each app deploys once and only
    # one runs at a time (tests/serve/conftest.py); their order within a group is kept.
    serve = [i for i, item in enumerate(items) if item.nodeid.startswith("tests/serve/")]
    if serve:
        from tests.serve.conftest import app_group

        ordered = sorted((items[i] for i in serve), key=app_group)
        for i, item in zip(serve, ordered):
            items[i] = item


@contextlib.contextmanager
def environ(values: dict[str, str]):
    """`values` in the environment inside the block; the environment restored afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def serve_switches(direct_port: int):
    """`make serve`'s Ray Serve switches (deployments/serve_env.py; direct ingress: each Router
    replica also takes HTTP on a port of its own, from `direct_port` up) in the environment while
    Ray's processes start (they read them then); the environment is restored afterwards."""
    from deployments.serve_env import SERVE_SWITCHES

    return environ({**SERVE_SWITCHES, "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(direct_port)})


def router_ports(first: int, count: int = 20) -> list[int]:
    """The Router replicas' own HTTP ports (direct ingress), from `first` up."""
    import httpx

    out = []
    for port in range(first, first + count):
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/debug/stats", timeout=2)
            if r.status_code == 200 and r.json().get("ingress", {}).get("kind") == "router":
                out.append(port)
        except (httpx.HTTPError, ValueError):
            pass
    return out


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
    from hidden_states.models.builtin import build

    return str(build(TEST_MODEL.split(":", 1)[1]))


class Reference:
    """Hugging Face transformers on the same weights: the oracle; with `adapter`, transformers +
    peft on the same LoRA adapter (PeftModel.from_pretrained)."""

    def __init__(self, path: str, adapter: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if adapter is not None:
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(self.model, adapter).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def last_hidden(self, token_ids, layer: int = -1) -> np.ndarray:
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([list(token_ids)]), output_hidden_states=True)
        return out.hidden_states[layer][0, -1].float().numpy()

    def assert_matches(self, token_ids, vector, layer: int = -1, atol: float | None = 1e-4, rtol: float = 1e-5):
        """The fidelity rule: max|ours - reference| <= rtol x max|reference| in float32
        (real models have entries of 10-100), and within `atol` where that holds too.
        Returns (max abs error, max |reference|): both are reported."""
        assert vector is not None, "no hidden states returned"
        vector = np.asarray(vector, dtype=np.float32)
        ref = self.last_hidden(token_ids, layer)
        assert vector.shape == ref.shape, (vector.shape, ref.shape)
        diff, scale = float(np.abs(vector - ref).max()), float(np.abs(ref).max())
        where = f"over {len(token_ids)} tokens, layer {layer}"
        assert diff <= rtol * scale, f"max abs error {diff:.3g} > {rtol:g} x max|reference| ({scale:.3g}) {where}"
        assert atol is None or diff <= atol, f"max abs error {diff:.3g} > {atol:g} (max|reference| {scale:.3g}) {where}"
        return diff, scale


@pytest.fixture(scope="session")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


# The test adapters: random LoRA weights, A and B both non-zero (PEFT's init_lora_weights=False),
# scaled alpha / r = 1/8 so the adapted model stays a perturbation of its base.
LORA_TARGETS = {
    "qv": ("q_proj", "v_proj"),  # the common choice; vLLM packs q, k, v: k gets no adapter
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


def build_lora(base: str, targets: str, seed: int, rank: int = 8) -> str:
    """A PEFT LoRA adapter for the model folder `base`, built deterministically from `seed` into the
    built-in models' cache (once; the folder name hashes the recipe), saved as PEFT saves it."""
    import hashlib
    import json
    from pathlib import Path

    from hidden_states.models.builtin import cache_root

    recipe = json.dumps([Path(base).name, LORA_TARGETS[targets], seed, rank, "peft-v1"])
    out = (
        cache_root().parent
        / "test-adapters"
        / f"{Path(base).name}-{targets}-{hashlib.sha1(recipe.encode()).hexdigest()[:10]}"
    )
    if (out / "adapter_config.json").exists():
        return str(out)
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank, lora_alpha=1, lora_dropout=0.0, target_modules=list(LORA_TARGETS[targets]), init_lora_weights=False
    )
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    get_peft_model(model, config).save_pretrained(str(tmp))
    try:
        tmp.rename(out)  # adapter_config.json appears whole, or not at all
    except OSError:  # another process built it first
        if not (out / "adapter_config.json").exists():
            raise
    return str(out)


@pytest.fixture(scope="session")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


# The counters every engine test module finds at 0 when its engine stops (after all its tests).
ENGINE_CLEAN = ("pending", "missing_vectors", "malformed_vectors")


@contextlib.contextmanager
def running_engine(
    loop_thread,
    model: str = TEST_MODEL,
    *,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    one_more_step: str | None = None,
    clean: tuple[str, ...] = ENGINE_CLEAN,
    check=None,
    errors: list | None = None,
    **start,
):
    """`HiddenStatesEngine.start(model, **start)` on `loop_thread` (within `timeout` s, with `env` in the
    environment while it starts), for the block. After it: with `one_more_step`, a 2-token greedy completion of
    that prompt (the runner sees the last finished ids with the next step); then, if `clean` or `check`, the
    engine's stats: every counter named in `clean` is 0, and `check(stats)`. Whatever happened, the engine is shut
    down and each (case, max abs error, max |reference|) in `errors` printed."""
    from hidden_states.vllm.engine import HiddenStatesEngine

    with environ(env or {}):
        eng = loop_thread.run(HiddenStatesEngine.start(model, **start), timeout=timeout)
    try:
        yield eng
        if one_more_step is not None:
            loop_thread.run(eng.complete(one_more_step, sampling()(max_tokens=2), return_hidden_states=False))
        if clean or check:
            stats = loop_thread.run(eng.stats())
            assert all(stats[k] == 0 for k in clean), stats
            if check:
                check(stats)
    finally:
        eng.shutdown()
        for case, diff, scale in errors or ():
            print(f"  {case}: max abs error {diff:.3g}, max |reference| {scale:.3g}")


def engine_fixture(model: str = TEST_MODEL, *, setup=None, **options):
    """A module-scoped fixture: the engine of `running_engine(loop_thread, model, **options)`, one per module.
    `setup`, if given, is a function whose parameters name fixtures: those are set up before the engine (and
    torn down after it), and the start arguments it returns (a dict, or None) are added to `options`."""
    names = list(inspect.signature(setup).parameters) if setup else []

    @pytest.fixture(scope="module")
    def engine(request, loop_thread):
        more = setup(**{name: request.getfixturevalue(name) for name in names}) if setup else None
        with running_engine(loop_thread, model, **options, **(more or {})) as eng:
            yield eng

    return engine


def sampling(**defaults):
    """An engine test module's `sp(**kw)`: vLLM SamplingParams, greedy, with the module's defaults
    (e.g. `max_tokens`); keywords override both."""

    def sp(**kw):
        from vllm import SamplingParams

        return SamplingParams(**{"temperature": 0.0, **defaults, **kw})

    return sp


def long_text(words: int, seed: int = 0) -> str:
    from pathlib import Path

    import hidden_states.models

    lines = (Path(hidden_states.models.__file__).parent / "data" / "corpus.txt").read_text().split()
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(lines, size=words))


def openai_answer(engine, loop_thread, route: str, body: dict, model: str = "tiny-llama"):
    """vLLM's OpenAI serving over an engine (a replica's frontend): (status, JSON, or the SSE events' JSON)."""
    import json

    async def run():
        frontend = await engine.openai(model, "r0")
        parts = [part async for part in frontend.handle(route, json.dumps(body).encode())]
        status, first = parts[0]
        if first:
            return status, json.loads(first)
        events = b"".join(parts[1:]).decode().split("\n\n")
        return status, [json.loads(e[6:]) for e in events if e.startswith("data: {")]

    return loop_thread.run(run())
