"""`POST /v1/hidden_states`: the true vector for given tokens, and a comparison with a claimed one.

For verifiers (TopLOC-style checks of inference done elsewhere), reward models
and probes: no generation, one prefill of the given tokens on the prefix cache
(the extraction step), returning the final token's vector(s) and the token ids
they belong to. Input: `prompt` (text or token ids), or `messages` rendered
with the chat template plus an optional assistant `completion` (text or token
ids) appended after the generation prompt: exactly the `prompt_token_ids +
token_ids` of a chat completion. With `compare`, the answer adds the error of
a claimed vector against the true one and whether it is within `tolerance`
(relative: max |claimed - true| <= tolerance x max |true|).

This module is the request model and the arithmetic; the engine's frontend
(hidden_states/vllm/openai.py) tokenizes and extracts.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from hidden_states.params import HiddenStatesRequestError


class Compare(BaseModel):
    model_config = ConfigDict(extra="forbid")
    vector: list[float] | str = Field(description="the claimed vector: floats, or base64 of little-endian float32")
    tolerance: float = Field(1e-5, gt=0, description="largest relative error that still matches")


class HiddenStatesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    completion: str | list[int] | None = Field(None, description="with messages: the assistant's answer")
    add_special_tokens: bool = Field(True, description="for a text prompt, as /v1/completions")
    hidden_states_layers: list[int] | None = None
    hidden_states_encoding: Literal["float", "base64"] = "float"
    compare: Compare | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "HiddenStatesRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of `prompt` and `messages`")
        if self.completion is not None and self.messages is None:
            raise ValueError("`completion` goes with `messages` (with `prompt`, append it to the prompt)")
        if self.prompt is not None and len(self.prompt) == 0:
            raise ValueError("`prompt` is empty")
        if self.compare is not None and self.hidden_states_layers not in (None, [-1]):
            raise ValueError("`compare` checks the last layer: leave hidden_states_layers unset")
        return self


def decode_claimed(value: list[float] | str, dim: int) -> np.ndarray:
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except ValueError:
            raise HiddenStatesRequestError("compare.vector is not valid base64", "compare") from None
        if len(raw) % 4:
            raise HiddenStatesRequestError("compare.vector: base64 of float32 needs a multiple of 4 bytes", "compare")
        vec = np.frombuffer(raw, "<f4")
    else:
        vec = np.asarray(value, dtype=np.float32)
    if vec.shape != (dim,):
        raise HiddenStatesRequestError(f"compare.vector has {vec.size} values; this model's vectors have {dim}",
                                       "compare")
    return vec


def comparison(claimed: np.ndarray, true: np.ndarray, tolerance: float) -> dict[str, Any]:
    diff = float(np.abs(claimed.astype(np.float64) - true).max())
    scale = float(np.abs(true).max())
    norm = float(np.linalg.norm(claimed) * np.linalg.norm(true))
    rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
    return {"max_abs_error": diff, "max_abs_reference": scale, "relative_error": rel,
            "cosine_similarity": float(np.dot(claimed.astype(np.float64), true) / norm) if norm > 0 else None,
            "tolerance": tolerance, "match": bool(rel <= tolerance)}


def response(model: str, token_ids: list[int], vecs: dict[int, np.ndarray], req: HiddenStatesRequest,
             meta: dict[str, Any], encode) -> bytes:
    out: dict[str, Any] = {"object": "hidden_states", "model": model, "token_ids": token_ids}
    if req.hidden_states_layers is None:
        out["hidden_states"] = encode(vecs[-1], req.hidden_states_encoding)
    else:
        out["hidden_states_by_layer"] = {str(layer): encode(v, req.hidden_states_encoding) for layer, v in vecs.items()}
    out["hidden_states_meta"] = meta
    if req.compare is not None:
        true = vecs[-1]
        out["comparison"] = comparison(decode_claimed(req.compare.vector, true.size), true, req.compare.tolerance)
    return json.dumps(out, separators=(",", ":")).encode()
