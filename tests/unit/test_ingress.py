"""The replica's HTTP ingress (`ingress: replica`) in memory: the real routes, checks,
relay and counters over httpx.ASGITransport, with the FakeEngine (no vLLM, no Ray)."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import pytest

from deployments import http
from deployments.replica import EngineReplica, app
from hidden_states.testing import FakeEngine, fake_vector


async def make(**args):
    cls = EngineReplica
    replica = cls.__new__(cls)
    await cls.__init__(replica, {"model": "builtin:tiny-llama", **args}, engine_cls=FakeEngine)
    return replica


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def call(replica, method: str, path: str, **kw) -> httpx.Response:
    transport = httpx.ASGITransport(app=http.asgi_app(app, replica))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.request(method, path, **kw)


def stats(replica) -> dict:
    return run(call(replica, "GET", "/debug/stats")).json()["ingress"]


def test_health_models_and_a_completion_with_its_vector():
    async def go():
        r = await make()
        assert (await call(r, "GET", "/health")).status_code == 200
        assert (await call(r, "GET", "/v1/models")).json()["data"][0]["id"] == "tiny-llama"
        res = await call(r, "POST", "/v1/completions", json={
            "prompt": "Hi there", "max_tokens": 3, "n": 2, "return_hidden_states": True,
            "hidden_states_encoding": "base64"})
        return r, res

    r, res = run(go())
    assert res.status_code == 200 and res.headers["x-replica-id"] == r.replica_id
    for ch in res.json()["choices"]:
        ids = list(b"Hi there") + [8 + ch["index"] + i for i in range(3)]
        got = np.frombuffer(base64.b64decode(ch["hidden_states"]), "<f4")
        assert np.array_equal(got, fake_vector(ids))
        assert ch["token_ids"] is None  # not asked for: hidden again
    assert stats(r) | {"kind": "replica"} == {"kind": "replica", "pending": 0, "served": 1, "failed": 0}


def test_stream_vectors_on_final_chunks_and_done():
    async def go():
        r = await make()
        return r, await call(r, "POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "yo"}], "max_tokens": 2, "stream": True,
            "return_hidden_states": True, "return_token_ids": True})

    r, res = run(go())
    events = [e for e in res.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    finals = [json.loads(e[6:])["choices"][0] for e in events[:-1]]
    assert "hidden_states" not in finals[0] and finals[1]["finish_reason"] == "length"
    assert np.allclose(finals[1]["hidden_states"], fake_vector(list(b"yo") + [2, 3]))
    assert stats(r)["served"] == 1


@pytest.mark.parametrize("args, body, headers, status, words", [
    ({}, {"prompt": "x", "return_hidden_states": "yes"}, {}, 400, "boolean"),
    ({}, {"prompt": "x", "hidden_states_layers": [7], "return_hidden_states": True}, {}, 400, "out of range"),
    ({}, {"prompt": "x", "n": 99}, {}, 400, "n must be"),
    ({}, {"model": "gpt-4", "prompt": "x"}, {}, 404, "does not exist"),
    ({"enable_return_hidden_states": False}, {"prompt": "x", "return_hidden_states": True}, {}, 400,
     "enable_return_hidden_states: true"),
    ({"api_key": "k"}, {"prompt": "x"}, {}, 401, "API key"),
    ({"api_key": "k"}, {"prompt": "x"}, {"authorization": "Bearer wrong"}, 401, "API key"),
    ({"max_request_body_bytes": 100}, {"prompt": "x" * 200}, {}, 413, "exceeds"),
])
def test_refusals_never_reach_the_engine(args, body, headers, status, words):
    async def go():
        r = await make(**args)
        return r, await call(r, "POST", "/v1/completions", json=body, headers=headers)

    r, res = run(go())
    assert res.status_code == status and words in res.json()["error"]["message"], res.text
    if status != 400 or "layers" not in json.dumps(body):  # a bad layer is the engine's to judge
        assert r.engine.requests == 0


def test_engine_dying_mid_stream_is_an_sse_error_and_counted_failed():
    async def go():
        r = await make()
        r.engine.fail_next = True
        return r, await call(r, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})

    r, res = run(go())
    last = json.loads(res.text.strip().split("\n\n")[-1][6:])
    assert last["error"]["code"] == 503 and "RuntimeError" in last["error"]["message"]
    assert stats(r) | {"kind": "replica"} == {"kind": "replica", "pending": 0, "served": 0, "failed": 1}


def test_api_key_guards_stats_and_models_too():
    async def go():
        r = await make(api_key="k")
        ok = await call(r, "GET", "/v1/models", headers={"authorization": "Bearer k"})
        return [await call(r, "GET", p) for p in ("/v1/models", "/debug/stats")], ok

    (models, debug), ok = run(go())
    assert models.status_code == debug.status_code == 401 and ok.status_code == 200
