"""HiddenStatesEngine: vLLM's AsyncLLM plus the extraction step.

The vector (what every caller gets): the last-layer hidden state of the final
token of prompt+completion, i.e. of `prompt_token_ids + choice.token_ids`:
- the tokens are the token ids vLLM reports for the choice: a generated EOS
  counts; a stop *string* cuts the text but not the token ids used;
- "last layer" is the tensor the LM head consumes, after the model's final
  norm: transformers' `output_hidden_states[-1][0, -1]` on the same ids;
- returned as numpy float32 of shape [hidden_size]; computed in the engine's
  dtype (float32 on CPU by default; bfloat16/float16 widen exactly).

How: when a choice finishes and its request asked, the engine submits a
prefill-only request of those token ids (max one token) flagged with a key;
the runner hook (vllm_patch) sends that row over the side channel; we wait for
the key with a timeout. On the engine that just generated the choice the
prefix cache holds all but the last block, so the step recomputes under one
block of tokens (32 on CPU by default). It is scheduled ahead of waiting
generation (vLLM's priority policy, priority -1), so it does not queue behind
the batch's new prompts.

Two ways in, one path:
- `generate()/complete()/extract()` for Python callers;
- any code that drives the engine through vLLM's EngineClient interface
  (vLLM's own OpenAI serving classes) with request ids built from a base id
  registered with `engine.collecting(base_id)`: the vectors land in that
  collector, keyed by (engine request id, choice index).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

from hidden_states.protocol import HiddenStatesExtractionRequest
from hidden_states.side_channel import HiddenStatesReceiver, HiddenStatesTimeout
from hidden_states.tiny_model import DEFAULT_MODEL, resolve_model
from hidden_states.vllm_patch import ENGINE_ENV, WORKER_EXTENSION, check_vllm_version

logger = logging.getLogger(__name__)


class HiddenStatesDisabledError(RuntimeError):
    """A request asked for hidden states on an engine started without them."""


class HiddenStatesRequestError(ValueError):
    """A hidden-states request this engine cannot serve (bad layer, unsupported model)."""


POSITIONS = ("completion_end", "prompt_end")

# Defaults start() gives the engine when hidden states are on (an explicit
# engine argument wins). vLLM's CPU backend defaults to 128-token blocks, so the
# step would recompute up to 128 tokens; its attention takes multiples of 32.
CPU_EXTRACTION_BLOCK_SIZE = 32
EXTRACTION_PRIORITY = -1  # lower runs first under vLLM's priority policy; requests default to 0


def warm_up_sizes(max_tokens: int) -> list[int]:
    """Every batch size (tokens per step) from 1 to `max_tokens` (the engine's
    max_num_batched_tokens), most useful first: every size up to 64 (decode
    batches), every 8th up to 512 and every 64th beyond (prefill chunks), then the
    rest. A CPU engine is warmed up with as many of them as its time budget allows."""
    first = [*range(1, 65), *range(72, 513, 8), *range(576, max_tokens + 1, 64)]
    first = [n for n in first if n <= max_tokens]
    seen = set(first)
    return first + [n for n in range(1, max_tokens + 1) if n not in seen]


async def _cpu_start_up(llm: Any, prefault_kv_cache: bool, warm_up_s: float, malloc_trim_interval_s: float,
                        timeout_s: float) -> dict[str, Any]:
    """A CPU engine's start-up steps, before it takes requests; returns what they did."""
    out: dict[str, Any] = {}
    if prefault_kv_cache:  # resident memory flat from the start (vllm_patch point 6)
        touched = await llm.collective_rpc("hidden_states_prefault_kv_cache", timeout=timeout_s)
        out["kv_cache_prefaulted_bytes"] = sum(touched)
    if warm_up_s > 0:  # kernel caches at their working size before the first request (point 7)
        sizes = warm_up_sizes(llm.vllm_config.scheduler_config.max_num_batched_tokens)
        done = await llm.collective_rpc("hidden_states_warm_up", timeout=timeout_s + warm_up_s, args=(sizes, warm_up_s))
        out.update(warm_up_batch_sizes=min(n for n, _ in done), warm_up_of=len(sizes),
                   warm_up_seconds=round(max(t for _, t in done), 3))
    if malloc_trim_interval_s > 0:  # free heap pages back to the OS when idle (malloc_trim.py)
        started = await llm.collective_rpc("hidden_states_start_trimmer", timeout=timeout_s,
                                           args=(malloc_trim_interval_s,))
        out["malloc_trim_interval_s"] = malloc_trim_interval_s if all(started) else None
    return out


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@dataclasses.dataclass(frozen=True)
class ExtractionStats:
    tokens: int  # prompt + completion
    cached_tokens: int  # found in the prefix cache
    seconds: float


@dataclasses.dataclass
class HiddenStatesCollector:
    """Per-request sink for vectors, registered with `HiddenStatesEngine.collecting()`."""

    layers: tuple[int, ...] = (-1,)
    position: str = "completion_end"
    # (engine request id, output index) -> {requested layer: float32 [D]}
    vectors: dict[tuple[str, int], dict[int, np.ndarray]] = dataclasses.field(default_factory=dict)
    stats: dict[tuple[str, int], ExtractionStats] = dataclasses.field(default_factory=dict)


def _request_base_ids(request_id: str) -> list[str]:
    # vLLM's OpenAI layer derives engine ids from the base id it was given:
    # "cmpl-{base}-{i}", "chatcmpl-{base}", "chatcmpl-{base}_{i}".
    return re.split(r"[-_]", request_id)


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


def _make_async_llm_class():
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    class ExtractingAsyncLLM(AsyncLLM):
        """AsyncLLM whose generate() runs the extraction step for collected requests."""

        hidden_states: "HiddenStatesEngine"

        async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
            collector = self.hidden_states.collector_for(request_id)
            if collector is None or sampling_params is None or not hasattr(sampling_params, "n"):
                async for out in super().generate(prompt, sampling_params, request_id, *args, **kwargs):
                    yield out
                return
            if collector.position == "prompt_end":
                async for out in self._generate_prompt_end(collector, prompt, sampling_params, request_id, *args, **kwargs):
                    yield out
                return
            sampling_params = self.hidden_states._leave_room_for_extraction(prompt, sampling_params)
            delta = sampling_params.output_kind == RequestOutputKind.DELTA
            tokens: dict[int, list[int]] = {}
            prompt_ids: list[int] | None = None
            async for out in super().generate(prompt, sampling_params, request_id, *args, **kwargs):
                if out.prompt_token_ids is not None:
                    prompt_ids = list(out.prompt_token_ids)
                finished = []
                for o in out.outputs:
                    if delta:
                        tokens.setdefault(o.index, []).extend(o.token_ids)
                    else:
                        tokens[o.index] = list(o.token_ids)
                    if o.finish_reason is not None and (request_id, o.index) not in collector.vectors:
                        finished.append(o.index)
                # Choices finishing together (n > 1, non-streaming) extract together.
                results = await asyncio.gather(*(
                    self.hidden_states.extract_layers(prompt_ids + tokens[i], collector.layers) for i in finished
                ))
                for i, (vecs, stats) in zip(finished, results):
                    collector.vectors[(request_id, i)] = vecs
                    collector.stats[(request_id, i)] = stats
                yield out

        async def _generate_prompt_end(self, collector, prompt, sampling_params, request_id, *args, **kwargs):
            # The generating request itself is flagged: its prefill computes the
            # last prompt position anyway, so no extraction step runs.
            hs = self.hidden_states
            key = uuid.uuid4().hex
            params = sampling_params.clone()
            params.extra_args = {**(params.extra_args or {}),
                                 **HiddenStatesExtractionRequest(key=key, layers=list(collector.layers)).to_extra_args()}
            hs.receiver.expect(key)
            vecs, prompt_len = None, 0
            try:
                async for out in super().generate(prompt, params, request_id, *args, **kwargs):
                    prompt_len = len(out.prompt_token_ids or ()) or prompt_len
                    for o in out.outputs:
                        if o.finish_reason is not None:
                            if vecs is None:  # one prompt, one vector for every choice
                                vecs = hs._by_layer(await hs._wait(key, prompt_len), collector.layers)
                            collector.vectors[(request_id, o.index)] = vecs
                    yield out
            finally:
                hs.receiver.discard(key)

    return ExtractingAsyncLLM


class HiddenStatesEngine:
    """A vLLM v1 engine that returns hidden states of finished completions.

    Start with `await HiddenStatesEngine.start(model, **engine_args)`; stop with
    `shutdown()`. Engine arguments are vLLM's (`AsyncEngineArgs`).
    """

    def __init__(self, llm: Any, receiver: HiddenStatesReceiver | None, extraction_timeout_s: float):
        self.llm = llm
        hf = llm.vllm_config.model_config.hf_config
        self.num_layers = int(hf.num_hidden_layers)
        self.architecture = (getattr(hf, "architectures", None) or ["?"])[0]
        self.eager = bool(llm.vllm_config.model_config.enforce_eager)
        self._collectors: dict[str, HiddenStatesCollector] = {}
        self.receiver = receiver
        self.extraction_timeout_s = extraction_timeout_s
        self.extractions = 0
        self.extraction_tokens = 0
        self.extraction_cached_tokens = 0
        self.extraction_priority = 0  # set by start(): vLLM refuses priorities under its fcfs policy
        self.startup: dict[str, Any] = {}  # set by start(): what the CPU start-up steps did

    @property
    def enabled(self) -> bool:
        return self.receiver is not None

    @classmethod
    async def start(
        cls,
        model: str = DEFAULT_MODEL,
        *,
        enable_return_hidden_states: bool = True,
        extraction_timeout_s: float = 60.0,
        install_timeout_s: float = 120.0,
        prefault_kv_cache: bool = True,
        warm_up_s: float = 10.0,
        malloc_trim_interval_s: float = 5.0,
        **engine_args: Any,
    ) -> "HiddenStatesEngine":
        check_vllm_version()
        os.environ.update(ENGINE_ENV)  # inherited by the engine-core process
        from vllm.engine.arg_utils import AsyncEngineArgs

        engine_args.setdefault("enable_prefix_caching", True)
        if enable_return_hidden_states:
            # The extraction step is one short prefill that a client is waiting on:
            # it goes ahead of queued generation (priority -1), and smaller blocks
            # bound what it recomputes (prefix caching matches whole blocks only).
            engine_args.setdefault("scheduling_policy", "priority")
            if _on_cpu():
                engine_args.setdefault("block_size", CPU_EXTRACTION_BLOCK_SIZE)
        engine_args["worker_extension_cls"] = WORKER_EXTENSION
        args = AsyncEngineArgs(model=resolve_model(model), **engine_args)
        llm = _make_async_llm_class().from_engine_args(args)
        receiver = None
        try:
            startup = await _cpu_start_up(llm, prefault_kv_cache, warm_up_s, malloc_trim_interval_s,
                                          install_timeout_s) if _on_cpu() else {}
            if enable_return_hidden_states:
                receiver = HiddenStatesReceiver()
                receiver.start()
                installed = await llm.collective_rpc("hidden_states_install", timeout=install_timeout_s, args=(receiver.address,))
                logger.info("hidden-states hook installed on %d worker(s)", len(installed))
        except BaseException:
            llm.shutdown()
            if receiver is not None:
                receiver.close()
            raise
        engine = cls(llm, receiver, extraction_timeout_s)
        engine.startup = startup
        engine.extraction_priority = EXTRACTION_PRIORITY if llm.vllm_config.scheduler_config.policy == "priority" else 0
        llm.hidden_states = engine
        return engine

    def check_request(self, layers: Sequence[int] = (-1,), position: str = "completion_end") -> tuple[int, ...]:
        """Raises HiddenStatesRequestError with the fix if this engine cannot serve it."""
        if not self.enabled:
            raise HiddenStatesDisabledError(
                "hidden states are disabled on this engine; start it with enable_return_hidden_states=True"
            )
        if position not in POSITIONS:
            raise HiddenStatesRequestError(f"hidden_states_position must be one of {list(POSITIONS)}, not {position!r}")
        layers = tuple(dict.fromkeys(int(l) for l in layers))
        if not layers:
            raise HiddenStatesRequestError("hidden_states_layers must name at least one layer")
        L = self.num_layers
        bad = [l for l in layers if not -(L + 1) <= l <= L]
        if bad:
            raise HiddenStatesRequestError(
                f"hidden_states_layers {bad} out of range: this model has layers 0..{L} "
                f"(0 = embeddings, {L} = after the final norm; negative counts from the end, -1 = {L})")
        if any(self._absolute(l) != L for l in layers):
            from hidden_states.vllm_patch import SUPPORTED_LAYER_ARCHS

            if self.architecture not in SUPPORTED_LAYER_ARCHS:
                raise HiddenStatesRequestError(
                    f"intermediate hidden_states_layers are supported for the Llama, Qwen2 and Mistral families "
                    f"({', '.join(SUPPORTED_LAYER_ARCHS)}), not {self.architecture}; ask for the last layer (-1) only")
            if not self.eager:
                raise HiddenStatesRequestError(
                    "intermediate hidden_states_layers need an eager engine: start it with enforce_eager=True")
        return layers

    def _leave_room_for_extraction(self, prompt: Any, params: Any) -> Any:
        """The extraction step prefills prompt+completion and asks for one token, so
        prompt+completion must stay below max_model_len: cap max_tokens by one."""
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if ids is None:
            return params
        limit = self.llm.model_config.max_model_len
        room = limit - 1 - len(ids)
        if room < 1:
            raise HiddenStatesRequestError(
                f"a prompt of {len(ids)} tokens leaves no room for a completion with hidden states: "
                f"prompt + completion must stay below max_model_len ({limit}), since the extraction "
                "step needs one more position")
        if params.max_tokens is None or params.max_tokens > room:
            params = params.clone()
            params.max_tokens = room
        return params

    def _absolute(self, layer: int) -> int:
        return layer if layer >= 0 else self.num_layers + 1 + layer

    def _by_layer(self, results, layers: Sequence[int]) -> dict[int, np.ndarray]:
        got = {r.layer: r for r in results}
        return {l: got[self._absolute(l)].to_numpy() for l in layers}

    async def _wait(self, key: str, num_tokens: int):
        try:
            return await self.receiver.wait(key, self.extraction_timeout_s)
        except TimeoutError:
            raise HiddenStatesTimeout(
                f"hidden states for a sequence of {num_tokens} tokens did not arrive within "
                f"{self.extraction_timeout_s:g}s (extraction_timeout_s): the engine is overloaded, "
                "or a side-channel message was lost"
            ) from None

    @contextlib.contextmanager
    def collecting(self, base_id: str, layers: Sequence[int] = (-1,), position: str = "completion_end"):
        """Vectors of every finished choice of requests whose id contains `base_id`."""
        layers = self.check_request(layers, position)
        if base_id in self._collectors:
            raise ValueError(f"request base id {base_id!r} is already collecting")
        collector = self._collectors[base_id] = HiddenStatesCollector(layers, position)
        try:
            yield collector
        finally:
            del self._collectors[base_id]

    def collector_for(self, request_id: str) -> HiddenStatesCollector | None:
        if not self._collectors:
            return None
        for part in _request_base_ids(request_id):
            if part in self._collectors:
                return self._collectors[part]
        return None

    # -- the extraction step --------------------------------------------------

    async def extract_one(self, token_ids: Sequence[int]) -> tuple[np.ndarray, ExtractionStats]:
        """The last-layer hidden state of the final token of `token_ids` (float32 [D])."""
        vecs, stats = await self.extract_layers(token_ids, (-1,))
        return vecs[-1], stats

    async def extract_layers(self, token_ids: Sequence[int], layers: Sequence[int]) -> tuple[dict[int, np.ndarray], ExtractionStats]:
        """The final token's hidden state at each of `layers` (transformers numbering)."""
        layers = self.check_request(layers)
        if not token_ids:
            raise ValueError("extraction needs at least one token id")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        key = uuid.uuid4().hex
        params = SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
            extra_args=HiddenStatesExtractionRequest(key=key, layers=list(layers)).to_extra_args(),
        )
        t0 = time.perf_counter()
        deadline = t0 + self.extraction_timeout_s
        self.receiver.expect(key)
        cached = 0
        try:
            async with asyncio.timeout(self.extraction_timeout_s):
                # AsyncLLM.generate, not ours: an extraction never triggers another.
                async for out in AsyncLLM.generate(self.llm, TokensPrompt(prompt_token_ids=list(token_ids)), params, f"hs-{key}",
                                                  priority=self.extraction_priority):
                    cached = out.num_cached_tokens or 0
            results = await self.receiver.wait(key, max(0.0, deadline - time.perf_counter()))
        except TimeoutError:  # HiddenStatesTimeout included: one message with the configured bound
            self.receiver.discard(key)
            raise HiddenStatesTimeout(
                f"hidden states for a sequence of {len(token_ids)} tokens did not arrive within "
                f"{self.extraction_timeout_s:g}s (extraction_timeout_s): the engine is overloaded, "
                "or a side-channel message was lost"
            ) from None
        except BaseException:
            self.receiver.discard(key)
            raise
        vecs = self._by_layer(results, layers)
        self.extractions += 1
        self.extraction_tokens += len(token_ids)
        self.extraction_cached_tokens += cached
        return vecs, ExtractionStats(len(token_ids), cached, time.perf_counter() - t0)

    async def extract(self, token_id_seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Batch form: the final-token vector of each sequence, in order."""
        outs = await asyncio.gather(*(self.extract_one(ids) for ids in token_id_seqs))
        return [vec for vec, _ in outs]

    # -- generation -----------------------------------------------------------

    async def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, *, return_hidden_states: bool = False,
        layers: Sequence[int] = (-1,), position: str = "completion_end",
    ) -> AsyncIterator[tuple[Any, dict[int, dict[int, np.ndarray]]]]:
        """vLLM RequestOutputs, each with {choice index: {layer: vector}} of the choices it finished."""
        base = uuid.uuid4().hex
        request_id = f"{request_id}-{base}"
        with self.collecting(base, layers, position) if return_hidden_states else contextlib.nullcontext() as collector:
            async for out in self.llm.generate(prompt, sampling_params, request_id):
                done = {o.index: collector.vectors[(request_id, o.index)] for o in out.outputs
                        if collector is not None and o.finish_reason is not None}
                yield out, done

    async def complete(
        self, prompt: str | Sequence[int], sampling_params: Any = None, *, return_hidden_states: bool = True,
        layers: Sequence[int] = (-1,), position: str = "completion_end",
    ) -> Completion:
        """One prompt (text or token ids) to a finished Completion with a vector per choice."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = (sampling_params or SamplingParams()).clone()
        params.output_kind = RequestOutputKind.FINAL_ONLY
        base = uuid.uuid4().hex
        request_id = f"cmpl-{base}"
        if isinstance(prompt, str):
            prompt = self.llm.tokenizer.encode(prompt)
        engine_prompt = {"prompt_token_ids": list(prompt)}
        final = None
        with self.collecting(base, layers, position) if return_hidden_states else contextlib.nullcontext(HiddenStatesCollector()) as collector:
            async for out in self.llm.generate(engine_prompt, params, request_id):
                final = out
        return Completion(
            request_id=request_id,
            prompt_token_ids=tuple(final.prompt_token_ids),
            choices=tuple(
                CompletionChoice(
                    o.index, o.text, tuple(o.token_ids), o.finish_reason,
                    (collector.vectors.get((request_id, o.index)) or {}).get(-1),
                    collector.stats.get((request_id, o.index)),
                    collector.vectors.get((request_id, o.index)),
                )
                for o in final.outputs
            ),
        )

    # -- operations -----------------------------------------------------------

    async def stats(self) -> dict:
        workers = await self.llm.collective_rpc("hidden_states_stats", timeout=30) if self.enabled else []
        return {
            "enabled": self.enabled,
            "extractions": self.extractions,
            "extraction_tokens": self.extraction_tokens,
            "extraction_cached_tokens": self.extraction_cached_tokens,
            "pending": self.receiver.num_pending if self.receiver else 0,
            "malformed_frames": self.receiver.malformed_frames if self.receiver else 0,
            "unclaimed_results": self.receiver.unclaimed_results if self.receiver else 0,
            "workers": workers,
            "startup": self.startup,
        }

    def shutdown(self) -> None:
        self.llm.shutdown()
        if self.receiver is not None:
            self.receiver.close()

