"""OpenAI response formatting of vectors and errors: no vLLM here.

`ChoiceVectors` puts each finished choice's vector into an OpenAI response or
stream chunk, found by the choice's own prompt_token_ids + token_ids in the
request's `HiddenStatesCollector`; a choice without one fails the request.
Used by the vLLM frontend (hidden_states/vllm/openai.py) and the fake engine.
"""

from __future__ import annotations

import base64
import json
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


class ChoiceVectors:
    """Puts each finished choice's vector into the response, found by the choice's
    own prompt_token_ids + token_ids; fails the request if one has none."""

    def __init__(self, engine, collector: HiddenStatesCollector, request, route: Route,
                 replica_id: str):
        self.engine, self.collector, self.route, self.replica_id = engine, collector, route, replica_id
        self.encoding = request.hidden_states_encoding
        self.by_layer = request.hidden_states_layers is not None
        self.show_token_ids = bool(request.return_token_ids)  # as the client asked, before we force it on
        self.prompt_ids: dict[int, list[int]] = {}  # streaming: choice index -> prompt ids
        self.tokens: dict[int, list[int]] = {}  # streaming: choice index -> completion ids so far

    def inject(self, choice: dict, prompt_ids: list[int] | None, token_ids: list[int]) -> None:
        vecs = None if prompt_ids is None else self.collector.vectors_for(prompt_ids, token_ids)
        if vecs is None:
            raise self.engine.missing(f"choice {choice.get('index')}")
        if self.by_layer:
            choice["hidden_states_by_layer"] = {str(layer): encode_vector(v, self.encoding) for layer, v in vecs.items()}
        else:
            choice["hidden_states"] = encode_vector(vecs[-1], self.encoding)
        meta = {"position": self.collector.position, "replica": self.replica_id}
        st = self.collector.stats.get(self.collector.key(prompt_ids, token_ids))
        if st is not None:
            meta.update(via=st.via, tokens=st.tokens, cached_tokens=st.cached_tokens,
                        computed_tokens=st.computed_tokens, extraction_seconds=round(st.seconds, 6))
        choice["hidden_states_meta"] = meta
        self.engine.vector_sent(self.collector.position, st, sum(v.nbytes for v in vecs.values()))

    def fill_response(self, payload: dict) -> None:
        top_prompt = payload.get("prompt_token_ids")  # chat: once per response
        for choice in payload["choices"]:
            prompt_ids = choice.get("prompt_token_ids") if self.route == "completions" else top_prompt
            self.inject(choice, prompt_ids, choice.get("token_ids") or [])
            if not self.show_token_ids:
                choice["token_ids"] = None
                if "prompt_token_ids" in choice:
                    choice["prompt_token_ids"] = None
        if not self.show_token_ids and "prompt_token_ids" in payload:
            payload["prompt_token_ids"] = None

    def fill_chunk(self, chunk: str) -> str:
        """One SSE event: token ids recorded, vectors put on finishing choices."""
        data = json.loads(chunk[6:])
        changed = False
        if data.get("prompt_token_ids") is not None:  # chat: the first chunk
            self.prompt_ids[-1] = data["prompt_token_ids"]
            if not self.show_token_ids:
                data["prompt_token_ids"], changed = None, True
        choices = data.get("choices") or ()
        if self.route == "chat" and not self.show_token_ids and choices and all(carries_nothing(c) for c in choices):
            return ""  # sent only because we asked vLLM for token ids: the client would not have seen it
        for choice in choices:
            i = choice.get("index", 0)
            if choice.get("prompt_token_ids") is not None:  # completions: each choice's first chunk
                self.prompt_ids[i] = choice["prompt_token_ids"]
            self.tokens.setdefault(i, []).extend(choice.get("token_ids") or ())
            if choice.get("finish_reason") is not None:
                self.inject(choice, self.prompt_ids.get(i, self.prompt_ids.get(-1)), self.tokens[i])
                changed = True
            if not self.show_token_ids and (choice.get("token_ids") is not None or choice.get("prompt_token_ids") is not None):
                choice["token_ids"] = None
                if "prompt_token_ids" in choice:
                    choice["prompt_token_ids"] = None
                changed = True
        return "data: " + json.dumps(data, separators=(",", ":")) + "\n\n" if changed else chunk


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


def carries_nothing(choice: dict) -> bool:
    """A chat stream choice with no text, no logprobs and no finish: vLLM sends one
    per token that decodes to nothing yet only when token ids were asked for."""
    return (choice.get("finish_reason") is None and not choice.get("logprobs")
            and not any(v is not None for v in (choice.get("delta") or {}).values()))


def validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)
