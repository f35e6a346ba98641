"""The engine interface the Serve layer uses, and what crosses it.

The vector (what every caller gets): the last-layer hidden state of the final
token of prompt+completion, i.e. of `prompt_token_ids + choice.token_ids`:
- the tokens are the token ids the engine reports for the choice: a generated
  EOS counts; a stop *string* cuts the text but not the token ids used;
- "last layer" is the tensor the LM head consumes, after the model's final
  norm: transformers' `output_hidden_states[-1][0, -1]` on the same ids;
- returned as numpy float32 of shape [hidden_size].

`Engine` is what a replica needs: start, the OpenAI routes, Python-handle
completions, stats, health. `hidden_states.vllm.engine.HiddenStatesEngine` is
the real one (vLLM; it is the only code that imports vllm, with the rest of
`hidden_states/vllm/`); `hidden_states.testing.FakeEngine` stands in for the
Serve layer's unit tests. Vectors are collected per request by a
`HiddenStatesCollector`, filed by engine request and choice.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, Callable, Protocol

import numpy as np

from hidden_states.protocol import COLLECTOR_TAG_KEY

logger = logging.getLogger(__name__)


class MissingHiddenStatesError(RuntimeError):
    """A choice finished without its vector although the request asked for it (a bug:
    the request fails rather than return a partial answer)."""


class HiddenStatesTimeout(TimeoutError):
    """An extraction step that did not finish within `extraction_timeout_s`."""




@dataclasses.dataclass(frozen=True)
class ExtractionStats:
    tokens: int  # prompt + completion
    cached_tokens: int  # found in the prefix cache (the tail step: every token but the final one)
    seconds: float  # from the choice's end in the engine's output to its vector
    via: str = "extraction"  # "tail": the engine's extra decode row; "extraction": a prefill request

    @property
    def computed_tokens(self) -> int:
        """Positions computed to get the vector: 1 is the floor."""
        return self.tokens - self.cached_tokens


ChoiceKey = tuple[int, int]  # (the request's prompt ordinal, the choice's index within that prompt)


@dataclasses.dataclass
class HiddenStatesCollector:
    """Per-request sink for vectors, registered with `HiddenStatesEngine.collecting()`.

    Engine requests reach it through `tag` in their `SamplingParams.extra_args`.
    Vectors are filed by engine request and choice: (the prompt's ordinal in the
    OpenAI request, the choice's index among that prompt's n), which is how vLLM's
    serving numbers response choices (`ordinal * n + index`)."""

    tag: str
    layers: tuple[int, ...] = (-1,)
    position: str = "completion_end"
    vectors: dict[ChoiceKey, dict[int, np.ndarray]] = dataclasses.field(default_factory=dict)  # {layer: float32 [D]}
    stats: dict[ChoiceKey, "ExtractionStats"] = dataclasses.field(default_factory=dict)

    @property
    def extra_args(self) -> dict[str, str]:
        """What an engine request carries (SamplingParams.extra_args, an OpenAI request's
        vllm_xargs) for its vectors to land here."""
        return {COLLECTOR_TAG_KEY: self.tag}

    def put(self, key: ChoiceKey, vectors: dict[int, np.ndarray], stats: "ExtractionStats | None") -> None:
        self.vectors[key] = vectors
        if stats is not None:
            self.stats[key] = stats


@dataclasses.dataclass(frozen=True)
class CompletionChoice:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    hidden_states: np.ndarray | None  # float32 [hidden_size]: the last layer, if it was asked for
    extraction: ExtractionStats | None = None  # None for prompt_end: no extraction step
    hidden_states_by_layer: dict[int, np.ndarray] | None = None  # requested layer -> vector


@dataclasses.dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    choices: tuple[CompletionChoice, ...]


@dataclasses.dataclass(frozen=True)
class VectorEvent:
    """One vector handed to a caller: what metrics count (deployments/metrics.py)."""

    position: str  # completion_end | prompt_end
    via: str  # tail | extraction | prompt (the prefill the engine ran anyway)
    computed_tokens: int | None
    cached_tokens: int | None
    seconds: float | None
    nbytes: int  # the vector(s) as sent, all layers


class VectorObservers:
    """Callbacks for every vector an engine hands out (a replica registers its metrics)."""

    def __init__(self):
        self.observers: list[Callable[[VectorEvent], None]] = []

    def vector_sent(self, position: str, stats: "ExtractionStats | None", nbytes: int) -> None:
        event = VectorEvent(position, stats.via if stats else "prompt", stats.computed_tokens if stats else None,
                            stats.cached_tokens if stats else None, stats.seconds if stats else None, nbytes)
        for observe in self.observers:
            try:
                observe(event)
            except Exception:  # metrics never fail a request
                logger.exception("a vector observer failed")


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """What a Python-handle completion may ask for (the OpenAI routes take vLLM's whole surface)."""

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


class Engine(Protocol):
    """What an EngineReplica needs of its engine."""

    enabled: bool  # hidden states on

    @classmethod
    async def start(cls, model: str, **kwargs: Any) -> "Engine": ...

    async def openai(self, served_model_name: str, replica_id: str) -> "OpenAIRoutes": ...

    async def complete(self, prompt: str | Sequence[int], options: SamplingOptions, *, return_hidden_states: bool,
                       layers: Sequence[int], position: str) -> Completion: ...

    async def stats(self) -> dict: ...

    def healthy(self) -> bool: ...

    def shutdown(self) -> None: ...


class OpenAIRoutes(Protocol):
    def handle(self, route: str, body: bytes) -> AsyncIterator[tuple[int, bytes] | bytes]:
        """(status, whole body), or (200, b"") then SSE chunks."""
        ...
