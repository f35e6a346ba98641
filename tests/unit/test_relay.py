"""How an ingress relays a stream (the one relay of both ingresses, deployments/http.py),
with the Router's replica stream: what counts as served and what as failed (the
counters behind /debug/stats that the serve tests check)."""

from __future__ import annotations

import asyncio
import time
import types

from deployments.http import SSE_DONE
from deployments.router import Router, _cancel_unless_done


class FakeStream:
    def __init__(self, chunks):
        self.chunks, self.cancelled = list(chunks), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.chunks:
            await asyncio.sleep(3600)  # the replica's end of stream has not arrived yet
        return self.chunks.pop(0)

    def cancel(self):
        self.cancelled = True


def router():
    """The Router's own _relay and _finish on a bare object (an instance of the Serve
    ingress class itself would need a running replica)."""
    cls = Router.func_or_class
    r = types.SimpleNamespace(pending=1, served=0, failed=0)
    r._finish = lambda ok: cls._finish(r, ok)
    r._relay = lambda stream, deadline: cls._relay(r, _cancel_unless_done(stream), deadline)
    return r


async def relay_then_hang_up(r, stream, n):
    gen = r._relay(stream, time.monotonic() + 30)
    got = [await anext(gen) for _ in range(n)]
    await gen.aclose()  # the client hangs up
    return got


def test_client_hanging_up_after_done_is_served():
    r, stream = router(), FakeStream([b"data: {}\n\n", SSE_DONE])
    got = asyncio.run(relay_then_hang_up(r, stream, 2))
    assert got[-1] == SSE_DONE
    assert (r.pending, r.served, r.failed) == (0, 1, 0)


def test_client_hanging_up_mid_stream_is_failed_and_cancels_the_replica_stream():
    r, stream = router(), FakeStream([b"data: {}\n\n", b"data: {}\n\n", SSE_DONE])
    asyncio.run(relay_then_hang_up(r, stream, 1))
    assert (r.pending, r.served, r.failed) == (0, 0, 1)
    assert stream.cancelled
