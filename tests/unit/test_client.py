"""deployments/client.py: a Python caller that stops waiting cancels its request; errors carry HTTP's status."""

from __future__ import annotations

import asyncio
import types

import pytest

from deployments import client, wire
from deployments.wire import HandleError, HandleReply
from tests.helpers import give_up, run


class Response:
    """A DeploymentResponse that never answers (or answers `raw`)."""

    def __init__(self, raw: bytes | None = None):
        self.raw, self.cancelled = raw, False

    def result(self, timeout_s=None):
        if self.raw is None:
            raise TimeoutError("Timed out resolving to ObjectRef.")
        return self.raw

    def __await__(self):
        if self.raw is None:
            yield from asyncio.sleep(3600).__await__()
        return self.raw

    def cancel(self):
        self.cancelled = True


def handle(response: Response):
    method = types.SimpleNamespace(remote=lambda *_: response)
    return types.SimpleNamespace(complete=method, hidden_states=method)


def test_a_blocking_call_that_times_out_cancels_the_request():
    r = Response()
    with pytest.raises(TimeoutError):
        client.complete(handle(r), "x", timeout_s=0.1)
    assert r.cancelled


def test_an_async_call_whose_task_is_cancelled_cancels_the_request():
    r = Response()

    async def go():
        await give_up(client.complete_async(handle(r), "x"), 0.05)

    run(go())
    assert r.cancelled


def test_an_error_reply_raises_with_its_status():
    r = Response(wire.ENCODER.encode(HandleReply(error=HandleError(504, "no vector within extraction_timeout_s"))))
    with pytest.raises(client.HandleRequestError) as e:
        client.complete(handle(r), "x")
    assert e.value.status == 504 and not r.cancelled
