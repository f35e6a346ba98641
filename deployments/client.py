"""Python callers: complete() over a Serve handle, typed results, numpy vectors.

    from deployments.client import complete
    handle = serve.get_app_handle("hidden-states")
    result = complete(handle, "Hello!", max_tokens=16)       # or await complete_async(...)
    result.choices[0].hidden_states  # numpy float32 [hidden_size]
    check = verify(handle, prompt=ids, compare={"vector": claimed.tolist()})   # POST /v1/hidden_states

Only msgspec bytes cross the handle (deployments/wire.py). A failed request raises
`HandleRequestError` with the status HTTP would give it; a caller that stops waiting cancels it.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np

from deployments.wire import ENCODER, REPLY_BODY_DECODER, REPLY_DECODER, HandleCompletionRequest, HandleReply, from_wire
from hidden_states.interface import Completion
from hidden_states.protocol import widen


class HandleRequestError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


def _request(prompt: str | list[int] | None, messages: list[dict] | None, **kw: Any) -> bytes:
    """The request's bytes; the hidden-states fields as over HTTP, in `hidden_states`."""
    fields = {k: kw.pop(k) for k in list(kw) if k.startswith(("hidden_states", "return_hidden"))}
    fields = {k: v.model_dump() if hasattr(v, "model_dump") else v for k, v in fields.items()}
    # proofs, or heads' outputs, or else the vector
    fields.setdefault(
        "return_hidden_states", fields.get("hidden_states_proof") is None and not fields.get("hidden_states_heads")
    )
    if (prompt is None) == (messages is None):
        raise TypeError("complete() takes a prompt (text or token ids) or messages=[...] (chat), not both")
    return ENCODER.encode(
        HandleCompletionRequest(
            prompt=prompt, messages=None if messages is None else list(messages), hidden_states=fields, **kw
        )
    )


def _result(raw: bytes) -> Completion:
    reply: HandleReply = REPLY_DECODER.decode(raw)
    if reply.error is not None:
        raise HandleRequestError(reply.error.status, reply.error.message)
    c = reply.ok
    return Completion(
        request_id=c.request_id,
        prompt_token_ids=tuple(c.prompt_token_ids),
        choices=tuple(from_wire(ch) for ch in c.choices),
    )


def _wait(response: Any, timeout_s: float) -> bytes:
    """A handle call's answer; a caller that stops waiting cancels the call."""
    try:
        return response.result(timeout_s=timeout_s)
    except BaseException:
        _cancel(response)
        raise


async def _await(response: Any) -> bytes:
    try:
        return await response
    except BaseException:  # e.g. the caller's task was cancelled
        _cancel(response)
        raise


def _cancel(response: Any) -> None:
    try:  # best effort, as Serve's is: never masks what ended the wait
        response.cancel()
    except Exception:
        pass


def complete(
    handle: Any,
    prompt: str | list[int] | None = None,
    *,
    messages: list[dict] | None = None,
    timeout_s: float = 600,
    **kw: Any,
) -> Completion:
    """Blocking. A `prompt` (text or token ids) or chat `messages`. Defaults unlike HTTP's: greedy,
    max_tokens 16, return_hidden_states true. kw as over HTTP (model: a LoRA adapter; the
    hidden_states_* fields). Vectors are numpy: [D] for one position, [n, D] at `choice.positions`
    for several, in the dtype asked (bfloat16: float32 of its values, `choice.dtype` says so);
    with topk, `hidden_states` holds values and `hidden_states_indices` int32 indices; every layer is
    in `hidden_states_by_layer`; with a proof, `choice.proofs`; with hidden_states_heads, `choice.heads`
    (and no rows unless return_hidden_states=True). Raises HandleRequestError (400 too
    large, 404 unknown model, ...)."""
    return _result(_wait(handle.complete.remote(_request(prompt, messages, **kw)), timeout_s))


async def complete_async(
    handle: Any, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None, **kw: Any
) -> Completion:
    return _result(await _await(handle.complete.remote(_request(prompt, messages, **kw))))


def _verify_request(fields: dict[str, Any]) -> bytes:
    body = {k: v for k, v in fields.items() if v is not None}
    body["hidden_states_encoding"] = "base64"  # exact float32 bytes across the handle
    return json.dumps(body).encode()


def _verify_result(raw: bytes) -> dict[str, Any]:
    reply = REPLY_BODY_DECODER.decode(raw)
    out = json.loads(reply.body)
    if reply.head.status != 200:
        raise HandleRequestError(reply.head.status, out.get("error", {}).get("message", reply.body.decode()))

    meta = out.get("hidden_states_meta") or {}
    dtype, shape = meta.get("dtype", "float32"), meta.get("shape")

    def array(b64: str, raw_dtype: str) -> np.ndarray:
        a = np.frombuffer(base64.b64decode(b64), raw_dtype)
        return a.reshape(shape) if shape else a.copy()

    def vec(value: str | dict) -> np.ndarray | dict[str, np.ndarray]:
        """Base64 rows as numpy, in the dtype asked (bfloat16: float32 of its values), shaped as the meta says."""
        if isinstance(value, dict):  # top-k: {"indices", "values"}
            return {"indices": array(value["indices"], "<i4"), "values": vec(value["values"])}
        if dtype == "bfloat16":
            return widen(array(value, "<u2"), "bfloat16")
        return array(value, "<f2" if dtype == "float16" else "<f4").copy()

    if "hidden_states" in out:
        out["hidden_states"] = vec(out["hidden_states"])
    if "hidden_states_by_layer" in out:
        out["hidden_states_by_layer"] = {int(k): vec(v) for k, v in out["hidden_states_by_layer"].items()}
    return out


def verify(handle: Any, *, timeout_s: float = 600, **fields: Any) -> dict[str, Any]:
    """POST /v1/hidden_states over a handle (blocking), fields as over HTTP. Vectors come back as numpy
    ([D] or [n, D], bfloat16 as float32; top-k as {"indices", "values"})."""
    return _verify_result(_wait(handle.hidden_states.remote(_verify_request(fields)), timeout_s))


async def verify_async(handle: Any, **fields: Any) -> dict[str, Any]:
    return _verify_result(await _await(handle.hidden_states.remote(_verify_request(fields))))
