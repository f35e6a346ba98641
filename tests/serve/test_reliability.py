"""Reliability against the real app: load without mix-ups, bad input, keys, engine faults.

The engine-fault test (`fault_app`: the guarded app, last of its tests) kills its engine and waits
for Serve to replace the replica; the app is deleted after it: no other test meets the killed engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import psutil
import pytest

from tests.conftest import long_text
from tests.helpers import post
from tests.serve.conftest import API_KEY, decode_vector, replica_stats

HS = {"return_hidden_states": True, "return_token_ids": True}


# -- 1. concurrency: no vector belongs to another request ----------------------


async def _one(client: openai.AsyncOpenAI, i: int):
    stream, chat, n = i % 2 == 0, i % 3 == 0, 2 if i % 4 == 1 else 1
    extra = {**HS, "hidden_states_encoding": "base64" if i % 5 < 2 else "float"}
    kw = dict(model="tiny-llama", max_tokens=6 + i % 11, n=n, extra_body=extra)
    if n > 1:
        kw.update(temperature=1.0, seed=i)
    text = f"request {i}: " + long_text(5 + (i * 7) % 90, seed=i)
    if chat:
        kw["messages"] = [{"role": "user", "content": text}]
        call = client.chat.completions.create
    else:
        kw["prompt"] = text
        call = client.completions.create
    if not stream:
        r = await call(**kw)
        prompt = r.prompt_token_ids if chat else r.choices[0].prompt_token_ids
        return [(prompt + c.token_ids, c.hidden_states) for c in r.choices]
    tokens, vectors, prompt = {}, {}, None
    async for chunk in await call(stream=True, **kw):
        extra_chunk = chunk.model_extra or {}
        prompt = prompt or extra_chunk.get("prompt_token_ids")
        for c in chunk.choices:
            ce = c.model_extra or {}
            prompt = prompt or ce.get("prompt_token_ids")
            tokens.setdefault(c.index, []).extend(ce.get("token_ids") or [])
            if c.finish_reason is not None:
                vectors[c.index] = ce["hidden_states"]
    assert len(vectors) == n
    return [(prompt + tokens[k], vectors[k]) for k in sorted(vectors)]


def test_64_concurrent_mixed_requests_no_mixups(serve_app, reference):
    async def run():
        client = openai.AsyncOpenAI(base_url=f"{serve_app}/v1", api_key="unused", timeout=300, max_retries=0)
        return await asyncio.gather(*(_one(client, i) for i in range(64)), return_exceptions=True)

    results = asyncio.run(run())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    checked = 0
    for choices in results:
        for ids, vec in choices:
            reference.assert_matches(ids, decode_vector(vec))
            checked += 1
    assert checked >= 64 + 16
    stats = replica_stats(serve_app)
    assert stats["ingress"]["pending"] == 0


# -- 4. bad input ---------------------------------------------------------------


def assert_openai_error(r, status: int, *words: str):
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert {"message", "type", "code"} <= set(err) and err["code"] == status
    for w in words:
        assert w in err["message"], err["message"]


@pytest.mark.parametrize(
    "body,status,words",
    [
        ({"prompt": 5}, 400, ()),
        ({"prompt": "hi", "max_tokens": "many"}, 400, ("max_tokens",)),
        ({"prompt": "hi", "max_tokens": -1}, 400, ()),
        ({"prompt": "hi", "max_tokens": 10**9}, 400, ()),
        ({"prompt": "hi", "n": 100000}, 400, ("n",)),
        ({"prompt": "hi", "n": "two"}, 400, ("n",)),
        ({"prompt": "hi " * 5000, "max_tokens": 4}, 400, ()),
        ({"prompt": "hi", "model": "gpt-17"}, 404, ("gpt-17",)),
        (
            {"prompt": "hi", "return_hidden_states": True, "hidden_states_encoding": "hex"},
            400,
            ("hidden_states_encoding",),
        ),
        ({"prompt": "hi", "return_hidden_states": "yes"}, 400, ("return_hidden_states",)),
        ({"prompt": "hi", "temperature": "hot"}, 400, ()),
    ],
)
def test_named_bad_inputs(serve_app, body, status, words):
    assert_openai_error(post(serve_app, "/v1/completions", body), status, *words)


def test_bad_chat_and_bad_json(serve_app):
    assert_openai_error(post(serve_app, "/v1/chat/completions", {"messages": "hello"}), 400)
    assert_openai_error(post(serve_app, "/v1/completions", raw=b"{not json"), 400, "JSON")
    assert_openai_error(post(serve_app, "/v1/completions", raw=b"[1, 2]"), 400, "object")


def test_hidden_states_requested_on_switched_off_server(off_app):
    r = post(
        off_app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "return_hidden_states": True}
    )
    assert_openai_error(r, 400, "enable_return_hidden_states")


def test_body_over_limit_is_refused(guarded_app):
    big = {"prompt": "x" * (80 * 1024)}
    r = post(guarded_app, "/v1/completions", big, headers={"authorization": f"Bearer {API_KEY}"})
    assert_openai_error(r, 413, "limit")


def test_schemathesis_finds_no_server_errors(serve_app):
    """Schemathesis against the router's own OpenAPI schema: no 5xx, replicas survive."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(f"{serve_app}/openapi.json")
    tried: dict[str, int] = {}
    statuses: dict[int, int] = {}

    def fuzzer(operation):
        @given(operation.as_strategy())
        @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case):
            resp = case.call(base_url=serve_app, timeout=120)
            tried[operation.label] = tried.get(operation.label, 0) + 1
            statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
            case.validate_response(resp, checks=[not_a_server_error])

        return fuzz

    for op in schema.get_all_operations():
        fuzzer(op.ok())()
    print("schemathesis:", tried, statuses)
    assert sum(tried.values()) >= 100, tried
    r = post(serve_app, "/v1/completions", {"prompt": "still alive", "max_tokens": 3, **HS})
    assert r.status_code == 200 and len(r.json()["choices"][0]["hidden_states"]) == 128


# -- 5. keys --------------------------------------------------------------------


def test_api_key_required_and_no_engine_work_without_it(guarded_app):
    base = guarded_app
    good = {"authorization": f"Bearer {API_KEY}"}
    before = replica_stats(base, good)["replica"]["requests"]
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": API_KEY}):
        assert_openai_error(
            post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers=headers), 401, "API key"
        )
        assert httpx.get(f"{base}/v1/models", headers=headers, timeout=30).status_code == 401
    assert replica_stats(base, good)["replica"]["requests"] == before
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, timeout=120, max_retries=0)
    r = client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2, extra_body=HS)
    assert len(r.choices[0].hidden_states) == 128
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200  # health stays open for probes


# -- the replica as its own ingress (`ingress: replica`: the guarded app) ----------


def test_replica_ingress_serves_checks_and_streams(guarded_app, reference):
    base = guarded_app
    good = {"authorization": f"Bearer {API_KEY}"}
    stats = replica_stats(base, good)
    assert stats["ingress"]["kind"] == "replica"
    assert stats["replica"]["serve_user_code_in_separate_thread"] is False  # serve_env reached the replica
    assert_openai_error(
        post(base, "/v1/completions", {"model": "gpt-4", "prompt": "x"}, headers=good), 404, "tiny-llama"
    )
    assert_openai_error(post(base, "/v1/completions", {"prompt": "x", "n": 99}, headers=good), 400, "n must be")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, timeout=120, max_retries=0)
    r = client.completions.with_raw_response.create(
        model="tiny-llama", prompt=long_text(60, seed=8), max_tokens=12, extra_body=HS
    )
    assert r.headers["x-replica-id"] == stats["replica"]["replica"]
    (c,) = r.parse().choices
    reference.assert_matches(c.prompt_token_ids + c.token_ids, decode_vector(c.hidden_states))
    stream = client.completions.create(
        model="tiny-llama",
        prompt=long_text(40, seed=9),
        max_tokens=8,
        stream=True,
        extra_body={**HS, "hidden_states_encoding": "base64"},
    )
    tokens, vector, prompt_ids = [], None, None
    for chunk in stream:
        for ch in chunk.choices:
            extra = ch.model_extra or {}
            prompt_ids = extra.get("prompt_token_ids") or prompt_ids
            tokens += extra.get("token_ids") or []
            if ch.finish_reason is not None:
                vector = extra["hidden_states"]
    assert vector is not None and prompt_ids
    reference.assert_matches(prompt_ids + tokens, decode_vector(vector))
    assert replica_stats(base, good)["ingress"]["pending"] == 0


# -- 2. engine faults (on an app of its own: no other test meets the killed engine) --


def _engine_core_pids(replica_pid: int) -> list[int]:
    out = []
    for child in psutil.Process(replica_pid).children(recursive=True):
        try:
            if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
                out.append(child.pid)
        except psutil.Error:
            pass
    return out


def test_engine_killed_mid_request(fault_app):
    base = fault_app
    good = {"authorization": f"Bearer {API_KEY}"}
    stats = replica_stats(base, good)["replica"]
    pid = stats["pid"]
    cores = _engine_core_pids(pid)
    assert cores, f"no EngineCore process under replica pid {pid}"

    async def in_flight():
        async with httpx.AsyncClient(timeout=120) as http:

            async def one(i):
                body = {
                    "prompt": long_text(50, seed=i),
                    "max_tokens": 2000,
                    "ignore_eos": True,
                    "stream": i % 2 == 0,
                    **HS,
                }
                t0 = time.monotonic()
                async with http.stream("POST", f"{base}/v1/completions", json=body, headers=good) as r:
                    text = (await r.aread()).decode()
                return r.status_code, text, time.monotonic() - t0

            tasks = [asyncio.create_task(one(i)) for i in range(4)]
            await asyncio.sleep(4)  # the requests are generating
            for c in cores:
                os.kill(c, signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(in_flight())
    for status, text, seconds in results:
        assert seconds < 60, "a request hung past the configured timeout"
        if status == 200:  # streaming: the error arrives as an SSE event
            events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
            assert "error" in events[-1], text[-500:]
            assert events[-1]["error"]["code"] >= 500
        else:
            assert status >= 500, (status, text[:300])
            assert "error" in json.loads(text)
    # Serve's health check sees the dead engine and replaces the replica.
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        try:
            s = replica_stats(base, good)
            if s.get("replica", {}).get("pid") not in (None, pid):
                break
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(3)
    else:
        pytest.fail("the replica with the dead engine was not replaced")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, timeout=120, max_retries=0)
    r = client.completions.create(model="tiny-llama", prompt="after the fault", max_tokens=4, extra_body=HS)
    assert len(r.choices[0].hidden_states) == 128
    assert replica_stats(base, good)["ingress"]["pending"] == 0
