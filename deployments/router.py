"""Router: the HTTP ingress. Checks what is cheap to check, forwards, relays.

It does no tokenization and no engine work: it authenticates, bounds the body,
refuses what the server cannot do (hidden states switched off, unknown model,
too many choices) with OpenAI-style errors, then streams the raw body to an
EngineReplica and relays its answer. It counts requests in flight
(`/debug/stats` -> `pending`), so a test can see that nothing is left behind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from deployments import wire
from deployments.config import AppArgs
from deployments.openai_serving import error_body
from deployments.wire import HandleError, HandleReply

logger = logging.getLogger(__name__)

# Module-level helpers sit above the deployment class: Serve serializes the
# class when the decorator runs, capturing only names defined by then.

app = FastAPI(title="hidden-states-serve", description="OpenAI-compatible completions with final-token hidden states")

HS_DISABLED = (
    "hidden states are disabled on this server: set `enable_return_hidden_states: true` "
    "in the app's args (config.yaml: applications[0].args) and redeploy"
)


class _Body(BaseModel):
    """The request fields this server adds or checks itself; every other field
    of vLLM's OpenAI API is accepted too (the replica validates the whole body)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    n: int | None = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    logprobs: int | None = None
    return_hidden_states: bool = False
    hidden_states_encoding: Literal["float", "base64"] = "float"
    return_token_ids: bool | None = None
    hidden_states_layers: list[int] | None = None
    hidden_states_position: Literal["completion_end", "prompt_end"] = "completion_end"


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]


class ChatBody(_Body):
    messages: list[dict[str, str]] = Field(min_length=1)


def _openapi_body(model: type[BaseModel]) -> dict:
    # Request bodies are read raw (forwarded as bytes), so document them explicitly.
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def _error(status: int, message: str, param: str | None = None) -> Response:
    return Response(error_body(message, status, param=param), status_code=status, media_type="application/json")


async def _bounded(stream, deadline: float):
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise asyncio.TimeoutError()
        try:
            yield await asyncio.wait_for(stream.__anext__(), remaining)
        except StopAsyncIteration:
            return


def _failure_message(e: BaseException) -> tuple[int, str]:
    if isinstance(e, asyncio.TimeoutError):
        return 504, "the request timed out (request_timeout_s) waiting for the engine"
    logger.warning("request failed in a replica: %s: %s", type(e).__name__, e)
    return 503, f"the engine replica failed while serving this request ({type(e).__name__}); retry"


def _failure(e: BaseException) -> Response:
    status, message = _failure_message(e)
    return _error(status, message)


@serve.deployment(max_ongoing_requests=1000)
@serve.ingress(app)
class Router:
    def __init__(self, replica: DeploymentHandle, args: dict):
        self.args = AppArgs.model_validate(args)
        self.replica = replica
        self.pending = 0
        self.served = 0
        self.failed = 0

    # -- checks ---------------------------------------------------------------

    def _auth(self, request: Request) -> Response | None:
        if self.args.api_key is None:
            return None
        if request.headers.get("authorization", "") != f"Bearer {self.args.api_key}":
            return _error(401, "invalid or missing API key: send Authorization: Bearer <key>")
        return None

    async def _body(self, request: Request) -> bytes | Response:
        limit = self.args.max_request_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return _error(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                return _error(413, f"request body exceeds the limit of {limit} bytes")
        return bytes(body)

    def _check(self, body: bytes) -> Response | None:
        try:
            req = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            return _error(400, f"request body is not valid JSON: {e}")
        if not isinstance(req, dict):
            return _error(400, "request body must be a JSON object")
        model = req.get("model")
        if model is not None and model != self.args.model_name:
            return _error(404, f"the model `{model}` does not exist; this server serves `{self.args.model_name}`", "model")
        hs = req.get("return_hidden_states", False)
        if not isinstance(hs, bool):
            return _error(400, "return_hidden_states must be a boolean", "return_hidden_states")
        if hs and not self.args.enable_return_hidden_states:
            return _error(400, HS_DISABLED, "return_hidden_states")
        enc = req.get("hidden_states_encoding", "float")
        if enc not in ("float", "base64"):
            return _error(400, f"hidden_states_encoding must be 'float' or 'base64', not {enc!r}", "hidden_states_encoding")
        layers = req.get("hidden_states_layers")
        if layers is not None and (not isinstance(layers, list) or not layers
                                   or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)):
            return _error(400, "hidden_states_layers must be a non-empty list of integers (-1 = last layer)", "hidden_states_layers")
        position = req.get("hidden_states_position", "completion_end")
        if position not in ("completion_end", "prompt_end"):
            return _error(400, f"hidden_states_position must be 'completion_end' or 'prompt_end', not {position!r}",
                          "hidden_states_position")
        n = req.get("n", 1)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.args.max_n):
            return _error(400, f"n must be an integer from 1 to {self.args.max_n}", "n")
        return None

    # -- routes ---------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        if (denied := self._auth(request)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [
            {"id": self.args.model_name, "object": "model", "created": 0, "owned_by": "hidden-states-serve"}
        ]})

    @app.post("/v1/completions", openapi_extra=_openapi_body(CompletionBody))
    async def completions(self, request: Request) -> Response:
        return await self._forward("completions", request)

    @app.post("/v1/chat/completions", openapi_extra=_openapi_body(ChatBody))
    async def chat_completions(self, request: Request) -> Response:
        return await self._forward("chat", request)

    @app.get("/debug/stats")
    async def debug_stats(self, request: Request) -> Response:
        if (denied := self._auth(request)) is not None:
            return denied
        out = {"router": {"pending": self.pending, "served": self.served, "failed": self.failed}}
        try:
            out["replica"] = json.loads(await asyncio.wait_for(self.replica.stats.remote(), 30))
        except Exception as e:
            out["replica_error"] = str(e)
        return JSONResponse(out)

    async def _forward(self, route: str, request: Request) -> Response:
        if (denied := self._auth(request)) is not None:
            return denied
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        if (refused := self._check(body)) is not None:
            return refused
        deadline = time.monotonic() + self.args.request_timeout_s
        self.pending += 1
        stream = None
        try:
            stream, head = await self._open(route, body, deadline)
            if head.media_type != "text/event-stream":
                parts = [p async for p in _bounded(stream, deadline)]
                self._finish(head.status < 500)
                return Response(b"".join(parts), status_code=head.status, media_type=head.media_type,
                                headers={"x-replica-id": head.replica})
        except Exception as e:
            self._finish(False)
            if stream is not None:
                stream.cancel()
            return _failure(e)
        return StreamingResponse(self._relay(stream, deadline), media_type="text/event-stream",
                                 headers={"x-replica-id": head.replica})

    async def _open(self, route: str, body: bytes, deadline: float):
        """Sends the request; a replica that died before answering gets one retry elsewhere."""
        for attempt in (1, 2):
            stream = self.replica.options(stream=True).openai.remote(route, body)
            try:
                head = await asyncio.wait_for(stream.__anext__(), max(0.0, deadline - time.monotonic()))
                return stream, wire.HEAD_DECODER.decode(head)
            except (RayActorError, ActorUnavailableError) as e:
                stream.cancel()
                if attempt == 2:
                    raise
                logger.warning("replica died before answering (%s); retrying once", type(e).__name__)

    async def _relay(self, stream, deadline: float):
        ok = False
        try:
            async for chunk in _bounded(stream, deadline):
                yield chunk
            ok = True
        except Exception as e:
            status, message = _failure_message(e)
            yield b"data: " + error_body(message, status) + b"\n\n"
        finally:
            if not ok:
                stream.cancel()
            self._finish(ok)

    def _finish(self, ok: bool) -> None:
        self.pending -= 1
        if ok:
            self.served += 1
        else:
            self.failed += 1

    # -- Python handles -------------------------------------------------------

    async def complete(self, request: bytes) -> bytes:
        """For `deployments.client.complete(handle, ...)`: HandleCompletionRequest -> HandleReply bytes."""
        try:
            req = wire.REQUEST_DECODER.decode(request)
        except Exception as e:
            return wire.ENCODER.encode(HandleReply(error=HandleError(400, f"invalid request: {e}")))
        if req.return_hidden_states and not self.args.enable_return_hidden_states:
            return wire.ENCODER.encode(HandleReply(error=HandleError(400, HS_DISABLED)))
        if not 1 <= req.n <= self.args.max_n:
            return wire.ENCODER.encode(HandleReply(error=HandleError(400, f"n must be from 1 to {self.args.max_n}")))
        self.pending += 1
        try:
            reply = await asyncio.wait_for(self.replica.complete.remote(request), self.args.request_timeout_s)
            self._finish(True)
            return reply
        except Exception as e:
            self._finish(False)
            return wire.ENCODER.encode(HandleReply(error=HandleError(*_failure_message(e))))

