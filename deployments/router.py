"""Router: the HTTP ingress (`ingress: router`, the default). Checks, forwards, relays.

It does no tokenization and no engine work: it runs the checks of
`deployments/http.py` (auth, body limit, what the server cannot do), sends the
raw body to an EngineReplica (one call for a plain request, a streaming handle
for `stream: true`) and relays its answer; a replica that dies before answering
gets the request again on another. It counts requests in flight
(`/debug/stats` -> `pending`), so a test can see that nothing is left behind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from deployments import http, wire
from deployments.config import AppArgs
from deployments.readiness import Readiness
from hidden_states.openai_format import error_body
from deployments.wire import HandleError, HandleReply

logger = logging.getLogger(__name__)

# Module-level helpers sit above the deployment class: Serve serializes the
# class when the decorator runs, capturing only names defined by then.

app = FastAPI(title="hidden-states-serve", description="OpenAI-compatible completions with final-token hidden states")


def _failure(e: BaseException) -> Response:
    return http.error(*http.failure(e))


async def _cancel_unless_done(stream) -> AsyncIterator[bytes]:
    """A replica's response stream as an async generator: closing it early cancels the replica's work."""
    done = False
    try:
        async for chunk in stream:
            yield chunk
        done = True
    finally:
        if not done:
            stream.cancel()


@serve.deployment(max_ongoing_requests=1000)
@serve.ingress(app)
class Router(http.ingress_routes(app, "router")):
    def __init__(self, replica: DeploymentHandle, args: dict):
        self.args = AppArgs.model_validate(args)
        self.replica = replica
        self.replica_stream = replica.options(stream=True)  # built once: options() is not free
        self.readiness = Readiness(serve.get_replica_context().app_name)

    async def _not_ready(self) -> str | None:
        return await self.readiness.why_not()

    async def _replica_stats(self) -> dict:
        try:
            return {"replica": json.loads(await asyncio.wait_for(self.replica.stats.remote(), 30))}
        except Exception as e:
            return {"replica_error": str(e)}

    async def _serve(self, route: str, request: Request) -> Response:
        admitted = await http.admit(self.args, request, route)
        if isinstance(admitted, Response):
            return admitted
        body, req = admitted
        if (why := await self._not_ready()) is not None:  # rather than wait for a replica until the timeout
            return http.error(503, why)
        deadline = time.monotonic() + self.args.request_timeout_s
        self.pending += 1
        if req.get("stream") is not True:
            try:
                reply = await self._call(route, body, deadline)
            except Exception as e:
                self._finish(False)
                return _failure(e)
            self._finish(reply.head.status < 500)
            return Response(reply.body, status_code=reply.head.status, media_type=reply.head.media_type,
                            headers={"x-replica-id": reply.head.replica})
        stream = None
        try:
            stream, head = await self._open(route, body, deadline)
            if head.media_type != "text/event-stream":  # an error answer to a streaming request
                parts = [p async for p in http.until(stream, deadline)]
                self._finish(head.status < 500)
                return Response(b"".join(parts), status_code=head.status, media_type=head.media_type,
                                headers={"x-replica-id": head.replica})
        except Exception as e:
            self._finish(False)
            if stream is not None:
                stream.cancel()
            return _failure(e)
        return StreamingResponse(self._relay(_cancel_unless_done(stream), deadline), media_type="text/event-stream",
                                 headers={"x-replica-id": head.replica})

    async def _call(self, route: str, body: bytes, deadline: float) -> wire.Reply:
        """A non-streaming request: one call, one reply. A replica that died
        before answering gets one retry elsewhere (nothing was sent yet)."""
        for attempt in (1, 2):
            ref = self.replica.openai_unary.remote(route, body)
            try:
                raw = await asyncio.wait_for(ref, max(0.0, deadline - time.monotonic()))
                return wire.REPLY_BODY_DECODER.decode(raw)
            except (RayActorError, ActorUnavailableError) as e:
                if attempt == 2:
                    raise
                logger.warning("replica died before answering (%s); retrying once", type(e).__name__)
            except BaseException:
                ref.cancel()
                raise

    async def _open(self, route: str, body: bytes, deadline: float):
        """Sends a streaming request; a replica that died before answering gets one retry elsewhere."""
        for attempt in (1, 2):
            stream = self.replica_stream.openai.remote(route, body)
            try:
                head = await asyncio.wait_for(stream.__anext__(), max(0.0, deadline - time.monotonic()))
                return stream, wire.HEAD_DECODER.decode(head)
            except (RayActorError, ActorUnavailableError) as e:
                stream.cancel()
                if attempt == 2:
                    raise
                logger.warning("replica died before answering (%s); retrying once", type(e).__name__)

    # -- Python handles -------------------------------------------------------

    async def hidden_states(self, body: bytes) -> bytes:
        """For `deployments.client.verify(handle, ...)`: POST /v1/hidden_states's JSON in, a Reply out."""
        if (refused := http.route_refusal(self.args, "hidden_states")) is not None:
            return wire.ENCODER.encode(wire.Reply(wire.ResponseHead(400, "application/json", ""), refused))
        if (why := await self._not_ready()) is not None:
            return wire.ENCODER.encode(wire.Reply(wire.ResponseHead(503, "application/json", ""),
                                                  error_body(why, 503)))
        self.pending += 1
        try:
            reply = await self._call("hidden_states", body, time.monotonic() + self.args.request_timeout_s)
        except Exception as e:
            self._finish(False)
            status, message = http.failure(e)
            return wire.ENCODER.encode(wire.Reply(wire.ResponseHead(status, "application/json", ""),
                                                  error_body(message, status)))
        self._finish(reply.head.status < 500)
        return wire.ENCODER.encode(reply)

    async def complete(self, request: bytes) -> bytes:
        """For `deployments.client.complete(handle, ...)`: HandleCompletionRequest -> HandleReply bytes."""
        try:
            req = wire.REQUEST_DECODER.decode(request)
        except Exception as e:
            return wire.ENCODER.encode(HandleReply(error=HandleError(400, f"invalid request: {e}")))
        if (refused := http.handle_refusal(self.args, req)) is not None:
            return wire.ENCODER.encode(HandleReply(error=refused))
        if (why := await self._not_ready()) is not None:
            return wire.ENCODER.encode(HandleReply(error=HandleError(503, why)))
        self.pending += 1
        try:
            reply = await asyncio.wait_for(self.replica.complete.remote(request), self.args.request_timeout_s)
            self._finish(True)
            return reply
        except Exception as e:
            self._finish(False)
            return wire.ENCODER.encode(HandleReply(error=HandleError(*http.failure(e))))

