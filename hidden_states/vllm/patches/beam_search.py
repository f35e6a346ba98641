"""Ledger point 21: beam search's final beams extracted (frontend process, vLLM's OpenAI serving objects).

Why: vLLM's beam search runs one engine request per beam and step, which carries no tag of ours, and picks the
tokens across beams outside the engine core: no step's rows are a returned beam's. Its final beams are
extracted instead, one vector per returned beam, with room left for it.
How: `OpenAIServingCompletion.beam_search` and `OpenAIServingChat.beam_search` are wrapped on the serving
instances (`serving`, from frontend/openai.py when hidden states are on): the wrapper (frontend/openai.py's
`_wrap_beam_search`, the product logic: refusals, room, the extraction of the beams) calls vLLM's own.
Relies on: `beam_search(prompt, request_id, params, lora_request, ...)` on both serving classes, and chat
completion calling `self.beam_search(` (so the instance's wrapper is the one called).
Remove when: vLLM's beam search returns its beams' hidden states, or is refused with hidden states.
"""

from __future__ import annotations

from typing import Any

from hidden_states.vllm.patches.drift import _SERVING_CHAT, _SERVING_CMPL, Symbol


def serving(serving: Any, beam_search: Any, **_: Any) -> None:
    """`beam_search` (which calls the instance's own, read before) in place of `serving.beam_search`."""
    serving.beam_search = beam_search


RELIED: tuple[Symbol, ...] = (
    Symbol(_SERVING_CMPL, "21", kind="open instances"),  # beam_search set on the instance
    Symbol(_SERVING_CHAT, "21", kind="open instances"),
    Symbol(f"{_SERVING_CMPL}.beam_search", "21", ("prompt", "request_id", "params", "lora_request"), "wrapped"),
    Symbol(f"{_SERVING_CHAT}.beam_search", "21", ("prompt", "request_id", "params", "lora_request"), "wrapped"),
    Symbol(f"{_SERVING_CHAT}._create_chat_completion", "21", kind="method", mentions=("self.beam_search(",)),
)
