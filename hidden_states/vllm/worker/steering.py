"""Steering: per-request additions to the residual stream, applied at each layer's site (layers.entry_site)
(eager engines) or by the traced entries of the static layer set (traced.py, compiled engines).

Each steered request carries its entries in its own sampling params (`protocol.RequestSpec.steer`,
`protocol.SteerEntry`); every worker reads them off its copy of the request, so every
tensor-parallel rank applies them. Per step and layer, one persistent buffer of the step's token
rows x D holds each steered row's delta and zeros elsewhere, with a row mask beside it; the stream
at the layer becomes where(mask, stream + delta, stream) (static shapes, as a CUDA graph
would need), so an unsteered row keeps its exact bits. `add` puts scale x vector into the buffer; `ablate` puts
minus the
stream's component along the unit vector (after the entries before it); `cap` minus the part of
that component above its bound; `clamp` (value - f(stream)) x the SAE feature's decoder row, f the
feature's encoder (float32) as the entry carries it (`nonlinear`). No request state beyond
the parsed entries of the requests in the batch. A request whose entries raise (parsing them, or
writing them) fails alone (`guard.fault`); the others' rows are steered as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hidden_states.protocol import RequestSpec, SteerEntry


class StepSteering:
    def __init__(self, runner: Any, guard: Any):
        self.runner = runner
        self.guard = guard  # capture._RunnerHook: fault(rid, hook, error), faulted(rid), held
        self._entries: dict[str, list[tuple[SteerEntry, Any]]] = {}  # request id -> (entry, vector on the device)
        self._so: Any = None
        self._given: dict = {}  # this step's plan, {request id: PlanEntry}
        # layer -> (request, rows, op, vector, gate: None, or a bool on the device where a worker's verdict decides)
        self._plan: dict[int, list[tuple[str, Any, str, Any, Any]]] | None = None
        self._buffers: dict[int, Any] = {}
        self.steered_rows = 0  # rows that got a nonzero entry (counted per layer and step)
        self.gated_rows: Any = 0  # of those, rows a gated entry applied to: a count on the device (`steered`)
        self.gated_planned = 0  # entries' rows the worker decided itself (async `when`: PlanEntry.steer_if)
        self.traced: Any = None  # traced.TracedLayers: on compiled engines the entries go into its buffers

    def before_forward(self, num_tokens: int) -> bool:
        """On an engine whose static layers are traced: the step's entries into their buffers, before
        the forward (the runner's `_model_forward`); True if any were written (then `after_forward`)."""
        if self.traced is None or self._so is None or not self._so.num_scheduled_tokens:
            return False
        plan = self._step_plan()
        if not plan:
            return False
        try:  # every request's entries at once
            rids = list(dict.fromkeys(e[0] for entries in plan.values() for e in entries))
            self._count(*self._fill(rids, _rows_ops(plan), num_tokens))
        except Exception:  # then request by request: the one that raises fails alone
            self.traced.clear()
            for rid in dict.fromkeys(e[0] for entries in plan.values() for e in entries):
                try:
                    self._count(*self._fill([rid], _rows_ops(plan, rid), num_tokens))
                except Exception as err:
                    self.guard.fault(rid, "steering", err)
        return True

    def _fill(self, rids: list[str], ops: Any, num_tokens: int) -> tuple[int, Any]:
        """The entries of requests `rids` (`ops`) into the traced buffers: (rows, gated rows)."""
        return self.traced.fill(ops, num_tokens)

    def _count(self, rows: int, gated: Any) -> None:
        self.steered_rows += rows
        self.gated_rows = self.gated_rows + gated

    def steered(self) -> int:
        """Rows an entry applied to, per layer and step: the planned rows, and the gated ones where their gate held."""
        return self.steered_rows + int(self.gated_rows)

    def after_forward(self) -> None:
        self.traced.clear()

    def begin(self, so: Any, given: dict | None = None) -> None:
        """A step starts: its SchedulerOutput, and the scheduler's plan as the capture decoded it (`decode_plan`)."""
        self._so, self._plan, self._given = so, None, given or {}
        for rid in getattr(so, "finished_req_ids", ()) or ():
            self._entries.pop(rid, None)

    def end(self) -> None:
        self._so, self._plan = None, None

    def _of(self, rid: str) -> list[tuple[SteerEntry, Any]]:
        got = self._entries.get(rid)
        if got is None:
            import torch

            state = getattr(self.runner, "requests", {}).get(rid)
            sp = getattr(state, "sampling_params", None)
            entries = RequestSpec.of(getattr(sp, "extra_args", None)).steer
            got = self._entries[rid] = []
            if entries:
                device, dtype = getattr(self.runner, "device", "cpu"), self.runner.model_config.dtype
                for e in entries:
                    vec = torch.from_numpy(e.array().copy()).to(device=device, dtype=dtype)
                    got.append((e, nonlinear(e, device, dtype) if e.op in ("clamp", "cap") else vec))
        return got

    def _step_plan(self) -> dict[int, list[tuple[Any, str, Any]]]:
        """Per layer, each steered request's rows in this step (by their positions) with its entries."""
        if self._plan is not None:
            return self._plan
        plan: dict[int, list[tuple[Any, str, Any]]] = {}
        so, runner = self._so, self.runner
        batch = runner.input_batch
        starts = runner.query_start_loc.np
        given = self._given  # the scheduler's plan: where conditional entries apply (every rank)
        for rid, n in so.num_scheduled_tokens.items():
            try:
                entries = self._of(rid)
                if not entries:
                    continue
                i = batch.req_id_to_index[rid]
                first = int(batch.num_computed_tokens_cpu[i])
                positions = np.arange(first, first + n)
                start = int(starts[i])
                pe = given.get(rid)
                decided = {int(k): offsets for k, offsets in pe.steer} if pe is not None else {}
                gated = {int(k): (int(m), int(o)) for k, m, o in pe.steer_if} if pe is not None else {}
                mine = []
                for k, (e, vec) in enumerate(entries):  # absolute positions e.start..e.end-1 (steering.anchor)
                    gate = None
                    if k in gated:  # async: where the worker's own verdict of the row before holds (on the device)
                        monitor, offset = gated[k]
                        rows, gate = np.asarray([offset], dtype=np.int64), self._gate(rid, first + offset - 1, monitor)
                        self.gated_planned += 1
                    elif e.when is not None:  # the rows the scheduler decided (their previous rows held it)
                        rows = np.asarray(decided.get(k, ()), dtype=np.int64)
                    elif e.at is not None:  # a replay: exactly where the choice's own steps applied it
                        rows = np.flatnonzero(np.isin(positions, e.at))
                    else:
                        rows = np.flatnonzero((positions >= e.start) & ((positions < e.end) if e.end >= 0 else True))
                    if len(rows):  # (clamp and cap: vec is nonlinear's (direction, encoder, parameters))
                        mine.append((e.layer, (rid, rows + start, e.op, vec * e.scale if e.op == "add" else vec, gate)))
            except Exception as err:  # this request's entries: it fails alone
                self.guard.fault(rid, "steering", err)
                continue
            for layer, entry in mine:
                plan.setdefault(layer, []).append(entry)
        self._plan = plan
        return plan

    def _gate(self, rid: str, position: int, monitor: int) -> Any:
        """Whether monitor `monitor` held on row `position` of `rid`, as this worker judged it in an earlier step
        (capture's `held`): a bool on the device, never read on the host here."""
        got = self.guard.held.get(rid)
        if got is None or got[0] != position:
            raise RuntimeError(
                f"no verdict of row {position} for a conditional steering entry (this worker's last "
                f"is of row {None if got is None else got[0]})"
            )
        return got[1][monitor]

    def apply(self, layer: int, hidden: Any, residual: Any) -> Any:
        """Layer `layer`'s row (hidden + residual) steered: a new `hidden` (hidden + buffer), or None if no row is."""
        if self._so is None or not self._so.num_scheduled_tokens or self.traced is not None:
            return None
        wanted = self._step_plan().get(layer)
        if not wanted:
            return None
        import torch

        n = hidden.shape[0]
        buf = self._buffers.get(layer)
        if buf is None or buf[0].shape[0] < n or buf[0].dtype != hidden.dtype or buf[0].device != hidden.device:
            size = max(n, self.runner.max_num_tokens)
            buf = self._buffers[layer] = (
                torch.zeros(size, hidden.shape[-1], dtype=hidden.dtype, device=hidden.device),
                torch.zeros(size, 1, dtype=torch.bool, device=hidden.device),
            )
        delta, steered = buf[0][:n], buf[1][:n]
        delta.zero_()
        steered.zero_()
        for rid, rows, op, vec, gate in wanted:  # each entry of each request (its rows only)
            if self.guard.faulted(rid):
                continue
            idx = torch.from_numpy(rows).to(hidden.device)
            try:
                self._add_entry(rid, idx, op, vec, gate, hidden, residual, delta, steered)
            except Exception as err:  # this request fails alone; its rows go unsteered
                self.guard.fault(rid, "steering", err)
                steered[idx] = False
                continue
            if gate is None:
                self.steered_rows += len(rows)
            else:  # counted on the device where it applied (read with the stats)
                self.gated_rows = self.gated_rows + gate.to(torch.int64)
        # Unsteered rows keep their exact bits (-0.0 included): the sum is taken where a row is steered.
        return torch.where(steered, hidden + delta, hidden)

    def _add_entry(
        self, rid: str, idx: Any, op: str, vec: Any, gate: Any, hidden: Any, residual: Any, delta: Any, steered: Any
    ) -> None:
        """One entry of request `rid` into the step's buffers at its rows `idx` (steering)."""
        import torch

        # gated (async `when`): the entry's change times 1 or 0, decided on the device; the row is
        # steered only where some entry applies, so a row no entry applies to keeps its bits
        steered[idx] = True if gate is None else steered[idx] | gate
        if op == "add":
            delta[idx] += gated(vec, gate)
        elif op == "ablate":  # the stream's component along the unit vector, after the entries before it
            stream = hidden[idx] + delta[idx] + (0 if residual is None else residual[idx])
            unit = vec / vec.norm()
            delta[idx] -= gated((stream @ unit)[:, None] * unit, gate)
        else:  # clamp, cap: (value - f(stream)) x direction, after the entries before it
            direction, enc, par = vec
            stream = (hidden[idx] + delta[idx] + (0 if residual is None else residual[idx])).float()
            s = stream @ enc.T + par[:2]  # [rows, 2]: the magnitude's and the gate's pre-activations
            f = torch.relu(s[:, 0]) * (s[:, 1] > par[2]).to(s.dtype)
            delta[idx] += gated((par[3] - f)[:, None].to(delta.dtype) * direction, gate)


def gated(value: Any, gate: Any) -> Any:
    """`value`, or value x 1 / x 0 where a bool on the device decides (exact either way): a conditional
    entry the worker decides (async `when`), in the eager hooks and the traced buffers alike."""
    return value if gate is None else value * gate.to(value.dtype)


def _rows_ops(plan: dict, rid: str | None = None) -> dict[int, list[tuple[Any, str, Any, Any]]]:
    """The plan as traced.fill takes it (layer -> [(rows, op, vector, gate)]), of one request or all."""
    out: dict[int, list[tuple[Any, str, Any, Any]]] = {}
    for layer, entries in plan.items():
        mine = [(rows, op, vec, gate) for r, rows, op, vec, gate in entries if rid is None or r == rid]
        if mine:
            out[layer] = mine
    return out


def nonlinear(e: SteerEntry, device: Any, dtype: Any) -> tuple[Any, Any, Any]:
    """A clamp's or cap's (direction [D] in the model's dtype, encoder [2, D] float32, parameters [4]
    float32: b_mag, b_gate, threshold, value), the one form the eager apply and the traced entry take:
    the row gets (value - f) x direction with f = relu(x.w_mag + b_mag) * [x.w_gate + b_gate > threshold]
    of its stream x. A clamp's b_dec is folded into its biases (x - b_dec).w = x.w - b_dec.w. A cap along
    the unit vector u with bound c: w_mag = w_gate = u, biases -c, threshold 0, value 0, so the row gets
    -max(x.u - c, 0) u."""
    import torch

    v = torch.from_numpy(e.array().astype(np.float32)).to(device)
    if e.op == "cap":
        unit = v / v.norm()
        par = torch.tensor([-e.cap, -e.cap, 0.0, 0.0], dtype=torch.float32, device=device)
        return unit.to(dtype), torch.stack([unit, unit]), par
    c = e.clamp
    b_dec = np.frombuffer(c.b_dec, "<f4").astype(np.float64)
    w_mag, w_gate = np.frombuffer(c.w_mag, "<f4"), np.frombuffer(c.w_gate, "<f4")
    enc = torch.from_numpy(np.stack([w_mag, w_gate]).astype(np.float32)).to(device)
    par = torch.tensor(
        [c.b_mag - float(b_dec @ w_mag), c.b_gate - float(b_dec @ w_gate), c.threshold, c.value],
        dtype=torch.float32,
        device=device,
    )
    return v.to(dtype), enc, par
