"""The HTTP surface both ingresses share: request models, cheap checks, OpenAI-style errors, counters.

Module-level only: Serve serializes a deployment class when its decorator runs.
An admitted request is `pending` until it ends, exactly once, as one of
- `served`: an answer below 500 delivered (a stream: its `data: [DONE]` sent);
- `failed`: a 5xx, or a stream with a 5xx SSE error event (a 4xx event, a refusal once the stream began, counts served);
- `cancelled`: the client went away first (the replica's call and the engine request are
  cancelled with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from deployments import metrics
from deployments.config import AppArgs
from deployments.wire import HandleCompletionRequest, HandleError
from hidden_states import errors, media, params
from hidden_states.errors import Refused
from hidden_states.openai_format import error_body
from hidden_states.params import HiddenStatesFields
from hidden_states.verify import VerifyRequest

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"  # an OpenAI stream's last event: a client may hang up right after it
SSE_ERROR = b'data: {"error"'  # an error event mid-stream (errors.sse_error, vLLM's own)

# How a request ended (the counters of /debug/stats): see the module docstring.
SERVED, FAILED, CANCELLED = "served", "failed", "cancelled"


class _Body(HiddenStatesFields):
    """The fields this server checks itself; vLLM's request models validate the rest in the replica."""

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
    messages: list[dict[str, Any]] = Field(
        min_length=1,
        description="OpenAI chat messages, as vLLM takes them: a role, and content as a string or a "
        "list of content parts; tool calls and the rest of each message pass through",
    )


def failure(e: BaseException) -> Response:
    """The OpenAI-style error answer to a request that failed after it was admitted (hidden_states/errors.py)."""
    status, body = errors.error_response(e)
    return Response(body, status_code=status, media_type="application/json")


def handle_failure(e: BaseException) -> HandleError:
    """The same, for a Python-handle caller (deployments/client.py raises it as HandleRequestError)."""
    f = errors.logged_status_of(e)
    return HandleError(f.status, f.message)


def error_event_status(chunk: bytes) -> int:
    """The status an SSE error event carries (`{"error": {"code": ...}}`); 500 if it says none. A
    refusal that reaches a client as an event once the stream started (vLLM's) is a 4xx, as whole."""
    try:
        code = json.loads(chunk.split(b"\n\n", 1)[0][len(b"data: ") :])["error"].get("code")
    except (ValueError, KeyError, AttributeError, TypeError):
        return 500
    return code if isinstance(code, int) and 400 <= code < 600 else 500


def outcome(status: int) -> str:
    """How a request that got an answer with this status counts."""
    return SERVED if status < 500 else FAILED


class Stream(StreamingResponse):
    """A streamed answer (its body a `Relay`) closed however the response ends: Starlette leaves an
    unfinished body to the garbage collector, so closing here ends the request at once."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except Exception as e:
            # Serve cancelled the request (its client went away) while Starlette listened for the
            # disconnect: nothing is left to answer, and re-raising only logs a traceback per hang-up.
            if type(e).__name__ != "TaskCancelledError":
                raise
        finally:
            with anyio.CancelScope(shield=True):  # the task may be being cancelled: close anyway
                await self.body_iterator.aclose()


class Relay:
    """A stream to the client, ending by `deadline`: the one relay of both ingresses. `aclose()` ends
    it once, started or not: closes `parts` and passes `finish` SERVED (`[DONE]` sent), FAILED (an
    error event sent) or CANCELLED."""

    def __init__(self, parts: AsyncIterator[bytes], deadline: float, finish: Callable[[str], None]):
        self.parts, self.deadline, self.finish = parts, deadline, finish
        self.how = CANCELLED  # unless it gets further: the client went away
        self._gen: AsyncIterator[bytes] | None = None
        self._ended = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        self._gen = self._run()
        return self._gen

    async def _run(self) -> AsyncIterator[bytes]:
        failed = False  # an error event went out (vLLM may still end the stream with [DONE])
        try:
            async with contextlib.aclosing(until(self.parts, self.deadline)) as chunks:
                async for chunk in chunks:
                    failed = failed or (chunk.startswith(SSE_ERROR) and error_event_status(chunk) >= 500)
                    if chunk.endswith(SSE_DONE):  # delivered, even if the client hangs up before the stream ends
                        self.how = FAILED if failed else SERVED
                    yield chunk
            self.how = FAILED if failed else SERVED
        except Exception as e:
            self.how = FAILED
            yield errors.sse_error(e)
        finally:
            await self._end()

    async def aclose(self) -> None:
        if self._gen is not None:
            await self._gen.aclose()
        await self._end()

    async def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        try:
            await self.parts.aclose()
        finally:
            self.finish(self.how)


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
    """Documents the raw-read request bodies, nested models inlined (no `$defs` refs)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline({**defs[ref.removeprefix("#/$defs/")], **{k: v for k, v in node.items() if k != "$ref"}})
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


def error(status: int, message: str, param: str | None = None) -> Response:
    return Response(error_body(message, status, param=param), status_code=status, media_type="application/json")


API_KEY_ENV = "HIDDEN_STATES_API_KEY"  # the key out of the config (which Ray's dashboard shows), as vLLM's VLLM_API_KEY


def api_key(args: AppArgs) -> str | None:
    """The key /v1 routes require: `api_key` or the environment variable in the ingress's process;
    both set and different is a start-up error."""
    env = os.environ.get(API_KEY_ENV) or None
    if env is not None and args.api_key is not None and not secrets.compare_digest(env.encode(), args.api_key.encode()):
        raise ValueError(f"api_key in the app's args and ${API_KEY_ENV} differ: set one")
    return env or args.api_key


def auth(args: AppArgs, request: Request) -> None:
    """Raises Refused (401) unless the request carries the key, where one is set."""
    key = api_key(args)
    if key is None:
        return
    given = request.headers.get("authorization", "").encode()
    if not secrets.compare_digest(given, b"Bearer " + key.encode()):  # constant time: no timing oracle on the key
        raise Refused(401, "invalid or missing API key: send Authorization: Bearer <key>")


async def read_body(args: AppArgs, request: Request) -> bytes:
    """The body, read up to the limit (Refused, 413, beyond it)."""
    limit = args.max_request_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Refused(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise Refused(413, f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


def check(args: AppArgs, body: bytes, route: str = "completions") -> tuple[dict, params.HiddenStatesFields]:
    """The parsed body and its spec (params.parse_fields); Refused if it is refused. /v1/hidden_states's body
    is the replica's to parse: its spec here is params.NOTHING."""
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise Refused(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise Refused(400, "request body must be a JSON object")
    model = req.get("model")
    if model is not None and model not in args.served_model_names:  # the model, or one of its LoRA adapters
        raise Refused(404, params.unknown_model(model, args.served_model_names), "model")
    try:
        spec = (
            params.NOTHING
            if route == "hidden_states"
            else params.parse_fields(req, enabled=args.enable_return_hidden_states)
        )
        params.check_n(req.get("n", 1), args.max_n)
        if route in ("chat", "hidden_states"):
            check_media(args, req)
    except params.HiddenStatesRequestError as e:
        raise Refused(400, str(e), e.param) from None
    return req, spec


def check_media(args: AppArgs, req: dict) -> None:
    """A request's image and audio parts (hidden_states/media.py), before any engine work."""
    media.check_media(
        req,
        max_media_bytes=args.max_media_bytes,
        remote_media=args.remote_media,
        local_media=bool(args.engine.get("allowed_local_media_path")),
    )


async def admit(
    args: AppArgs, request: Request, route: str = "completions"
) -> tuple[bytes, dict, params.HiddenStatesFields]:
    """auth, body limit, checks: (raw body, parsed body, its spec); a refusal is counted by status and raised
    (Refused: the routes answer it with `failure`)."""
    try:
        auth(args, request)
        body = await read_body(args, request)
        return (body, *check(args, body, route))
    except Refused as e:
        metrics.refused(e.status)
        raise


def models_list(args: AppArgs, engine_card: dict | None = None) -> Response:
    # As vLLM's /v1/models: the model, then each LoRA adapter with its folder (`root`) and base (`parent`),
    # each with the engine's max_model_len (prompt + completion tokens; None while no engine answered)
    # and the heads a request may read (hidden_states_heads; an adapter's requests read them too).
    engine_card = engine_card or {}
    card = {
        "object": "model",
        "created": 0,
        "owned_by": "hidden-states-serve",
        "max_model_len": engine_card.get("max_model_len"),
        "heads": engine_card.get("heads", []),
        "steering_vectors": engine_card.get("steering_vectors", []),
        "capture_layers": engine_card.get("capture_layers"),
    }
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {"id": args.model_name, **card, "parent": None},
                *({"id": m.name, **card, "root": m.path, "parent": args.model_name} for m in args.lora_modules),
            ],
        }
    )


def asgi_app(routes_app: FastAPI, instance: Any) -> FastAPI:
    """The ingress routes on a plain FastAPI app, without Serve (unit tests over ASGI)."""
    from fastapi.routing import APIRoute

    bound = FastAPI(title=routes_app.title)
    for route in routes_app.routes:
        if isinstance(route, APIRoute):  # the route's own function, as Serve calls it (a deployment's handle
            # method of the same name, e.g. `hidden_states`, does not shadow it)
            bound.add_api_route(route.path, route.endpoint.__get__(instance), methods=list(route.methods))
    return bound


def ingress_routes(app: FastAPI, kind: str) -> type:
    """The routes of an ingress deployment, registered on `app`, as a base class.

    The deployment supplies `args` (AppArgs), `_serve(route, body, req, spec)`, `_replica_stats()`,
    `_engine_card()` and optionally `_not_ready()`; it gets the routes, the relay and the counters.
    """

    class IngressRoutes:
        pending = served = failed = cancelled = 0

        @app.get("/health")
        async def health(self) -> Response:
            if (why := await self._not_ready()) is not None:
                return error(503, why)
            return Response(status_code=200)

        @app.get("/v1/models")
        async def models(self, request: Request) -> Response:
            try:
                auth(self.args, request)
            except Refused as e:
                return failure(e)
            if (why := await self._not_ready()) is not None:
                return error(503, why)
            return models_list(self.args, await self._engine_card())

        @app.post("/v1/completions", openapi_extra=openapi_body(CompletionBody))
        async def completions(self, request: Request) -> Response:
            return await self._admitted("completions", request)

        @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatBody))
        async def chat_completions(self, request: Request) -> Response:
            return await self._admitted("chat", request)

        @app.post("/v1/hidden_states", openapi_extra=openapi_body(VerifyRequest))
        async def hidden_states(self, request: Request) -> Response:
            """The true final-token vector of given tokens, optionally compared with a claimed one."""
            return await self._admitted("hidden_states", request)

        @app.post("/tokenize")
        async def tokenize(self, request: Request) -> Response:
            """vLLM's: a prompt or messages as the token ids a completion would see."""
            return await self._admitted("tokenize", request)

        @app.post("/detokenize")
        async def detokenize(self, request: Request) -> Response:
            """vLLM's: token ids as text."""
            return await self._admitted("detokenize", request)

        @app.get("/debug/stats")
        async def debug_stats(self, request: Request) -> Response:
            try:
                auth(self.args, request)
            except Refused as e:
                return failure(e)
            out = {
                "ingress": {
                    "kind": kind,
                    "pending": self.pending,
                    "served": self.served,
                    "failed": self.failed,
                    "cancelled": self.cancelled,
                    "specs_parsed": params.PARSED[0],
                }
            }
            return JSONResponse(out | await self._replica_stats())

        async def _admitted(self, route: str, request: Request) -> Response:
            """The request admitted (`admit`) and served by the deployment's `_serve(route, body, req, spec)`,
            or its refusal answered."""
            try:
                body, req, spec = await admit(self.args, request, route)
            except Refused as e:
                return failure(e)
            return await self._serve(route, body, req, spec)

        async def _engine_card(self) -> dict | None:
            """What /v1/models says of the engine ({max_model_len, heads}), or None if no engine says."""
            return None

        async def _not_ready(self) -> str | None:
            """Why no engine can serve now (a 503's message), or None."""
            return None

        def _relay(self, parts: AsyncIterator[bytes], deadline: float) -> Relay:
            """The streamed answer's body: `parts` relayed, and the request counted when it ends."""
            return Relay(parts, deadline, self._finish)

        def _finish(self, how: str) -> None:
            """One admitted request ended: SERVED, FAILED or CANCELLED."""
            self.pending -= 1
            setattr(self, how, getattr(self, how) + 1)

    return IngressRoutes


def handle_spec(args: AppArgs, req: HandleCompletionRequest) -> params.HiddenStatesFields:
    """The same checks for Python-handle requests (`deployments.client`): the request's spec; Refused if refused
    (`handle_failure` answers it)."""
    if (req.prompt is None) == (req.messages is None):
        raise Refused(400, "send exactly one of `prompt` (text or token ids) and `messages` (chat)")
    if req.messages is not None and not (
        req.messages and all(isinstance(m, dict) and "role" in m for m in req.messages)
    ):
        raise Refused(400, '`messages` must be a non-empty list of chat messages ({"role", "content"})')
    try:
        spec = params.parse_fields(req.hidden_states, enabled=args.enable_return_hidden_states)
        params.check_n(req.n, args.max_n)
        if req.messages is not None:
            check_media(args, {"messages": req.messages})
    except params.HiddenStatesRequestError as e:
        raise Refused(400, str(e)) from None
    if req.model is not None and req.model not in args.served_model_names:
        raise Refused(404, params.unknown_model(req.model, args.served_model_names))
    return spec
