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
- `complete()/extract()` for Python callers;
- any code that drives the engine through vLLM's EngineClient interface
  (vLLM's own OpenAI serving classes) with sampling params tagged by a
  collector (`with engine.collecting() as c: c.tag(params)`; an OpenAI
  request carries the tag in `vllm_xargs`, which vLLM copies into
  `SamplingParams.extra_args`): the vectors land in that collector, keyed by
  the token sequence they belong to (`collector.key(prompt_ids, token_ids)`),
  so a response choice finds its vector from its own token ids, whatever
  request ids vLLM made up on the way.
- beam search (vLLM's serving runs it as one-token engine requests per step,
  which carry no tag): `extract_beams()` wraps its final output and extracts
  one vector per returned beam.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

from hidden_states.preflight import EngineStartupError, check_architecture, check_cpu_memory, check_model_folder
from hidden_states.params import (HiddenStatesDisabledError, HiddenStatesRequestError, check_layers,
                                  check_position)
from hidden_states.protocol import COLLECTOR_TAG_KEY, HiddenStatesExtractionRequest
from hidden_states.side_channel import HiddenStatesReceiver, HiddenStatesTimeout
from hidden_states.tiny_model import DEFAULT_MODEL, resolve_model
from hidden_states.vllm_patch import ENGINE_ENV, WORKER_EXTENSION, check_vllm_version

logger = logging.getLogger(__name__)




class MissingHiddenStatesError(RuntimeError):
    """A choice finished without its vector although the request asked for it (a bug:
    the request fails rather than return a partial answer)."""



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


def _preflight(model: str, engine_args: dict[str, Any]) -> str:
    """The model's local path, after the checks that give a start-up failure its real cause."""
    try:
        path = resolve_model(model)
    except Exception as e:
        raise EngineStartupError(f"the built-in model {model} could not be built: {e}") from e
    cfg = check_model_folder(path)
    if cfg is not None:
        from vllm.model_executor.models import ModelRegistry

        check_architecture(cfg, path, set(ModelRegistry.get_supported_archs()))
    if _on_cpu():
        check_cpu_memory(path, engine_args.get("kv_cache_memory_bytes"))
    return path


def _execution_mode(cfg: Any) -> dict[str, Any]:
    """What decides how the runner hook runs (patch ledger): logged and in stats."""
    comp = cfg.compilation_config
    return {
        "enforce_eager": bool(cfg.model_config.enforce_eager),
        "async_scheduling": bool(getattr(cfg.scheduler_config, "async_scheduling", False)),
        "cudagraph_mode": str(getattr(comp, "cudagraph_mode", None)),
        "compilation_mode": str(getattr(comp, "mode", getattr(comp, "level", None))),
        "v2_model_runner": os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") == "1",
    }


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
    """Per-request sink for vectors, registered with `HiddenStatesEngine.collecting()`.

    Engine requests reach it through `tag` in their `SamplingParams.extra_args`.
    Vectors are keyed by the token sequence they are the final-token state of, so
    identical choices share one extraction and a choice finds its own vector."""

    tag: str
    layers: tuple[int, ...] = (-1,)
    position: str = "completion_end"
    # key(prompt ids, completion ids) -> {requested layer: float32 [D]}
    vectors: dict[tuple[int, ...], dict[int, np.ndarray]] = dataclasses.field(default_factory=dict)
    stats: dict[tuple[int, ...], ExtractionStats] = dataclasses.field(default_factory=dict)

    def key(self, prompt_token_ids: Sequence[int], token_ids: Sequence[int]) -> tuple[int, ...]:
        """The token sequence whose final-token vector a choice carries."""
        if self.position == "prompt_end":
            return tuple(prompt_token_ids)
        return (*prompt_token_ids, *token_ids)

    def tag_params(self, params: Any) -> Any:
        """A copy of `params` (vLLM SamplingParams) whose engine requests land here."""
        params = params.clone()
        params.extra_args = {**(params.extra_args or {}), COLLECTOR_TAG_KEY: self.tag}
        return params

    def vectors_for(self, prompt_token_ids: Sequence[int], token_ids: Sequence[int]) -> dict[int, np.ndarray] | None:
        return self.vectors.get(self.key(prompt_token_ids, token_ids))


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
        """AsyncLLM whose generate() runs the extraction step for tagged requests."""

        hidden_states: "HiddenStatesEngine"

        async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
            collector = self.hidden_states.collector_for(sampling_params)
            if collector is None:
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
                    if o.finish_reason is not None:
                        finished.append(collector.key(prompt_ids, tokens[o.index]))
                # Choices finishing together (n > 1, non-streaming) extract together;
                # identical sequences once.
                await self.hidden_states.extract_into(collector, finished)
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
            prompt_ids: list[int] = []
            try:
                async for out in super().generate(prompt, params, request_id, *args, **kwargs):
                    prompt_ids = list(out.prompt_token_ids or ()) or prompt_ids
                    if any(o.finish_reason is not None for o in out.outputs):
                        seq = collector.key(prompt_ids, ())
                        if seq not in collector.vectors:  # one prompt, one vector for every choice
                            collector.vectors[seq] = hs._by_layer(await hs._wait(key, len(prompt_ids)), collector.layers)
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
        self.missing_vectors = 0  # choices that finished without their vector (each failed its request)
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
        path = _preflight(model, engine_args)
        args = AsyncEngineArgs(model=path, **engine_args)
        try:
            llm = _make_async_llm_class().from_engine_args(args)
        except Exception as e:
            raise EngineStartupError(
                f"the vLLM engine for {model} failed to start ({type(e).__name__}: {e}); vLLM logs the root cause "
                "from its engine-core process just above this error in the replica's log") from e
        receiver, installed = None, []
        try:
            startup = await _cpu_start_up(llm, prefault_kv_cache, warm_up_s, malloc_trim_interval_s,
                                          install_timeout_s) if _on_cpu() else {}
            if enable_return_hidden_states:
                receiver = HiddenStatesReceiver()
                receiver.start()
                installed = await llm.collective_rpc("hidden_states_install", timeout=install_timeout_s, args=(receiver.address,))
                logger.info("hidden-states hook installed on %d worker(s); intermediate layers: %s", len(installed),
                            installed[0]["layer_capture_reason"] or "yes")
        except BaseException:
            llm.shutdown()
            if receiver is not None:
                receiver.close()
            raise
        engine = cls(llm, receiver, extraction_timeout_s)
        engine.startup = {**startup, **_execution_mode(llm.vllm_config)}
        logger.info("engine execution mode: %s", _execution_mode(llm.vllm_config))
        # What the workers found at install (vllm_patch.layer_capture_support); check_request reads it.
        engine.layer_capture = {**installed[0], "layer_capture": all(w["layer_capture"] for w in installed)} \
            if installed else None
        engine.extraction_priority = EXTRACTION_PRIORITY if llm.vllm_config.scheduler_config.policy == "priority" else 0
        llm.hidden_states = engine
        return engine

    def check_request(self, layers: Sequence[int] = (-1,), position: str = "completion_end") -> tuple[int, ...]:
        """Raises HiddenStatesRequestError with the fix if this engine cannot serve it."""
        if not self.enabled:
            raise HiddenStatesDisabledError()
        check_position(position)
        layers = check_layers(layers, self.num_layers)
        L = self.num_layers
        if any(self._absolute(l) != L for l in layers):
            from hidden_states.vllm_patch import SUPPORTED_LAYER_ARCHS

            # The workers' install result; without one (no engine), the checked architectures.
            found = getattr(self, "layer_capture", None)
            if not (found["layer_structure"] if found else self.architecture in SUPPORTED_LAYER_ARCHS):
                why = f" ({found['layer_capture_reason']})" if found else ""
                families = ", ".join(a.removesuffix("ForCausalLM") for a in SUPPORTED_LAYER_ARCHS)
                raise HiddenStatesRequestError(
                    "intermediate hidden_states_layers need decoder layers that carry the residual stream as "
                    f"forward(positions, hidden_states, residual), as the {families} families do; "
                    f"not {self.architecture}{why}; ask for the last layer (-1) only", "hidden_states_layers")
            if not self.eager:
                raise HiddenStatesRequestError(
                    "intermediate hidden_states_layers need an eager engine: start it with enforce_eager=True",
                    "hidden_states_layers")
            if found and not found["layer_capture"]:
                raise HiddenStatesRequestError(
                    f"intermediate hidden_states_layers are unavailable on this engine: "
                    f"{found['layer_capture_reason'] or 'not every worker hooked its decoder layers'}",
                    "hidden_states_layers")
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
                "step needs one more position", "prompt")
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
            raise self._timed_out(num_tokens) from None

    def _timed_out(self, num_tokens: int) -> HiddenStatesTimeout:
        return HiddenStatesTimeout(
            f"hidden states for a sequence of {num_tokens} tokens did not arrive within "
            f"{self.extraction_timeout_s:g}s (extraction_timeout_s): the engine is overloaded, "
            "or a side-channel message was lost")

    @contextlib.contextmanager
    def collecting(self, layers: Sequence[int] = (-1,), position: str = "completion_end"):
        """A collector for one request's vectors: tag its sampling params with
        `collector.tag_params()` (or its OpenAI request's `vllm_xargs` with `collector.tag`)."""
        layers = self.check_request(layers, position)
        collector = HiddenStatesCollector(uuid.uuid4().hex, layers, position)
        self._collectors[collector.tag] = collector
        try:
            yield collector
        finally:
            del self._collectors[collector.tag]

    def collector_for(self, sampling_params: Any) -> HiddenStatesCollector | None:
        extra = getattr(sampling_params, "extra_args", None)
        if not extra or not self._collectors:
            return None
        tag = extra.get(COLLECTOR_TAG_KEY)
        return None if tag is None else self._collectors.get(tag)

    def missing(self, what: str) -> MissingHiddenStatesError:
        """Counts a choice that finished without its vector; the error to fail its request with."""
        self.missing_vectors += 1
        return MissingHiddenStatesError(
            f"{what} finished without its hidden states although the request asked for them; the request "
            "fails rather than return a partial answer (a server bug: please report it)")

    async def extract_into(self, collector: HiddenStatesCollector, sequences: Sequence[tuple[int, ...]]) -> None:
        """Extracts each sequence's final-token vector into the collector, once per distinct sequence."""
        todo = [seq for seq in dict.fromkeys(sequences) if seq not in collector.vectors]
        results = await asyncio.gather(*(self.extract_layers(seq, collector.layers) for seq in todo))
        for seq, (vecs, stats) in zip(todo, results):
            collector.vectors[seq] = vecs
            collector.stats[seq] = stats

    async def extract_beams(self, outputs: AsyncIterator[Any], collector: HiddenStatesCollector) -> AsyncIterator[Any]:
        """vLLM's beam search output with one extraction per returned beam, on that
        beam's own prompt + token_ids (its per-step engine requests carry no tag)."""
        async for out in outputs:
            done = [collector.key(out.prompt_token_ids, o.token_ids) for o in out.outputs if o.finish_reason is not None]
            if done and collector.position == "prompt_end":
                # Beam steps are not flagged: the prompt's vector comes from a (cached) extraction.
                if done[0] not in collector.vectors:
                    collector.vectors[done[0]] = (await self.extract_layers(done[0], collector.layers))[0]
            else:
                await self.extract_into(collector, done)
            yield out

    def beam_search_room(self, prompt_len: int, max_tokens: int) -> int:
        """max_tokens for a beam search whose beams each need one more position to extract."""
        return max(1, min(max_tokens, self.llm.model_config.max_model_len - 1 - prompt_len))

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
            raise self._timed_out(len(token_ids)) from None
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

    async def complete(
        self, prompt: str | Sequence[int], sampling_params: Any = None, *, return_hidden_states: bool = True,
        layers: Sequence[int] = (-1,), position: str = "completion_end",
    ) -> Completion:
        """One prompt (text or token ids) to a finished Completion with a vector per choice."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = (sampling_params or SamplingParams()).clone()
        params.output_kind = RequestOutputKind.FINAL_ONLY
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if isinstance(prompt, str):
            prompt = self.llm.tokenizer.encode(prompt)
        engine_prompt = {"prompt_token_ids": list(prompt)}
        final, choices = None, []
        with self.collecting(layers, position) if return_hidden_states else contextlib.nullcontext() as collector:
            if collector is not None:
                params = collector.tag_params(params)
            async for out in self.llm.generate(engine_prompt, params, request_id):
                final = out
        for o in final.outputs:
            vecs = stats = None
            if collector is not None:
                seq = collector.key(final.prompt_token_ids, o.token_ids)
                vecs, stats = collector.vectors.get(seq), collector.stats.get(seq)
                if vecs is None:
                    raise self.missing(f"choice {o.index}")
            choices.append(CompletionChoice(o.index, o.text, tuple(o.token_ids), o.finish_reason,
                                            None if vecs is None else vecs.get(-1), stats, vecs))
        return Completion(request_id=request_id, prompt_token_ids=tuple(final.prompt_token_ids), choices=tuple(choices))

    # -- operations -----------------------------------------------------------

    async def stats(self) -> dict:
        workers = await self.llm.collective_rpc("hidden_states_stats", timeout=30) if self.enabled else []
        return {
            "enabled": self.enabled,
            "extractions": self.extractions,
            "extraction_tokens": self.extraction_tokens,
            "extraction_cached_tokens": self.extraction_cached_tokens,
            "missing_vectors": self.missing_vectors,
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

