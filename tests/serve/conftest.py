"""A real Ray cluster (`ray start`, so a second driver can join) and the real app over HTTP."""

from __future__ import annotations

import base64
import json
import os
import time

import httpx
import numpy as np
import pytest

from tests.conftest import TEST_ENGINE_ARGS

PORT = int(os.environ.get("HS_TEST_PORT", "8123"))
METRICS_PORT = int(os.environ.get("HS_TEST_METRICS_PORT", "8124"))  # Ray's Prometheus endpoint for this session
BASE = f"http://127.0.0.1:{PORT}"
APP = "hidden-states"
API_KEY = "test-key-not-secret"
GUARDED = "/guarded"  # 1 replica: API key, small body limit, short timeouts


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

    ctx = ray.init(address="local", num_cpus=8, namespace="serve", logging_level="WARNING",
                   include_dashboard=False, _metrics_export_port=METRICS_PORT)
    yield ctx.address_info["gcs_address"]
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def app_args(**over) -> dict:
    args = {
        "model": "builtin:tiny-llama",
        "engine": dict(TEST_ENGINE_ARGS),
        "enable_return_hidden_states": True,
        "extraction_timeout_s": 60,
        "request_timeout_s": 120,
        "replica_autoscaling": {"min_replicas": 2, "max_replicas": 2},
    }
    args.update(over)
    return args


@pytest.fixture(scope="session")
def serve_app(ray_cluster):
    """Two engine replicas with hidden states on; an app with them off (both behind a
    Router); a guarded app whose replica is its own HTTP ingress (`ingress: replica`)."""
    from ray import serve

    from deployments.app import build_app

    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app(app_args()), name=APP, route_prefix="/", blocking=False)
    serve.run(
        build_app(app_args(enable_return_hidden_states=False, replica_autoscaling={"min_replicas": 1, "max_replicas": 1})),
        name="hs-off", route_prefix="/off", blocking=False,
    )
    serve.run(
        build_app(app_args(ingress="replica", api_key=API_KEY, max_request_body_bytes=64 * 1024, request_timeout_s=60,
                           extraction_timeout_s=20, replica_autoscaling={"min_replicas": 1, "max_replicas": 1})),
        name="hs-guarded", route_prefix=GUARDED, blocking=False,
    )
    apps = (APP, "hs-off", "hs-guarded")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        status = serve.status().applications
        if all(a in status and status[a].status == "RUNNING" for a in apps):
            break
        if any(a in status and status[a].status == "DEPLOY_FAILED" for a in apps):
            raise RuntimeError(f"deploy failed: {status}")
        time.sleep(2)
    else:
        raise TimeoutError(f"apps not running: {serve.status()}")
    wait_http(f"{BASE}/health", 60)
    return BASE


@pytest.fixture(scope="session")
def client(serve_app):
    import openai

    return openai.OpenAI(base_url=f"{serve_app}/v1", api_key="unused", timeout=120, max_retries=0)


def replica_stats(base: str, headers: dict | None = None) -> dict:
    return json.loads(httpx.get(f"{base}/debug/stats", timeout=30, headers=headers).text)
