"""A real Ray cluster (`ray start`, so a second driver can join) and the real app over HTTP."""

from __future__ import annotations

import base64
import json
import os
import time

import httpx
import numpy as np
import pytest

from tests.conftest import TEST_ENGINE_ARGS, serve_switches
from tests.conftest import router_ports as find_router_ports
from tests.helpers import post

PORT = int(os.environ.get("HS_TEST_PORT", "8123"))
METRICS_PORT = int(os.environ.get("HS_TEST_METRICS_PORT", "8124"))  # Ray's Prometheus endpoint for this session
# how often this session's processes export their metrics to it (Ray's default: 10 s); test_metrics.py waits
# for counts to arrive and to settle, a few of these intervals
METRICS_REPORT_INTERVAL_S = 2
BASE = f"http://127.0.0.1:{PORT}"
DIRECT_PORT = PORT + 10  # direct ingress: ingress replicas' own ports start here
APP = "hidden-states"
API_KEY = "test-key-not-secret"
GUARDED = "/guarded"  # 1 replica: API key, small body limit, short timeouts, a small bound on rows
GUARDED_ROWS_BYTES = 10 * 128 * 4  # the guarded app's max_hidden_states_bytes: 10 float32 rows of the tiny model


def decode_vector(value) -> np.ndarray:
    if isinstance(value, str):
        return np.frombuffer(base64.b64decode(value), dtype="<f4")
    return np.asarray(value, dtype=np.float32)


def wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


@pytest.fixture(scope="session")
def ray_cluster():
    """A private Ray cluster for this session (not `ray start`: other Ray users on the
    machine are left alone). A second driver joins it by its GCS address."""
    import ray

    # Ray Serve's switches as `make serve` sets them, for Ray's processes only.
    with serve_switches(DIRECT_PORT):
        ctx = ray.init(
            address="local",
            num_cpus=8,
            namespace="serve",
            logging_level="WARNING",
            include_dashboard=False,
            _metrics_export_port=METRICS_PORT,
            _system_config={"metrics_report_interval_ms": METRICS_REPORT_INTERVAL_S * 1000},
        )
    yield ctx.address_info["gcs_address"]
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


SPEC_NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def app_args(**over) -> dict:
    from tests.heads_ref import build_test_heads

    args = {
        "model": "builtin:tiny-llama",
        "engine": dict(TEST_ENGINE_ARGS),
        # the test heads (tests/heads_ref.py) on every tiny-Llama app: a request without heads must not
        # see them (every other test), one with them gets SAELens's and numpy's outputs (test_heads.py)
        "heads": build_test_heads(),
        "enable_return_hidden_states": True,
        "extraction_timeout_s": 60,
        "request_timeout_s": 120,
        "replica_autoscaling": {"min_replicas": 2, "max_replicas": 2},
        # no CPU warm-up (up to 10 s of dummy forwards per engine start, before the replica is ready): its
        # effect is tested on the engine (tests/engine/test_engine.py), and the serve path with it on runs
        # in every `serve run` test (test_config_yaml.py, test_haproxy.py: config.yaml's defaults)
        "warm_up_s": 0,
    }
    args.update(over)
    return args


def vlm_args(model: str) -> dict:
    return app_args(
        model=model,
        heads=[],
        engine={**TEST_ENGINE_ARGS, "max_model_len": 1024, "limit_mm_per_prompt": {"image": 2}},
        replica_autoscaling={"min_replicas": 1, "max_replicas": 1},
    )


def tiny_lora_modules() -> list[dict]:
    """The LoRA app's adapters on the tiny model (tests/conftest.py build_lora; built once, cached)."""
    from hidden_states.models.builtin import build
    from tests.conftest import build_lora

    base = str(build("tiny-llama"))
    return [
        {"name": "lora-qv", "path": build_lora(base, "qv", seed=1)},
        {"name": "lora-all", "path": build_lora(base, "all", seed=2)},
    ]


# The apps of the shapes the compiled engine must also serve (TP = 2, n-gram speculative decoding, LoRA)
# run compiled (vLLM's default execution; CUDA graphs on GPUs) with the static layer set: every layer of
# the tiny model, so their layer, head and steering tests run inside the compiled forward
# (tests/serve/test_compiled.py checks the set, the exactness and the compile counts; the eager engine
# of each shape: tests/engine/test_parallel.py, test_spec_decode.py, test_lora.py).
COMPILED = {"capture_layers": [0, 1]}


# The suite's apps. At most one runs at a time, so the suite holds at most two engines
# (the main app's two replicas) and fits a machine with 8 GiB: each engine costs about
# 2.6 GB even on the tiny model (Serve replica, EngineCore, worker).
APPS = {
    APP: ("/", lambda: app_args()),  # replica_routing auto: prefix (two replicas behind the Router)
    # the main app routing as Serve does by default, to compare prefix cache hits with (test_prefix_routing.py)
    "hs-p2c": ("/p2c", lambda: app_args(replica_routing="power_of_two")),
    "hs-off": (
        "/off",
        lambda: app_args(
            enable_return_hidden_states=False, heads=[], replica_autoscaling={"min_replicas": 1, "max_replicas": 1}
        ),
    ),
    # the replica is its own HTTP ingress: API key, small body limit, short timeouts, 10 rows at most a response
    "hs-guarded": (
        GUARDED,
        lambda: app_args(
            ingress="replica",
            api_key=API_KEY,
            max_request_body_bytes=64 * 1024,
            max_hidden_states_bytes=GUARDED_ROWS_BYTES,
            request_timeout_s=60,
            extraction_timeout_s=20,
            replica_autoscaling={"min_replicas": 1, "max_replicas": 1},
        ),
    ),
    # (the engine-fault test breaks the guarded app's engine after its other tests: `fault_app`)
    # two LoRA adapters served by name (lora_modules), 1 replica; compiled with the static layer set
    # (vLLM's CPU platform runs a LoRA engine's forward uncompiled: the traced entries run eagerly)
    "hs-lora": (
        "/lora",
        lambda: app_args(
            lora_modules=tiny_lora_modules(),
            **COMPILED,
            engine={**TEST_ENGINE_ARGS, "enforce_eager": False},
            replica_autoscaling={"min_replicas": 1, "max_replicas": 1},
        ),
    ),
    # one replica whose engine runs tensor parallelism 2: two CPU worker processes (2 CPUs); compiled
    "hs-tp2": (
        "/tp2",
        lambda: app_args(
            engine={**TEST_ENGINE_ARGS, "tensor_parallel_size": 2, "enforce_eager": False},
            **COMPILED,
            replica_autoscaling={"min_replicas": 1, "max_replicas": 1},
        ),
    ),
    # one replica whose engine runs pipeline parallelism 2: two CPU worker processes, one stage each; compiled, each
    # stage tracing its own capture layer (the eager engine under PP: tests/engine/test_pipeline_capture.py)
    "hs-pp2": (
        "/pp2",
        lambda: app_args(
            engine={**TEST_ENGINE_ARGS, "pipeline_parallel_size": 2, "enforce_eager": False},
            **COMPILED,
            replica_autoscaling={"min_replicas": 1, "max_replicas": 1},
        ),
    ),
    # one replica whose engine runs n-gram speculative decoding (3 draft tokens per step); compiled
    "hs-spec": (
        "/spec",
        lambda: app_args(
            engine={
                **TEST_ENGINE_ARGS,
                "speculative_config": SPEC_NGRAM,
                "async_scheduling": False,
                "enforce_eager": False,
            },
            **COMPILED,
            replica_autoscaling={"min_replicas": 1, "max_replicas": 1},
        ),
    ),
    # three built-in VLM families (hidden_states/models/vlm.py), 1 replica each, two images a prompt at most
    "hs-gemma3-vlm": ("/gemma3-vlm", lambda: vlm_args("builtin:tiny-gemma3-vlm")),
    # two replicas: the Router's media-aware key keeps an image's chats on one (test_multimodal.py)
    "hs-llava": (
        "/llava",
        lambda: {**vlm_args("builtin:tiny-llava"), "replica_autoscaling": {"min_replicas": 2, "max_replicas": 2}},
    ),
    "hs-qwen-vl": ("/qwen-vl", lambda: vlm_args("builtin:tiny-qwen3-vl")),
    # completions with prompt_embeds (vLLM's enable_prompt_embeds), 1 replica behind the Router
    "hs-embeds": (
        "/embeds",
        lambda: app_args(
            engine={**TEST_ENGINE_ARGS, "enable_prompt_embeds": True},
            heads=[],
            replica_autoscaling={"min_replicas": 1, "max_replicas": 1},
        ),
    ),
}
# Tests run grouped by the app they use (tests/conftest.py orders them), so each app
# deploys once; any order still works, only slower.
APP_FIXTURES = {
    "serve_app": APP,
    "client": APP,
    "off_app": "hs-off",
    "guarded_app": "hs-guarded",
    "fault_app": "hs-guarded",
    "lora_app": "hs-lora",
    "tp2_app": "hs-tp2",
    "pp2_app": "hs-pp2",
    "spec_app": "hs-spec",
    "gemma3_vlm_app": "hs-gemma3-vlm",
    "llava_app": "hs-llava",
    "qwen_vl_app": "hs-qwen-vl",
    "embeds_app": "hs-embeds",
}


class AppSlot:
    """Deploys the app a test asks for, deleting the one before it."""

    def __init__(self):
        self.current: str | None = None

    def use(self, name: str) -> str:
        from ray import serve

        from deployments.app import build_app

        if self.current == name:
            return BASE + APPS[name][0].rstrip("/")
        self.release()
        prefix, args = APPS[name]
        serve.run(build_app(args()), name=name, route_prefix=prefix, blocking=False)
        self.current = name
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            status = serve.status().applications.get(name)
            if status is not None and status.status == "RUNNING":
                break
            if status is not None and status.status == "DEPLOY_FAILED":
                raise RuntimeError(f"deploy of {name} failed: {status}")
            time.sleep(0.5)
        else:
            raise TimeoutError(f"{name} not running: {serve.status().applications.get(name)}")
        base = BASE + prefix.rstrip("/")
        wait_http(f"{base}/health", 60)
        return base

    def release(self) -> None:
        from ray import serve

        if self.current is not None:
            name, self.current = self.current, None
            serve.delete(name, _blocking=True)


@pytest.fixture(scope="session")
def app_slot(ray_cluster):
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    slot = AppSlot()
    yield slot
    slot.release()


@pytest.fixture
def serve_http(app_slot) -> str:
    """Serve's HTTP proxy, whichever app runs (tests that deploy apps of their own)."""
    return BASE


@pytest.fixture
def serve_app(app_slot) -> str:
    """Two engine replicas with hidden states on, behind the Router."""
    return app_slot.use(APP)


@pytest.fixture
def fault_app(app_slot):
    """The guarded app, for the engine-fault test to break (it runs last of the app's tests: `app_group`):
    deleted after it."""
    base = app_slot.use(APP_FIXTURES["fault_app"])
    yield base
    app_slot.release()


def _app_fixture(name: str):
    """The fixture `name` of APP_FIXTURES: its app deployed (APPS says what it runs), its base URL."""

    def deployed(app_slot) -> str:
        return app_slot.use(APP_FIXTURES[name])

    deployed.__doc__ = f"The app {APP_FIXTURES[name]!r} (APPS), deployed: its base URL."
    return pytest.fixture(deployed, name=name)


for _name in (
    "off_app",
    "guarded_app",
    "lora_app",
    "spec_app",
    "tp2_app",
    "pp2_app",
    "gemma3_vlm_app",
    "llava_app",
    "embeds_app",
    "qwen_vl_app",
):
    globals()[_name] = _app_fixture(_name)


@pytest.fixture
def client(serve_app):
    import openai

    return openai.OpenAI(base_url=f"{serve_app}/v1", api_key="unused", timeout=120, max_retries=0)


def app_group(item) -> tuple[int, int]:
    """Where a serve test runs: by the app it uses (APPS' order: the main app first), then tests without one.
    Within an app's tests, one marked `serve_app(name, "first")` (it deploys the app itself, after another
    it compares with) comes before the others, and one that breaks its app (`fault_app`, or marked
    `serve_app(name, "last")`) after them."""
    order = list(APPS)
    mark = item.get_closest_marker("serve_app")
    if mark is not None:
        app, place = mark.args
    else:
        used = [APP_FIXTURES[f] for f in item.fixturenames if f in APP_FIXTURES]
        app, place = (used[-1] if used else None), ("last" if "fault_app" in item.fixturenames else "among")
    return (order.index(app) if app is not None else len(order)), ("first", "among", "last").index(place)


def post_hidden_states(base: str, body: dict, *, model: str = "tiny-llama", **kw) -> httpx.Response:
    """POST /v1/hidden_states (the verifier's way in) for `model`; `kw`: tests.helpers.post's (timeout, headers)."""
    return post(base, "/v1/hidden_states", {"model": model, **body}, **kw)


def parallel_choices_exact(client, reference, prompts: list[str], seed: int, stream: bool) -> None:
    """An n = 2 completion of `prompts` (base64, sampled with `seed`) on a parallel engine: four choices, each
    vector by the tail step (one position) and transformers' on that choice's own tokens."""
    from tests.helpers import completion_choices

    r = client.completions.create(
        model="tiny-llama",
        prompt=prompts,
        max_tokens=10,
        n=2,
        temperature=1.0,
        seed=seed,
        stream=stream,
        extra_body={"return_hidden_states": True, "return_token_ids": True, "hidden_states_encoding": "base64"},
    )
    choices, prompt_ids = completion_choices(r, stream)
    assert sorted(choices) == list(range(2 * len(prompts)))
    for index, ch in choices.items():
        ids = prompt_ids[index] + ch["token_ids"]
        meta = ch["hidden_states_meta"]
        assert meta["via"] == "tail" and meta["computed_tokens"] == 1 and meta["tokens"] == len(ids), meta
        reference.assert_matches(ids, decode_vector(ch["hidden_states"]))


def stopped_by_a_string(client, messages: list[dict], extra_body: dict):
    """The greedy chat answer to `messages`, asked again with a stop string cut from its middle: a stop the engine
    cannot see, so the vector comes from the extraction step (checked). Returns the stopped choice's response."""
    free = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=24, temperature=0)
    text = free.choices[0].message.content
    assert len(text) > 8, text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    chat = client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=24, temperature=0, stop=[stop], extra_body=extra_body
    )
    c = chat.choices[0]
    assert c.finish_reason == "stop" and c.model_extra["hidden_states_meta"]["via"] == "extraction"
    return chat


def replica_stats(base: str, headers: dict | None = None) -> dict:
    return json.loads(httpx.get(f"{base}/debug/stats", timeout=30, headers=headers).text)


def router_ports() -> list[int]:
    """The Router replicas' own HTTP ports (direct ingress)."""
    return find_router_ports(DIRECT_PORT)
