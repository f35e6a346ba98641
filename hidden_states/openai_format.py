"""OpenAI response formatting of vectors and errors: no vLLM here.

`ChoiceVectors` puts each finished choice's vector into an OpenAI response or
stream chunk, found in the request's `HiddenStatesCollector` by engine request
and choice; a choice without one fails the request.
Used by the vLLM frontend (hidden_states/vllm/openai.py) and the fake engine.
"""

from __future__ import annotations

import base64
import json
import re
from http import HTTPStatus
from typing import Literal

import numpy as np
from pydantic import ValidationError

from hidden_states.engine import HiddenStatesCollector

Route = Literal["completions", "chat", "hidden_states"]


def encode_vector(vec: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(vec, dtype=np.float32).tolist()


def error_body(message: str, status: int, err_type: str | None = None, param: str | None = None) -> bytes:
    err_type = err_type or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return json.dumps({"error": {"message": message, "type": err_type, "param": param, "code": status}}).encode()


_FINISHING = re.compile(r'"finish_reason":\s*"')  # an SSE chunk that finishes a choice (else it passes untouched)


class ChoiceVectors:
    """Puts each finished choice's vector into the response, found by engine request and
    choice: (prompt ordinal, index) = divmod(response index, n) for completions (vLLM numbers
    choices `ordinal * n + index`), (0, index) for chat; fails the request if one has none.
    Nothing else in the response changes."""

    def __init__(self, engine, collector: HiddenStatesCollector, request, route: Route, replica_id: str):
        self.engine, self.collector, self.route, self.replica_id = engine, collector, route, replica_id
        self.encoding = request.hidden_states_encoding
        self.by_layer = request.hidden_states_layers is not None
        self.n = (getattr(request, "n", None) or 1) if route == "completions" else 0

    def fields(self, index: int) -> dict:
        """The vector fields of response choice `index`."""
        key = divmod(index, self.n) if self.n else (0, index)
        vecs = self.collector.vectors.get(key)
        if vecs is None:
            raise self.engine.missing(f"choice {index}")
        out = {}
        if self.by_layer:
            out["hidden_states_by_layer"] = {str(layer): encode_vector(v, self.encoding) for layer, v in vecs.items()}
        else:
            out["hidden_states"] = encode_vector(vecs[-1], self.encoding)
        meta = {"position": self.collector.position, "replica": self.replica_id}
        st = self.collector.stats.get(key)
        if st is not None:
            meta.update(via=st.via, tokens=st.tokens, cached_tokens=st.cached_tokens,
                        computed_tokens=st.computed_tokens, extraction_seconds=round(st.seconds, 6))
        out["hidden_states_meta"] = meta
        self.engine.vector_sent(self.collector.position, st, sum(v.nbytes for v in vecs.values()))
        return out

    def fill_response(self, response) -> None:
        """A whole response: a dict, or vLLM's pydantic response (its models allow extra fields)."""
        if isinstance(response, dict):
            for choice in response["choices"]:
                choice.update(self.fields(choice["index"]))
            return
        for choice in response.choices:
            for name, value in self.fields(choice.index).items():
                setattr(choice, name, value)

    def fill_chunk(self, chunk: str) -> str:
        """One SSE event: vectors put on the choices it finishes; any other event unchanged."""
        if not _FINISHING.search(chunk):
            return chunk
        data = json.loads(chunk[6:])
        for choice in data.get("choices") or ():
            if choice.get("finish_reason") is not None:
                choice.update(self.fields(choice.get("index", 0)))
        return "data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False) + "\n\n"


def not_from_token_ids(request) -> tuple[str, str] | None:
    """(param, message) if the request's input is not token ids alone: the extraction
    step replays prompt + completion as token ids, which would not be the same input."""
    if getattr(request, "prompt_embeds", None):
        return "prompt_embeds", ("prompt_embeds cannot be combined with return_hidden_states: the vector is "
                                 "computed from token ids; send the prompt as text or token ids")
    for message in getattr(request, "messages", None) or ():
        content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
            if kind not in ("text", None):
                return "messages", (f"a {kind!r} content part cannot be combined with return_hidden_states: the "
                                    "vector is computed from token ids, so only text messages are supported")
    return None


def validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)
