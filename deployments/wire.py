"""What travels between Ray processes: msgspec structs as bytes, never pickled objects.

- Router -> replica: the raw HTTP body, and the spec's JSON (`HiddenStatesFields.to_json`).
- Replica -> Router: a `ResponseHead` then SSE chunks (streaming), or one `Reply`.
- Handle callers <-> Router <-> replica: `HandleCompletionRequest` / `HandleCompletion`;
  vectors as raw little-endian bytes (`to_wire` / `from_wire`).

Every message names its wire version (`WIRE`, a msgspec tag); another version is refused with
`WireVersionError` naming both. Bump `WIRE_VERSION` whenever a struct here changes shape.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from hidden_states.interface import CompletionChoice, ExtractionStats
from hidden_states.protocol import narrow, numpy_dtype, widen


WIRE_VERSION = 3
WIRE = f"hidden-states-wire/{WIRE_VERSION}"
_VERSIONED = dict(tag=WIRE, tag_field="wire")


class WireVersionError(ValueError):
    """A message of another wire version: its sender runs another release of this project."""


class ResponseHead(msgspec.Struct, array_like=True, gc=False, **_VERSIONED):
    status: int
    media_type: str
    replica: str


class Reply(msgspec.Struct, array_like=True, gc=False, **_VERSIONED):
    head: ResponseHead
    body: bytes


class HandleCompletionRequest(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True, **_VERSIONED):
    prompt: str | list[int] | None = None  # exactly one of prompt and messages
    messages: list[dict[str, Any]] | None = None  # chat: rendered with the model's chat template, as over HTTP
    model: str | None = None  # a LoRA adapter's name (lora_modules); None or the model's own: the base model
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = []
    # The request's hidden-states fields as a JSON object, as over HTTP (params.HiddenStatesFields, parsed
    # once by the Router: params.parse_fields); a handle asks for the final token's vector by default.
    hidden_states: dict[str, Any] = msgspec.field(default_factory=lambda: {"return_hidden_states": True})


class HandleStats(msgspec.Struct, array_like=True, gc=False):
    """A choice's work as the engine counted it (interface.ExtractionStats)."""

    tokens: int
    cached_tokens: int
    seconds: float
    via: str


class HandleChoice(msgspec.Struct, array_like=True, gc=False):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    hidden_states: bytes | None  # little-endian float32, the last layer (one-vector requests)
    stats: HandleStats | None = None  # None: no rows computed for it (prompt_end, or none asked)
    hidden_states_by_layer: dict[int, bytes] = {}
    # Rows (params.rowwise: a position other than completion_end/prompt_end, a dtype, top-k): by layer only,
    # each row-major little-endian `dtype` (bfloat16: the high 16 bits of float32) of `shape` ([n, width];
    # [width] for one position), top-k's indices int32 alike; None: the one-vector fields above.
    shape: list[int] | None = None
    dtype: str = "float32"
    positions: list[int] | None = None
    hidden_states_indices_by_layer: dict[int, bytes] = {}
    proofs: list[str] | None = None  # hidden_states_proof: base64, the scheme's format
    heads: dict[str, Any] | None = None  # hidden_states_heads: {head: outputs} as over HTTP
    steering: list[dict[str, Any]] | None = None  # hidden_states_steering applied, as hidden_states_meta echoes it


def to_wire(ch: CompletionChoice, rows: bool) -> HandleChoice:
    """A finished choice for the handle; `rows`: the request was rowwise (values narrowed back to the
    dtype they were cast to, exactly)."""
    st = ch.extraction
    cached = None if st is None else HandleStats(st.tokens, st.cached_tokens, st.seconds, st.via)
    by_layer = ch.hidden_states_by_layer or {}
    if ch.proofs is not None:
        return HandleChoice(ch.index, ch.text, list(ch.token_ids), ch.finish_reason, None, cached,
                            proofs=list(ch.proofs))
    if not rows:
        return HandleChoice(ch.index, ch.text, list(ch.token_ids), ch.finish_reason,
                            None if ch.hidden_states is None else np.asarray(ch.hidden_states, "<f4").tobytes(),
                            cached, {layer: np.asarray(v, "<f4").tobytes() for layer, v in by_layer.items()},
                            heads=ch.heads, steering=ch.steering)
    shape = list(next(iter(by_layer.values())).shape) if by_layer else None
    return HandleChoice(ch.index, ch.text, list(ch.token_ids), ch.finish_reason, None, cached,
                        {layer: narrow(v, ch.dtype).tobytes() for layer, v in by_layer.items()}, shape, ch.dtype,
                        None if ch.positions is None else list(ch.positions),
                        {layer: np.asarray(i, "<i4").tobytes()
                         for layer, i in (ch.hidden_states_indices_by_layer or {}).items()}, heads=ch.heads,
                        steering=ch.steering)


def decode_rows(raw: bytes, dtype: str, shape: list[int]) -> np.ndarray:
    """Rows off the wire: numpy float32 or float16 as sent; bfloat16 (no numpy dtype) widened exactly to float32."""
    arr = np.frombuffer(raw, numpy_dtype(dtype))
    arr = widen(arr, dtype) if dtype == "bfloat16" else arr.astype(arr.dtype.newbyteorder("="))
    return arr.reshape(shape)


def from_wire(ch: HandleChoice) -> CompletionChoice:
    """A HandleChoice as the engine's CompletionChoice, its work as the engine counted it."""
    stats = None if ch.stats is None else ExtractionStats(ch.stats.tokens, ch.stats.cached_tokens, ch.stats.seconds,
                                                          ch.stats.via)
    if ch.proofs is not None:
        return CompletionChoice(ch.index, ch.text, tuple(ch.token_ids), ch.finish_reason, None, stats,
                                proofs=tuple(ch.proofs))
    if ch.shape is None:  # one float32 vector per layer
        values = {layer: np.frombuffer(b, "<f4").copy() for layer, b in ch.hidden_states_by_layer.items()}
        last = None if ch.hidden_states is None else np.frombuffer(ch.hidden_states, "<f4").copy()
        indices, positions = None, None
    else:
        values = {layer: decode_rows(b, ch.dtype, ch.shape) for layer, b in ch.hidden_states_by_layer.items()}
        indices = {layer: np.frombuffer(b, "<i4").reshape(ch.shape).copy()
                   for layer, b in ch.hidden_states_indices_by_layer.items()} or None
        last, positions = values.get(-1), None if ch.positions is None else tuple(ch.positions)
    return CompletionChoice(ch.index, ch.text, tuple(ch.token_ids), ch.finish_reason, last, stats, values or None,
                            positions, ch.dtype, None if indices is None else indices.get(-1), indices, heads=ch.heads,
                            steering=ch.steering)


class HandleCompletion(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    replica: str
    prompt_token_ids: list[int]
    choices: list[HandleChoice]


class HandleError(msgspec.Struct, array_like=True, gc=False):
    status: int
    message: str


class HandleReply(msgspec.Struct, array_like=True, gc=False, **_VERSIONED):
    ok: HandleCompletion | None = None
    error: HandleError | None = None


def wire_version(raw: bytes) -> str | None:
    """The version a message names (None: a release from before wire versions, or not a message)."""
    try:
        msg = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return None
    first = msg[0] if isinstance(msg, list) and msg else msg.get("wire") if isinstance(msg, dict) else None
    return first if isinstance(first, str) and first.startswith("hidden-states-wire/") else None


def _message_shaped(raw: bytes) -> bool:
    try:
        return isinstance(msgspec.msgpack.decode(raw), (list, dict))
    except msgspec.DecodeError:
        return False


class _MapVersion(msgspec.Struct):
    wire: str | None = None


_MAP_VERSION = msgspec.msgpack.Decoder(_MapVersion)


class Decoder:
    """msgspec's decoder for one message type, refusing another wire version by name."""

    def __init__(self, cls: type):
        self._decoder, self._what = msgspec.msgpack.Decoder(cls), cls.__name__
        self._map = not cls.__struct_config__.array_like

    def decode(self, raw: bytes) -> Any:
        try:
            if self._map and _MAP_VERSION.decode(raw).wire != WIRE:
                raise msgspec.ValidationError("another wire version")
            return self._decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            theirs = wire_version(raw)
            if theirs == WIRE or (theirs is None and not _message_shaped(raw)):
                raise  # malformed, not another version
            raise WireVersionError(
                f"a {self._what} of {theirs or 'a release from before wire versions'} reached a process that "
                f"speaks {WIRE}: the Router, the engine replicas and Python handle callers (deployments.client) "
                "must run the same release of hidden-states-serve; finish the rolling upgrade and retry") from None


ENCODER = msgspec.msgpack.Encoder()
HEAD_DECODER = Decoder(ResponseHead)
REPLY_BODY_DECODER = Decoder(Reply)
REQUEST_DECODER = Decoder(HandleCompletionRequest)
REPLY_DECODER = Decoder(HandleReply)
