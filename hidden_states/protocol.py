"""What crosses a process boundary, and its codec.

Every message is a msgspec struct encoded as msgpack (the vLLM v1 wire
discipline): a vector travels as raw bytes with its dtype and shape, never as a
Python list and never pickled. Decoding validates the frame and raises
`SideChannelProtocolError` with what was wrong; nothing here can execute code
from a frame.

- `HiddenStatesExtractionRequest` rides inside `SamplingParams.extra_args`
  (key `EXTRA_ARGS_KEY`) from the caller to the model runner: it marks a
  request for capture and carries the key the result comes back under (vLLM
  rewrites request ids; the key survives).
- `HiddenStatesBatch` goes from the model runner to the caller over the side
  channel: every result of one engine step, in one frame.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

EXTRA_ARGS_KEY = "hidden_states_capture"
# The collector a generating request's vectors go to (engine side only, never the worker).
COLLECTOR_TAG_KEY = "hidden_states_collector"
# Keys of `extra_args` (an OpenAI request's `vllm_xargs`) that are ours: stripped
# from what clients send, so no client can forge a capture or join a collector.
RESERVED_EXTRA_ARGS_PREFIX = "hidden_states"

# dtype name -> bytes per element. bfloat16 has no numpy dtype: decoded by hand.
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_NUMPY_DTYPE = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}


class SideChannelProtocolError(ValueError):
    """A side-channel frame that is not a valid HiddenStatesBatch."""


class HiddenStatesExtractionRequest(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    key: str
    # Layers as transformers numbers `output_hidden_states` (-1 = after the final norm).
    layers: list[int] = msgspec.field(default_factory=lambda: [-1])
    # False: capture at the last prompt token. True: at the tail step, the extra decode row of the
    # final token that the TailScheduler runs when the request stops (hidden_states/vllm/scheduler.py).
    tail: bool = False

    def to_extra_args(self) -> dict:
        return {EXTRA_ARGS_KEY: msgspec.to_builtins(self)}

    @staticmethod
    def from_extra_args(extra_args: dict | None) -> "HiddenStatesExtractionRequest | None":
        raw = (extra_args or {}).get(EXTRA_ARGS_KEY)
        return None if raw is None else msgspec.convert(raw, HiddenStatesExtractionRequest)


class HiddenStatesResult(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    key: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes
    layer: int = -1

    def to_numpy(self) -> np.ndarray:
        """The vector as float32 (bfloat16 and float16 widen exactly)."""
        if self.dtype == "float32":
            arr = np.frombuffer(self.data, dtype="<f4")
        elif self.dtype == "float16":
            arr = np.frombuffer(self.data, dtype="<f2").astype(np.float32)
        else:  # bfloat16: the high half of a float32
            arr = (np.frombuffer(self.data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        return arr.reshape(self.shape).astype(np.float32, copy=False)


class HiddenStatesBatch(msgspec.Struct, array_like=True, gc=False):
    results: list[HiddenStatesResult]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(HiddenStatesBatch)


def encode_batch(batch: HiddenStatesBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(frame: bytes) -> HiddenStatesBatch:
    try:
        batch = _decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise SideChannelProtocolError(f"malformed hidden-states frame ({len(frame)} bytes): {e}") from None
    for r in batch.results:
        if r.dtype not in ITEMSIZE:
            raise SideChannelProtocolError(f"unsupported dtype {r.dtype!r} for key {r.key!r}; expected one of {sorted(ITEMSIZE)}")
        if any(d < 0 for d in r.shape) or math.prod(r.shape) * ITEMSIZE[r.dtype] != len(r.data):
            raise SideChannelProtocolError(
                f"key {r.key!r}: {len(r.data)} bytes do not hold shape {list(r.shape)} of {r.dtype}"
            )
    return batch


def result_from_array(key: str, arr: np.ndarray, dtype: str, layer: int = -1) -> HiddenStatesResult:
    """`arr` holds the raw elements: float32/float16 arrays, or uint16 bit patterns for bfloat16."""
    if dtype not in ITEMSIZE:
        raise ValueError(f"unsupported dtype {dtype!r}")
    if arr.dtype.newbyteorder("<") != np.dtype(_NUMPY_DTYPE[dtype]):
        raise ValueError(f"array of {arr.dtype} cannot be sent as {dtype}")
    return HiddenStatesResult(key=key, dtype=dtype, shape=tuple(arr.shape), data=arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes(), layer=layer)
