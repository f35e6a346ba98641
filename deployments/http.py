"""The HTTP surface both ingresses share: request models, cheap checks, OpenAI-style errors.

Whichever deployment takes HTTP (the Router by default, the EngineReplica with
`ingress: replica`) authenticates, bounds the body and refuses what the server
cannot do here, before any engine work. Module-level only: Serve serializes a
deployment class when its decorator runs, capturing only names defined by then.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from deployments import metrics
from deployments.config import AppArgs
from hidden_states.openai_format import error_body
from deployments.wire import HandleCompletionRequest, HandleError
from hidden_states import params
from hidden_states.params import HiddenStatesFields
from hidden_states.verify import HiddenStatesRequest

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"  # an OpenAI stream's last event: a client may hang up right after it

TIMED_OUT = "the request timed out (request_timeout_s) waiting for the engine"

class _Body(HiddenStatesFields):
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
    return_token_ids: bool | None = None


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]


class ChatBody(_Body):
    messages: list[dict[str, str]] = Field(min_length=1)


def failure(e: BaseException) -> tuple[int, str]:
    """(status, message) for a request that failed after it was admitted."""
    if isinstance(e, asyncio.TimeoutError):
        return 504, TIMED_OUT
    logger.warning("request failed in a replica: %s: %s", type(e).__name__, e)
    return 503, f"the engine replica failed while serving this request ({type(e).__name__}); retry"


async def until(parts: AsyncIterator, deadline: float) -> AsyncIterator:
    """`parts` item by item, raising TimeoutError once `deadline` (time.monotonic) passes."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError()
        try:
            yield await asyncio.wait_for(anext(parts), remaining)
        except StopAsyncIteration:
            return


def openapi_body(model: type[BaseModel]) -> dict:
    # Request bodies are read raw (forwarded as bytes), so document them explicitly.
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def error(status: int, message: str, param: str | None = None) -> Response:
    return Response(error_body(message, status, param=param), status_code=status, media_type="application/json")


def auth(args: AppArgs, request: Request) -> Response | None:
    if args.api_key is None:
        return None
    if request.headers.get("authorization", "") != f"Bearer {args.api_key}":
        return error(401, "invalid or missing API key: send Authorization: Bearer <key>")
    return None


async def read_body(args: AppArgs, request: Request) -> bytes | Response:
    limit = args.max_request_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return error(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            return error(413, f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


def check(args: AppArgs, body: bytes) -> Response | dict:
    """The parsed body, or the refusal."""
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        return error(400, f"request body is not valid JSON: {e}")
    if not isinstance(req, dict):
        return error(400, "request body must be a JSON object")
    model = req.get("model")
    if model is not None and model != args.model_name:
        return error(404, f"the model `{model}` does not exist; this server serves `{args.model_name}`", "model")
    try:
        params.check_fields(req, enabled=args.enable_return_hidden_states)
    except params.HiddenStatesRequestError as e:
        return error(400, str(e), e.param)
    n = req.get("n", 1)
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= args.max_n):
        return error(400, f"n must be an integer from 1 to {args.max_n}", "n")
    return req


def route_refusal(args: AppArgs, route: str) -> bytes | None:
    """An error body if this server cannot serve the route at all."""
    if route == "hidden_states" and not args.enable_return_hidden_states:
        return error_body(params.DISABLED, 400, param="return_hidden_states")
    return None


async def admit(args: AppArgs, request: Request, route: str = "completions") -> tuple[bytes, dict] | Response:
    """auth, body limit, checks: (raw body, parsed body) or the refusal (counted by status)."""
    out = await _admit(args, request, route)
    if isinstance(out, Response):
        metrics.refused(out.status_code)
    return out


async def _admit(args: AppArgs, request: Request, route: str) -> tuple[bytes, dict] | Response:
    if (denied := auth(args, request)) is not None:
        return denied
    if (refused := route_refusal(args, route)) is not None:
        return Response(refused, status_code=400, media_type="application/json")
    body = await read_body(args, request)
    if isinstance(body, Response):
        return body
    req = check(args, body)
    if isinstance(req, Response):
        return req
    return body, req


def models_list(args: AppArgs, request: Request) -> Response:
    if (denied := auth(args, request)) is not None:
        return denied
    return JSONResponse({"object": "list", "data": [
        {"id": args.model_name, "object": "model", "created": 0, "owned_by": "hidden-states-serve"}
    ]})


def asgi_app(routes_app: FastAPI, instance: Any) -> FastAPI:
    """The routes registered on `routes_app` by `ingress_routes`, bound to one instance,
    on a plain FastAPI app: the ingress without Serve, for unit tests over ASGI."""
    from fastapi.routing import APIRoute

    bound = FastAPI(title=routes_app.title)
    for route in routes_app.routes:
        if isinstance(route, APIRoute):
            bound.add_api_route(route.path, getattr(instance, route.endpoint.__name__), methods=list(route.methods))
    return bound


def ingress_routes(app: FastAPI, kind: str) -> type:
    """The routes of an ingress deployment, registered on `app`, as a base class.

    The deployment supplies `args` (AppArgs), `_serve(route, request)`,
    `_replica_stats()` and, if it can be up without an engine, `_not_ready()`; it gets the routes and the in-flight counters that
    `/debug/stats` reports (a test checks that nothing is left pending).
    """

    class IngressRoutes:
        pending = served = failed = 0

        @app.get("/health")
        async def health(self) -> Response:
            if (why := await self._not_ready()) is not None:
                return error(503, why)
            return Response(status_code=200)

        @app.get("/v1/models")
        async def models(self, request: Request) -> Response:
            if (denied := auth(self.args, request)) is not None:
                return denied
            if (why := await self._not_ready()) is not None:
                return error(503, why)
            return models_list(self.args, request)

        @app.post("/v1/completions", openapi_extra=openapi_body(CompletionBody))
        async def completions(self, request: Request) -> Response:
            return await self._serve("completions", request)

        @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatBody))
        async def chat_completions(self, request: Request) -> Response:
            return await self._serve("chat", request)

        @app.post("/v1/hidden_states", openapi_extra=openapi_body(HiddenStatesRequest))
        async def hidden_states(self, request: Request) -> Response:
            """The true final-token vector of given tokens, optionally compared with a claimed one."""
            return await self._serve("hidden_states", request)

        @app.get("/debug/stats")
        async def debug_stats(self, request: Request) -> Response:
            if (denied := auth(self.args, request)) is not None:
                return denied
            out = {"ingress": {"kind": kind, "pending": self.pending, "served": self.served, "failed": self.failed}}
            return JSONResponse(out | await self._replica_stats())

        async def _not_ready(self) -> str | None:
            """Why no engine can serve now (a 503's message), or None. An engine replica
            that answers is itself ready; the Router asks Serve (deployments/readiness.py)."""
            return None

        async def _relay(self, parts: AsyncIterator[bytes], deadline: float) -> AsyncIterator[bytes]:
            """A streamed answer to the client, ending by `deadline`; the one relay of both
            ingresses. `parts` is closed when the relay ends, however it ends."""
            ok = False
            try:
                async for chunk in until(parts, deadline):
                    ok = chunk.endswith(SSE_DONE)  # delivered, even if the client hangs up before the stream ends
                    yield chunk
                ok = True
            except Exception as e:
                status, message = failure(e)
                yield b"data: " + error_body(message, status) + b"\n\n"
            finally:
                await parts.aclose()
                self._finish(ok)

        def _finish(self, ok: bool) -> None:
            self.pending -= 1
            if ok:
                self.served += 1
            else:
                self.failed += 1

    return IngressRoutes


def handle_refusal(args: AppArgs, req: HandleCompletionRequest) -> HandleError | None:
    """The same checks for Python-handle requests (`deployments.client`)."""
    try:
        fields = {name: getattr(req, name) for name in req.__struct_fields__}  # defaults included
        params.check_fields(fields, enabled=args.enable_return_hidden_states)
    except params.HiddenStatesRequestError as e:
        return HandleError(400, str(e))
    if not 1 <= req.n <= args.max_n:
        return HandleError(400, f"n must be from 1 to {args.max_n}")
    return None
