"""FakeEngine: the engine interface (hidden_states/engine.py) without vLLM, for Serve-layer unit tests.

Deterministic and instant: a prompt's token ids are its UTF-8 bytes, a choice
generates `max_tokens` ids counting up from the prompt's length plus its index,
and the vector of a token sequence is `fake_vector(ids)`. Responses go through
the same formatting as the real frontend (`hidden_states.openai_format`), so
the ingress, relay, counters and vector placement are tested for real; only
vLLM is not there. `FakeEngine.fail_next` makes the next OpenAI request raise
mid-stream (a dying engine).
"""

from __future__ import annotations

import contextlib
import json
import time
import types
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

from hidden_states.engine import (Completion, CompletionChoice, ExtractionStats, HiddenStatesCollector,
                                  MissingHiddenStatesError, SamplingOptions, VectorObservers)
from hidden_states.openai_format import ChoiceVectors, error_body
from hidden_states.params import HiddenStatesDisabledError, HiddenStatesRequestError, check_layers, check_position

HIDDEN_SIZE = 8
NUM_LAYERS = 2


def fake_vector(ids: Sequence[int], layer: int = -1) -> np.ndarray:
    seed = (hash(tuple(ids)) ^ (layer * 7919)) & 0xFFFFFFFF
    return np.random.default_rng(seed).standard_normal(HIDDEN_SIZE).astype(np.float32)


class FakeEngine(VectorObservers):
    def __init__(self, enabled: bool):
        super().__init__()
        self.enabled = enabled
        self.missing_vectors = 0
        self.requests = 0
        self.fail_next = False
        self.dead = False

    @classmethod
    async def start(cls, model: str = "fake", *, enable_return_hidden_states: bool = True, **_: Any) -> "FakeEngine":
        return cls(enable_return_hidden_states)

    def check_request(self, layers: Sequence[int] = (-1,), position: str = "completion_end") -> tuple[int, ...]:
        if not self.enabled:
            raise HiddenStatesDisabledError()
        check_position(position)
        return check_layers(layers, NUM_LAYERS)

    def missing(self, what: str) -> MissingHiddenStatesError:
        self.missing_vectors += 1
        return MissingHiddenStatesError(f"{what} finished without its hidden states")

    @contextlib.contextmanager
    def collecting(self, layers: Sequence[int] = (-1,), position: str = "completion_end"):
        yield HiddenStatesCollector(uuid.uuid4().hex, self.check_request(layers, position), position)

    def _generate(self, prompt_ids: list[int], index: int, max_tokens: int) -> list[int]:
        return [(len(prompt_ids) + index + i) % 256 for i in range(max_tokens)]

    def _collect(self, collector: HiddenStatesCollector, prompt_ids: list[int], token_ids: list[int]) -> None:
        seq = collector.key(prompt_ids, token_ids)
        collector.vectors[seq] = {layer: fake_vector(seq, layer) for layer in collector.layers}
        if collector.position == "completion_end":
            collector.stats[seq] = ExtractionStats(len(seq), len(seq) - 1, 0.0)

    async def complete(self, prompt: str | Sequence[int], options: SamplingOptions | None = None, *,
                       return_hidden_states: bool = True, layers: Sequence[int] = (-1,),
                       position: str = "completion_end") -> Completion:
        o = options or SamplingOptions()
        ids = list(prompt.encode()) if isinstance(prompt, str) else list(prompt)
        choices = []
        with self.collecting(layers, position) if return_hidden_states else contextlib.nullcontext() as col:
            for i in range(o.n):
                toks = self._generate(ids, i, o.max_tokens or 16)
                vecs = None
                if col is not None:
                    self._collect(col, ids, toks)
                    vecs = col.vectors_for(ids, toks)
                choices.append(CompletionChoice(i, bytes(toks).decode("latin-1"), tuple(toks), "length",
                                                None if vecs is None else vecs.get(-1), None, vecs))
        return Completion(f"cmpl-{uuid.uuid4().hex}", tuple(ids), tuple(choices))

    async def openai(self, served_model_name: str, replica_id: str) -> "FakeOpenAI":
        return FakeOpenAI(self, served_model_name, replica_id)

    async def stats(self) -> dict:
        return {"enabled": self.enabled, "missing_vectors": self.missing_vectors, "pending": 0,
                "unclaimed_results": 0, "requests_seen": self.requests}

    def healthy(self) -> bool:
        return not self.dead

    def shutdown(self) -> None:
        self.dead = True


class FakeOpenAI:
    """A small OpenAI completions/chat surface: prompt, messages, n, max_tokens, stream."""

    def __init__(self, engine: FakeEngine, model: str, replica_id: str):
        self.engine, self.model, self.replica_id = engine, model, replica_id

    async def handle(self, route: str, body: bytes) -> AsyncIterator[tuple[int, bytes] | bytes]:
        eng = self.engine
        eng.requests += 1
        req = json.loads(body)
        if req.get("return_hidden_states") and not eng.enabled:
            e = HiddenStatesDisabledError()
            yield 400, error_body(str(e), 400, "BadRequestError", e.param)
            return
        if req.get("return_hidden_states"):
            try:
                eng.check_request(req.get("hidden_states_layers") or (-1,),
                                  req.get("hidden_states_position", "completion_end"))
            except HiddenStatesRequestError as e:
                yield 400, error_body(str(e), 400, "BadRequestError", e.param)
                return
        text = req.get("prompt") if route == "completions" else " ".join(m["content"] for m in req["messages"])
        prompt_ids = list(str(text).encode())
        n, max_tokens = req.get("n") or 1, req.get("max_tokens") or 4
        col_cm = eng.collecting(req.get("hidden_states_layers") or (-1,),
                                req.get("hidden_states_position", "completion_end")) \
            if req.get("return_hidden_states") else contextlib.nullcontext()
        with col_cm as col:
            vectors = None
            if col is not None:
                asked = types.SimpleNamespace(hidden_states_encoding=req.get("hidden_states_encoding", "float"),
                                              hidden_states_layers=req.get("hidden_states_layers"),
                                              return_token_ids=req.get("return_token_ids"))
                vectors = ChoiceVectors(eng, col, asked, route, self.replica_id)
            outs = [self._generate_choice(prompt_ids, i, max_tokens, col) for i in range(n)]
            if not req.get("stream"):
                payload = {"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()),
                           "model": self.model, "prompt_token_ids": prompt_ids if route == "chat" else None,
                           "choices": [self._choice(route, i, prompt_ids, toks) for i, toks in enumerate(outs)]}
                if vectors is not None:
                    vectors.fill_response(payload)
                yield 200, json.dumps(payload).encode()
                return
            yield 200, b""
            for i, toks in enumerate(outs):
                for j, tok in enumerate(toks):
                    if eng.fail_next:
                        eng.fail_next = False
                        raise RuntimeError("the fake engine died")
                    last = j == len(toks) - 1
                    choice = {"index": i, "text": chr(tok), "finish_reason": "length" if last else None,
                              "token_ids": [tok], "prompt_token_ids": prompt_ids if j == 0 else None}
                    chunk = "data: " + json.dumps({"id": "cmpl-fake", "choices": [choice]}) + "\n\n"
                    if vectors is not None:
                        chunk = vectors.fill_chunk(chunk)
                    yield chunk.encode()
            yield b"data: [DONE]\n\n"

    def _generate_choice(self, prompt_ids, i, max_tokens, col) -> list[int]:
        toks = self.engine._generate(prompt_ids, i, max_tokens)
        if col is not None:
            self.engine._collect(col, prompt_ids, toks)
        return toks

    @staticmethod
    def _choice(route: str, i: int, prompt_ids: list[int], toks: list[int]) -> dict:
        text = bytes(toks).decode("latin-1")
        out = {"index": i, "finish_reason": "length", "token_ids": toks}
        if route == "completions":
            out.update(text=text, prompt_token_ids=prompt_ids)
        else:
            out["message"] = {"role": "assistant", "content": text}
        return out
