"""Python callers: complete() over a Serve handle, typed results, numpy vectors.

    from ray import serve
    from deployments.client import complete
    handle = serve.get_app_handle("hidden-states")
    result = complete(handle, "Hello!", max_tokens=16)       # blocking
    result = await complete_async(handle, "Hello!")          # in async code
    result.choices[0].hidden_states  # numpy float32 [hidden_size]

Only msgspec bytes cross the handle (deployments/wire.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deployments.wire import ENCODER, REPLY_DECODER, HandleCompletionRequest, HandleReply
from hidden_states.engine import Completion, CompletionChoice, ExtractionStats


class HandleRequestError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


def _request(prompt: str | list[int], **kw: Any) -> bytes:
    return ENCODER.encode(HandleCompletionRequest(prompt=prompt, **kw))


def _result(raw: bytes) -> Completion:
    reply: HandleReply = REPLY_DECODER.decode(raw)
    if reply.error is not None:
        raise HandleRequestError(reply.error.status, reply.error.message)
    c = reply.ok
    total = len(c.prompt_token_ids)
    return Completion(
        request_id=c.request_id,
        prompt_token_ids=tuple(c.prompt_token_ids),
        choices=tuple(
            CompletionChoice(
                ch.index, ch.text, tuple(ch.token_ids), ch.finish_reason,
                None if ch.hidden_states is None else np.frombuffer(ch.hidden_states, "<f4").copy(),
                None if ch.hidden_states is None else ExtractionStats(total + len(ch.token_ids), ch.cached_tokens, 0.0),
                {layer: np.frombuffer(b, "<f4").copy() for layer, b in ch.hidden_states_by_layer.items()} or None,
            )
            for ch in c.choices
        ),
    )


def complete(handle: Any, prompt: str | list[int], *, timeout_s: float = 600, **kw: Any) -> Completion:
    """Blocking. kw: max_tokens, temperature, top_p, seed, n, stop, return_hidden_states,
    hidden_states_layers (default [-1]), hidden_states_position ("completion_end" | "prompt_end")."""
    return _result(handle.complete.remote(_request(prompt, **kw)).result(timeout_s=timeout_s))


async def complete_async(handle: Any, prompt: str | list[int], **kw: Any) -> Completion:
    return _result(await handle.complete.remote(_request(prompt, **kw)))
