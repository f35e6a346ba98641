"""The frontend half: rows off vLLM's outputs, and the extraction step where none came.

`ExtractingAsyncLLM` is vLLM's AsyncLLM whose output processor first takes each EngineCoreOutput's
`EngineMessage` into the collector of the engine request that asked (`Extraction.live`: each request's one
state, by its tag; its engine requests' capture keys are `{tag}.{n}`), and whose `generate()` flags tagged
requests with their span (`protocol.Span`). Positions a finished choice asked for that no step computed
come from one extraction step (`extract_rows`): a prefill-only request, with its own cache salt where the
prefix cache would skip them. Beam search: `extract_beams`. Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import numpy as np

from hidden_states import steering
from hidden_states.interface import (
    ChoiceKey,
    ExtractionStats,
    HiddenStatesCollector,
    HiddenStatesTimeout,
    HookFaultError,
    MissingHiddenStatesError,
    PooledSum,
    RowBatch,
)
from hidden_states.params import (
    DEFAULT_MAX_HIDDEN_STATES_BYTES,
    HiddenStatesFields,
    HiddenStatesRequestError,
    Span,
    absolute_layer,
    check_room,
    check_rows_budget,
    room_for_completion,
)
from hidden_states.protocol import (
    OUTPUT_KEY,
    SPEC_KEY,
    CapturedRows,
    CaptureSpec,
    EngineMessage,
    HiddenStatesProtocolError,
    HookFault,
    RequestSpec,
    SteeredReport,
    SteerEntry,
    StopReport,
)
from hidden_states.vllm.patches import install

_FAILED = ("abort", "error")
logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Origin:
    """What an extraction step takes from the request it serves: adapter, cache salt, priority, and a
    multimodal prompt's processed inputs (vLLM's MultiModalInput: items, hashes, placeholders), so the
    step sees the same images and audio (by their hashes: the engine core's caches) as the request."""

    lora_request: Any = None
    cache_salt: str | None = None
    priority: int = 0
    mm: Any = None  # (mm_kwargs, mm_hashes, mm_placeholders) of a multimodal prompt
    embeds: Any = None  # a prompt_embeds prompt's embeddings [P, D] (torch)
    steering: tuple[SteerEntry, ...] = ()  # the request's anchored steering: the step is steered the same
    # Renders the request's messages again (a coroutine function -> its engine input); set where some
    # item travels as its hash alone (`by_hash`), which the engine core's processor cache may evict
    rerender: Any = None

    @staticmethod
    def of(prompt: Any, kwargs: dict, steering: Sequence[SteerEntry] = (), rerender: Any = None) -> Origin:
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        mm = embeds = None
        if isinstance(prompt, dict) and prompt.get("type") == "multimodal":
            mm = (prompt["mm_kwargs"], prompt["mm_hashes"], prompt["mm_placeholders"])
        elif isinstance(prompt, dict) and prompt.get("type") == "embeds":
            embeds = prompt["prompt_embeds"]
        origin = Origin(kwargs.get("lora_request"), salt, int(kwargs.get("priority") or 0), mm, embeds, tuple(steering))
        return dataclasses.replace(origin, rerender=rerender) if origin.by_hash() else origin

    def by_hash(self) -> bool:
        """Whether an item travels as its hash alone (vLLM's frontend sent it before: the engine core's
        processor cache fills it in, unless it evicted it since)."""
        return self.mm is not None and any(item is None for items in self.mm[0].values() for item in items)

    async def resend(self) -> Origin | None:
        """This origin with every item's data: the messages rendered again (vLLM's frontend dropped the
        hashes the core reported missing, so it sends their data now); None if that cannot be done or
        gives other placeholders."""
        if self.rerender is None:
            return None
        prompt = await self.rerender()
        if (
            not (isinstance(prompt, dict) and prompt.get("type") == "multimodal")
            or prompt["mm_hashes"] != self.mm[1]
            or prompt["mm_placeholders"] != self.mm[2]
        ):
            return None
        return dataclasses.replace(
            self, mm=(prompt["mm_kwargs"], prompt["mm_hashes"], prompt["mm_placeholders"]), rerender=None
        )

    def prompt(self, token_ids: Sequence[int], cache_salt: str | None) -> dict:
        """The engine input of an extraction step over `token_ids` (the prompt's, then the completion's):
        the same multimodal items at the same placeholders, which all lie in the prompt; or the same
        prompt embeddings followed by the completion's token ids (vLLM's mixed input, `is_token_ids`)."""
        from vllm.inputs.engine import embeds_input, mm_input, tokens_input

        if self.mm is not None:
            return mm_input(list(token_ids), *self.mm, cache_salt=cache_salt)
        if self.embeds is not None:
            import torch

            P, T = len(self.embeds), len(token_ids)
            tail = torch.zeros(T - P, self.embeds.shape[1], dtype=self.embeds.dtype, device=self.embeds.device)
            return embeds_input(
                torch.cat([self.embeds, tail]),
                cache_salt=cache_salt,
                prompt_token_ids=[0] * P + list(token_ids[P:]),
                is_token_ids=[False] * P + [True] * (T - P),
            )
        return tokens_input(list(token_ids), cache_salt=cache_salt)

    def modalities(self) -> list[dict]:
        """Which prompt positions are which modality's placeholder tokens: [{modality, start, end}]."""
        if self.mm is None:
            return []
        spans = [
            {"modality": modality, "start": r.offset, "end": r.offset + r.length}
            for modality, ranges in self.mm[2].items()
            for r in ranges
        ]
        return sorted(spans, key=lambda s: s["start"])


def prompt_length(prompt: Any) -> int | None:
    """Positions of an engine input's prompt: its token ids (a multimodal one's include the
    placeholders) or its embeddings; None if it is neither."""
    if not isinstance(prompt, dict):
        return None
    if prompt.get("prompt_token_ids") is not None:
        return len(prompt["prompt_token_ids"])
    return len(prompt["prompt_embeds"]) if prompt.get("prompt_embeds") is not None else None


def prompt_ordinal(request_id: str) -> int:
    """Which prompt of an OpenAI request an engine request serves: vLLM's completions serving
    names them `{request_id}-{i}` (ledger point 10); chat and Python callers send one prompt."""
    tail = request_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() and len(tail) < 6 else 0


def _caller_request_id(state: Any) -> str | None:
    """The request id `generate()` was called with, of an output processor's request state (n > 1: the
    parent's)."""
    if state is None:
        return None
    parent = getattr(state, "parent_req", None)
    return getattr(parent if parent is not None else state, "external_req_id", None)


def make_async_llm_class():
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    class ExtractingAsyncLLM(AsyncLLM):
        """AsyncLLM whose outputs bring vectors, and whose generate() files them."""

        extraction: Extraction  # set by HiddenStatesEngine.start()

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            processor = self.output_processor

            def take_ours(engine_core_outputs):
                hs = getattr(self, "extraction", None)
                if hs is not None and hs.live:
                    for eco in engine_core_outputs:
                        params = eco.kv_transfer_params
                        if params is not None and OUTPUT_KEY in params:
                            raw = params.pop(OUTPUT_KEY)
                            if not params:
                                eco.kv_transfer_params = None
                            state = processor.request_states.get(eco.request_id)
                            caller = _caller_request_id(state) or eco.request_id
                            hs.receive(caller, raw, state.request_index if state is not None else None)

            # before vLLM's process_outputs reads them (ledger point 10, hidden_states/vllm/patches/output_rows.py)
            install("frontend", "async_llm", llm=self, before=take_ours)

        def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
            """vLLM's own generator for a request that asks for nothing (no layer of ours per output)."""
            hs = getattr(self, "extraction", None)
            collector = hs.collector_for(sampling_params) if hs is not None else None
            if collector is None:
                return super().generate(prompt, sampling_params, request_id, *args, **kwargs)
            return self._generate_with_vectors(hs, collector, prompt, sampling_params, request_id, *args, **kwargs)

        async def _generate_with_vectors(self, hs, collector, prompt, sampling_params, request_id, *args, **kwargs):
            prompt_end = collector.position == "prompt_end"
            # its one spec, its owner in its key (Extraction.owner); of what the caller's spec said, only a test's
            # injected fault stays (honoured only under FAULT_INJECTION_ENV)
            inject = RequestSpec.of(sampling_params.extra_args).inject
            ours = RequestSpec(key=f"{collector.tag}.{uuid.uuid4().hex}", inject=inject)
            if collector.steering:  # before the Origin: the extraction step is steered and salted the same
                prompt, steer = hs._steer(collector, prompt)
                ours = ours.replace(steer=steer)
            if not prompt_end and collector.captures:
                sampling_params = hs._leave_room_for_extraction(prompt, sampling_params)
            key, ordinal = ours.key, prompt_ordinal(request_id)
            origin = Origin.of(prompt, kwargs, ours.steer, collector.rerender)
            if collector.captures or collector.monitors or collector.conditional:
                prompt, capture = hs._flag(collector, prompt, sampling_params)
                ours = ours.replace(capture=capture)
            sampling_params = sampling_params.clone()
            sampling_params.extra_args = ours.into(sampling_params.extra_args)
            collector.prompt_lens[ordinal] = prompt_length(prompt)
            if origin.mm is not None:
                collector.modalities[ordinal] = origin.modalities()
            delta = sampling_params.output_kind == RequestOutputKind.DELTA
            tokens: dict[int, list[int]] = {}
            prompt_ids: list[int] = []
            hs.engine_request(collector, key, ordinal)
            settled: set[int] = set()  # cumulative outputs repeat finished choices
            try:
                # closed when this generator ends or raises: vLLM aborts the engine request at once
                async with contextlib.aclosing(
                    AsyncLLM.generate(self, prompt, sampling_params, request_id, *args, **kwargs)
                ) as outputs:
                    async for out in outputs:
                        hs.raise_fault(collector, key, request_id)
                        if out.prompt_token_ids is not None:
                            prompt_ids = list(out.prompt_token_ids)
                        finished = []
                        for o in out.outputs:
                            if delta:
                                tokens.setdefault(o.index, []).extend(o.token_ids)
                            else:
                                tokens[o.index] = list(o.token_ids)
                            if (
                                o.finish_reason is not None
                                and o.finish_reason not in _FAILED
                                and o.index not in settled
                            ):
                                finished.append(o.index)
                                settled.add(o.index)
                        if finished:
                            await hs.finish_choices(collector, ordinal, prompt_ids, tokens, finished, origin)
                        yield out
            finally:
                hs.engine_request_ended(collector, key)

    return ExtractingAsyncLLM


class Extraction:
    """One engine's frontend half: the requests in flight (`live`), the extraction step, counters.
    Built in `start()`; the AsyncLLM reaches it as `llm.extraction`."""

    def __init__(
        self,
        llm: Any,
        check_spec: Callable[..., tuple[int, ...]],
        check_layers: Callable[..., tuple[int, ...]],
        *,
        heads_of: Callable[..., tuple[tuple[str, int], ...]] = lambda spec: (),
        steering_of: Callable[..., tuple[list, list]] = lambda spec: ([], []),
        stop_of: Callable[..., tuple[list, list]] = lambda spec: ([], []),
        timeout_s: float = 60.0,
        tail_enabled: bool = False,
        priority: int = 0,
        max_hidden_states_bytes: int = DEFAULT_MAX_HIDDEN_STATES_BYTES,
    ):
        self.llm = llm
        self.check_spec, self.check_layers = check_spec, check_layers  # the engine's checks against its model
        self.heads_of = heads_of  # a spec's heads against the engine's registered ones (params.resolve_heads)
        self.steering_of = steering_of  # a spec's steering resolved (hidden_states/steering.py)
        self.stop_of = stop_of  # a spec's stop conditions resolved (params.resolve_stop)
        self.monitor_stops = 0  # choices a stop condition finished
        self.num_layers = int(llm.vllm_config.model_config.hf_text_config.num_hidden_layers)
        self.hidden_size = int(llm.vllm_config.model_config.get_hidden_size())
        self.extraction_timeout_s = timeout_s
        self.tail_enabled = tail_enabled  # the engine's scheduler runs tail steps
        self.extraction_priority = priority  # vLLM refuses priorities under its fcfs policy
        self.max_hidden_states_bytes = max_hidden_states_bytes  # a request's worst case of rows (params.py)
        # Each request's one state (its collector), from admission to its last chunk, by the request's tag (an
        # extraction step's, for the step); its engine requests in flight are its `engine_requests`, under
        # capture keys `{tag}.{n}` (`owner`).
        self.live: dict[str, HiddenStatesCollector] = {}
        self.vector_requests = 0  # engine requests that asked for rows
        self.extractions = 0
        self.extraction_tokens = 0
        self.extraction_cached_tokens = 0
        self.media_resent = 0  # extraction steps that sent their media again (evicted from the processor cache)
        self.tails = 0  # vectors from tail steps (one computed position each)
        self.missing_vectors = 0  # choices that finished without their vector (each failed its request)
        self.timeouts = 0  # extraction steps that did not finish within extraction_timeout_s
        self.malformed_vectors = 0  # vectors on outputs that did not decode (a bug)
        self.late_rows = 0  # rows on outputs of requests that had ended (an abort, a stop string: not a fault)
        self.hook_faults = 0  # hooks of ours that raised inside vLLM's output loop (each failed its request)

    def counts(self) -> dict[str, Any]:
        return {
            "extractions": self.extractions,
            "extraction_tokens": self.extraction_tokens,
            "extraction_cached_tokens": self.extraction_cached_tokens,
            "media_resent": self.media_resent,
            "missing_vectors": self.missing_vectors,
            "timeouts": self.timeouts,
            "tail_enabled": self.tail_enabled,
            "tails": self.tails,
            "pending": self.pending(),  # engine requests whose rows may still come
            "malformed_vectors": self.malformed_vectors,
            "late_rows": self.late_rows,
            "hook_faults": self.hook_faults,
            "monitor_stops": self.monitor_stops,
        }

    def fault(self, request_id: str, key: str, f: HookFault, where: str = "", exc: BaseException | None = None) -> None:
        """A hook of ours failed engine request `key` (vLLM's `request_id`) in the engine core (`where`: there it
        was logged with its traceback, and vLLM finished it with "error") or here (`exc`, logged with it): counted,
        and kept by its owner for its generator, which fails with it (raise_fault)."""
        logger.error(
            "request %s: the hidden-states hook %s failed%s; failing the request",
            request_id,
            f.hook,
            where,
            exc_info=exc,
        )
        self.hook_faults += 1
        if (col := self.owner(key)) is not None:
            col.faults[key] = f

    def receive(self, request_id: str, raw: Any, index: int | None) -> None:
        """One engine output's message (protocol.EngineMessage) for `request_id`'s choice `index`: its fault,
        its stop, where its conditional entries applied, its rows. A message that does not decode is counted
        and dropped (the rows it brought come from an extraction step); a part that raises here fails the
        request alone, and the output handler serves on."""
        try:
            msg = EngineMessage.from_output(raw)
        except HiddenStatesProtocolError:
            self.malformed_vectors += 1
            return
        if msg.fault is not None:  # a hook in the engine core failed this request (its finish: "error")
            self.fault(request_id, msg.key, msg.fault, f" in the engine core ({msg.fault.error})")
            return
        col = self.owner(msg.key)
        if col is None or index is None:  # it ended (an abort, a stop string): not a fault
            self.late_rows += 1
            return
        try:
            if msg.stop is not None:
                self.stopped(col, (col.engine_requests[msg.key], index), msg.stop)
            if msg.steered is not None:
                self.steered(col, (col.engine_requests[msg.key], index), msg.steered)
            if msg.rows is not None or msg.heads:
                self.deliver(col, (col.engine_requests[msg.key], index), msg.rows, msg.heads)
        except Exception as e:
            self.fault(request_id, msg.key, HookFault.of("deliver", e), " delivering its vectors", exc=e)

    @staticmethod
    def raise_fault(collector: HiddenStatesCollector, key: str, request_id: str) -> None:
        """Fails engine request `key`'s generator (vLLM's `request_id`) with the fault a hook reported for it."""
        if collector.faults and (f := collector.faults.pop(key, None)) is not None:
            raise HookFaultError(request_id, f.hook, f.error)

    def pending(self) -> int:
        """Engine requests in flight whose rows may still come."""
        return sum(len(col.engine_requests) for col in self.live.values())

    def owner(self, key: str) -> HiddenStatesCollector | None:
        """The collector whose engine request in flight has capture key `key` (`{tag}.{n}`), if any."""
        col = self.live.get(key.partition(".")[0])
        return col if col is not None and key in col.engine_requests else None

    def engine_request(self, collector: HiddenStatesCollector, key: str, ordinal: int) -> None:
        """An engine request of `collector` (its prompt `ordinal`) starts: its rows come under `key`."""
        collector.engine_requests[key] = ordinal
        self.vector_requests += 1

    def engine_request_ended(self, collector: HiddenStatesCollector, key: str) -> None:
        collector.engine_requests.pop(key, None)

    def deliver(
        self, col: HiddenStatesCollector, choice: ChoiceKey, cr: CapturedRows | None, outs: dict[str, CapturedRows]
    ) -> None:
        """Rows off an engine output (and each head's outputs at the same positions), into its choice."""
        some = cr if cr is not None else next(iter(outs.values()))
        values, indices = {}, None
        if cr is not None:
            raw_values, raw_indices = cr.arrays()
            at = {layer: i for i, layer in enumerate(cr.layers)}
            rows = [at[absolute_layer(l, self.num_layers)] for l in col.layers]
            values = {l: raw_values[i] for l, i in zip(col.layers, rows)}
            indices = None if raw_indices is None else {l: raw_indices[i] for l, i in zip(col.layers, rows)}
        head_values, head_indices = {}, {}
        for name, o in outs.items():
            v, i = o.arrays()
            head_values[name] = v[0]
            if i is not None:
                head_indices[name] = i[0]
        if cr is not None and cr.pooled:
            sums = {l: v[0].astype(np.float64) for l, v in values.items()}
            positions = np.asarray(cr.positions, dtype=np.int64)
            col.add_rows(choice, PooledSum(positions, sums, cr.tail_positions))
            return
        col.add_rows(
            choice,
            RowBatch(
                np.asarray(some.positions, dtype=np.int64),
                values,
                cr.dtype if cr is not None else col.dtype,
                indices,
                tail_positions=some.tail_positions,
                heads=head_values,
                head_indices=head_indices,
            ),
        )

    def stopped(self, col: HiddenStatesCollector, choice: ChoiceKey, stop: StopReport) -> None:
        """A choice a stop condition finished: what its hidden_states_meta.stop says."""
        col.state(choice).stop = {
            **col.stop_echo[stop.condition],
            "condition": stop.condition,
            "position": stop.position,
            "score": stop.score,
        }
        self.monitor_stops += 1

    def steered(self, col: HiddenStatesCollector, choice: ChoiceKey, steered: SteeredReport) -> None:
        """Where a choice's conditional steering entries applied (each output brings the positions decided
        since the last): its meta says so, and its extraction step replays them."""
        st = col.state(choice)
        mine = st.applied = st.applied if st.applied is not None else {}
        for k, positions in steered.applied:
            mine.setdefault(k, []).extend(positions)

    def _steer(self, collector: HiddenStatesCollector, prompt: Any) -> tuple[Any, list[SteerEntry]]:
        """A steered request: its entries anchored to its prompt (its spec's `steer`: the workers read them), and
        its steering's digest joined to its cache salt, so no prefix-cache block computed under one steering
        serves another (or none), while the same steering shares blocks. Returns (prompt, entries)."""
        from hidden_states.steering import anchor

        P = prompt_length(prompt)
        if P is None:
            raise HiddenStatesRequestError("steering needs the prompt as token ids or embeddings", "prompt")
        entries, digest = anchor(collector.steering, P)  # absolute positions: the extraction step sees the same
        return {**prompt, "cache_salt": f"{prompt.get('cache_salt') or ''}|steer-{digest}"}, entries

    def _flag(self, collector: HiddenStatesCollector, prompt: Any, params: Any) -> tuple[Any, CaptureSpec]:
        """A collector's generating request: memory bound checked, what it captures, a unique cache salt where
        prompt positions must be computed. Returns (prompt, capture)."""
        from vllm.sampling_params import RequestOutputKind

        P = prompt_length(prompt)
        if P is None:
            raise HiddenStatesRequestError("hidden states need the prompt as token ids or embeddings", "prompt")
        span = Span.of(collector.position, P)
        try:
            if not collector.pool:  # a pool's rows never wait on the host: one row per layer does
                check_rows_budget(
                    span,
                    P,
                    params.max_tokens or 0,
                    params.n or 1,
                    len(collector.layers) if collector.rows_wanted else 0,
                    self.hidden_size,
                    collector.dtype,
                    collector.topk,
                    self.max_hidden_states_bytes,
                )
        except HiddenStatesRequestError as e:
            collector.refusal = e  # the OpenAI layer answers it as a 400, streaming or not
            raise
        if 0 <= span.start < P - 1 and self.llm.vllm_config.cache_config.enable_prefix_caching:
            # Prompt positions are wanted: a prefix-cache hit would skip computing them.
            prompt = {**prompt, "cache_salt": f"hs-{uuid.uuid4().hex}"}
        return prompt, collector.capture(
            span.to_list(),
            # an end counted from the end stops before it; stop conditions alone capture nothing
            reaches_final=collector.captures and (span.end is None or span.end > P),
            every_step=collector.multi and params.output_kind != RequestOutputKind.FINAL_ONLY,
        )

    def check_beam_rows(self, collector: HiddenStatesCollector, prompt_len: int, max_tokens: int, beams: int) -> None:
        """The memory bound for a beam search's returned beams (their rows all come from extraction)."""
        try:
            check_rows_budget(
                Span.of(collector.position, prompt_len),
                prompt_len,
                max_tokens,
                beams,
                len(collector.layers),
                self.hidden_size,
                collector.dtype,
                collector.topk,
                self.max_hidden_states_bytes,
            )
        except HiddenStatesRequestError as e:
            collector.refusal = e
            raise

    async def finish_choices(
        self,
        collector: HiddenStatesCollector,
        ordinal: int,
        prompt_ids: list[int],
        tokens: dict[int, list[int]],
        finished: list[int],
        origin: Origin = Origin(),
    ) -> None:
        """Each finished choice's positions resolved on its length: the rows its outputs brought, plus one
        extraction step (shared by identical sequences) for the rest; the work counted."""
        P, jobs = len(prompt_ids), []
        for index in finished:
            seq = prompt_ids if collector.position == "prompt_end" else [*prompt_ids, *tokens.get(index, ())]
            wanted = list(Span.of(collector.position, P).positions(len(seq)))
            missing = sorted(set(wanted) - collector.held_positions((ordinal, index)))
            jobs.append(((ordinal, index), seq, wanted, missing))
        if not collector.captures:  # it only steers: nothing to resolve
            for index in finished:
                collector.close_choice((ordinal, index), [], None)
            return

        def replayed(key) -> tuple[tuple, Origin]:
            """The origin of a choice's extraction step: its conditional entries where its own steps applied them."""
            if not collector.conditional:
                return (), origin
            applied = collector.state(key).applied or {}
            return (
                tuple((k, tuple(v)) for k, v in sorted(applied.items())),
                dataclasses.replace(origin, steering=tuple(steering.replay(origin.steering, applied))),
            )

        todo, step_of = {}, {}  # one extraction step per distinct (sequence, positions, replay); each job's
        for key, seq, _, missing in jobs:
            if missing:
                replay, its_origin = replayed(key)
                step_of[key] = (tuple(seq), tuple(missing), replay)
                todo.setdefault(step_of[key], its_origin)
        layers = collector.layers if collector.rows_wanted else ()
        results = await asyncio.gather(
            *(
                self.extract_rows(
                    seq, missing, layers, collector.dtype, collector.topk, its_origin, collector.heads, collector.pool
                )
                for (seq, missing, _), its_origin in todo.items()
            )
        )
        extracted = dict(zip(todo, results))
        for key, seq, wanted, missing in jobs:
            stats = None
            if missing:
                batch, stats = extracted[step_of[key]]
                collector.add_rows(key, batch)
            elif collector.position != "prompt_end":
                n, counted = len(seq), collector.state(key).tail_positions
                via = "tail" if counted and n - 1 in wanted else "generation"
                stats = ExtractionStats(n, n - counted, 0.0, via=via)
                self.tails += via == "tail"
            collector.close_choice(key, wanted, None if collector.position == "prompt_end" else stats)

    def _leave_room_for_extraction(self, prompt: Any, params: Any) -> Any:
        """max_tokens capped to `params.room_for_completion` (the final token's one more position)."""
        P = prompt_length(prompt)
        if P is None:
            return params
        limit = self.llm.model_config.max_model_len
        check_room(P, limit, "prompt", completing=True)
        room = room_for_completion(P, limit)
        if params.max_tokens is None or params.max_tokens > room:
            params = params.clone()
            params.max_tokens = room
        return params

    def _timed_out(self, num_tokens: int) -> HiddenStatesTimeout:
        self.timeouts += 1
        return HiddenStatesTimeout(
            f"hidden states for a sequence of {num_tokens} tokens did not arrive within "
            f"{self.extraction_timeout_s:g}s (extraction_timeout_s): the engine is overloaded"
        )

    @contextlib.contextmanager
    def collecting(self, spec: HiddenStatesFields):
        """A collector for one request's rows (see HiddenStatesEngine.collecting)."""
        collector = HiddenStatesCollector.of(
            uuid.uuid4().hex,
            spec,
            self.check_spec(spec),
            self.heads_of(spec),
            self.steering_of(spec),
            self.stop_of(spec),
        )
        self.live[collector.tag] = collector
        try:
            yield collector
        finally:
            del self.live[collector.tag]

    def collector_for(self, sampling_params: Any) -> HiddenStatesCollector | None:
        extra = getattr(sampling_params, "extra_args", None)
        if not extra or not self.live:
            return None
        if SPEC_KEY not in extra:
            return None
        tag = RequestSpec.of(extra).key
        col = self.live.get(tag)
        return col if col is not None and col.tag == tag else None

    def missing(self, what: str) -> MissingHiddenStatesError:
        """Counts a choice that finished without its vector; the error to fail its request with."""
        self.missing_vectors += 1
        return MissingHiddenStatesError(
            f"{what} finished without its hidden states although the request asked for them; the request "
            "fails rather than return a partial answer (a server bug: please report it)"
        )

    async def extract_beams(
        self, outputs: AsyncIterator[Any], collector: HiddenStatesCollector, ordinal: int, origin: Origin = Origin()
    ) -> AsyncIterator[Any]:
        """vLLM's beam search output with one extraction per returned beam."""
        async for out in outputs:
            done = [o for o in out.outputs if o.finish_reason is not None]
            if done:
                await self.finish_choices(
                    collector,
                    ordinal,
                    list(out.prompt_token_ids),  # beams bring no rows: all extracted
                    {o.index: list(o.token_ids) for o in done},
                    [o.index for o in done],
                    origin,
                )
            yield out

    def beam_search_room(self, prompt_len: int, max_tokens: int) -> int:
        """max_tokens for a beam search whose beams each need one more position to extract."""
        return max(1, min(max_tokens, room_for_completion(prompt_len, self.llm.model_config.max_model_len)))

    # -- the extraction step --------------------------------------------------

    async def extract_rows(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        layers: Sequence[int],
        dtype: str = "float32",
        topk: int | None = None,
        origin: Origin = Origin(),
        heads: Sequence[tuple[str, int]] = (),
        pool: bool = False,
    ) -> tuple[RowBatch | PooledSum, ExtractionStats]:
        """The rows of `positions` of `token_ids` by a prefill, cast and selected as a generating
        request's (and `heads`' outputs over them; `layers` empty: heads alone); own cache salt where
        a prefix-cache hit would skip some. `pool`: their sum, reduced in the engine where they are evenly
        spaced (else the rows, in float32)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        total, lo = len(token_ids), min(positions)
        ordered = sorted(positions)
        stride = ordered[1] - ordered[0] if len(ordered) > 1 else 1
        even = pool and stride > 0 and ordered == list(range(lo, ordered[-1] + 1, stride))
        span = [lo, ordered[-1] + 1, stride] if even else [lo, total, 1]
        dtype = "float32" if pool else dtype

        def params(key: str):
            return SamplingParams(
                max_tokens=1,
                temperature=0.0,
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
                extra_args=RequestSpec(
                    key,
                    CaptureSpec(
                        span=span,
                        layers=list(layers),
                        dtype=dtype,
                        topk=topk or 0,
                        heads=[list(h) for h in heads],
                        pool=even,
                    ),
                    list(origin.steering),
                ).into(None),
            )

        key = uuid.uuid4().hex
        cache = self.llm.vllm_config.cache_config
        salt = origin.cache_salt
        if cache.enable_prefix_caching and lo < (total - 1) // cache.block_size * cache.block_size:
            salt = f"hs-{key}"
        want = np.asarray(sorted(positions), dtype=np.int64)
        t0 = time.perf_counter()
        while True:
            step = HiddenStatesCollector(
                f"step-{key}", tuple(layers), dtype=dtype, topk=topk, heads=tuple(heads), rows_wanted=bool(layers)
            )  # the step's own state
            merged, cached = await self._prefill(token_ids, origin, params(f"{step.tag}.0"), key, salt, step)
            if even and merged is None:  # the engine's sum, of exactly the positions asked
                sums = [s for st in step.choices.values() for s in st.sums]
                if len(sums) == 1 and np.array_equal(sums[0].positions, want):
                    merged = sums[0]
                    break
            elif merged is not None and np.isin(want, merged.positions).all():
                break
            # An item sent as its hash alone, evicted from the engine core's processor cache since the
            # request ran: vLLM fails the step and drops the hash; the items go again, with their data.
            resent = await origin.resend() if origin.by_hash() else None
            if resent is None:
                raise self.missing(f"the extraction step of {len(want)} position(s) of a sequence of {total} tokens")
            logger.warning(
                "extraction step %s: a media item was no longer in the engine core's processor cache; "
                "sending the items again",
                key,
            )
            self.media_resent += 1
            origin, key = resent, uuid.uuid4().hex
        self.extractions += 1
        self.extraction_tokens += total
        self.extraction_cached_tokens += cached
        stats = ExtractionStats(total, cached, time.perf_counter() - t0)
        return (merged if even else merged.select(np.isin(merged.positions, want))), stats

    async def _prefill(self, token_ids, origin: Origin, params, key: str, salt, step: HiddenStatesCollector):
        """One prefill of `token_ids` as `origin`'s input, its rows filed into `step` under `key`: (the rows
        it captured merged, or None; its cached tokens)."""
        from vllm.v1.engine.async_llm import AsyncLLM

        cached = 0
        capture = f"{step.tag}.0"
        self.live[step.tag] = step
        self.engine_request(step, capture, 0)
        try:
            async with (
                asyncio.timeout(self.extraction_timeout_s),
                contextlib.aclosing(
                    AsyncLLM.generate(
                        self.llm,
                        origin.prompt(token_ids, salt),
                        params,
                        f"hs-{key}",
                        lora_request=origin.lora_request,
                        priority=origin.priority + self.extraction_priority,
                    )
                ) as outputs,
            ):
                async for out in outputs:
                    self.raise_fault(step, capture, f"hs-{key}")
                    cached = out.num_cached_tokens or 0
        except TimeoutError:
            raise self._timed_out(len(token_ids)) from None
        finally:
            self.engine_request_ended(step, capture)
            del self.live[step.tag]
        return RowBatch.merge([b for st in step.choices.values() for b in st.pending]), cached

    async def extract_one(
        self, token_ids: Sequence[int], origin: Origin = Origin()
    ) -> tuple[np.ndarray, ExtractionStats]:
        """The last-layer hidden state of the final token of `token_ids` (float32 [D])."""
        vecs, stats = await self.extract_layers(token_ids, (-1,), origin)
        return vecs[-1], stats

    async def extract_layers(
        self, token_ids: Sequence[int], layers: Sequence[int], origin: Origin = Origin()
    ) -> tuple[dict[int, np.ndarray], ExtractionStats]:
        """The final token's hidden state (float32 [D]) at each of `layers`, with `origin`'s adapter, salt
        and priority."""
        layers = self.check_layers(layers)
        if not token_ids:
            raise ValueError("extraction needs at least one token id")
        batch, stats = await self.extract_rows(token_ids, [len(token_ids) - 1], layers, origin=origin)
        return {l: batch.floats(l)[0] for l in layers}, stats
