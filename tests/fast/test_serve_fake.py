"""The real Serve app over real HTTP (Serve's proxy -> Router -> EngineReplica, and
`ingress: replica`) on the FakeEngine: answers, errors, and one request's lifecycle.

Clients that hang up, streamed or not, leave nothing behind: the ingress's
`pending` returns to 0 and they count `cancelled`, the replica has no call in
flight, and the engine saw each request cancelled and has none unfinished
(`unfinished_requests`, as the vLLM engine reports it).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest

from hidden_states.testing import fake_rows, fake_vector
from tests.helpers import HUNG_UP, hang_up_plain, hang_up_streamed, post

INGRESSES = ("router", "replica")


def stats(base: str) -> dict:
    return httpx.get(f"{base}/debug/stats", timeout=30).json()


def settled(base: str, timeout_s: float = 15) -> dict:
    """The stats once nothing is pending in the ingress, the replica or the engine (or the last ones seen)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = stats(base)
        idle = (s["ingress"]["pending"], s["replica"]["in_flight"], s["replica"]["unfinished_requests"]) == (0, 0, 0)
        if idle or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


@pytest.mark.parametrize("ingress", INGRESSES)
def test_completions_with_and_without_vectors(fake_serve, ingress):
    base = fake_serve[ingress]
    plain = post(base, "/v1/completions", {"prompt": "Hi there", "max_tokens": 3}, timeout=30)
    flagged = post(
        base,
        "/v1/completions",
        {"prompt": "Hi there", "max_tokens": 3, "n": 2, "return_hidden_states": True, "return_token_ids": True},
        timeout=30,
    )
    assert plain.status_code == flagged.status_code == 200, (plain.text, flagged.text)
    assert "hidden_states" not in plain.json()["choices"][0]
    for ch in flagged.json()["choices"]:
        ids = list(b"Hi there") + [8 + ch["index"] + i for i in range(3)]
        assert ch["token_ids"] == ids[8:]
        assert np.allclose(ch["hidden_states"], fake_vector(ids))
    s = stats(base)
    assert s["replica"]["vllm_imported"] is False  # the fast tier never loads vLLM


@pytest.mark.parametrize("ingress", INGRESSES)
def test_rows_of_positions_in_a_dtype_and_streamed_topk(fake_serve, ingress):
    base, ids = fake_serve[ingress], list(b"Hi there") + [8, 9, 10]
    r = post(
        base,
        "/v1/completions",
        {
            "prompt": "Hi there",
            "max_tokens": 3,
            "return_hidden_states": True,
            "hidden_states_position": {"start": 2, "stride": 4},
            "hidden_states_dtype": "float16",
        },
        timeout=30,
    )
    ch = r.json()["choices"][0]
    assert ch["hidden_states_meta"]["positions"] == [2, 6, 10] and ch["hidden_states_meta"]["dtype"] == "float16"
    np.testing.assert_array_equal(ch["hidden_states"], fake_rows(ids, [2, 6, 10], dtype="float16").floats(-1))
    with httpx.stream(
        "POST",
        f"{base}/v1/completions",
        timeout=30,
        json={
            "prompt": "Hi there",
            "max_tokens": 3,
            "stream": True,
            "return_hidden_states": True,
            "hidden_states_position": "completion",
            "hidden_states_topk": 2,
        },
    ) as s:
        chunks = [json.loads(line[6:])["choices"][0] for line in s.iter_lines() if line[6:].startswith("{")]
    rows = [row for c in chunks for row in c.get("hidden_states", [])]
    positions = [p for c in chunks for p in c.get("hidden_states_meta", {}).get("positions", [])]
    want = fake_rows(ids, [8, 9, 10], topk=2)
    assert positions == [8, 9, 10] and [row["indices"] for row in rows] == want.indices[-1].tolist()
    assert [row["values"] for row in rows] == want.values[-1].tolist()


@pytest.mark.parametrize("ingress", INGRESSES)
def test_a_stream_with_vectors(fake_serve, ingress):
    base = fake_serve[ingress]
    before = stats(base)["ingress"]
    with httpx.stream(
        "POST",
        f"{base}/v1/chat/completions",
        timeout=30,
        json={
            "messages": [{"role": "user", "content": "yo"}],
            "max_tokens": 2,
            "stream": True,
            "return_hidden_states": True,
        },
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert '"hidden_states"' in events[-2] and '"hidden_states"' not in events[0]
    after = settled(base)["ingress"]
    assert after["served"] == before["served"] + 1 and after["cancelled"] == before["cancelled"]


@pytest.mark.parametrize("ingress", INGRESSES)
@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"prompt": "x", "n": 99}, 400, "n must be"),  # the ingress's own check
        (
            {"prompt": "x", "hidden_states_layers": [7], "return_hidden_states": True},
            400,
            "out of range",
        ),  # the engine's
        ({"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
    ],
)
def test_refusals_are_openai_errors(fake_serve, ingress, body, status, words):
    r = post(fake_serve[ingress], "/v1/completions", body, timeout=30)
    err = r.json()["error"]
    assert r.status_code == err["code"] == status and words in err["message"], r.text


@pytest.mark.parametrize("ingress", INGRESSES)
def test_past_the_deadline_is_a_504_and_the_engine_request_ends(fake_serve, ingress):
    """request_timeout_s is 3 s here; 400 tokens take 8 s."""
    base = fake_serve[ingress]
    before = stats(base)
    r = post(base, "/v1/completions", {"prompt": "slow", "max_tokens": 400}, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["type"] == "TimeoutError", r.text
    after = settled(base)
    assert after["ingress"]["pending"] == 0 and after["ingress"]["failed"] == before["ingress"]["failed"] + 1
    assert after["replica"]["unfinished_requests"] == 0
    assert after["replica"]["cancelled_requests"] == before["replica"]["cancelled_requests"] + 1


@pytest.mark.parametrize("ingress", INGRESSES)
def test_clients_hanging_up_leave_nothing_running(fake_serve, ingress):
    base = fake_serve[ingress]
    before = stats(base)
    bodies = [{"prompt": f"hang up {i}", "max_tokens": 400, "return_hidden_states": i % 2 == 0} for i in range(12)]

    async def go():
        return await asyncio.gather(
            *(hang_up_streamed(base, b, 3, timeout=30) for b in bodies[:6]),
            *(hang_up_plain(base, b, 1.0) for b in bodies[6:]),
        )

    results = asyncio.run(asyncio.wait_for(go(), 60))
    assert results == [3] * 6 + [HUNG_UP] * 6  # each client got its chunks, or waited, and left
    after = settled(base)
    ing, rep = after["ingress"], after["replica"]
    assert (ing["pending"], rep["in_flight"], rep["unfinished_requests"]) == (0, 0, 0), after
    assert ing["cancelled"] == before["ingress"]["cancelled"] + 12, after
    assert (ing["served"], ing["failed"]) == (before["ingress"]["served"], before["ingress"]["failed"]), after
    assert rep["cancelled_requests"] == before["replica"]["cancelled_requests"] + 12, after
