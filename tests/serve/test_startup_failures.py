"""An app whose engine cannot start says why: in `serve status`, and in 503s from /health,
/v1/models and requests; Serve stops retrying after a bounded number of attempts."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.serve.conftest import app_args

PiB = 2**50


def _deploy_and_wait_failed(name: str, args: dict, timeout_s: float = 300):
    from ray import serve

    from deployments.app import build_app

    try:
        serve.run(build_app(args), name=name, route_prefix=f"/{name}", blocking=False)
    except RuntimeError as e:  # serve.run waits for RUNNING and raises on DEPLOY_FAILED
        assert "failed" in str(e), e
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(name)
        if app is not None and app.status == "DEPLOY_FAILED":
            return app
        time.sleep(2)
    raise TimeoutError(f"{name} did not reach DEPLOY_FAILED: {serve.status().applications.get(name)}")


@pytest.fixture
def broken_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    return str(tmp_path)  # a model folder without weights: it cannot load


@pytest.mark.parametrize(
    "name,cause",
    [
        ("bad-model", "holds no weights"),
        ("bad-kv", "not enough memory"),
    ],
)
def test_failed_start_says_why(serve_http, broken_model, name, cause):
    from ray import serve

    over = (
        {"model": broken_model}
        if name == "bad-model"
        else {"engine": {**app_args()["engine"], "kv_cache_memory_bytes": PiB}}
    )
    args = app_args(replica_autoscaling={"min_replicas": 1, "max_replicas": 1}, **over)
    try:
        app = _deploy_and_wait_failed(name, args)
        engine = app.deployments["EngineReplica"]
        assert cause in engine.message, engine.message  # serve status shows the cause, not just "failed"
        base = f"{serve_http}/{name}"
        for path in ("/health", "/v1/models"):
            r = httpx.get(base + path, timeout=30)
            assert r.status_code == 503, (path, r.text)
            assert cause in r.json()["error"]["message"], r.text
        r = httpx.post(f"{base}/v1/completions", timeout=30, json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and cause in r.json()["error"]["message"], r.text
        if name == "bad-kv":  # the sizes and the setting to change
            msg = r.json()["error"]["message"]
            assert "kv_cache_memory_bytes = 1048576.00 GiB" in msg and "available" in msg, msg
    finally:
        serve.delete(name, _blocking=True)
