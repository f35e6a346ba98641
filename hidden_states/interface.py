"""The engine interface the Serve layer uses, and what crosses it.

The vector: the last-layer hidden state (after the final norm, transformers'
`output_hidden_states[-1][0, -1]`) of the final token of `prompt_token_ids + choice.token_ids`
(a generated EOS counts; a stop string cuts the text, not the ids), as numpy [hidden_size] (float32
unless another hidden_states_dtype is asked). A finished choice is one `CompletionChoice`, whichever
path reads it (the Python API, the handle wire, the HTTP formatter).

`Engine` is what a replica needs; `hidden_states.vllm.engine.HiddenStatesEngine` is the real
one, `hidden_states.testing.FakeEngine` the stand-in. Vectors are collected per request by a
`HiddenStatesCollector`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from hidden_states.heads import head_fields
from hidden_states.protocol import CaptureSpec, HookFault, RequestSpec, narrow, numpy_dtype, widen
from hidden_states.shape import several, squeeze

logger = logging.getLogger(__name__)


class MissingHiddenStatesError(RuntimeError):
    """A choice finished without the vector it asked for (a bug: the request fails)."""


class HookFaultError(RuntimeError):
    """A hook of ours inside vLLM's loops raised while serving this request: the request fails (500,
    naming it and the hook), and the engine serves every other request on."""

    def __init__(self, request_id: str, hook: str, error: BaseException | str):
        what = error if isinstance(error, str) else f"{type(error).__name__}: {error}"  # str: as reported
        super().__init__(
            f"request {request_id}: the hidden-states hook `{hook}` failed "
            f"({what}); this request fails, the engine serves on "
            "(a server bug: please report it)"
        )
        self.request_id, self.hook = request_id, hook


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

    def meta(self, timed: bool = True) -> dict[str, Any]:
        """The work in a response's `hidden_states_meta` (the one place it is formatted)."""
        out = {
            "via": self.via,
            "tokens": self.tokens,
            "cached_tokens": self.cached_tokens,
            "computed_tokens": self.computed_tokens,
        }
        if timed:
            out["extraction_seconds"] = round(self.seconds, 6)
        return out


ChoiceKey = tuple[int, int]  # (the request's prompt ordinal, the choice's index within that prompt)


@dataclasses.dataclass
class RowBatch:
    """Rows of one choice at absolute positions, per requested layer: raw elements of `dtype` (uint16
    bits for bfloat16), and for top-k int32 indices (largest magnitude first); and each head's
    outputs at the same positions (float32, with int32 feature indices for an SAE)."""

    positions: np.ndarray  # int64 [n], ascending
    values: dict[int, np.ndarray]  # requested layer -> [n, width]
    dtype: str = "float32"
    indices: dict[int, np.ndarray] | None = None  # requested layer -> int32 [n, k]
    tail_positions: int = 0  # positions the engine core scheduled for the final token's row (a count)
    heads: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # head -> float32 [n, width]
    head_indices: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # SAE head -> int32 [n, k]

    def __len__(self) -> int:
        return len(self.positions)

    def select(self, mask: np.ndarray) -> RowBatch:
        return RowBatch(
            self.positions[mask],
            {l: v[mask] for l, v in self.values.items()},
            self.dtype,
            None if self.indices is None else {l: i[mask] for l, i in self.indices.items()},
            heads={h: v[mask] for h, v in self.heads.items()},
            head_indices={h: i[mask] for h, i in self.head_indices.items()},
        )

    @staticmethod
    def merge(batches: Sequence[RowBatch]) -> RowBatch | None:
        """One batch in position order; a position that came twice, once."""
        batches = [b for b in batches if len(b)]
        if not batches:
            return None
        if len(batches) == 1 and np.all(np.diff(batches[0].positions) > 0):
            return batches[0]
        first = batches[0]
        positions = np.concatenate([b.positions for b in batches])
        _, order = np.unique(positions, return_index=True)  # sorted, first occurrence of each
        cat = RowBatch(
            positions,
            {l: np.concatenate([b.values[l] for b in batches]) for l in first.values},
            first.dtype,
            None
            if first.indices is None
            else {l: np.concatenate([b.indices[l] for b in batches]) for l in first.indices},
            heads={h: np.concatenate([b.heads[h] for b in batches]) for h in first.heads},
            head_indices={h: np.concatenate([b.head_indices[h] for b in batches]) for h in first.head_indices},
        )
        return cat.select(order)

    def floats(self, layer: int) -> np.ndarray:
        """The layer's values as float32 (exact: the cast values, widened)."""
        return widen(self.values[layer], self.dtype)

    def numpy(self, layer: int) -> np.ndarray:
        """The layer's values as Python gets them: float32 and float16 as they are (a view), bfloat16
        (which numpy lacks) widened exactly to float32."""
        values = self.values[layer]
        return widen(values, self.dtype) if self.dtype == "bfloat16" else values

    @property
    def width(self) -> int:
        """Each row's width (hidden size, or k with top-k); 0 without rows (heads alone)."""
        return next(iter(self.values.values())).shape[1] if self.values else 0

    @staticmethod
    def empty(layers: Sequence[int], width: int, dtype: str, topk: int | None) -> RowBatch:
        """No rows (a range that selects nothing of a sequence), shaped as the request's."""
        return RowBatch(
            np.zeros(0, np.int64),
            {l: np.zeros((0, width), numpy_dtype(dtype)) for l in layers},
            dtype,
            {l: np.zeros((0, width), np.int32) for l in layers} if topk and layers else None,
        )

    @property
    def nbytes(self) -> int:
        """The payload: every layer's values, and top-k indices (rows only; `head_nbytes`: the heads')."""
        return sum(v.nbytes for v in self.values.values()) + sum(i.nbytes for i in (self.indices or {}).values())

    @property
    def head_nbytes(self) -> int:
        """The heads' payload as it travelled: float32 outputs, and an SAE's int32 indices."""
        return sum(v.nbytes for v in self.heads.values()) + sum(i.nbytes for i in self.head_indices.values())


@dataclasses.dataclass
class PooledSum:
    """hidden_states_pool: the sum of a choice's rows at `positions`, per requested layer (float64 [D]), as
    the engine core reduced them (protocol.CapturedRows.pooled)."""

    positions: np.ndarray  # int64
    sums: dict[int, np.ndarray]
    tail_positions: int = 0

    def __len__(self) -> int:
        return len(self.positions)


@dataclasses.dataclass
class ChoiceState:
    """All a request knows of one of its choices, from its first row to its finish."""

    pending: list[RowBatch] = dataclasses.field(default_factory=list)  # rows received, not handed out yet
    sent: set[int] = dataclasses.field(default_factory=set)  # positions handed out
    wanted: int | None = None  # closed: how many positions it has in all (None: still running)
    stats: ExtractionStats | None = None  # the work for its final row (None: prompt_end, or not closed)
    tail_positions: int = 0  # positions the engine core scheduled for its final row (counted there)
    stop: dict | None = None  # the condition that finished it, as hidden_states_meta.stop says it
    applied: dict[int, list[int]] | None = None  # `when` entry -> positions applied (None: no output said)
    sent_bytes: int = 0  # rows (or proofs) handed out, in bytes
    head_bytes: int = 0  # heads' outputs handed out, in bytes
    head_positions: int = 0  # positions whose heads' outputs were handed out
    prover: Any = None  # hidden_states_proof: its proofs.ProofBuilder, fed as its rows are handed out
    sums: list[PooledSum] = dataclasses.field(default_factory=list)  # hidden_states_pool: received, not closed
    pooled: int = 0  # hidden_states_pool: the rows its mean is of (closed)


@dataclasses.dataclass
class HiddenStatesCollector:
    """Per-request sink for rows, registered with `HiddenStatesEngine.collecting()` and reached
    through `tag` in `SamplingParams.extra_args`. Rows are filed by (prompt ordinal, choice index):
    vLLM numbers response choices `ordinal * n + index`."""

    tag: str
    layers: tuple[int, ...] = (-1,)
    position: Any = "completion_end"  # params.POSITIONS, or a range {"start", "end", "stride"}
    beam_calls: int = 0  # vLLM's beam searches started for this request (one per prompt, in order)
    dtype: str = "float32"  # hidden_states_dtype
    topk: int | None = None  # hidden_states_topk
    choices: dict[ChoiceKey, ChoiceState] = dataclasses.field(default_factory=dict)  # each choice's own state
    refusal: Exception | None = None  # a 400 raised while its engine requests started (the memory bound)
    # hidden_states_proof (proofs.ProofRequest): the rows are the scheme's (position, dtype, top-k), and
    # choices carry proofs built from them; each prompt's length (by ordinal) bounds its prefill's proof.
    proof: Any = None
    prompt_lens: dict[int, int] = dataclasses.field(default_factory=dict)
    modalities: dict[int, list[dict]] = dataclasses.field(default_factory=dict)  # by ordinal: Origin.modalities
    spec: Any = None  # params.HiddenStatesFields: the request's spec as parsed (encoding, by-layer)
    engine_requests: dict[str, int] = dataclasses.field(default_factory=dict)  # capture key -> prompt ordinal
    faults: dict[str, HookFault] = dataclasses.field(default_factory=dict)  # capture key -> a hook that failed it
    heads: tuple[tuple[str, int], ...] = ()  # (head, k) the engine runs over the same positions (params.resolve_heads)
    rows_wanted: bool = True  # False: heads alone, no rows travel
    steering: list = dataclasses.field(default_factory=list)  # protocol.SteerEntry, not anchored: what the workers add
    steering_echo: list = dataclasses.field(default_factory=list)  # what hidden_states_meta.steering says
    # hidden_states_stop: the conditions the engine judges (protocol.Monitor), and what the meta says of each
    monitors: list = dataclasses.field(default_factory=list)
    stop_echo: list = dataclasses.field(default_factory=list)
    pool: bool = False  # hidden_states_pool "mean": one vector per layer, the mean of the span's rows
    # A chat with media: renders its messages again (a coroutine function -> the engine input), for an
    # extraction step whose items the engine core's processor cache evicted (extraction.Origin.resend)
    rerender: Any = None

    @classmethod
    def of(
        cls,
        tag: str,
        spec: Any,
        layers: tuple[int, ...],
        heads: tuple[tuple[str, int], ...] = (),
        steering: tuple[list, list] = ([], []),
        stop: tuple[list, list] = ([], []),
    ) -> HiddenStatesCollector:
        """The collector of a parsed spec (params.HiddenStatesFields) whose `layers`, `heads`,
        `steering` and `stop` (each: entries, echo) the engine checked."""
        _, position, dtype, topk = spec.capture()
        return cls(
            tag,
            layers,
            position,
            dtype=dtype,
            topk=topk,
            proof=spec.hidden_states_proof,
            spec=spec,
            heads=heads,
            rows_wanted=getattr(spec, "rows_asked", True),
            steering=list(steering[0]),
            steering_echo=list(steering[1]),
            monitors=list(stop[0]),
            stop_echo=list(stop[1]),
            pool=getattr(spec, "hidden_states_pool", None) == "mean",
        )

    @property
    def captures(self) -> bool:
        """Anything to capture (rows or heads); a request that only steers captures nothing."""
        return self.rows_wanted or bool(self.heads)

    def capture(self, span: Sequence, reaches_final: bool, every_step: bool) -> CaptureSpec:
        """What an engine request of this collector captures over `span` (protocol.Span as a list): the one place
        a request's capture fields become the engine's."""
        return CaptureSpec(
            span=list(span),
            layers=list(self.layers) if self.rows_wanted else [],
            dtype="float32" if self.pool else self.dtype,  # a pool's mean is cast in the frontend
            heads=[list(h) for h in self.heads],
            monitors=list(self.monitors),
            pool=self.pool,
            reaches_final=reaches_final,
            topk=self.topk or 0,
            every_step=every_step,
        )

    @property
    def conditional(self) -> bool:
        """Some steering entry applies where a condition held (`when`): the engine core decides, and says where."""
        return any(e.when is not None for e in self.steering)

    def state(self, key: ChoiceKey) -> ChoiceState:
        """The choice's state (made on first use)."""
        st = self.choices.get(key)
        if st is None:
            st = self.choices[key] = ChoiceState()
        return st

    def steering_meta(self, key: ChoiceKey) -> list:
        """What hidden_states_meta.steering says for a choice: the echo, and where each `when` entry applied."""
        st = self.choices.get(key)
        applied = st.applied if st is not None else None
        if not self.conditional:
            return self.steering_echo
        return [
            {**echo, "applied": applied.get(k, []) if applied is not None else None} if "when" in echo else echo
            for k, echo in enumerate(self.steering_echo)
        ]

    @property
    def multi(self) -> bool:
        """Several positions per choice: `hidden_states` is 2-D [n, D] (shape.several); a pool's is one vector."""
        return several(self.position) and not self.pool

    @property
    def position_label(self) -> str:
        return self.position if isinstance(self.position, str) else "range"

    def add_rows(self, key: ChoiceKey, batch: RowBatch | PooledSum) -> None:
        st = self.state(key)
        if st.wanted is None and len(batch):
            (st.sums if isinstance(batch, PooledSum) else st.pending).append(batch)
            st.tail_positions += batch.tail_positions

    def held_positions(self, key: ChoiceKey) -> set[int]:
        """Positions received for the choice (handed out or not)."""
        st = self.state(key)
        held = set(st.sent)
        for b in (*st.pending, *st.sums):
            held.update(b.positions.tolist())
        return held

    def close_choice(self, key: ChoiceKey, wanted: Sequence[int], stats: ExtractionStats | None) -> None:
        """The choice ended: of what it received, keep the positions it asked for (a pool: their mean)."""
        st = self.state(key)
        if self.pool:
            return self._close_pool(st, wanted, stats)
        merged, st.pending = RowBatch.merge(st.pending), []
        if merged is not None:
            keep = np.isin(merged.positions, np.asarray(wanted, dtype=np.int64))
            if st.sent:
                keep &= ~np.isin(merged.positions, np.fromiter(st.sent, dtype=np.int64))
            if keep.all():  # as received: no copy
                st.pending = [merged]
            elif keep.any():
                st.pending = [merged.select(keep)]
        st.wanted = len(wanted)
        if stats is not None:
            st.stats = stats

    def _close_pool(self, st: ChoiceState, wanted: Sequence[int], stats: ExtractionStats | None) -> None:
        """A pool's choice ended: the mean of the rows at `wanted`, from sums that each lie within them and do
        not overlap (a sum of rows past a stop the frontend cut is not), and any rows received as rows."""
        want, taken = set(wanted), set()
        total: dict[int, Any] = {l: 0.0 for l in self.layers}
        for part in st.sums:
            ps = set(part.positions.tolist())
            if ps <= want and not ps & taken:
                taken |= ps
                total = {l: total[l] + part.sums[l] for l in self.layers}
        rows = RowBatch.merge(st.pending)
        if rows is not None:
            keep = np.isin(rows.positions, np.fromiter(want - taken, np.int64, len(want - taken)))
            taken |= set(rows.positions[keep].tolist())
            total = {l: total[l] + rows.floats(l)[keep].astype(np.float64).sum(axis=0) for l in self.layers}
        st.sums, st.pending, st.wanted = [], [], len(wanted)
        if stats is not None:
            st.stats = stats
        if want and taken == want:
            st.pooled = len(want)
            means = {l: narrow((total[l] / len(want)).astype(np.float32), self.dtype)[None] for l in self.layers}
            st.pending = [RowBatch(np.array([max(want)], np.int64), means, self.dtype)]

    def hand_out(self, key: ChoiceKey) -> RowBatch | None:
        """The rows received since the last hand-out, in position order (each position once)."""
        st = self.state(key)
        merged, st.pending = RowBatch.merge(st.pending), []
        if merged is None:
            return None
        if st.sent:
            merged = merged.select(~np.isin(merged.positions, np.fromiter(st.sent, dtype=np.int64)))
        st.sent.update(merged.positions.tolist())
        return merged if len(merged) else None

    def choice(
        self,
        key: ChoiceKey,
        engine: Any,
        final: bool,
        index: int = 0,
        text: str = "",
        token_ids: Sequence[int] = (),
        finish_reason: str | None = None,
    ) -> CompletionChoice | None:
        """The one place a choice is built: what it carries since its last part (`final`: all of it, with its
        work, its stop and where its conditional steering applied) as a CompletionChoice, which the Python API
        returns, the handle wire carries and the formatter (openai_format.choice_fields) writes out. None:
        nothing new for a part. A final part reports the choice's vector to the engine's observers."""
        st = self.state(key)
        if final and st.wanted is None:
            raise engine.missing(f"choice {index}")
        head = (index, text, tuple(token_ids), finish_reason)
        if self.proof is not None:
            return self._proof_part(key, st, engine, final, head)
        batch = self.hand_out(key)
        if batch is None and not final:
            return None
        steering = (self.steering_meta(key) if final else self.steering_echo) or None
        stop = {"stop": st.stop, "stop_asked": True} if final and self.monitors else {}
        if not self.captures:  # it only steers or stops: nothing captured
            return CompletionChoice(*head, steering=steering, **stop) if final else None
        if final and self.pool and st.wanted and not st.pooled:
            raise engine.missing(f"choice {index}")
        rows, heads = _captured(self, batch, self.topk or engine.hidden_size, engine.heads)
        head_bytes = batch.head_nbytes if batch is not None else 0
        st.sent_bytes += rows.nbytes
        if heads is not None:
            st.head_bytes += head_bytes
            st.head_positions += len(rows)
        if final:
            engine.vector_sent(
                self.position_label,
                st.stats,
                st.sent_bytes,
                {name: st.head_positions for name, _ in self.heads},
                st.head_bytes,
            )
        return CompletionChoice(
            *head,
            rows,
            st.stats if final else None,
            self.multi,
            heads=heads,
            steering=steering,
            **stop,
            position=self.position,
            topk=self.topk,
            modalities=self.modalities.get(key[0]),
            head_bytes=head_bytes if heads is not None else None,
            final=final,
            pool=st.pooled if self.pool and final else None,
        )

    def _proof_part(self, key: ChoiceKey, st: ChoiceState, engine: Any, final: bool, head: tuple):
        """A proof choice's proofs completed since its last part (hidden_states/proofs), from its rows."""
        from hidden_states.proofs import ProofBuilder

        if st.prover is None:
            st.prover = ProofBuilder(self.proof, self.prompt_lens[key[0]], engine.hidden_size)
        prover, first = st.prover, st.prover.count
        batch = self.hand_out(key)
        proofs = [] if batch is None else prover.add(batch.positions, batch.indices[-1], batch.values[-1])
        if final:
            proofs += prover.finish()
            st.prover = None
        elif not proofs:
            return None
        st.sent_bytes += sum(len(p) for p in proofs)
        if final:
            engine.vector_sent("proof", st.stats, st.sent_bytes)
        return CompletionChoice(
            *head,
            None,
            st.stats if final else None,
            proofs=tuple(proofs),
            position="proof",
            proof_index=first,
            prompt_tokens=prover.prompt_len,
            final=final,
        )

    def tagged(self, extra_args: dict | None = None) -> dict:
        """`extra_args` (SamplingParams', or an OpenAI request's `vllm_xargs`) as an engine request carries them
        for its vectors to land here: its spec keyed by this collector's tag."""
        return RequestSpec.of(extra_args).replace(key=self.tag).into(extra_args)


@dataclasses.dataclass(frozen=True)
class CompletionChoice:
    """A finished choice, the one type the Python API returns, the handle wire carries
    (deployments/wire.py) and the HTTP formatter reads (openai_format.choice_fields): its text and
    tokens, its rows as the engine cast them, its work, its proofs, its heads' outputs, its steering.

    The numpy arrays are views of `rows` (`hidden_states`, `hidden_states_by_layer`, top-k's
    indices), shaped by `multi` (shape.squeeze: [n, D] for several positions, [D] for one), in the
    dtype asked: float32 and float16 as they are; bfloat16, which numpy lacks, widened exactly to float32
    (`dtype` says "bfloat16")."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    # The rows at their absolute positions of prompt+completion, per requested layer, raw as cast
    # (bfloat16: its bits); no layers for heads alone (the positions only); None: nothing captured
    # (a proof, steering only, no hidden states asked).
    rows: RowBatch | None = None
    extraction: ExtractionStats | None = None  # None for prompt_end: no extraction step
    multi: bool = False  # several positions (shape.several of the request's position)
    # hidden_states_proof: the choice's proofs (base64, the scheme's format), in chunk order.
    proofs: tuple[str, ...] | None = None
    # hidden_states_heads: {head: outputs} as the API gives them (heads.head_fields)
    heads: dict[str, Any] | None = None
    # hidden_states_steering: the steering applied, as hidden_states_meta.steering echoes it
    steering: list[dict] | None = None
    # hidden_states_stop: the condition that finished the choice ({head, feature, above | below, position,
    # score}, as hidden_states_meta.stop), None if none did; absent (stop_asked False) if none was asked
    stop: dict | None = None
    stop_asked: bool = False
    # How the request asked (hidden_states_meta says it): its position (params.POSITIONS, a range, or "proof"),
    # its top-k, and its prompt's media ({modality, positions} per item); a proof choice's first proof's index
    # and its prompt's length; this part's heads' bytes as they travelled (None: no heads); and whether it is
    # the choice's last part (the whole choice, for the Python API and the handles).
    position: Any = None
    topk: int | None = None
    modalities: list[dict] | None = None
    proof_index: int = 0
    prompt_tokens: int | None = None
    head_bytes: int | None = None
    final: bool = True
    pool: int | None = None  # hidden_states_pool: the rows its vector is the mean of (None: not pooled)

    @property
    def dtype(self) -> str:
        """hidden_states_dtype: the rows' values were cast to it."""
        return self.rows.dtype if self.rows is not None else "float32"

    @functools.cached_property
    def hidden_states_by_layer(self) -> dict[int, np.ndarray] | None:
        """Requested layer -> its rows [n, D] (one position: the vector [D]); None without rows."""
        if self.rows is None or not self.rows.values:
            return None
        return {layer: squeeze(self.rows.numpy(layer), self.multi) for layer in self.rows.values}

    @property
    def hidden_states(self) -> np.ndarray | None:
        """The last layer's (after the final norm), if it was asked for."""
        return (self.hidden_states_by_layer or {}).get(-1)

    @functools.cached_property
    def hidden_states_indices_by_layer(self) -> dict[int, np.ndarray] | None:
        """Top-k: requested layer -> int32 indices of `hidden_states_by_layer`'s values (largest |value| first)."""
        if self.rows is None or not self.rows.indices:
            return None
        return {layer: squeeze(i, self.multi) for layer, i in self.rows.indices.items()}

    @property
    def hidden_states_indices(self) -> np.ndarray | None:
        return (self.hidden_states_indices_by_layer or {}).get(-1)

    @property
    def positions(self) -> tuple[int, ...] | None:
        """Several positions: the absolute positions of the rows; one position: None."""
        return tuple(self.rows.positions.tolist()) if self.multi and self.rows is not None else None

    def raw(self, layer: int) -> np.ndarray:
        """The layer's rows as cast (bfloat16: its bits), shaped as `hidden_states_by_layer`."""
        return squeeze(self.rows.values[layer], self.multi)

    @property
    def shape(self) -> list[int]:
        """The rows' shape per layer: [n, width] for several positions, [width] for one."""
        return [len(self.rows), self.rows.width][0 if self.multi else 1 :]


def finished_choice(
    engine: Any,
    collector: HiddenStatesCollector | None,
    index: int,
    text: str,
    token_ids: Sequence[int],
    finish_reason: str | None,
) -> CompletionChoice:
    """A finished choice of a request (the Python API's): with what it captured, or its text alone."""
    if collector is None:
        return CompletionChoice(index, text, tuple(token_ids), finish_reason)
    return collector.choice((0, index), engine, True, index, text, token_ids, finish_reason)


def _captured(
    collector: HiddenStatesCollector, batch: RowBatch | None, width: int, registry: Any
) -> tuple[RowBatch, dict | None]:
    """A choice's rows as it carries them (no batch: none, shaped as asked; heads alone: positions
    only) and its heads' outputs."""
    layers = collector.layers if collector.rows_wanted else ()  # heads alone: no rows
    heads = head_fields(batch, collector.heads, registry, collector.multi) if collector.heads else None
    batch = batch if batch is not None else RowBatch.empty(layers, width, collector.dtype, collector.topk)
    rows = RowBatch(
        batch.positions,
        {l: batch.values[l] for l in layers},
        batch.dtype,
        {l: batch.indices[l] for l in layers} if batch.indices and layers else None,
    )
    return rows, heads


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
    head_outputs: dict[str, int] = dataclasses.field(default_factory=dict)  # head -> positions it gave outputs for
    head_bytes: int = 0  # the heads' outputs as sent (float32 values, int32 indices)


class VectorObservers:
    """Callbacks for every vector an engine hands out (a replica registers its metrics)."""

    def __init__(self):
        self.observers: list[Callable[[VectorEvent], None]] = []

    def vector_sent(
        self,
        position: str,
        stats: ExtractionStats | None,
        nbytes: int,
        head_outputs: dict[str, int] | None = None,
        head_bytes: int = 0,
    ) -> None:
        event = VectorEvent(
            position,
            stats.via if stats else "prompt",
            stats.computed_tokens if stats else None,
            stats.cached_tokens if stats else None,
            stats.seconds if stats else None,
            nbytes,
            dict(head_outputs or {}),
            head_bytes,
        )
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
    """What an EngineReplica (deployments/replica.py) uses of its engine, and nothing more:
    tests/unit/test_engine_protocol.py checks that the replica reaches only these, and that
    `HiddenStatesEngine` and `hidden_states.testing.FakeEngine` take every call as declared."""

    enabled: bool  # hidden states on
    max_model_len: int  # prompt + completion tokens, at most (/v1/models reports it)
    hidden_size: int  # D: the width of a row
    observers: list[Callable[[VectorEvent], None]]  # called for every vector handed out (metrics)
    heads: dict[str, Any]  # registered heads by name (heads.HeadSpec), as the model card lists them
    steering_vectors: dict[str, dict[int, Any]]  # registered steering vectors: name -> layer -> [D]
    layer_capture: dict[str, Any] | None  # what the workers found at install (the compiled engine's layers)

    @classmethod
    async def start(cls, model: str, **kwargs: Any) -> Engine:
        """`kwargs`: the app's engine options (AppArgs) and vLLM's engine arguments."""
        ...

    async def openai(self, served_model_name: str, replica_id: str, lora_modules: Sequence[dict] = ()) -> OpenAIRoutes:
        """`lora_modules`: [{name, path}], each adapter served under its name (a request's `model`)."""
        ...

    async def chat_input(self, messages: Sequence[dict]) -> dict:
        """Chat messages as the engine's input: the model's chat template with its generation prompt."""
        ...

    async def complete(
        self,
        prompt: str | Sequence[int] | dict,
        sampling: SamplingOptions | None = None,
        *,
        model: str | None = None,
        spec: Any = None,
    ) -> Completion:
        """One prompt's choices, each a `CompletionChoice` (`finished_choice`). `model`: a LoRA adapter's
        name (None: base; unknown raises UnknownModelError); `spec`: the request's parsed fields
        (params.HiddenStatesFields), None for none."""
        ...

    async def stats(self, fresh_workers: bool = True) -> dict:
        """The engine's counters; `fresh_workers=False` may give the workers' as last asked."""
        ...

    def healthy(self) -> bool: ...

    def shutdown(self) -> None: ...


class Head(NamedTuple):
    """What an OpenAI route yields first: its status and whole body, or (`body` None) SSE chunks follow."""

    status: int
    body: bytes | None


STREAM = Head(200, None)  # a stream: its SSE chunks (bytes) follow


class OpenAIRoutes(Protocol):
    def handle(self, route: str, body: bytes) -> AsyncIterator[Head | bytes]:
        """A Head, then (STREAM) the SSE chunks."""
        ...
