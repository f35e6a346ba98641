"""The replica's HTTP ingress (`ingress: replica`) in memory: the real routes, checks,
relay and counters over httpx.ASGITransport, with the FakeEngine (no vLLM, no Ray)."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest

from deployments.replica import EngineReplica, app
from hidden_states.testing import FakeEngine, fake_vector
from tests.helpers import asgi_request, give_up, run


async def make(**args):
    cls = EngineReplica
    replica = cls.__new__(cls)
    await cls.__init__(replica, {"model": "builtin:tiny-llama", **args}, engine_cls=FakeEngine)
    return replica


async def call(replica, method: str, path: str, **kw) -> httpx.Response:
    return await asgi_request(app, replica, method, path, **kw)


def stats(replica) -> dict:
    """The ingress counters (`specs_parsed`, a count for the process's life, left out)."""
    out = run(call(replica, "GET", "/debug/stats")).json()["ingress"]
    out.pop("specs_parsed")
    return out


def test_health_models_and_a_completion_with_its_vector():
    from hidden_states.params import PARSED

    parsed = PARSED[0]

    async def go():
        r = await make()
        assert (await call(r, "GET", "/health")).status_code == 200
        assert (await call(r, "GET", "/v1/models")).json()["data"][0]["id"] == "tiny-llama"
        res = await call(
            r,
            "POST",
            "/v1/completions",
            json={
                "prompt": "Hi there",
                "max_tokens": 3,
                "n": 2,
                "return_hidden_states": True,
                "hidden_states_encoding": "base64",
            },
        )
        return r, res

    r, res = run(go())
    assert res.status_code == 200 and res.headers["x-replica-id"] == r.replica_id
    for ch in res.json()["choices"]:
        ids = list(b"Hi there") + [8 + ch["index"] + i for i in range(3)]
        got = np.frombuffer(base64.b64decode(ch["hidden_states"]), "<f4")
        assert np.array_equal(got, fake_vector(ids))
        assert ch["token_ids"] is None  # not asked for: hidden again
    assert stats(r) | {"kind": "replica"} == {"kind": "replica", "pending": 0, "served": 1, "failed": 0, "cancelled": 0}
    assert (
        PARSED[0] - parsed == 1
    )  # `ingress: replica`: the fields parsed once, by the ingress; the frontend reads them


def test_stream_vectors_on_final_chunks_and_done():
    async def go():
        r = await make()
        return r, await call(
            r,
            "POST",
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "yo"}],
                "max_tokens": 2,
                "stream": True,
                "return_hidden_states": True,
                "return_token_ids": True,
            },
        )

    r, res = run(go())
    events = [e for e in res.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    finals = [json.loads(e[6:])["choices"][0] for e in events[:-1]]
    assert "hidden_states" not in finals[0] and finals[1]["finish_reason"] == "length"
    assert np.allclose(finals[1]["hidden_states"], fake_vector(list(b"yo") + [2, 3]))
    assert stats(r)["served"] == 1


@pytest.mark.parametrize(
    "args, body, headers, status, words",
    [
        ({}, {"prompt": "x", "return_hidden_states": "yes"}, {}, 400, "boolean"),
        ({}, {"prompt": "x", "hidden_states_layers": [7], "return_hidden_states": True}, {}, 400, "out of range"),
        ({}, {"prompt": "x", "n": 99}, {}, 400, "n must be"),
        ({}, {"model": "gpt-4", "prompt": "x"}, {}, 404, "does not exist"),
        (
            {"enable_return_hidden_states": False},
            {"prompt": "x", "return_hidden_states": True},
            {},
            400,
            "enable_return_hidden_states: true",
        ),
        ({"api_key": "k"}, {"prompt": "x"}, {}, 401, "API key"),
        ({"api_key": "k"}, {"prompt": "x"}, {"authorization": "Bearer wrong"}, 401, "API key"),
        ({"max_request_body_bytes": 100}, {"prompt": "x" * 200}, {}, 413, "exceeds"),
    ],
)
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
    assert last["error"]["code"] == 503 and "EngineDeadError" in last["error"]["message"]
    assert last["error"]["type"] == "ServiceUnavailableError" and "retry" in last["error"]["message"]
    assert stats(r) | {"kind": "replica"} == {"kind": "replica", "pending": 0, "served": 0, "failed": 1, "cancelled": 0}
    assert r.engine.live == set() and r.engine.cancelled == 0  # it failed: not cancelled by its caller


def test_api_key_guards_stats_and_models_too():
    async def go():
        r = await make(api_key="k")
        ok = await call(r, "GET", "/v1/models", headers={"authorization": "Bearer k"})
        return [await call(r, "GET", p) for p in ("/v1/models", "/debug/stats")], ok

    (models, debug), ok = run(go())
    assert models.status_code == debug.status_code == 401 and ok.status_code == 200


def test_api_key_from_the_environment_and_a_conflict_fails_the_start(monkeypatch):
    from deployments.http import API_KEY_ENV

    monkeypatch.setenv(API_KEY_ENV, "from-env")

    async def go():
        r = await make()
        return [
            await call(r, "GET", "/v1/models", headers=h)
            for h in ({}, {"authorization": "Bearer from-env"}, {"authorization": "Bearer from-en"})
        ]

    none, ok, near = run(go())
    assert (none.status_code, ok.status_code, near.status_code) == (401, 200, 401)
    with pytest.raises(ValueError, match=f"{API_KEY_ENV} differ"):
        run(make(api_key="from-yaml"))
    run(make(api_key="from-env"))  # the same key twice is no conflict


# -- one request's lifecycle: however it ends, nothing is left running ---------

SLOW = {"engine": {"token_delay_s": 0.05}}  # 400 tokens: 20 s, unless cancelled


def assert_released(r, cancelled: int = 1) -> None:
    assert r.engine.live == set() and r.engine.cancelled == cancelled
    assert r.in_flight == 0 and r.pending == 0


@pytest.mark.parametrize("stream", [False, True])
def test_http_client_hanging_up_cancels_the_engine_request(stream):
    async def go():
        r = await make(**SLOW)
        await give_up(
            call(
                r,
                "POST",
                "/v1/completions",
                json={"prompt": "x", "max_tokens": 400, "stream": stream, "return_hidden_states": True},
            ),
            0.5,
        )
        return r

    r = run(go())
    assert_released(r)
    assert stats(r) | {"kind": "replica"} == {"kind": "replica", "pending": 0, "served": 0, "failed": 0, "cancelled": 1}


def test_http_request_past_its_deadline_is_a_504_and_ends_the_engine_request():
    async def go():
        r = await make(request_timeout_s=0.3, **SLOW)
        return r, await call(r, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 400})

    r, res = run(go())
    assert res.status_code == 504 and res.json()["error"]["type"] == "TimeoutError"
    assert r.engine.live == set() and r.engine.cancelled == 1 and r.failed == 1 and r.pending == 0


def test_handle_calls_cancelled_by_the_router_cancel_the_engine_request():
    """What the Router's `ref.cancel()` / `stream.cancel()` does on the replica: Serve cancels the call's task."""
    body = json.dumps({"prompt": "x", "max_tokens": 400}).encode()

    async def go():
        r = await make(**SLOW)
        await give_up(r.openai_unary("completions", body), 0.3)
        one = (set(r.engine.live), r.engine.cancelled, r.in_flight)

        async def read_a_little():
            stream = r.openai("completions", json.dumps({"prompt": "x", "max_tokens": 400, "stream": True}).encode())
            async for _ in stream:
                pass

        await give_up(read_a_little(), 0.3)
        return r, one

    r, after_unary = run(go())
    assert after_unary == (set(), 1, 0)
    assert_released(r, cancelled=2)


def test_python_handle_failures_use_the_one_table():
    """A vector that timed out is a 504 over a handle as over HTTP (it was a 500 here)."""
    from deployments.wire import ENCODER, REPLY_DECODER, HandleCompletionRequest
    from hidden_states.interface import HiddenStatesTimeout

    async def go(exc):
        r = await make()

        async def fail(*_, **__):
            raise exc

        r.engine.complete = fail
        return REPLY_DECODER.decode(await r.complete(ENCODER.encode(HandleCompletionRequest(prompt="x")))).error

    timeout = run(go(HiddenStatesTimeout("no vector within extraction_timeout_s (60 s)")))
    bad = run(go(ValueError("max_tokens too large")))
    bug = run(go(RuntimeError("a bug")))
    assert (timeout.status, bad.status, bug.status) == (504, 400, 500)
    assert "extraction_timeout_s" in timeout.message and "max_tokens" in bad.message


def test_handle_complete_cancelled_ends_the_engine_request():
    from deployments.wire import ENCODER, HandleCompletionRequest

    async def go():
        r = await make(**SLOW)
        await give_up(r.complete(ENCODER.encode(HandleCompletionRequest(prompt="x", max_tokens=400))), 0.3)
        return r

    assert_released(run(go()))
