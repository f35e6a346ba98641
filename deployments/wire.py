"""What travels between Ray processes: msgspec structs as bytes, never pickled objects.

- Router -> replica: the raw HTTP body, and the spec's JSON (`HiddenStatesFields.to_json`).
- Replica -> Router: a `ResponseHead` then SSE chunks (streaming), or one `Reply`.
- Handle callers <-> Router <-> replica: `HandleCompletionRequest` / `HandleCompletion`; each choice
  is interface.CompletionChoice field for field, its rows raw little-endian bytes as the engine cast
  them (`to_wire` / `from_wire`, the one encoder and decoder).

Every message names its wire version (`WIRE`, a msgspec tag: `WIRE_VERSION` and the digest of the choice's
shape); another version is refused with `WireVersionError` naming both. Bump `WIRE_VERSION` whenever a struct
written out here changes shape.
"""

from __future__ import annotations

import dataclasses
import hashlib
import typing
from typing import Any

import msgspec
import numpy as np

from hidden_states.interface import CompletionChoice, ExtractionStats, RowBatch
from hidden_states.protocol import numpy_dtype


class HandleStats(msgspec.Struct, array_like=True, gc=False):
    """A choice's work as the engine counted it (interface.ExtractionStats)."""

    tokens: int
    cached_tokens: int
    seconds: float
    via: str


class HandleRows(msgspec.Struct, array_like=True, gc=False):
    """A choice's rows (interface.RowBatch) as the engine cast them: `positions` int64, and per layer the
    row-major little-endian elements of `dtype` [n, width] (bfloat16: the high 16 bits of float32),
    top-k's int32 indices alike. Decoded as bytearray: numpy views them, writable, with no copy."""

    positions: bytearray
    dtype: str
    width: int  # 0: no layers (heads alone: the positions only)
    values: dict[int, bytearray] = {}
    indices: dict[int, bytearray] | None = None


# HandleChoice is interface.CompletionChoice field for field. Its first six are converted (the token ids as a list,
# the rows as raw bytes, the work as HandleStats); the rest (SHARED) are CompletionChoice's own, by name, type and
# default, so a field added to the one choice travels on the handle wire with no line here, and the wire's version
# (its shape's digest) changes with it.
_CONVERTED = [
    ("index", int),
    ("text", str),
    ("token_ids", list[int]),
    ("finish_reason", str | None),
    ("rows", HandleRows | None, None),
    ("stats", HandleStats | None, None),  # None: no extraction step for it (prompt_end, or none asked)
]
_HINTS = typing.get_type_hints(CompletionChoice)
_SHARED_FIELDS = [(f.name, _HINTS[f.name], f.default) for f in dataclasses.fields(CompletionChoice)][len(_CONVERTED) :]
SHARED = tuple(name for name, _, _ in _SHARED_FIELDS)
HandleChoice = msgspec.defstruct(
    "HandleChoice", _CONVERTED + _SHARED_FIELDS, array_like=True, gc=False, module=__name__
)


def shape_digest(fields: list[tuple[str, Any, Any]]) -> str:
    """The digest of a choice's shared fields (name, type, default) that names the wire's version."""
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:8]


WIRE_VERSION = 5  # bump when a struct written out here changes shape (HandleChoice's shape is in its digest)
WIRE = f"hidden-states-wire/{WIRE_VERSION}.{shape_digest(_SHARED_FIELDS)}"
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


def _le(arr: np.ndarray, dtype: Any) -> bytes:
    return np.ascontiguousarray(arr, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


def to_wire(ch: CompletionChoice) -> HandleChoice:
    """A finished choice for the handle: its rows as the engine cast them, bit for bit."""
    st, rows = ch.extraction, ch.rows
    stats = None if st is None else HandleStats(st.tokens, st.cached_tokens, st.seconds, st.via)
    hr = (
        None
        if rows is None
        else HandleRows(
            _le(rows.positions, np.int64),
            rows.dtype,
            rows.width,
            {layer: _le(v, numpy_dtype(rows.dtype)) for layer, v in rows.values.items()},
            None if rows.indices is None else {layer: _le(i, np.int32) for layer, i in rows.indices.items()},
        )
    )
    return HandleChoice(ch.index, ch.text, list(ch.token_ids), ch.finish_reason, hr, stats, **_shared(ch))


def from_wire(ch: HandleChoice) -> CompletionChoice:
    """A HandleChoice as the engine's CompletionChoice, its work as the engine counted it."""
    st, hr = ch.stats, ch.rows
    stats = None if st is None else ExtractionStats(st.tokens, st.cached_tokens, st.seconds, st.via)
    rows = None
    if hr is not None:
        positions = np.frombuffer(hr.positions, "<i8")
        shape = (len(positions), hr.width)
        rows = RowBatch(
            positions,
            {layer: np.frombuffer(b, numpy_dtype(hr.dtype)).reshape(shape) for layer, b in hr.values.items()},
            hr.dtype,
            None
            if hr.indices is None
            else {layer: np.frombuffer(b, "<i4").reshape(shape) for layer, b in hr.indices.items()},
        )
    return CompletionChoice(ch.index, ch.text, tuple(ch.token_ids), ch.finish_reason, rows, stats, **_shared(ch))


def _shared(ch: Any) -> dict[str, Any]:
    return {name: getattr(ch, name) for name in SHARED}


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
                "must run the same release of hidden-states-serve; finish the rolling upgrade and retry"
            ) from None


ENCODER = msgspec.msgpack.Encoder()
HEAD_DECODER = Decoder(ResponseHead)
REPLY_BODY_DECODER = Decoder(Reply)
REQUEST_DECODER = Decoder(HandleCompletionRequest)
REPLY_DECODER = Decoder(HandleReply)
