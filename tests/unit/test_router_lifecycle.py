"""The Router's request lifecycle in memory: its real routes over ASGI, with a fake
replica handle that behaves as Serve's does where it matters here (cancelling the
wait for a call does not cancel the call; only `.cancel()` does).

However a request ends (answered, timed out, its client gone, Serve cancelling the
handler), `pending` returns to 0, it is counted once, and the replica's call or
stream is cancelled unless it ended. No Ray, no vLLM."""

from __future__ import annotations

import asyncio
import json
import types

import httpx
import pytest
from ray.exceptions import ActorDiedError

from deployments import http, router, wire
from deployments.config import AppArgs
from deployments.wire import HandleCompletion, HandleCompletionRequest, HandleReply, Reply, ResponseHead
from tests.helpers import asgi_request, give_up, run

OK_BODY = b'{"choices": []}'


class Call:
    """One replica call: it answers `result` after `delay` s (raises it if an exception);
    a streaming call yields `result` (its head), then `chunks`, `delay` s apart, and is
    `finished` once it ran out of them."""

    def __init__(self, result, delay: float, chunks=None):
        self.result, self.delay, self.chunks = result, delay, list(chunks or ())
        self.cancelled = self.finished = False
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self):
        await asyncio.sleep(self.delay)
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result

    def __await__(self):  # Serve's DeploymentResponse: a cancelled waiter leaves the call running
        return asyncio.shield(self.task).__await__()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.task.done() or self.task.result() is not None:
            head = await asyncio.shield(self.task)
            self.task = asyncio.get_running_loop().create_future()
            self.task.set_result(None)
            return head
        if not self.chunks:
            self.finished = True
            raise StopAsyncIteration
        await asyncio.sleep(self.delay)
        return self.chunks.pop(0)

    def cancel(self):
        self.cancelled = True
        self.task.cancel()


class Replica:
    """The Router's handle to EngineReplica: every `x.remote(...)` starts a Call from `script`."""

    def __init__(self, *script):
        self.script, self.calls = list(script), []

    def options(self, stream: bool = False):
        return self

    def __getattr__(self, method):
        def remote(*args):
            call = Call(*self.script.pop(0)) if self.script else Call(RuntimeError("no more calls scripted"), 0)
            self.calls.append((method, call))
            return call

        return types.SimpleNamespace(remote=remote)


def make_router(replica: Replica, **args):
    cls = router.Router.func_or_class.__mro__[1]  # the class as written, under Serve's ASGI wrapper
    assert cls.__name__ == "Router"
    r = cls.__new__(cls)
    r.args = AppArgs(model="builtin:tiny-llama", **args)
    r.replica = r.replica_stream = replica
    r.readiness = types.SimpleNamespace(why_not=lambda: asyncio.sleep(0))  # ready
    return r


def counts(r) -> tuple[int, int, int, int]:
    return r.pending, r.served, r.failed, r.cancelled


def reply(status: int = 200, body: bytes = OK_BODY) -> bytes:
    return wire.ENCODER.encode(Reply(ResponseHead(status, "application/json", "r1"), body))


def head(status: int = 200, media: str = "text/event-stream") -> bytes:
    return wire.ENCODER.encode(ResponseHead(status, media, "r1"))


async def post(r, body: dict, give_up_after: float | None = None) -> httpx.Response | None:
    """POST /v1/completions to the Router; `give_up_after`: the client hangs up then (its task
    is cancelled, as Serve cancels the handler when the HTTP client goes away)."""
    sent = asgi_request(router.app, r, "POST", "/v1/completions", json=body)
    if give_up_after is None:
        return await sent
    await give_up(sent, give_up_after)
    return None


def test_a_plain_request_is_served():
    async def go():
        r = make_router(Replica((reply(), 0.01)))
        return r, await post(r, {"prompt": "x"})

    r, res = run(go())
    assert res.status_code == 200 and res.content == OK_BODY and res.headers["x-replica-id"] == "r1"
    assert counts(r) == (0, 1, 0, 0)


def test_a_plain_client_hanging_up_cancels_the_replica_call_and_counts_cancelled():
    """The bug this guards: the Router caught Exception only, so the CancelledError of a
    client that hung up skipped the counting and `pending` never came back down."""

    async def go():
        r = make_router(Replica((reply(), 10)))
        await post(r, {"prompt": "x"}, give_up_after=0.2)
        return r

    r = run(go())
    assert counts(r) == (0, 0, 0, 1)
    ((method, call),) = r.replica.calls
    assert method == "openai_unary" and call.cancelled


def test_a_plain_request_past_its_deadline_is_a_504_and_cancels_the_call():
    async def go():
        r = make_router(Replica((reply(), 10)), request_timeout_s=0.2)
        return r, await post(r, {"prompt": "x"})

    r, res = run(go())
    assert res.status_code == 504 and res.json()["error"]["type"] == "TimeoutError"
    assert counts(r) == (0, 0, 1, 0) and r.replica.calls[0][1].cancelled


def test_a_stream_whose_head_comes_too_late_is_a_504_and_its_stream_cancelled():
    """The bug this guards: a timeout inside _open left the replica's stream running for nobody."""

    async def go():
        r = make_router(Replica((head(), 10, [b"data: {}\n\n"])), request_timeout_s=0.2)
        return r, await post(r, {"prompt": "x", "stream": True})

    r, res = run(go())
    assert res.status_code == 504
    assert counts(r) == (0, 0, 1, 0) and r.replica.calls[0][1].cancelled


def test_a_stream_client_hanging_up_before_the_head_cancels_the_stream():
    async def go():
        r = make_router(Replica((head(), 10, [b"data: {}\n\n"])))
        await post(r, {"prompt": "x", "stream": True}, give_up_after=0.2)
        return r

    r = run(go())
    assert counts(r) == (0, 0, 0, 1) and r.replica.calls[0][1].cancelled


def test_a_stream_cancelled_mid_relay_cancels_the_replica_stream():
    async def go():
        r = make_router(Replica((head(), 0.05, [b"data: {}\n\n"] * 100)))
        await post(r, {"prompt": "x", "stream": True}, give_up_after=0.5)
        return r

    r = run(go())
    assert counts(r) == (0, 0, 0, 1)
    call = r.replica.calls[0][1]
    assert call.cancelled and not call.finished


def test_a_whole_stream_is_served_and_not_cancelled():
    async def go():
        r = make_router(Replica((head(), 0.01, [b"data: {}\n\n", http.SSE_DONE])))
        return r, await post(r, {"prompt": "x", "stream": True})

    r, res = run(go())
    assert res.status_code == 200 and res.text.endswith("data: [DONE]\n\n")
    assert counts(r) == (0, 1, 0, 0) and not r.replica.calls[0][1].cancelled


def test_an_error_answer_to_a_stream_request_is_relayed_whole():
    err = b'{"error": {"message": "bad", "type": "BadRequestError", "param": null, "code": 400}}'

    async def go():
        r = make_router(Replica((head(400, "application/json"), 0.01, [err])))
        return r, await post(r, {"prompt": "x", "stream": True})

    r, res = run(go())
    assert res.status_code == 400 and res.json()["error"]["message"] == "bad"
    assert counts(r) == (0, 1, 0, 0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_replica_that_died_before_answering_gets_one_retry(stream):
    first = (ActorDiedError(), 0.01) if not stream else (ActorDiedError(), 0.01, [])
    ok = (reply(), 0.01) if not stream else (head(), 0.01, [b"data: {}\n\n", http.SSE_DONE])

    async def go():
        once = make_router(Replica(first, ok))
        twice = make_router(Replica(first, first))
        return (
            once,
            await post(once, {"prompt": "x", "stream": stream}),
            twice,
            await post(twice, {"prompt": "x", "stream": stream}),
        )

    once, ok_res, twice, bad_res = run(go())
    assert ok_res.status_code == 200 and counts(once) == (0, 1, 0, 0) and len(once.replica.calls) == 2
    assert bad_res.status_code == 503 and bad_res.json()["error"]["type"] == "ServiceUnavailableError"
    assert counts(twice) == (0, 0, 1, 0) and len(twice.replica.calls) == 2


def handle_reply(raw: bytes) -> HandleReply:
    return wire.REPLY_DECODER.decode(raw)


def test_python_handle_timeout_is_504_like_http_and_cancels_the_call():
    request = wire.ENCODER.encode(HandleCompletionRequest(prompt="x"))
    ok = wire.ENCODER.encode(HandleReply(ok=HandleCompletion("id", "r1", [1], [])))

    async def go():
        slow = make_router(Replica((ok, 10)), request_timeout_s=0.2)
        fast = make_router(Replica((ok, 0.01)))
        return slow, handle_reply(await slow.complete(request)), fast, handle_reply(await fast.complete(request))

    slow, timed_out, fast, answered = run(go())
    assert timed_out.error.status == 504 and "request_timeout_s" in timed_out.error.message
    assert counts(slow) == (0, 0, 1, 0) and slow.replica.calls[0][1].cancelled
    assert answered.ok.request_id == "id" and counts(fast) == (0, 1, 0, 0)


def test_python_handle_call_cancelled_cancels_the_replica_call():
    request = wire.ENCODER.encode(HandleCompletionRequest(prompt="x"))

    async def go():
        r = make_router(Replica((b"", 10)))
        await give_up(r.complete(request), 0.2)
        return r

    r = run(go())
    assert counts(r) == (0, 0, 0, 1) and r.replica.calls[0][1].cancelled


def test_debug_stats_reports_the_four_counters_and_the_specs_parsed():
    async def go():
        r = make_router(Replica((json.dumps({"replica": "r1"}).encode(), 0.01)))
        return (await asgi_request(router.app, r, "GET", "/debug/stats")).json()

    from hidden_states.params import PARSED

    out = run(go())
    assert out["ingress"] == {
        "kind": "router",
        "pending": 0,
        "served": 0,
        "failed": 0,
        "cancelled": 0,
        "specs_parsed": PARSED[0],
    }
    assert out["replica"] == {"replica": "r1"}
