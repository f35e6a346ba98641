"""FakeEngine: the engine interface (hidden_states/interface.py) without vLLM, for Serve-layer unit tests.

Deterministic and instant: token ids are UTF-8 bytes; a choice generates `max_tokens` ids
counting up; the row of position p is `fake_vector(ids[:p + 1])`, cast and selected as the
engine does. Responses go through `hidden_states.openai_format`. `fail_next` raises
`EngineDeadError` mid-stream. `stats()` reports `unfinished_requests` and `cancelled_requests`.
`engine` args: `token_delay_s` per token, `first_token_delay_s` once (prefill), `hidden_size`
(default 8).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import types
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

from hidden_states.interface import (
    STREAM,
    Completion,
    ExtractionStats,
    Head,
    HiddenStatesCollector,
    MissingHiddenStatesError,
    RowBatch,
    SamplingOptions,
    VectorObservers,
    finished_choice,
)
from hidden_states.openai_format import ChoiceVectors, error_body
from hidden_states.params import (
    DEFAULT_MAX_HIDDEN_STATES_BYTES,
    HiddenStatesFields,
    HiddenStatesRequestError,
    Span,
    check_layers,
    check_model,
    check_rows_budget,
    parse_fields,
    spec_of,
)
from hidden_states.protocol import narrow

HIDDEN_SIZE = 8
NUM_LAYERS = 2


def fake_vector(ids: Sequence[int], layer: int = -1, size: int = HIDDEN_SIZE) -> np.ndarray:
    seed = (hash(tuple(ids)) ^ (layer * 7919)) & 0xFFFFFFFF
    return np.random.default_rng(seed).standard_normal(size).astype(np.float32)


def fake_rows(
    ids: Sequence[int],
    positions: Sequence[int],
    layers: Sequence[int] = (-1,),
    dtype: str = "float32",
    topk: int | None = None,
    size: int = HIDDEN_SIZE,
) -> RowBatch:
    """The rows of `ids` at `positions` (row p: `fake_vector(ids[:p + 1])`) as the engine sends them:
    top-k of the float32 rows by magnitude (int32 indices, largest first), then cast to `dtype` (raw)."""
    pos = np.asarray(positions, dtype=np.int64)
    values, indices = {}, {} if topk else None
    for layer in layers:
        rows = (
            np.stack([fake_vector(ids[: p + 1], layer, size) for p in pos])
            if len(pos)
            else np.zeros((0, size), np.float32)
        )
        if topk:
            indices[layer] = np.argsort(-np.abs(rows), axis=-1, kind="stable")[:, :topk].astype(np.int32)
            rows = np.take_along_axis(rows, indices[layer], axis=-1)
        values[layer] = narrow(rows, dtype)
    return RowBatch(pos, values, dtype, indices)


class EngineDeadError(RuntimeError):
    """vLLM's name for "the engine core died" (hidden_states/errors.py matches it by name: a 503)."""


class FakeEngine(VectorObservers):
    hidden_size = HIDDEN_SIZE
    layer_capture = None  # no workers

    def __init__(
        self,
        enabled: bool,
        token_delay_s: float = 0.0,
        max_hidden_states_bytes: int = DEFAULT_MAX_HIDDEN_STATES_BYTES,
        first_token_delay_s: float = 0.0,
        hidden_size: int = HIDDEN_SIZE,
    ):
        super().__init__()
        self.hidden_size = hidden_size
        self.enabled = enabled
        self.token_delay_s = token_delay_s
        self.first_token_delay_s = first_token_delay_s
        self.max_hidden_states_bytes = max_hidden_states_bytes
        self.missing_vectors = 0
        self.requests = 0
        self.live: set[str] = set()  # requests started and not ended
        self.cancelled = 0  # requests their caller closed or cancelled before they ended
        self.fail_next = False
        self.dead = False
        self.heads: dict = {}  # none registered
        self.steering_vectors: dict = {}

    @classmethod
    async def start(
        cls,
        model: str = "fake",
        *,
        enable_return_hidden_states: bool = True,
        token_delay_s: float = 0.0,
        max_hidden_states_bytes: int = DEFAULT_MAX_HIDDEN_STATES_BYTES,
        first_token_delay_s: float = 0.0,
        hidden_size: int = HIDDEN_SIZE,
        **_: Any,
    ) -> FakeEngine:
        return cls(
            enable_return_hidden_states, token_delay_s, max_hidden_states_bytes, first_token_delay_s, hidden_size
        )

    @contextlib.asynccontextmanager
    async def running(self):
        """One request's life: live until it ends; `cancelled` if its caller gave up on it first."""
        rid = uuid.uuid4().hex
        self.live.add(rid)
        try:
            yield rid
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled += 1
            raise
        finally:
            self.live.discard(rid)

    async def _tick(self) -> None:
        """One token's worth of work: a point where a request can be cancelled, as in vLLM."""
        await asyncio.sleep(self.token_delay_s)

    async def _prefill(self) -> None:
        """A request's wait before its first token (`first_token_delay_s`); none by default."""
        if self.first_token_delay_s > 0:
            await asyncio.sleep(self.first_token_delay_s)

    def check_spec(self, spec: HiddenStatesFields) -> tuple[int, ...]:
        return check_model(spec, NUM_LAYERS, self.hidden_size)

    def check_layers(self, layers: Sequence[int]) -> tuple[int, ...]:
        return check_layers(layers, NUM_LAYERS)

    def missing(self, what: str) -> MissingHiddenStatesError:
        self.missing_vectors += 1
        return MissingHiddenStatesError(f"{what} finished without its hidden states")

    @contextlib.contextmanager
    def collecting(self, spec: HiddenStatesFields):
        yield HiddenStatesCollector.of(uuid.uuid4().hex, spec, self.check_spec(spec))

    def check_budget(self, col: HiddenStatesCollector | None, prompt_len: int, max_tokens: int, n: int) -> None:
        """The engine's memory bound on a request (params.check_rows_budget), before it starts."""
        if col is not None:
            check_rows_budget(
                Span.of(col.position, prompt_len),
                prompt_len,
                max_tokens,
                n,
                len(col.layers),
                self.hidden_size,
                col.dtype,
                col.topk,
                self.max_hidden_states_bytes,
            )

    def _generate(self, prompt_ids: list[int], index: int, max_tokens: int) -> list[int]:
        return [(len(prompt_ids) + index + i) % 256 for i in range(max_tokens)]

    async def _generate_slowly(self, prompt_ids: list[int], index: int, max_tokens: int) -> list[int]:
        toks = self._generate(prompt_ids, index, max_tokens)
        for _ in toks:
            await self._tick()
        return toks

    def _collect(
        self, collector: HiddenStatesCollector, index: int, prompt_ids: list[int], token_ids: list[int]
    ) -> None:
        """Choice `index` of the request's one prompt: its rows, filed as the real engine files them."""
        seq = list(prompt_ids) if collector.position == "prompt_end" else [*prompt_ids, *token_ids]
        stats = None if collector.position == "prompt_end" else ExtractionStats(len(seq), len(seq) - 1, 0.0)
        wanted = list(Span.of(collector.position, len(prompt_ids)).positions(len(seq)))
        collector.prompt_lens[0] = len(prompt_ids)
        collector.add_rows(
            (0, index), fake_rows(seq, wanted, collector.layers, collector.dtype, collector.topk, self.hidden_size)
        )
        collector.close_choice((0, index), wanted, stats)

    async def complete(
        self,
        prompt: str | Sequence[int],
        options: SamplingOptions | None = None,
        *,
        return_hidden_states: bool = True,
        layers: Sequence[int] = (-1,),
        position: Any = "completion_end",
        model: str | None = None,
        dtype: str = "float32",
        topk: int | None = None,
        proof: Any = None,
        spec: HiddenStatesFields | None = None,
    ) -> Completion:
        o = options or SamplingOptions()
        if isinstance(prompt, dict):
            prompt = prompt["prompt_token_ids"]
        ids = list(prompt.encode()) if isinstance(prompt, str) else list(prompt)
        choices = []
        if spec is None:
            spec = spec_of(return_hidden_states, layers, position, dtype, topk, proof, enabled=self.enabled)
        async with self.running():
            with self.collecting(spec) if spec.wants else contextlib.nullcontext() as col:
                self.check_budget(col, len(ids), o.max_tokens or 16, o.n)
                await self._prefill()
                for i in range(o.n):
                    toks = await self._generate_slowly(ids, i, o.max_tokens or 16)
                    text = bytes(toks).decode("latin-1")
                    if col is not None:
                        self._collect(col, i, ids, toks)
                    choices.append(finished_choice(self, col, i, text, toks, "length"))
        return Completion(f"cmpl-{uuid.uuid4().hex}", tuple(ids), tuple(choices))

    max_model_len = 4096

    async def chat_input(self, messages: Sequence[dict]) -> dict:
        return {"prompt_token_ids": self.chat_prompt(messages)}

    def chat_prompt(self, messages: Sequence[dict]) -> list[int]:
        """As FakeOpenAI renders chat: the messages' contents joined, as bytes."""
        return list(" ".join(str(m.get("content", "")) for m in messages).encode())

    async def openai(self, served_model_name: str, replica_id: str, lora_modules: Sequence[dict] = ()) -> FakeOpenAI:
        return FakeOpenAI(self, served_model_name, replica_id)

    async def stats(self, fresh_workers: bool = True) -> dict:
        return {
            "enabled": self.enabled,
            "missing_vectors": self.missing_vectors,
            "pending": 0,
            "late_rows": 0,
            "requests_seen": self.requests,
            "unfinished_requests": len(self.live),
            "cancelled_requests": self.cancelled,
            "vllm_imported": "vllm" in sys.modules,
        }  # the fake-engine tier must never load vLLM

    def healthy(self) -> bool:
        return not self.dead

    def shutdown(self) -> None:
        self.dead = True


class FakeOpenAI:
    """A small OpenAI completions/chat surface: prompt, messages, n, max_tokens, stream."""

    def __init__(self, engine: FakeEngine, model: str, replica_id: str):
        self.engine, self.model, self.replica_id = engine, model, replica_id

    async def handle(
        self, route: str, body: bytes, spec: HiddenStatesFields | None = None
    ) -> AsyncIterator[Head | bytes]:
        async with self.engine.running(), contextlib.aclosing(self._handle(route, body, spec)) as parts:
            async for part in parts:
                yield part

    async def _handle(self, route: str, body: bytes, spec: HiddenStatesFields | None) -> AsyncIterator[Head | bytes]:
        eng = self.engine
        eng.requests += 1
        req = json.loads(body)
        try:  # as the real frontend: the ingress's spec, or this one parses the fields
            spec = spec or parse_fields(req, enabled=eng.enabled)
        except HiddenStatesRequestError as e:
            yield Head(400, error_body(str(e), 400, "BadRequestError", e.param))
            return
        prompt_ids = (
            list(str(req.get("prompt")).encode()) if route == "completions" else eng.chat_prompt(req["messages"])
        )
        n, max_tokens = req.get("n") or 1, req.get("max_tokens") or 4
        ids_asked = bool(req.get("return_token_ids"))  # as vLLM: token ids only when asked for
        with contextlib.ExitStack() as stack:
            try:  # the engine's checks: the fields against the model, then the memory bound
                col = stack.enter_context(eng.collecting(spec)) if spec.return_hidden_states else None
                eng.check_budget(col, len(prompt_ids), max_tokens, n)
            except HiddenStatesRequestError as e:
                yield Head(400, error_body(str(e), 400, "BadRequestError", e.param))
                return
            vectors = None
            if col is not None:
                vectors = ChoiceVectors(eng, col, types.SimpleNamespace(n=n), route, self.replica_id)
            await eng._prefill()
            if not req.get("stream"):
                outs = [await self._generate_choice(prompt_ids, i, max_tokens, col) for i in range(n)]
                payload = {
                    "id": "cmpl-fake",
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": self.model,
                    "prompt_token_ids": prompt_ids if route == "chat" and ids_asked else None,
                    "choices": [self._choice(route, i, prompt_ids, toks, ids_asked) for i, toks in enumerate(outs)],
                }
                if vectors is not None:
                    vectors.fill_response(payload)
                yield Head(200, json.dumps(payload).encode())
                return
            yield STREAM
            for i in range(n):
                toks = eng._generate(prompt_ids, i, max_tokens)
                if col is not None:
                    eng._collect(col, i, prompt_ids, toks)
                for j, tok in enumerate(toks):
                    await eng._tick()
                    if eng.fail_next:
                        eng.fail_next = False
                        raise EngineDeadError("the fake engine died")
                    last = j == len(toks) - 1
                    choice = {"index": i, "text": chr(tok), "finish_reason": "length" if last else None}
                    if ids_asked:
                        choice.update(token_ids=[tok], prompt_token_ids=prompt_ids if j == 0 else None)
                    chunk = "data: " + json.dumps({"id": "cmpl-fake", "choices": [choice]}) + "\n\n"
                    if vectors is not None:
                        chunk = vectors.fill_chunk(chunk)
                    yield chunk.encode()
            yield b"data: [DONE]\n\n"

    async def _generate_choice(self, prompt_ids, i, max_tokens, col) -> list[int]:
        toks = await self.engine._generate_slowly(prompt_ids, i, max_tokens)
        if col is not None:
            self.engine._collect(col, i, prompt_ids, toks)
        return toks

    @staticmethod
    def _choice(route: str, i: int, prompt_ids: list[int], toks: list[int], ids_asked: bool) -> dict:
        text = bytes(toks).decode("latin-1")
        out = {"index": i, "finish_reason": "length", "token_ids": toks if ids_asked else None}
        if route == "completions":
            out.update(text=text, prompt_token_ids=prompt_ids if ids_asked else None)
        else:
            out["message"] = {"role": "assistant", "content": text}
        return out
