"""One table: which HTTP status and OpenAI error type an exception becomes.

Every surface that answers a failure (HTTP, Python handles, SSE error events, the replica's
OpenAI layer) asks `status_of`, so a failure gets the same status whichever way it came.

    Refused (the ingress's own checks: auth, body size, JSON, model, n, media)
                                                   its status  (the status's name)Error (+ its `param`)
    HiddenStatesRequestError, HiddenStatesDisabledError  400  BadRequestError (+ its `param`)
    UnknownModelError (neither the model nor an adapter)  404  NotFoundError (param model)
    any other ValueError                                  400  BadRequestError
    any TimeoutError                                      504  TimeoutError
    MissingHiddenStatesError                              500  InternalServerError (param return_hidden_states)
    HookFaultError (a hook of ours raised for the request) 500  InternalServerError (param return_hidden_states)
    Ray's RayActorError, ActorUnavailableError (and subclasses),
    vLLM's EngineDeadError: the replica or its engine is gone
                                                          503  ServiceUnavailableError ("...; retry")
    anything else                                         500  InternalServerError

A RayTaskError is judged by the exception it wraps. Ray and vLLM classes are matched by name
along the MRO, so this module imports neither. `asyncio.CancelledError` is not in the table.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import NamedTuple

from hidden_states.interface import HookFaultError, MissingHiddenStatesError
from hidden_states.openai_format import error_body
from hidden_states.params import HiddenStatesRequestError, UnknownModelError

logger = logging.getLogger(__name__)

TIMED_OUT = "the request timed out (request_timeout_s) waiting for the engine"
GONE = frozenset({"RayActorError", "ActorUnavailableError", "EngineDeadError"})  # matched by class name


class Refused(Exception):
    """A request the ingress refuses before any engine work (401, 404, 413, 400), with its status."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class Failure(NamedTuple):
    status: int
    type: str  # OpenAI's `error.type`
    message: str
    param: str | None = None


def replica_gone(e: BaseException) -> bool:
    """The replica (a Ray actor) or its engine died or cannot be reached: another replica may serve a retry."""
    return any(cls.__name__ in GONE for cls in type(cause(e)).__mro__)


def cause(e: BaseException) -> BaseException:
    """What a Ray task error wraps (its message would carry the remote traceback), else `e`."""
    while any(c.__name__ == "RayTaskError" for c in type(e).__mro__) and isinstance(
        getattr(e, "cause", None), BaseException
    ):
        e = e.cause
    return e


def status_of(e: BaseException) -> Failure:
    """(status, OpenAI error type, message, param) for a request that failed with `e` (the table above)."""
    e = cause(e)
    if isinstance(e, Refused):
        return Failure(e.status, HTTPStatus(e.status).phrase.replace(" ", "") + "Error", e.message, e.param)
    if isinstance(e, HiddenStatesRequestError):
        return Failure(400, "BadRequestError", str(e), e.param)
    if isinstance(e, ValueError):
        return Failure(400, "BadRequestError", str(e))
    if isinstance(e, UnknownModelError):
        return Failure(404, "NotFoundError", str(e), "model")
    if isinstance(e, TimeoutError):  # asyncio.TimeoutError is TimeoutError since Python 3.11
        return Failure(504, "TimeoutError", str(e) or TIMED_OUT)
    if isinstance(e, (MissingHiddenStatesError, HookFaultError)):
        return Failure(500, "InternalServerError", str(e), "return_hidden_states")
    if replica_gone(e):
        return Failure(
            503,
            "ServiceUnavailableError",
            f"the engine replica failed while serving this request ({type(e).__name__}); retry",
        )
    return Failure(500, "InternalServerError", f"{type(e).__name__}: {e}")


def logged_status_of(e: BaseException) -> Failure:
    """`status_of`, logging server-side failures (5xx) once, where they are turned into an answer."""
    f = status_of(e)
    if f.status >= 500:
        logger.warning("request failed: %s (%s: %s)", f.status, type(e).__name__, e)
    return f


def error_response(e: BaseException) -> tuple[int, bytes]:
    """(status, OpenAI error JSON): a whole answer, e.g. what an OpenAI route yields for `e`."""
    f = logged_status_of(e)
    return f.status, error_body(f.message, f.status, f.type, f.param)


def sse_error(e: BaseException) -> bytes:
    """The same error as one SSE event: how a stream that already started fails."""
    return b"data: " + error_response(e)[1] + b"\n\n"
