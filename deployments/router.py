"""Router: the HTTP ingress (`ingress: router`, the default). Checks, forwards, relays.

No tokenization, no engine work: it runs deployments/http.py's checks (the spec parsed once),
sends the raw body and spec to an EngineReplica and relays the answer; a replica that dies
before answering gets one retry on another. Whatever ends a request early cancels the
replica's call or stream (`DeploymentResponse.cancel()`), and so the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from fastapi import FastAPI
from fastapi.responses import Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments import http, routing, wire
from deployments.config import AppArgs
from deployments.readiness import Readiness
from deployments.wire import HandleError, HandleReply
from hidden_states import errors
from hidden_states.errors import Refused
from hidden_states.openai_format import error_body
from hidden_states.params import HiddenStatesFields

logger = logging.getLogger(__name__)

# Module-level helpers sit above the deployment class: Serve serializes the
# class when the decorator runs, capturing only names defined by then.

app = FastAPI(title="hidden-states-serve", description="OpenAI-compatible completions with final-token hidden states")


class ReplicaStream:
    """A replica's response stream as the relay's `parts`: `aclose()` cancels the replica's work unless
    the stream ended, even if never iterated."""

    def __init__(self, stream):
        self.stream, self.done = stream, False

    def __aiter__(self) -> ReplicaStream:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.stream.__anext__()
        except StopAsyncIteration:
            self.done = True
            raise

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            _cancel(self.stream)


def _cancel(response) -> None:
    """Cancels a replica call or stream (best effort, as Serve's is): never masks what ended the wait."""
    try:
        response.cancel()
    except Exception as e:
        logger.debug("cancelling a replica call failed: %s", e)


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


@serve.deployment(max_ongoing_requests=1000)
@serve.ingress(app)
class Router(http.ingress_routes(app, "router")):
    prefix_routing = False  # replica_routing resolved to prefix: the replica calls carry a routing key

    def __init__(self, replica: DeploymentHandle, args: dict):
        self.args = AppArgs.model_validate(args)
        http.api_key(self.args)  # a conflicting key fails the start, with the reason
        self.replica = replica
        self.replica_stream = replica.options(stream=True)  # built once: options() is not free
        self.readiness = Readiness(serve.get_replica_context().app_name)
        self.prefix_routing = self.args.resolved_replica_routing() == "prefix"
        self.engine_card: dict | None = None

    async def _not_ready(self) -> str | None:
        return await self.readiness.why_not()

    async def _engine_card(self) -> dict | None:
        """Asked of a replica once (every replica runs the same engine arguments), then kept."""
        if self.engine_card is None:
            try:
                self.engine_card = json.loads(await self._call_once(self.replica.model_card, time.monotonic() + 30))
            except Exception as e:  # /v1/models still answers, without it
                logger.warning("no replica told its engine card (max_model_len, heads): %s", e)
        return self.engine_card

    async def _replica_stats(self) -> dict:
        try:
            return {"replica": json.loads(await self._call_once(self.replica.stats, time.monotonic() + 30))}
        except Exception as e:
            return {"replica_error": str(e)}

    async def _serve(self, route: str, body: bytes, req: dict, spec: HiddenStatesFields) -> Response:
        fields = spec.to_json()  # the spec crosses as the value parsed here: the replica does not check it again
        if (why := await self._not_ready()) is not None:  # rather than wait for a replica until the timeout
            return http.error(503, why)
        deadline = time.monotonic() + self.args.request_timeout_s
        routed = self._routing(routing.http_key(route, req, self.args.model_name) if self.prefix_routing else "")
        self.pending += 1
        how = http.CANCELLED  # unless it gets an answer: the client went away
        try:
            if req.get("stream") is not True:
                reply = await self._call(route, body, deadline, routed, fields)
                how = http.outcome(reply.head.status)
                return Response(
                    reply.body,
                    status_code=reply.head.status,
                    media_type=reply.head.media_type,
                    headers={"x-replica-id": reply.head.replica},
                )
            stream, head = await self._open(route, body, deadline, routed, fields)
            parts = ReplicaStream(stream)
            if head.media_type != "text/event-stream":  # an error answer to a streaming request
                async with contextlib.aclosing(parts):
                    whole = b"".join([p async for p in http.until(parts, deadline)])
                how = http.outcome(head.status)
                return Response(
                    whole, status_code=head.status, media_type=head.media_type, headers={"x-replica-id": head.replica}
                )
            how = None  # the relay counts it from here
            return http.Stream(
                self._relay(parts, deadline), media_type="text/event-stream", headers={"x-replica-id": head.replica}
            )
        except Exception as e:
            how = http.FAILED
            return http.failure(e)
        finally:
            if how is not None:
                self._finish(how)

    @staticmethod
    def _routing(key: str) -> dict:
        """A replica call's keyword arguments for the request router (deployments/routing.py): its routing key."""
        return {routing.KEY_KWARG: key} if key else {}

    async def _call_once(self, method, deadline: float, *args, **kwargs):
        """One replica call by `deadline`; however the wait ends early (timeout, cancellation), the call is
        cancelled."""
        ref = method.remote(*args, **kwargs)
        try:
            return await asyncio.wait_for(ref, _remaining(deadline))
        except BaseException:
            _cancel(ref)
            raise

    async def _call(
        self, route: str, body: bytes, deadline: float, routed: dict | None = None, fields: bytes = b""
    ) -> wire.Reply:
        """A non-streaming request; a replica that died before answering gets one retry elsewhere."""
        for attempt in (1, 2):
            try:
                return wire.REPLY_BODY_DECODER.decode(
                    await self._call_once(self.replica.openai_unary, deadline, route, body, fields, **(routed or {}))
                )
            except Exception as e:
                if attempt == 2 or not errors.replica_gone(e):
                    raise
                logger.warning("replica died before answering (%s); retrying once", type(e).__name__)

    async def _open(self, route: str, body: bytes, deadline: float, routed: dict | None = None, fields: bytes = b""):
        """A streaming request: (the replica's stream, its ResponseHead); one retry as `_call`; however the
        wait ends early, the stream is cancelled."""
        for attempt in (1, 2):
            stream = self.replica_stream.openai.remote(route, body, fields, **(routed or {}))
            try:
                head = await asyncio.wait_for(stream.__anext__(), _remaining(deadline))
                return stream, wire.HEAD_DECODER.decode(head)
            except BaseException as e:
                _cancel(stream)
                if attempt == 2 or not isinstance(e, Exception) or not errors.replica_gone(e):
                    raise
                logger.warning("replica died before answering (%s); retrying once", type(e).__name__)

    # -- Python handles -------------------------------------------------------

    async def hidden_states(self, body: bytes) -> bytes:
        """For `deployments.client.verify(handle, ...)`: POST /v1/hidden_states's JSON in, a Reply out."""
        if (why := await self._not_ready()) is not None:
            return wire.ENCODER.encode(wire.Reply(wire.ResponseHead(503, "application/json", ""), error_body(why, 503)))
        self.pending += 1
        how = http.CANCELLED
        try:
            reply = await self._call("hidden_states", body, time.monotonic() + self.args.request_timeout_s)
            how = http.outcome(reply.head.status)
            return wire.ENCODER.encode(reply)
        except Exception as e:
            how = http.FAILED
            status, err = errors.error_response(e)
            return wire.ENCODER.encode(wire.Reply(wire.ResponseHead(status, "application/json", ""), err))
        finally:
            self._finish(how)

    async def complete(self, request: bytes) -> bytes:
        """For `deployments.client.complete(handle, ...)`: HandleCompletionRequest -> HandleReply bytes."""
        try:
            req = wire.REQUEST_DECODER.decode(request)
        except Exception as e:
            return wire.ENCODER.encode(HandleReply(error=HandleError(400, f"invalid request: {e}")))
        try:
            spec = http.handle_spec(self.args, req)
        except Refused as e:
            return wire.ENCODER.encode(HandleReply(error=http.handle_failure(e)))
        if (why := await self._not_ready()) is not None:
            return wire.ENCODER.encode(HandleReply(error=HandleError(503, why)))
        self.pending += 1
        how = http.CANCELLED
        try:
            routed = self._routing(routing.handle_key(req, self.args.model_name) if self.prefix_routing else "")
            raw = await self._call_once(
                self.replica.complete, time.monotonic() + self.args.request_timeout_s, request, spec.to_json(), **routed
            )
            error = wire.REPLY_DECODER.decode(raw).error
            how = http.outcome(error.status) if error is not None else http.SERVED
            return raw
        except Exception as e:
            how = http.FAILED
            return wire.ENCODER.encode(HandleReply(error=http.handle_failure(e)))
        finally:
            self._finish(how)
