"""How an ingress relays a stream (the one relay of both ingresses, deployments/http.py),
with the Router's replica stream: what counts as served, failed and cancelled (the
counters behind /debug/stats that the serve tests check), and that the replica's
stream is cancelled however the relay ends."""

from __future__ import annotations

import asyncio
import json
import time
import types

from deployments.http import SSE_DONE
from deployments.router import ReplicaStream, Router
from tests.helpers import give_up


class FakeStream:
    """A streaming handle's response: chunks, then (if `end`) its end, else silence."""

    def __init__(self, chunks, end: bool = False):
        self.chunks, self.end, self.cancelled = list(chunks), end, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.chunks:
            if self.end:
                raise StopAsyncIteration
            await asyncio.sleep(3600)  # the replica's end of stream has not arrived yet
        return self.chunks.pop(0)

    def cancel(self):
        self.cancelled = True


def router():
    """The Router's own _relay and _finish on a bare object (an instance of the Serve
    ingress class itself would need a running replica)."""
    cls = Router.func_or_class
    r = types.SimpleNamespace(pending=1, served=0, failed=0, cancelled=0)
    r._finish = lambda how: cls._finish(r, how)
    r._relay = lambda stream, deadline: cls._relay(r, ReplicaStream(stream), deadline)
    return r


def counts(r) -> tuple[int, int, int, int]:
    return r.pending, r.served, r.failed, r.cancelled


async def relay_then_hang_up(r, stream, n, deadline_s: float = 30):
    relay = r._relay(stream, time.monotonic() + deadline_s)
    chunks = aiter(relay)
    got = [await anext(chunks) for _ in range(n)]
    await relay.aclose()  # the client hangs up (http.Stream closes its body however the response ends)
    return got


def test_client_hanging_up_after_done_is_served():
    r, stream = router(), FakeStream([b"data: {}\n\n", SSE_DONE])
    got = asyncio.run(relay_then_hang_up(r, stream, 2))
    assert got[-1] == SSE_DONE
    assert counts(r) == (0, 1, 0, 0)


def test_a_stream_to_its_end_is_served_and_not_cancelled():
    r, stream = router(), FakeStream([b"data: {}\n\n", SSE_DONE], end=True)

    async def go():
        return [c async for c in r._relay(stream, time.monotonic() + 30)]

    assert asyncio.run(go()) == [b"data: {}\n\n", SSE_DONE]
    assert counts(r) == (0, 1, 0, 0) and not stream.cancelled


def test_client_hanging_up_mid_stream_is_cancelled_and_cancels_the_replica_stream():
    r, stream = router(), FakeStream([b"data: {}\n\n", b"data: {}\n\n", SSE_DONE])
    asyncio.run(relay_then_hang_up(r, stream, 1))
    assert counts(r) == (0, 0, 0, 1)
    assert stream.cancelled


def test_a_relay_closed_before_it_started_still_ends_its_request():
    """Serve may cancel the response before its body is first iterated: the
    request is still counted and the replica's stream cancelled."""
    r, stream = router(), FakeStream([b"data: {}\n\n"])
    asyncio.run(r._relay(stream, time.monotonic() + 30).aclose())
    assert counts(r) == (0, 0, 0, 1) and stream.cancelled


def test_the_relay_task_cancelled_mid_wait_is_cancelled():
    """The handler's task is cancelled while the relay waits for the replica (Serve cancels
    the request): the same as a hang-up."""
    r, stream = router(), FakeStream([b"data: {}\n\n"])

    async def go():
        relay = r._relay(stream, time.monotonic() + 30)

        async def consume():
            async for _ in relay:
                pass

        await give_up(consume(), 0.05)  # the first chunk went out; the relay waits for the next
        await relay.aclose()  # what http.Stream does in its finally: a no-op by now

    asyncio.run(go())
    assert counts(r) == (0, 0, 0, 1) and stream.cancelled


def test_deadline_mid_stream_is_an_sse_504_counted_failed():
    r, stream = router(), FakeStream([b"data: {}\n\n"])

    async def go():
        return [c async for c in r._relay(stream, time.monotonic() + 0.2)]

    got = asyncio.run(go())
    err = json.loads(got[-1][6:])["error"]
    assert err["code"] == 504 and err["type"] == "TimeoutError" and "request_timeout_s" in err["message"]
    assert counts(r) == (0, 0, 1, 0) and stream.cancelled


def test_an_engine_error_event_counts_failed_even_if_done_follows():
    """vLLM ends a stream that failed with its error event, then [DONE]."""
    err = b'data: {"error":{"message":"boom","type":"InternalServerError","param":null,"code":500}}\n\n'
    r, stream = router(), FakeStream([b"data: {}\n\n", err, SSE_DONE], end=True)

    async def go():
        return [c async for c in r._relay(stream, time.monotonic() + 30)]

    assert asyncio.run(go())[-1] == SSE_DONE
    assert counts(r) == (0, 0, 1, 0)


def test_a_refusal_sent_as_an_error_event_counts_served_as_its_whole_form_does():
    """vLLM refuses some options only once the stream started (a 400 error event, then [DONE]):
    a client error, counted as the same request's 400 is when not streamed, not as a failure."""
    refusal = b'data: {"error":{"message":"no reasoning parser","type":"BadRequestError","param":null,"code":400}}\n\n'
    malformed = b'data: {"error": "no object"}\n\n'
    for event, want in ((refusal, (0, 1, 0, 0)), (malformed, (0, 0, 1, 0))):
        r, stream = router(), FakeStream([b"data: {}\n\n", event, SSE_DONE], end=True)

        async def go(r=r, stream=stream):
            return [c async for c in r._relay(stream, time.monotonic() + 30)]

        assert asyncio.run(go())[-1] == SSE_DONE
        assert counts(r) == want, event
