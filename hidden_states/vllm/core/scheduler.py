"""The engine core's scheduler: each step's capture plan, rows onto outputs, the tail step
(ledger point 9 in __init__.py).

- **Capture.** `_plan` names each step's rows (`PLAN_ATTR`); the runner hangs them on the
  ModelRunnerOutput (`protocol.StepCapture`) and `update_from_output` files them per request.
- **Delivery.** Rows leave in the `kv_transfer_params` of the request's EngineCoreOutputs
  (`protocol.EngineMessage` under `OUTPUT_KEY`): a stream's on each output, the rest on the
  finishing one. A wanted position no output brought is computed by the frontend's
  extraction step. Nothing waits on a timer.
- **The tail step** (`TailScheduler`, synchronous only). A `tail=True` request that stops
  inside the engine is held one step: its final token is appended but not emitted, the next
  step computes its row as an ordinary decode row, the token sampled from it is dropped, and
  the held token is emitted with its logprobs and the original finish (vLLM's detokenizer
  drops a stop token from the text only when it arrives with its finish).

Not held (the extraction step computes the row): no room for one more position, a grammar,
or a stop the frontend cuts (stop strings).

**Faults stay with their request** (ledger point 19). Each hook of ours here works request by
request (`_plan`, `_store_step`, `_send_rows` and the finishing rows of `_free_request`, the tail's hold in
`_update_request_with_output`); one that raises for a request, or a worker's report of
one (`StepCapture.faults`), finishes that request with vLLM's FINISHED_ERROR at the end of the
update: its output of this step is replaced by an "error" finish carrying the `HookFault`
(`EngineMessage.fault`), and the frontend fails its caller with a 500 naming the hook.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from hidden_states.protocol import (
    MONITOR_BLOCK,
    OUTPUT_KEY,
    PLAN_ATTR,
    SEQ_ATTR,
    STEP_ATTR,
    STOP_REASON,
    CapturedRows,
    CaptureSpec,
    EngineMessage,
    HookFault,
    PlanEntry,
    RequestSpec,
    Span,
    SteeredReport,
    StopReport,
    absolute_layer,
    captured_rows,
    encode_plan,
)
from hidden_states.vllm import _require

logger = logging.getLogger(__name__)

_HOLD = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_REPETITION)


@dataclasses.dataclass
class _Held:
    """A stopped request's finish, kept for one step: emitted with the tail step's output."""

    status: Any
    stop_reason: Any
    tokens: list[int]
    logprobs: Any  # LogprobsLists of the held tokens, or None
    sampling_mask: Any


@dataclasses.dataclass
class _Rows:
    """A span request's unsent rows: a window over a buffer that grows by doubling. Undecided rows
    are a suffix, so a step appends and drops in place: O(1) copies per row."""

    spec: CaptureSpec
    span: Span
    next: int = 0  # positions below were captured already (a resumed request recomputes them)
    layers: list[int] | None = None
    dtype: str = "float32"
    _pos: np.ndarray | None = None  # [capacity]
    _val: np.ndarray | None = None  # [layers, capacity, width] raw elements
    _ind: np.ndarray | None = None  # int32, alike (top-k)
    lo: int = 0  # the window: buffer slots lo..hi-1
    hi: int = 0

    def add(self, positions: np.ndarray, values: np.ndarray, indices: np.ndarray | None) -> None:
        m = len(positions)
        if self._pos is None:
            self._pos = np.empty(max(m, 8), np.int64)
            self._val = np.empty((values.shape[0], len(self._pos), values.shape[2]), values.dtype)
            self._ind = None if indices is None else np.empty(self._val.shape[:2] + indices.shape[2:], indices.dtype)
        elif self.hi + m > len(self._pos):
            self._resize(max(2 * (self.hi - self.lo), self.hi - self.lo + m, 8))
        sl = slice(self.hi, self.hi + m)
        self._pos[sl], self._val[:, sl] = positions, values
        if indices is not None:
            self._ind[:, sl] = indices
        self.hi += m

    def _resize(self, capacity: int) -> None:
        """The window moved to slot 0 of a buffer of `capacity` slots."""
        n, w = self.hi - self.lo, slice(self.lo, self.hi)
        pos, val = (
            np.empty(capacity, np.int64),
            np.empty(self._val.shape[:1] + (capacity,) + self._val.shape[2:], self._val.dtype),
        )
        pos[:n], val[:, :n] = self._pos[w], self._val[:, w]
        if self._ind is not None:
            ind = np.empty(self._ind.shape[:1] + (capacity,) + self._ind.shape[2:], self._ind.dtype)
            ind[:, :n] = self._ind[:, w]
            self._ind = ind
        self._pos, self._val, self.lo, self.hi = pos, val, 0, n

    def prune(self, known: int) -> None:
        """Drops the oldest rows no longer wantable; the window stays as long as the range."""
        if self.hi > self.lo:
            wanted, undecided = self.span.classify(self._pos[self.lo : self.hi], known)
            keep = wanted | undecided
            self.lo += int(np.argmax(keep)) if keep.any() else len(keep)

    def trim(self, limit: int) -> None:
        """Drops rows at `limit` and past it (a suffix of the window: positions only grow)."""
        if self.hi > self.lo:
            self.hi = self.lo + int(np.count_nonzero(self._pos[self.lo : self.hi] < limit))
        self.next = min(self.next, limit)

    def release(self, known: int, total: int | None = None) -> CapturedRows | None:
        """The rows decided wanted (all of them, on `total` tokens, once ended); undecided stay."""
        if self.hi == self.lo:
            return None
        w = slice(self.lo, self.hi)
        wanted, undecided = self.span.classify(self._pos[w], known, total)
        out = None
        if wanted.any():
            out = captured_rows(
                self.dtype,
                self.spec.topk,
                self.layers,
                self._pos[w][wanted].tolist(),
                self._val[:, w][:, wanted],
                None if self._ind is None else self._ind[:, w][:, wanted],
            )
        first = int(np.argmax(undecided)) if undecided.any() else len(undecided)
        if undecided[first:].all():  # a suffix: drop the decided prefix in place
            self.lo += first
        else:  # not expected of any span; kept correct all the same
            keep = np.flatnonzero(undecided) + self.lo
            n = len(keep)
            self._pos[:n], self._val[:, :n] = self._pos[keep], self._val[:, keep]
            if self._ind is not None:
                self._ind[:, :n] = self._ind[:, keep]
            self.lo, self.hi = 0, n
        return out


@dataclasses.dataclass
class _StepRefs:
    """A span request whose every row is wanted: per step only a reference to the step's host
    buffer and its blocks; rows are copied out once, when sent."""

    spec: CaptureSpec
    span: Span
    next: int = 0  # positions below were captured already (a resumed request recomputes them)
    layers: list[int] | None = None
    pieces: list = dataclasses.field(default_factory=list)  # (step data, blocks by layer, row mask or None)

    def add(self, data: np.ndarray, blocks: list, first: list[int], bound: int) -> None:
        """A step's rows from position `first`; rows at `bound` and past (rejected drafts) never count."""
        keep = None
        if first[0] < self.next or first[-1] >= bound:  # recomputed rows (a resumed request): once
            keep = (np.asarray(first) >= self.next) & (np.asarray(first) < bound)
            if not keep.any():
                return
        self.pieces.append((data, blocks, keep))
        self.next = max(self.next, min(first[-1] + 1, bound))
        self.layers = [b.layer for b in blocks]

    def trim(self, limit: int) -> None:
        """Drops rows at `limit` and past it (tokens accepted past a stop)."""
        if self.next <= limit:
            return
        pieces, self.pieces = self.pieces, []
        for data, blocks, keep in pieces:
            pos = np.asarray(blocks[0].positions)
            k = (pos < limit) if keep is None else keep & (pos < limit)
            if k.any():
                self.pieces.append((data, blocks, None if k.all() else k))
        self.next = limit

    def release(self, known: int, total: int | None = None) -> CapturedRows | None:
        if not self.pieces:
            return None
        pieces, self.pieces = self.pieces, []

        def cat(get) -> np.ndarray:
            per_layer = [
                [get(blocks[j], data) if keep is None else get(blocks[j], data)[keep] for data, blocks, keep in pieces]
                for j in range(len(self.layers))
            ]
            return np.stack([np.concatenate(p) if len(p) > 1 else p[0] for p in per_layer])

        positions = [
            p
            for _, blocks, keep in pieces
            for p in (blocks[0].positions if keep is None else np.asarray(blocks[0].positions)[keep].tolist())
        ]
        return captured_rows(
            self.spec.dtype,
            self.spec.topk,
            self.layers,
            positions,
            cat(lambda b, d: b.values(d)),
            cat(lambda b, d: b.indices(d)) if self.spec.topk else None,
        )


@dataclasses.dataclass
class _Pool:
    """hidden_states_pool: a request's rows summed per layer (float64 here), released once, on its finishing
    output. A step brings the float32 sum of its rows where the plan pooled them on the device (`PlanEntry.pool`:
    no drafts, every planned row wanted, none computed before); else its rows, which `inner` keeps as any span
    request's until the end decides them."""

    inner: _Rows | _StepRefs
    sums: np.ndarray | None = None  # [layers, width] float64
    summed: list = dataclasses.field(default_factory=list)  # the positions in `sums`, a list per step
    planned: int = 0  # positions below were planned pooled (a resumed request recomputes them: planned once)

    @property
    def spec(self) -> CaptureSpec:
        return self.inner.spec

    @property
    def span(self) -> Span:
        return self.inner.span

    def add(self, data: np.ndarray, blocks: list) -> None:
        """A step's pooled blocks (one float32 row per layer)."""
        values = np.stack([b.values(data)[0] for b in blocks]).astype(np.float64)
        self.sums = values if self.sums is None else self.sums + values
        self.summed.append(blocks[0].positions)
        self.inner.layers = [b.layer for b in blocks]

    def trim(self, limit: int) -> None:
        if any(p[-1] >= limit for p in self.summed):  # never planned: pooled steps have no drafts
            raise RuntimeError(f"pooled rows past the request's end ({limit} tokens)")
        self.inner.trim(limit)

    def release(self, known: int, total: int | None = None) -> CapturedRows | None:
        """On the end (`total`): the sum of every row of the span, with their positions."""
        if total is None:
            return None
        plain = self.inner.release(known, total)
        positions, sums = [p for ps in self.summed for p in ps], self.sums
        if plain is not None:
            values, _ = plain.arrays()
            more = values.astype(np.float64).sum(axis=1)
            positions += plain.positions
            sums = more if sums is None else sums + more
        if sums is None:
            return None
        if len(set(positions)) != len(positions) or any(p >= total for p in positions):
            raise RuntimeError("a pooled position summed twice, or past the request's end")
        self.sums, self.summed = None, []
        order = sorted(positions)
        return captured_rows(
            "float32", 0, self.inner.layers, order, sums.astype(np.float32)[:, None], None, pooled=True
        )


@dataclasses.dataclass
class _Capture:
    """One flagged request from `add_request` to its last output: its `spec`, whether a tail step
    computes its final row (decided once), its unsent rows, and the tail steps' positions."""

    spec: CaptureSpec
    tail: bool
    rows: _Rows | _StepRefs | _Pool
    tail_positions: int = 0
    # Each head's outputs (protocol.RowBlock.head), kept as rows are: the same span, their own spec.
    heads: dict[str, _Rows | _StepRefs] = dataclasses.field(default_factory=dict)
    judged: int = 0  # its monitors (spec.monitors) and conditions have scored the rows below this position
    prompt_len: int = 0
    # Conditional steering entries (protocol.SteerEntry.when): (entry index, its condition, start, end); per
    # position the bits of the conditions that held on its row; per entry the positions it was applied at.
    conditional: list = dataclasses.field(default_factory=list)
    held_at: dict[int, int] = dataclasses.field(default_factory=dict)
    applied: dict[int, list] = dataclasses.field(default_factory=dict)
    decided: int = 0  # positions below were decided (each as soon as its previous row was scored)
    sent: dict[int, int] = dataclasses.field(default_factory=dict)  # per entry: applied positions sent so far

    def decide(self) -> None:
        """Each conditional entry's positions from `decided` on whose previous row is scored: applied where
        that row held its condition (completion positions within the entry's span)."""
        upto = self.judged + 1  # row q - 1 is scored for q - 1 < judged
        for bit, (k, _, start, end) in enumerate(self.conditional):
            mine = self.applied.setdefault(k, [])
            mine += [
                q
                for q in range(max(self.decided, self.prompt_len, start), upto if end < 0 else min(upto, end))
                if self.held_at.get(q - 1, 0) >> bit & 1
            ]
        self.decided = max(self.decided, upto)

    def unsent(self) -> list:
        """[[entry index, applied positions not sent yet]] (each output of the request carries its new ones)."""
        out = []
        for k, positions in self.applied.items():
            new = positions[self.sent.get(k, 0) :]
            if new:
                out.append([k, new])
                self.sent[k] = len(positions)
        return out

    def accumulators(self) -> list[_Rows | _StepRefs | _Pool]:
        return [self.rows, *self.heads.values()]

    def release(self, known: int, total: int | None = None) -> _Taken | None:
        """The rows and head outputs decided wanted since the last take (all of them once ended)."""
        rows = self.rows.release(known, total)
        heads = {name: out for name, acc in self.heads.items() if (out := acc.release(known, total)) is not None}
        return _Taken(rows, heads) if rows is not None or heads else None


@dataclasses.dataclass
class _Taken:
    """What one output carries: rows, and each head's outputs at the same positions."""

    rows: CapturedRows | None
    heads: dict[str, CapturedRows]

    @property
    def last_position(self) -> int:
        some = self.rows if self.rows is not None else next(iter(self.heads.values()))
        return some.positions[-1]

    def counted(self, tail_positions: int) -> _Taken:
        for cr in [self.rows, *self.heads.values()]:
            if cr is not None:
                cr.tail_positions = tail_positions
        return self


@dataclasses.dataclass
class _Record:
    """All the scheduler knows of one request of ours, from `add_request` to its last output. It goes
    whole: when that output has left (`_drop_sent`), when the request is aborted, or when it fails."""

    key: str = ""  # its RequestSpec.key: every message of ours for it goes under it
    capture: _Capture | None = None  # a flagged request's rows, heads, monitors and conditions
    held: _Held | None = None  # stopped: its finish held one step, for the tail step
    released: _Held | None = None  # its held finish, emitted in this update (the held tokens' logprobs)
    trigger: tuple[int, int, float] | None = None  # a monitor held: (position, monitor, score), for its update
    stop: StopReport | None = None  # the monitor that finished it, for its finishing output
    steered: SteeredReport | None = None  # where its `when` entries applied, for its finishing output
    last_rows: _Taken | None = None  # its last rows, for its finishing output
    awaiting: int | None = None  # async: the step in flight that computes its final row (its sequence number)
    tokens: int = 0  # (its length then)
    stashed: tuple[int, Any] | None = None  # its finishing output (client, output), waiting for that step
    fault: HookFault | None = None  # a hook failed it in this update: finished with an error at the end
    freed: bool = False  # vLLM freed it: the record goes once its finishing output has left

    @property
    def live(self) -> _Capture | None:
        """Its capture while vLLM runs it (a freed request's rows are only sent, not planned)."""
        return None if self.freed else self.capture


class _HiddenStatesScheduling:
    """Mixed into a vLLM v1 scheduler: vectors onto finishing outputs, and (if `holds`) the tail step;
    (if `async_tail`) the tail under async scheduling. Per request, one `_Record` in `_records`."""

    holds = False
    async_tail = False
    _updating: int | None = None

    def __init__(self, *args: Any, **kwargs: Any):
        for name in ("add_request", "schedule", "update_from_output", "_update_request_with_output", "_free_request"):
            _require(hasattr(Scheduler, name), f"Scheduler.{name} (the scheduler hook, ledger point 9)")
        super().__init__(*args, **kwargs)
        self._records: dict[str, _Record] = {}  # requests of ours, by request id
        self._step_output: Any = None  # the ModelRunnerOutput being applied (for a held token's logprobs)
        self.tails_run = 0
        self.monitor_stops = 0  # requests a monitor finished
        # Async scheduling: the step after a stop is in flight with the final token as its input.
        self._seq = 0  # schedule() calls so far: a step's sequence number
        self._scheduled: dict[int, dict[str, int]] = {}  # recent steps' scheduled tokens per request, by sequence

    def _fault(self, rid: str, hook: str, error: BaseException | HookFault) -> None:
        """A hook of ours raised for `rid` (here, or in a worker: its report): the request fails at the
        end of this update, alone."""
        if (rec := self._records.get(rid)) is None:  # (a steered request's: no capture)
            req = self.requests.get(rid)
            rec = self._records[rid] = _Record(RequestSpec.of(req.sampling_params.extra_args).key if req else "")
        if rec.fault is not None:
            return
        if isinstance(error, HookFault):
            logger.error("request %s: the hidden-states hook %s failed in a worker (%s)", rid, error.hook, error.error)
            rec.fault = error
        else:
            logger.error(
                "request %s: the hidden-states hook %s raised in the scheduler; failing the request",
                rid,
                hook,
                exc_info=error,
            )
            rec.fault = HookFault.of(hook, error)

    def _live(self):
        """(request id, record, capture) of each flagged request vLLM runs."""
        return ((rid, rec, rec.capture) for rid, rec in self._records.items() if rec.live is not None)

    def add_request(self, request: Any) -> None:
        sp = request.sampling_params
        ours = RequestSpec.of(sp.extra_args if sp is not None else None)
        if (spec := ours.capture) is not None:
            L = self.vllm_config.model_config.hf_text_config.num_hidden_layers
            spec.layers = [absolute_layer(l, L) for l in spec.layers]  # once, for every step's plan
            span = Span.from_list(spec.span)
            tail = spec.reaches_final and self._takes_tail(sp)
            # Every captured row is wanted where the span starts at an absolute position and either has
            # no end counted from the end, or stops just before the final token without a tail step
            # (a proof's: that row is computed only by a draft in the finishing step, and the frontend
            # keeps what was asked): references to the steps' buffers, no window per step.
            every_row = span.start >= 0 and (span.end is None or span.end >= 0 or (span.end == -1 and not tail))
            acc = (lambda f: _StepRefs(f, span)) if every_row else (lambda f: _Rows(f, span, dtype=f.dtype))
            heads = {name: acc(spec.head_spec(name, k)) for name, k in spec.heads}
            rows = acc(spec)
            if spec.pool:  # summed on the device where no draft may be rejected and every planned row is wanted
                rows = _Pool(rows, planned=0 if every_row and self.vllm_config.speculative_config is None else -1)
            conditional = [(k, e.when, e.start, e.end) for k, e in enumerate(ours.steer) if e.when is not None]
            cap = _Capture(spec, tail, rows, heads=heads, prompt_len=request.num_prompt_tokens, conditional=conditional)
            self._records[request.request_id] = _Record(ours.key, capture=cap)
        super().add_request(request)

    def _takes_tail(self, sp: Any) -> bool:
        """The one place a request's tail is decided: this scheduler takes tails, the stop is seen by
        the engine (not a stop string) and there is no grammar. (`_holds` adds room for one more
        position.)"""
        return (self.holds or self.async_tail) and not sp.stop and getattr(sp, "structured_outputs", None) is None

    def schedule(self, *args: Any, **kwargs: Any):
        bumped = []
        for rid, rec, cap in self._live():
            req = self.requests.get(rid)
            if req is None:
                continue
            # A tail step computes the final token alone, and a request with conditional steering gets one
            # completion row a step, each decided: no draft tokens after them.
            if (rec.held is not None or cap.conditional) and req.spec_token_ids:
                req.spec_token_ids = []
            # vLLM's async scheduler does not schedule the step after the one that reaches max_tokens; a
            # tail-flagged request needs it (it computes the final token's row): its max_tokens is one
            # more while scheduling only (check_stop reads the real one).
            if self.async_tail and cap.tail and req.num_output_placeholders > 0 and req.max_tokens is not None:
                req.max_tokens += 1
                bumped.append(req)
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            for req in bumped:
                req.max_tokens -= 1
        plan = self._plan(out) if self._records else None
        setattr(out, PLAN_ATTR, encode_plan(plan) if plan else None)
        for rid, rec, cap in self._live():  # a tail step's work, counted as scheduled (1 position, unless recomputed)
            if rec.held is not None:
                cap.tail_positions += out.num_scheduled_tokens.get(rid, 0)
        if self.async_tail:
            self._seq += 1
            setattr(out, SEQ_ATTR, self._seq)
            self._scheduled[self._seq] = dict(out.num_scheduled_tokens)
            self._scheduled.pop(self._seq - 4, None)
        return out

    def _plan(self, out: Any) -> dict[str, PlanEntry] | None:
        """The step's capture plan: per flagged request scheduled, the rows of its span among the
        positions first..stop-1 it computes (drafts included; rejected ones dropped on output). A
        final-position-only span is planned only where that position can be computed: a held
        request's tail step, or under async scheduling every decode row."""
        plan, sched = {}, out.num_scheduled_tokens
        for rid, rec, cap in self._live():
            n = sched.get(rid)
            if not n or rec.fault is not None:
                continue
            try:
                if (entry := self._plan_request(rid, rec, cap, n)) is not None:
                    plan[rid] = entry
            except Exception as e:  # this request fails alone (at the end of the step's update)
                self._fault(rid, "plan", e)
        return plan or None

    def _plan_request(self, rid: str, rec: _Record, cap: _Capture, n: int) -> PlanEntry | None:
        """One request's entry of the step's plan (`n` positions scheduled), or None: nothing to do."""
        req, span, spec = self.requests[rid], cap.rows.span, cap.spec
        stop = req.num_computed_tokens  # advanced by this step already (Scheduler._update_after_schedule)
        first = stop - n
        if not span.final_only:
            positions = span.capturable(first, stop)
        elif rec.held is not None:
            positions = [stop - 1] if stop == req.num_tokens else []
        elif self.async_tail and cap.tail and stop > req.num_prompt_tokens:
            positions = [stop - 1]  # kept only if it is the final token's (_async_tails)
        else:
            positions = []
        # Its monitors score the completion rows not judged yet, its conditions those from the last prompt
        # row on (a held request's tail row is not scored: nothing comes after it).
        lowest = req.num_prompt_tokens - 1 if cap.conditional else req.num_prompt_tokens
        watch = (
            []
            if not (spec.monitors or cap.conditional) or rec.held is not None
            else list(range(max(first, lowest, cap.judged), stop))
        )
        steer = self._decide(cap, first, stop) if cap.conditional else []
        steer_if = self._on_device(cap, first, len(spec.monitors)) if cap.conditional else []
        pool = isinstance(cap.rows, _Pool) and cap.rows.planned >= 0
        if pool and positions:  # a resumed request's recomputed rows were summed already
            positions = [p for p in positions if p >= cap.rows.planned]
            cap.rows.planned = positions[-1] + 1 if positions else cap.rows.planned
        if positions or watch or steer or steer_if:
            monitors = [
                [m.head, m.index, m.above, m.threshold] for m in (*spec.monitors, *(c[1] for c in cap.conditional))
            ]
            return PlanEntry(
                [p - first for p in positions],
                positions,
                spec.layers,
                stop,
                spec.dtype,
                spec.topk,
                spec.heads,
                [p - first for p in watch],
                watch,
                monitors if watch else [],
                steer,
                steer_if,
                bool(cap.conditional and self.async_tail and watch),
                pool,
            )
        return None

    def _decide(self, cap: _Capture, first: int, stop: int) -> list:
        """Each conditional entry's rows among positions first..stop-1, as decided from the rows scored in
        earlier steps (one completion row a step; a recomputed prefill's were decided before):
        [[entry index, offsets]]."""
        cap.decide()
        return [
            [k, [q - first for q in positions if first <= q < stop]]
            for k, positions in cap.applied.items()
            if positions and positions[-1] >= first
        ]

    def _on_device(self, cap: _Capture, first: int, monitors: int) -> list:
        """Async scheduling: the conditional entries at position `first` whose row before has not been scored
        here yet (the step in flight computed it): [[entry index, monitor index, 0]], each applied by the worker
        where its own verdict of that row holds (the verdict `_judge` reaches later, from the same score).
        A later position of the step would need a row of the same step: a request with a conditional entry
        gets one completion row a step (no drafts), so none is."""
        if first < max(cap.decided, cap.prompt_len):
            return []
        return [
            [k, monitors + bit, 0]
            for bit, (k, _, start, end) in enumerate(cap.conditional)
            if first >= start and (end < 0 or first < end)
        ]

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any):
        step = getattr(model_runner_output, STEP_ATTR, None)
        if step is not None:
            for rid, fault in step.faults.items():  # a worker's hook failed these: no rows of theirs came
                self._fault(rid, fault.hook, fault)
            self._store_step(step, scheduler_output, model_runner_output)
        self._step_output = model_runner_output
        self._updating = getattr(scheduler_output, SEQ_ATTR, None)
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
        finally:
            self._step_output = None
        if not self._records:
            return outputs
        if self.async_tail:
            self._async_tails(outputs)
        self._send_rows(outputs)
        self._fail(outputs)
        self._drop_sent()
        return outputs

    def _async_tails(self, outputs: dict) -> None:
        """Async: a stopped request's finishing output waits for the step in flight, whose row is the
        final token's, and leaves with the vector one step later."""
        from vllm.v1.engine import EngineCoreOutputs

        seq = self._updating
        for rid, rec in self._records.items():
            if rec.awaiting is None or seq is None or rec.awaiting > seq:
                continue
            rec.awaiting, stashed, rec.stashed = None, rec.stashed, None
            if stashed is None:  # (its finishing output never came: nothing to send)
                continue
            client, eco = stashed  # this step computed its final token
            cap, tokens = rec.capture, rec.tokens
            if (rows := cap.release(tokens, total=tokens)) is not None:  # its rows, the final one too
                if rows.last_position == tokens - 1:  # the step in flight's row: the positions it scheduled
                    rows.counted(self._scheduled.get(seq, {}).get(rid, 0))
                    self.tails_run += 1
                rec.last_rows = rows  # sent by _send_rows, on this very output
            if client not in outputs:
                outputs[client] = EngineCoreOutputs(outputs=[])
            outputs[client].outputs.append(eco)
        for client, batch in outputs.items():  # finishing outputs of requests just put to wait
            keep = []
            for eco in batch.outputs:
                rec = self._records.get(eco.request_id)
                if rec is not None and rec.awaiting is not None and eco.finish_reason is not None:
                    rec.stashed = (client, eco)
                else:
                    keep.append(eco)
            batch.outputs = keep

    def _send_rows(self, outputs: dict) -> None:
        """Every output of a span request carries the rows decided since its last one (a request
        whose outputs are final-only: its finishing output carries them all); a finishing output,
        also where a monitor stopped it and where its `when` entries applied; and a released held
        token, its own logprobs."""
        for batch in outputs.values():
            for eco in batch.outputs:
                rid = eco.request_id
                if (rec := self._records.get(rid)) is None:
                    continue
                try:
                    self._send_request(eco, rec)
                except Exception as e:  # this request fails alone (_fail, right after)
                    self._fault(rid, "send", e)
                if (held := rec.released) is not None:  # the held token's own logprobs, not the tail sample's
                    rec.released = None
                    eco.new_logprobs = held.logprobs
                    if held.sampling_mask is not None:
                        eco.new_sampling_mask = held.sampling_mask

    def _send_request(self, eco: Any, rec: _Record) -> None:
        """What one output of a request of ours carries: its rows, and on its finishing output its stop and
        where its `when` entries applied."""
        cap, msg = rec.capture, EngineMessage(rec.key)
        if eco.finish_reason is not None:
            rows, rec.last_rows = rec.last_rows, None
            msg.stop, msg.steered = rec.stop, rec.steered  # a monitor that finished it; where `when` entries applied
        elif cap is not None and cap.spec.every_step and (req := self.requests.get(eco.request_id)) is not None:
            rows = cap.release(req.num_tokens)
        else:
            rows = None
        if eco.finish_reason is None and cap is not None and cap.conditional:
            cap.decide()  # its new decisions: a stop string's extraction step (frontend) replays them
            if new := cap.unsent():
                msg.steered = SteeredReport(new)
        if rows is not None:
            msg.rows, msg.heads = rows.rows, rows.heads
        if msg:
            eco.kv_transfer_params = {**(eco.kv_transfer_params or {}), OUTPUT_KEY: msg.to_output()}

    def _fail(self, outputs: dict) -> None:
        """The requests a hook failed in this update: finished with FINISHED_ERROR, their outputs of the
        step replaced by one "error" finish that carries the fault (the frontend fails the caller)."""
        faults = {rid: rec for rid, rec in self._records.items() if rec.fault is not None}
        if not faults:
            return
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

        clients: dict[str, int] = {}
        for client, batch in outputs.items():  # this step's tokens of a failed request are not sent
            if any(eco.request_id in faults for eco in batch.outputs):
                clients.update((eco.request_id, client) for eco in batch.outputs if eco.request_id in faults)
                batch.outputs = [eco for eco in batch.outputs if eco.request_id not in faults]
        for rid in faults:  # async: a finishing output waiting for its tail
            if (stashed := self._records[rid].stashed) is not None:
                clients[rid] = stashed[0]
        for request in self.finish_requests(
            [rid for rid in faults if rid in self.requests], RequestStatus.FINISHED_ERROR
        ):
            clients[request.request_id] = request.client_index
        for rid, rec in faults.items():
            del self._records[rid]
            if rid not in clients:  # finished and sent before the fault was known: nothing left to fail
                continue
            outputs.setdefault(clients[rid], EngineCoreOutputs(outputs=[])).outputs.append(
                EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=[],
                    finish_reason=FinishReason.ERROR,
                    kv_transfer_params={OUTPUT_KEY: EngineMessage(rec.key, fault=rec.fault).to_output()},
                )
            )

    def _drop_sent(self) -> None:
        """The records of requests vLLM freed whose finishing output has left (not one awaiting a step)."""
        for rid in [rid for rid, rec in self._records.items() if rec.freed and rec.awaiting is None]:
            del self._records[rid]

    def _store_step(self, step: Any, so: Any, mro: Any) -> None:
        """A step's captured rows, head outputs and monitor scores, each into its request's record."""
        spec = so.scheduled_spec_decode_tokens
        for rid, blocks in step.requests.items():
            rec = self._records.get(rid)
            if rec is None or (cap := rec.capture) is None:
                continue
            try:
                self._store_request(rid, rec, cap, blocks, step.data, spec, mro)
            except Exception as e:  # this request fails alone (at the end of this update)
                self._fault(rid, "file", e)

    def _store_request(
        self, rid: str, rec: _Record, cap: _Capture, blocks: list, data: np.ndarray, drafts: dict, mro: Any
    ) -> None:
        """One request's blocks of a step into its record (`drafts`: the step's scheduled draft tokens)."""
        # Rows past the accepted tokens are rejected drafts' (speculative decoding): the step
        # computed tokens up to num_tokens - rejected (the scheduler's own rollback).
        bound = blocks[0].num_tokens - _rejected(rid, drafts, mro)
        by_head: dict[str, list] = {}
        for b in blocks:
            by_head.setdefault(b.head, []).append(b)
        for head, mine in by_head.items():
            if head == MONITOR_BLOCK:
                if not rec.freed:  # (not a finished request's, awaiting its tail row)
                    self._judge(rec, mine[0], data, bound)
                continue
            acc = cap.heads.get(head) if head else cap.rows
            if acc is not None:
                _file_into(acc, data, sorted(mine, key=lambda b: b.layer), bound)

    def _judge(self, rec: _Record, block: Any, data: np.ndarray, bound: int) -> None:
        """A step's monitor scores of a request (float32 [positions, monitors]): the first position not
        judged yet, below `bound` (accepted tokens only), where a monitor holds (in order) is its trigger."""
        cap = rec.capture
        scores = block.values(data)
        monitors = cap.spec.monitors
        conditions = len(monitors)  # the conditional entries' scores follow the stop conditions'
        for r, position in enumerate(block.positions):
            if position < cap.judged or position >= bound:
                continue
            if cap.conditional:
                cap.held_at[int(position)] = sum(
                    1 << bit for bit, c in enumerate(cap.conditional) if c[1].holds(float(scores[r, conditions + bit]))
                )
            if position < cap.prompt_len:
                continue
            for i, monitor in enumerate(monitors):
                if monitor.holds(float(scores[r, i])):
                    rec.trigger = (int(position), i, float(scores[r, i]))
                    cap.judged = bound  # nothing past the trigger is judged
                    return
        cap.judged = max(cap.judged, min(block.positions[-1] + 1, bound))

    def _update_request_with_output(self, request: Any, new_token_ids: list[int], *args: Any, **kwargs: Any):
        rec = self._records.get(request.request_id) if self._records else None
        if rec is None:
            return super()._update_request_with_output(request, new_token_ids, *args, **kwargs)
        if (held := rec.held) is not None:
            # The tail step ran: drop the token sampled from it; emit the held one with its finish.
            rec.held, rec.released = None, held
            request.status, request.stop_reason = held.status, held.stop_reason
            self.tails_run += 1
            return list(held.tokens), True
        if (trigger := rec.trigger) is not None:  # a monitor held at row p: tokens up to p stay, the rest goes
            rec.trigger = None
            position, index, score = trigger
            keep = max(position + 1 - request.num_tokens, 0)
            new_token_ids, stopped = super()._update_request_with_output(request, new_token_ids[:keep], *args, **kwargs)
            if not stopped:  # (an ordinary stop at or before p stands)
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, STOP_REASON.format(index)
                stopped = True
                self.monitor_stops += 1
                rec.stop = StopReport(position, index, score)
        else:
            new_token_ids, stopped = super()._update_request_with_output(request, new_token_ids, *args, **kwargs)
        if not stopped or (cap := rec.live) is None:
            return new_token_ids, stopped
        try:
            if self._stopped(request, rec, cap, new_token_ids):
                return [], False
        except Exception as e:  # this request fails alone (at the end of this update)
            self._fault(request.request_id, "tail", e)
        return new_token_ids, stopped

    def _stopped(self, request: Any, rec: _Record, cap: _Capture, new_token_ids: list[int]) -> bool:
        """A request of ours stopped in this update: its rows past the stop go, and whether its finish is
        held for the tail step (then it runs one more step)."""
        for acc in cap.accumulators():  # draft tokens accepted past the stop: their rows go too
            acc.trim(request.num_tokens)
        if not (self.holds and self._holds(request, cap)):
            return False
        rec.held = self._hold(request, new_token_ids)
        request.status, request.stop_reason = RequestStatus.RUNNING, None
        # The tail step computes the final token, once: with draft tokens accepted past a stop,
        # the step computed beyond it (those positions are no longer the request's).
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        request.spec_token_ids = []
        return True

    def _holds(self, request: Any, cap: _Capture) -> bool:
        n = request.num_tokens
        return (
            cap.tail
            and request.status in _HOLD
            and n < self.max_model_len
            and request.structured_output_request is None
            and n - 1 in cap.rows.span.positions(n)
        )  # its span wants the final token, now its length is known

    def _hold(self, request: Any, tokens: list[int]) -> _Held:
        out, n = self._step_output, len(tokens)
        index = out.req_id_to_index[request.request_id]
        sp = request.sampling_params
        logprobs = (
            out.logprobs.slice_request(index, n)
            if sp is not None and sp.num_logprobs is not None and out.logprobs
            else None
        )
        masks = getattr(out, "sampling_masks", None)
        mask = masks.slice_request(index, n) if self.return_sampling_mask and masks is not None and n else None
        return _Held(request.status, request.stop_reason, list(tokens), logprobs, mask)

    def _free_request(self, request: Any, *args: Any, **kwargs: Any):
        rid = request.request_id
        if (rec := self._records.get(rid)) is not None:
            if request.status == RequestStatus.FINISHED_ABORTED:  # no finishing output of ours follows
                del self._records[rid]
            else:
                self._finished(request, rec)
        return super()._free_request(request, *args, **kwargs)

    def _finished(self, request: Any, rec: _Record) -> None:
        """A request vLLM frees: what its finishing output carries, or (async) the step it awaits."""
        rec.freed, rec.held, rec.trigger = True, None, None
        if (cap := rec.capture) is None:
            return
        if cap.conditional:  # where each `when` entry applies, the final token's position decided too
            cap.decide()
            rec.steered = SteeredReport(cap.unsent())
        # (a monitor's stop: its final row is this step's, already filed; the step in flight's is a dropped token's)
        if self.async_tail and cap.tail and rec.stop is None and self._await_tail(request, rec):
            return  # the step in flight computes its final row (_async_tails sends the rows)
        try:
            rows = cap.release(request.num_tokens, total=request.num_tokens)
            if rows is not None:
                rec.last_rows = rows.counted(cap.tail_positions)
        except Exception as e:  # its rows for the finishing output: it fails alone
            self._fault(request.request_id, "send", e)

    def _await_tail(self, request: Any, rec: _Record) -> bool:
        """Async, a stopped request: whether the already-scheduled next step computes its final token
        (then its output waits, `_async_tails`), else the extraction step computes it."""
        nxt = None if self._updating is None else self._updating + 1
        if request.request_id in self._scheduled.get(nxt, ()):
            rec.awaiting, rec.tokens = nxt, request.num_tokens
            return True
        return False


def _file_into(acc: _Rows | _StepRefs | _Pool, data: np.ndarray, blocks: list, bound: int) -> None:
    """One request's blocks of a step (rows of its layers, or one head's outputs) into `acc`."""
    first, spec = blocks[0], acc.spec
    if isinstance(acc, _Pool):
        if first.pooled:
            acc.add(data, blocks)
        else:
            _file_into(acc.inner, data, blocks, bound)
        return
    if isinstance(acc, _StepRefs):  # the plan asked only for rows the span wants (Span.capturable)
        acc.add(data, blocks, first.positions, bound)
        return
    positions = np.asarray(first.positions, dtype=np.int64)
    # An end-aligned span: some rows wait for the end; a resumed request recomputes rows sent already.
    wanted, undecided = acc.span.classify(positions, first.num_tokens)
    keep = (wanted | undecided) & (positions >= acc.next) & (positions < bound)
    acc.next = max(acc.next, min(first.positions[-1] + 1, bound))
    if not keep.any():
        return
    acc.layers = [b.layer for b in blocks]
    values = np.stack([b.values(data)[keep] for b in blocks])
    indices = np.stack([b.indices(data)[keep] for b in blocks]) if spec.topk else None
    acc.add(positions[keep], values, indices)
    if not spec.every_step:  # nothing taken before the finish: drop what the end can no longer want
        acc.prune(first.num_tokens)


def _rejected(rid: str, spec: dict, mro: Any) -> int:
    """Draft tokens of `rid` the step rejected (0 without speculative decoding), as vLLM counts them."""
    drafts = spec.get(rid) if spec else None
    if not drafts:
        return 0
    sampled = mro.sampled_token_ids[mro.req_id_to_index[rid]] if mro.sampled_token_ids else []
    return len(drafts) - max(len(sampled) - 1, 0)


class TailScheduler(_HiddenStatesScheduling, Scheduler):
    """vLLM's v1 Scheduler (synchronous): vectors on outputs, and the tail step."""

    holds = True


class AsyncVectorScheduler(_HiddenStatesScheduling, AsyncScheduler):
    """vLLM's AsyncScheduler (the GPU default): vectors on outputs, the tail taken from the step in
    flight. Every decode row of a tail-flagged request is planned, since the stop is seen after
    the next step is scheduled; the finishing output waits one step for it."""

    holds = False
    async_tail = True


class VectorScheduler(_HiddenStatesScheduling, Scheduler):
    """vLLM's v1 Scheduler with vectors on outputs and no tail step (`tail_step=False`): a baseline
    to measure the tail against."""

    holds = False
