"""What travels between Ray processes: msgspec structs as bytes, never pickled objects.

Ray carries the bytes; our code never hands it a Python object to pickle.
- Router -> replica: the raw HTTP body. Replica -> router: for a streaming
  request a `ResponseHead` frame, then SSE chunks (bytes) on a streaming
  handle; otherwise one `Reply` (head and body) on a plain call.
- Python handle callers (`deployments.client`) <-> router <-> replica:
  `HandleCompletionRequest` / `HandleCompletion`.
"""

from __future__ import annotations

import msgspec


class ResponseHead(msgspec.Struct, array_like=True, gc=False):
    status: int
    media_type: str
    replica: str


class Reply(msgspec.Struct, array_like=True, gc=False):
    head: ResponseHead
    body: bytes


class HandleCompletionRequest(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    prompt: str | list[int]
    model: str | None = None  # a LoRA adapter's name (lora_modules); None or the model's own: the base model
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = []
    return_hidden_states: bool = True
    hidden_states_layers: list[int] = msgspec.field(default_factory=lambda: [-1])
    hidden_states_position: str = "completion_end"


class HandleChoice(msgspec.Struct, array_like=True, gc=False):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    hidden_states: bytes | None  # little-endian float32, the last layer
    cached_tokens: int = 0
    hidden_states_by_layer: dict[int, bytes] = {}


class HandleCompletion(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    replica: str
    prompt_token_ids: list[int]
    choices: list[HandleChoice]


class HandleError(msgspec.Struct, array_like=True, gc=False):
    status: int
    message: str


class HandleReply(msgspec.Struct, array_like=True, gc=False):
    ok: HandleCompletion | None = None
    error: HandleError | None = None


ENCODER = msgspec.msgpack.Encoder()
HEAD_DECODER = msgspec.msgpack.Decoder(ResponseHead)
REPLY_BODY_DECODER = msgspec.msgpack.Decoder(Reply)
REQUEST_DECODER = msgspec.msgpack.Decoder(HandleCompletionRequest)
REPLY_DECODER = msgspec.msgpack.Decoder(HandleReply)
