"""The extraction step and its bookkeeping, on vLLM's AsyncLLM.

When a tagged request's choice finishes, `ExtractingAsyncLLM.generate` submits
a prefill-only request of prompt+completion (max one token) flagged with a key
for the runner hook (worker.py), and files the vector it sends back in the
request's collector, under the token sequence it belongs to. Collectors are
found by the tag a request carries in `SamplingParams.extra_args` (an OpenAI
request's `vllm_xargs`), never by parsing vLLM's request ids. vLLM's beam
search makes its own untagged one-token requests per step; `extract_beams`
extracts its returned beams instead. Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

from hidden_states.engine import ExtractionStats, HiddenStatesCollector, MissingHiddenStatesError
from hidden_states.params import HiddenStatesRequestError
from hidden_states.protocol import COLLECTOR_TAG_KEY, HiddenStatesExtractionRequest
from hidden_states.side_channel import HiddenStatesTimeout


def make_async_llm_class():
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    class ExtractingAsyncLLM(AsyncLLM):
        """AsyncLLM whose generate() runs the extraction step for tagged requests."""

        hidden_states: "Extraction"

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
            hs = self.hidden_states
            sampling_params = hs._leave_room_for_extraction(prompt, sampling_params)
            tail_key = None
            if hs.takes_tail(sampling_params):
                # The engine holds the request's finish for one step and captures its final
                # token's row then (scheduler.py): no extraction request at all.
                tail_key = uuid.uuid4().hex
                sampling_params = sampling_params.clone()
                sampling_params.extra_args = {**(sampling_params.extra_args or {}), **HiddenStatesExtractionRequest(
                    key=tail_key, layers=list(collector.layers), tail=True).to_extra_args()}
                hs.receiver.expect(tail_key)
            delta = sampling_params.output_kind == RequestOutputKind.DELTA
            tokens: dict[int, list[int]] = {}
            prompt_ids: list[int] | None = None
            try:
                async for out in super().generate(prompt, sampling_params, request_id, *args, **kwargs):
                    if out.prompt_token_ids is not None:
                        prompt_ids = list(out.prompt_token_ids)
                    finished = []
                    for o in out.outputs:
                        if delta:
                            tokens.setdefault(o.index, []).extend(o.token_ids)
                        else:
                            tokens[o.index] = list(o.token_ids)
                        if o.finish_reason is not None and o.finish_reason not in ("abort", "error"):
                            finished.append(collector.key(prompt_ids, tokens[o.index]))
                    if tail_key is not None and finished:
                        await hs.collect_tail(collector, tail_key, finished[0])
                    else:
                        # Choices finishing together (n > 1, non-streaming) extract together;
                        # identical sequences once.
                        await hs.extract_into(collector, finished)
                    yield out
            finally:
                if tail_key is not None:
                    hs.receiver.discard(tail_key)

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


class Extraction:
    """The engine's extraction step (mixed into HiddenStatesEngine, which sets `llm`,
    `receiver`, `num_layers`, `extraction_timeout_s`, `extraction_priority`, the
    counters and `_collectors`)."""

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
        self.timeouts += 1
        return HiddenStatesTimeout(
            f"hidden states for a sequence of {num_tokens} tokens did not arrive within "
            f"{self.extraction_timeout_s:g}s (extraction_timeout_s): the engine is overloaded, "
            "or a side-channel message was lost")

    @contextlib.contextmanager
    def collecting(self, layers: Sequence[int] = (-1,), position: str = "completion_end"):
        """A collector for one request's vectors: tag its sampling params with
        `collector.extra_args` (SamplingParams.extra_args, or an OpenAI request's `vllm_xargs`)."""
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

    def takes_tail(self, params: Any) -> bool:
        """Whether the tail step (scheduler.py) captures this generating request's vector:
        one choice, a stop the engine sees (stop strings are cut in the frontend, which
        then aborts), no grammar (its matcher is done once the request stops)."""
        return (self.tail_enabled and params.n == 1 and not params.stop
                and getattr(params, "structured_outputs", None) is None)

    async def collect_tail(self, collector: HiddenStatesCollector, key: str, seq: tuple[int, ...]) -> None:
        """The vector the tail step sent for `seq` (one position computed: the final token)."""
        t0 = time.perf_counter()
        collector.vectors[seq] = self._by_layer(await self._wait(key, len(seq)), collector.layers)
        collector.stats[seq] = ExtractionStats(len(seq), len(seq) - 1, time.perf_counter() - t0, via="tail")
        self.tails += 1

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
