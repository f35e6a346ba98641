"""The capture: the scheduler's plan gathered on the device, one copy to the host (ledger point 2).

Holds no request state: it gathers the rows the plan names (`protocol.PlanEntry` under
`PLAN_ATTR`), casts and top-k selects them on the device, and moves the step's rows in one
transfer after sampling, on the ModelRunnerOutput (`protocol.StepCapture`). Its view of the
runner is one adapter (`_V1Runner`); another runner needs only its own (docs/how-it-works.md,
"Porting the capture").
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import numpy as np

from hidden_states.protocol import (
    MONITOR_BLOCK,
    PLAN_ATTR,
    PP_FAULTS_KEY,
    PP_INDEX_KEY,
    PP_ROWS_KEY,
    STEP_ATTR,
    HookFault,
    PlanEntry,
    RowBlock,
    StepCapture,
    decode_plan,
    decode_pp_faults,
    encode_pp_faults,
)
from hidden_states.vllm import VERIFIED_LAYER_ARCHS, unverified_reason
from hidden_states.vllm.patches.runner_step import on_output
from hidden_states.vllm.worker.layers import entry_site, final_norm_in_logits, layer_capture_support, stage_layers
from hidden_states.vllm.worker.steering import StepSteering
from hidden_states.vllm.worker.traced import TRACED_ATTR

logger = logging.getLogger(__name__)


class _Entry(NamedTuple):
    """One request's rows in a step's plan."""

    rid: str
    layers: list[int]  # absolute
    flat: list[int]  # the rows' indices among the step's scheduled tokens
    positions: list[int]  # their absolute positions in prompt+completion
    num_tokens: int  # tokens the request's scheduled span reaches
    dtype: str | None  # None: the engine's own, uncast
    topk: int
    heads: list  # [name, k]: heads over the same rows (heads.DeviceHead)
    monitors: list = []  # [head, index, above, threshold]: a watch entry's scores (protocol.MONITOR_BLOCK), no rows
    keep_held: bool = False  # keep its last row's verdicts for the next step's conditional steering (`held`)
    pool: bool = False  # its rows summed per layer (float32): one row per layer travels (PlanEntry.pool)


class _Block(NamedTuple):
    """One plan entry's rows at one layer, on the device: `src[first:end]`."""

    entry: int  # its index in the step's plan
    layer: int
    src: Any
    first: int
    end: int


class _Laid(NamedTuple):
    """Where one entry's rows (or a head's outputs) of one layer lie in the step's byte buffer."""

    entry: _Entry
    layer: int
    head: str  # "": rows
    dtype: str
    width: int
    values_at: int
    indices_at: int  # -1: dense


_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def _encode(x: Any, dtype: str | None, topk: int) -> tuple[Any, Any]:
    """Rows [m, D] on the device -> (values [m, D or k] in `dtype`, int32 indices [m, k] or None):
    top-k by magnitude (torch.topk on abs, largest first), then cast."""
    import torch

    indices = None
    if topk:
        indices = torch.topk(x.float().abs(), topk, dim=-1).indices
        x = torch.gather(x, -1, indices)
        indices = indices.to(torch.int32)
    if dtype is not None:
        x = x.to(getattr(torch, _TORCH_DTYPES[dtype]))
    elif x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        x = x.float()
    return x.contiguous(), indices


def _rows_of(blocks: list, members: list[int]) -> Any:
    """The members' rows in order as one tensor: a view where they are one stretch of one source,
    else a concatenation."""
    import torch

    head = blocks[members[0]]
    src, first, end = head.src, head.first, head.end
    for b in members[1:]:
        if blocks[b].src is not src or blocks[b].first != end:
            return torch.cat([blocks[m].src[blocks[m].first : blocks[m].end] for m in members])
        end = blocks[b].end
    return src[first:end]


def _gather(hidden: Any, residual: Any, flat: list[int]) -> Any:
    """Rows `flat` of a layer's stream: vLLM carries it as hidden + residual (None before layer 0)."""
    import torch

    pos = torch.tensor(flat, device=hidden.device)
    return hidden[pos] if residual is None else hidden[pos] + residual[pos]


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def _verdicts(scores: Any, monitors: tuple, cache: dict) -> Any:
    """Whether each monitor holds on each row of `scores` (float32 [rows, monitors]), bool on the device, as
    the scheduler judges them (Monitor.holds: float(score) against the float64 threshold): above t, a float32
    score exceeds t exactly where it exceeds the largest float32 <= t; below t, where it is under the smallest
    float32 >= t. The bounds go to the device once per set of monitors (`cache`)."""
    import torch

    if (got := cache.get(monitors)) is not None:
        return torch.where(got[1], scores > got[0], scores < got[0])
    bounds, above = [], []
    for _, _, up, t in monitors:
        b = np.float32(t)
        if up and float(b) > t:
            b = np.nextafter(b, np.float32(-np.inf))
        elif not up and float(b) < t:
            b = np.nextafter(b, np.float32(np.inf))
        bounds.append(b)
        above.append(bool(up))
    bound = torch.tensor(np.asarray(bounds, np.float32), device=scores.device)
    up = torch.tensor(above, device=scores.device)
    if len(cache) > 256:
        cache.clear()
    cache[monitors] = (bound, up)
    return torch.where(up, scores > bound, scores < bound)


class _V1Runner:
    """The runner adapter: what the capture reads of Model Runner V1 (and its CPU/XPU subclasses)."""

    def __init__(self, runner: Any):
        self.runner = runner

    def step_rows(self) -> Any:
        """Every scheduled token's last-layer row (after the final norm), [num_scheduled_tokens, D] on
        the device, or None outside a step."""
        state = getattr(self.runner, "execute_model_state", None)
        return None if state is None else state.hidden_states

    def starts(self, rids) -> dict[str, int]:
        """Each request's first scheduled token's index among the step's rows."""
        index, starts = self.runner.input_batch.req_id_to_index, self.runner.query_start_loc.np
        return {rid: int(starts[index[rid]]) for rid in rids}

    @staticmethod
    def to_host(data: Any) -> Any:
        return data.to("cpu").numpy()  # the step's one device-to-host transfer (uint8)


def _join(pieces: list) -> tuple[Any, list] | None:
    """Packed steps of single requests (`_RunnerHook._pack`) as one: buffers concatenated, offsets moved."""
    import torch

    if not pieces:
        return None
    parts, layout, at = [], [], 0
    for data, lay in pieces:
        parts.append(data)
        layout += [
            x._replace(values_at=x.values_at + at, indices_at=x.indices_at + at if x.indices_at >= 0 else -1)
            for x in lay
        ]
        at += int(data.numel())
    return (torch.cat(parts) if len(parts) > 1 else parts[0]), layout


class _RunnerHook:
    """Per-worker: this step's capture plan (the scheduler's) and its rows.

    Layer L is transformers' `hidden_states[L]` (docs/api.md): 0 the embeddings, l in 1..L-1 the
    output of decoder layer l-1 (hidden + residual), L the final-norm output. The plan lives from
    `before_step` to `end_step`, so dummy batches capture nothing. Intermediate layers are sliced
    where layers.entry_site puts them (a pre-hook on layer 0, forward hooks on the others); every
    row of a step is packed into one byte buffer for one device-to-host copy.

    Faults stay with their request: each batched piece of work (a layer's gather, the step's pack, a
    head's product, a request's steering entries) that raises is redone request by request, and a
    request whose own piece raises is left out of the step and reported on its StepCapture
    (`faults`): the scheduler fails it alone (ledger point 19).
    """

    steering_class = StepSteering  # (the fault-injecting twins replace both: worker/fault_injection.py)

    def __init__(self, runner: Any):
        self.runner = runner
        self.adapter = _V1Runner(runner)
        self.attaches = True  # this worker's ModelRunnerOutput is the one the executor returns (install sets it)
        # Pipeline parallelism: this rank (of an earlier stage; install sets it) gathers its stage's layers' rows
        # and sends them on to the next stage's; the rows it sent on and received, counted
        self.forwards = False
        # A fault here can fail its request alone: this rank sends (attaches), or it is the one rank of an earlier
        # stage, whose faults ride its intermediate tensors to the stage that sends (install sets it)
        self.contains_faults = True
        self.forwarded_faults = 0  # requests failed here, sent on to be reported by the last stage
        self.forwarded_rows = 0
        self.forwarded_bytes = 0
        self.received_rows = 0
        self.captured = 0
        self.steps_with_capture = 0
        self.steps = 0  # forward steps with scheduled tokens (before_step)
        self.steps_with_rows = 0  # steps whose plan had rows (after_step): each should make one host copy
        self.host_copies = 0  # device-to-host transfers made (_to_host)
        self.bytes_copied = 0
        self.encoder_items = 0  # multimodal items the model's encoder embedded (patches/encoder_items.py)
        self.heads: dict[str, Any] = {}  # name -> heads.DeviceHead (install_heads), on the rank that sends
        self.head_layers: dict[str, int] = {}  # name -> the layer its rows are read at, on every rank
        self.steering = self.steering_class(runner, self)  # per-request additions to the stream, on every rank
        self.hook_faults = 0  # requests a hook of this worker failed (each left out of its step)
        self._faults: dict[str, HookFault] = {}  # this step's, by request id: attached with its rows
        self._stage = "capture"  # the hook the step's pack is in (capture | heads): names a fault
        self.head_rows = 0  # rows the heads encoded (one matrix product per head per step)
        self.head_products = 0  # head matrix products run (per head per step with its rows)
        # the products' work: rows x the weight columns each multiplies (an SAE's full encode: its
        # features; a monitor's: the watched features' columns; a linear head's: its outputs)
        self.head_column_rows = 0
        self.ranked_rows = 0  # rows a top-k SAE's monitors encoded in full, to rank a feature (_ranked)
        self.num_layers = runner.vllm_config.model_config.hf_text_config.num_hidden_layers
        self.final_norm = None  # the model's final norm where its forward stops before it (layers.final_norm_in_logits)
        self._given: dict[str, PlanEntry] | None = None  # the scheduler's plan for this step
        self._plan: list[_Entry] | None = None
        self._layer_rows: dict[int, tuple[list[int], list[int]]] = {}  # layer -> (flat rows, plan entries)
        self._slices: list[tuple[int, list[int], Any]] = []  # (layer, plan entries, [k, D] on device)
        self._ready: tuple[Any, list[tuple[_Entry, int, str, int, int, int]]] | None = None  # bytes, layout
        self.traced: Any = None  # traced.TracedLayers: the static layer set inside the compiled forward
        # Under async scheduling, per request with conditional steering: (position, bool [its monitors] on the
        # device), the verdicts of its last watched row; the next step's `steer_if` entries read them (steering.py).
        self.held: dict[str, tuple[int, Any]] = {}
        self._bounds: dict[tuple, tuple[Any, Any]] = {}  # monitors -> their thresholds on the device (_verdicts)

    def install_layer_hooks(self) -> dict[str, Any]:
        """Hooks the decoder layers if the model allows; returns `layer_capture` (or
        `layer_capture_reason`). Intermediate layers are served on the verified families only
        (hidden_states.vllm.VERIFIED_LAYER_ARCHS); the structure check can only refuse more."""
        mc = self.runner.vllm_config.model_config
        arch = (getattr(mc.hf_config, "architectures", None) or ["?"])[0]
        layers, why = layer_capture_support(self.runner.model, self.num_layers, mc.get_hidden_size())
        verified = arch in VERIFIED_LAYER_ARCHS
        info = {"architecture": arch, "layer_structure": layers is not None, "layer_capture_verified": verified}
        if not verified:
            layers, why = None, unverified_reason(arch)
        traced = getattr(self.runner, TRACED_ATTR, None)
        if isinstance(traced, str):  # capture_layers asked, but this model has no traced capture
            layers, why = None, traced
        elif traced is not None:  # the static set's entries are in the traced forward (traced.py)
            self.traced = traced
            self.steering.traced = traced
            here = stage_layers(layers) if layers is not None else []
            layers, why = None, None
            info["capture_layers"] = list(traced.engine_layers)  # the engine's; this stage traces `traced_layers`
            info["traced_layers"] = list(traced.layers)
            info["stage_layers"] = [here[0], here[-1] + 1] if here else [0, 0]
        elif layers is not None and not mc.enforce_eager:
            # A compiled model does not run hooks added after compilation (or recompiles for them).
            layers, why = (
                None,
                (
                    "the engine is compiled (enforce_eager=False) and was started without "
                    "capture_layers, the layers its compiled forward captures"
                ),
            )
        self.final_norm = final_norm_in_logits(self.runner.model, mc.get_hidden_size())
        info["final_norm_in_logits"] = self.final_norm is not None
        self.layer_hooks = 0
        if layers is not None:
            here = stage_layers(layers)  # under pipeline parallelism, this stage's
            for i in here:
                module, at = entry_site(layers, i)
                if at == "input":
                    module.register_forward_pre_hook(self._make_pre_hook(i), with_kwargs=True)
                else:
                    module.register_forward_hook(self._make_post_hook(i), with_kwargs=True)
            self.layer_hooks = len(here)
            info["stage_layers"] = [here[0], here[-1] + 1] if here else [0, 0]
        else:
            logger.info("intermediate hidden-state layers unavailable on %s: %s", arch, why)
        return {
            **info,
            "layer_capture": layers is not None or self.traced is not None,
            "layer_hooks": self.layer_hooks,
            "layer_capture_reason": why,
        }

    def install_heads(self, specs: list) -> list[str]:
        """The registered heads' weights on this worker's device (heads.HeadSpec as builtins)."""
        import msgspec

        from hidden_states.heads import DeviceHead, HeadSpec

        device = getattr(self.runner, "device", "cpu")
        for raw in specs:
            spec = msgspec.convert(raw, HeadSpec)
            self.head_layers[spec.name] = spec.layer  # an earlier pipeline stage gathers a head's rows at its layer
            if self.attaches:  # only the rank that sends runs heads
                self.heads[spec.name] = DeviceHead(spec, device)
        return sorted(self.heads)

    def before_step(self, so: Any) -> None:
        self._faults = {}
        if getattr(so, "total_num_scheduled_tokens", 0):
            self.steps += 1
        if self.held:
            for rid in getattr(so, "finished_req_ids", ()) or ():
                self.held.pop(rid, None)
        self._given = decode_plan(getattr(so, PLAN_ATTR, None)) or None  # set by the scheduler (scheduler.py)
        self.steering.begin(so, self._given)
        self._plan, self._layer_rows, self._slices, self._ready = None, {}, [], None

    def fault(self, rid: str, hook: str, error: BaseException) -> None:
        """A hook of ours raised for `rid`: logged with its traceback, counted, reported with the step."""
        if rid in self._faults:
            return
        logger.error(
            "request %s: the hidden-states hook %s raised in the worker; failing the request", rid, hook, exc_info=error
        )
        self.hook_faults += 1
        self._faults[rid] = HookFault.of(hook, error)
        if not self.contains_faults:
            # A tensor-parallel rank that does not send: the request cannot fail alone from here (its outputs never
            # reach the engine core), and going on without its hook would leave this rank's share of the stream
            # unlike the sending rank's, a wrong answer nobody sees. The step fails.
            raise RuntimeError(
                f"request {rid}: the hidden-states hook {hook} raised on a rank whose outputs do not reach the "
                "engine core; the engine stops rather than serve rows computed without it"
            ) from error

    def faulted(self, rid: str) -> bool:
        return rid in self._faults

    # The per-request pieces of a step's work, each for the requests `rids`: where one raises, the work is
    # redone request by request, and the request whose own piece raises fails alone.

    def _gather_rows(self, rids: list[str], hidden: Any, residual: Any, flat: list[int]) -> Any:
        """The rows `flat` of the stream at a layer's site (capture)."""
        return _gather(hidden, residual, flat)

    def _head_rows(self, rids: list[str], blocks: list, group: list[int]) -> Any:
        """A head's input rows: the blocks `group` of the step's rows (heads)."""
        return _rows_of(blocks, group)

    def end_step(self) -> None:
        """After every execute_model call, captured or not: no plan outlives its step."""
        self.steering.end()
        self._given, self._plan, self._layer_rows, self._slices = None, None, {}, []

    @property
    def _capturing(self) -> bool:
        # Only the rank that sends (`attaches`), or forwards its stage's rows to it, slices rows: the other
        # tensor-parallel ranks hold the same ones.
        return (self.attaches or self.forwards) and self._given is not None

    def receive_rows(self, tensors: dict | None) -> None:
        """Pipeline parallelism, at the start of a step of a later stage: the rows the stages before gathered,
        taken off the intermediate tensors it received (before vLLM copies those into its buffers) and kept as
        this step's own slices."""
        rows, index = (
            (None, None) if tensors is None else (tensors.pop(PP_ROWS_KEY, None), tensors.pop(PP_INDEX_KEY, None))
        )
        faults = None if tensors is None else tensors.pop(PP_FAULTS_KEY, None)
        if faults is not None:  # requests a stage before failed: left out here too, reported with this step
            for rid, f in decode_pp_faults(faults.numpy().tobytes()).items():
                self._faults.setdefault(rid, f)
        if rows is None or index is None or self._given is None:
            return
        raw, at, k = index.tolist(), 0, 0
        while k < len(raw):
            layer, n = raw[k], raw[k + 1]
            owners, count = raw[k + 2 : k + 2 + n], raw[k + 2 + n]
            self._slices.append((layer, owners, rows[at : at + count]))
            at, k = at + count, k + 3 + n
        self.received_rows += at

    def forward_rows(self, tensors: dict) -> None:
        """Pipeline parallelism, after the forward of an earlier stage: this step's slices (its layers', and those
        it received) onto the intermediate tensors it sends the next stage (protocol.PP_ROWS_KEY, PP_INDEX_KEY)."""
        import torch

        if self.traced is not None and self._capturing:  # this stage's traced layers' rows, after its forward
            plan = self._step_plan()
            self._slices += self._traced_slices(plan, {i for i, e in enumerate(plan) if e.rid not in self._faults})
        if self._faults:  # this step's faults here and from the stages before: the last stage reports them
            raw = encode_pp_faults(self._faults)
            tensors[PP_FAULTS_KEY] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # sent as vLLM sends a CPU one
            self.forwarded_faults += len(self._faults)
        if not self._slices:
            return
        index: list[int] = []
        for layer, owners, rows in self._slices:
            index += [layer, len(owners), *owners, int(rows.shape[0])]
        rows = torch.cat([rows for _, _, rows in self._slices])
        tensors[PP_ROWS_KEY] = rows
        tensors[PP_INDEX_KEY] = torch.tensor(index, dtype=torch.int64, device=rows.device)
        self.forwarded_rows += int(rows.shape[0])
        self.forwarded_bytes += rows.numel() * rows.element_size() + 8 * len(index)

    def _step_plan(self) -> list[_Entry]:
        """The scheduler's plan as flat row indices among the step's scheduled tokens."""
        if self._plan is not None:
            return self._plan
        plan = []
        for rid, raw in self._given.items():
            try:
                e = raw
                start = self.adapter.starts((rid,))[rid]
                if e.offsets:
                    plan.append(
                        _Entry(
                            rid,
                            list(e.layers),
                            [start + o for o in e.offsets],
                            list(e.positions),
                            e.num_tokens,
                            e.dtype,
                            e.topk,
                            list(e.heads),
                            pool=bool(e.pool),
                        )
                    )
                if e.watch:  # the rows its monitors score: their scores travel, not the rows
                    plan.append(
                        _Entry(
                            rid,
                            [],
                            [start + o for o in e.watch],
                            list(e.watch_positions),
                            e.num_tokens,
                            None,
                            0,
                            [],
                            [list(m) for m in e.monitors],
                            bool(e.keep_held),
                        )
                    )
            except Exception as err:  # this request's entry: it fails alone
                self.fault(rid, "capture", err)
        L = self.num_layers
        self._plan = plan
        self._layer_rows = {}
        for i, e in enumerate(plan):
            for l in self._layers_of(e):
                if l < L:
                    flat, owners = self._layer_rows.setdefault(l, ([], []))
                    flat += e.flat
                    owners.append(i)
        return plan

    def _layers_of(self, e: _Entry) -> list[int]:
        """The layers an entry's rows are sliced at: its own, its heads' and its monitors' heads'."""
        if not e.heads and not e.monitors:
            return e.layers
        return list(dict.fromkeys([*e.layers, *(self.head_layers[h[0]] for h in (*e.heads, *e.monitors))]))

    def _make_pre_hook(self, layer: int):
        """Layer 0 (the embeddings), or a later pipeline stage's first layer: at the input of its decoder layer."""
        entry = self._entry(layer)

        def pre_hook(module, args, kwargs):
            # forward(positions, hidden_states, residual, ...), positionally or by name
            hidden = args[1] if len(args) > 1 else kwargs["hidden_states"]
            residual = args[2] if len(args) > 2 else kwargs.get("residual")
            steered = entry(hidden, residual)
            if steered is None:
                return None
            if len(args) > 1:
                return (*args[:1], steered, *args[2:]), kwargs
            return args, {**kwargs, "hidden_states": steered}

        return pre_hook

    def _make_post_hook(self, layer: int):
        """Layer l >= 1: at the output (hidden, residual) of decoder layer l-1."""
        entry = self._entry(layer)

        def post_hook(module, args, kwargs, output):
            hidden, residual = output
            steered = entry(hidden, residual)
            return None if steered is None else (steered, residual)

        return post_hook

    def _entry(self, layer: int):
        """Layer `layer`'s steering, then its rows, on the stream hidden + residual: returns the steered
        hidden (None: unchanged)."""

        def entry(hidden, residual):
            steered = self.steering.apply(layer, hidden, residual)  # every rank; then the rows read the steered stream
            if steered is not None:
                hidden = steered
            if self._capturing:
                plan = self._step_plan()
                wanted = self._layer_rows.get(layer)
                if wanted is not None:
                    flat, owners = wanted
                    if self._faults:  # requests failed earlier in the step are left out
                        owners = [i for i in owners if plan[i].rid not in self._faults]
                        flat = [f for i in owners for f in plan[i].flat]
                    try:  # the layer's rows of every request at once
                        if owners:
                            rids = [plan[i].rid for i in owners]
                            self._slices.append((layer, owners, self._gather_rows(rids, hidden, residual, flat)))
                    except Exception:  # then request by request: the one that raises fails alone
                        for i in owners:
                            try:
                                rows = self._gather_rows([plan[i].rid], hidden, residual, plan[i].flat)
                                self._slices.append((layer, [i], rows))
                            except Exception as err:
                                self.fault(plan[i].rid, "capture", err)
            return steered

        return entry

    def after_step(self) -> None:
        """After the forward pass (sampling pending): the step's rows, sliced on the device. Packed for
        every request at once; if that raises, request by request (the one that raises fails alone)."""
        hidden = self.adapter.step_rows()
        if hidden is None or not self._capturing:
            return
        plan = self._step_plan()
        members = [i for i, e in enumerate(plan) if e.rid not in self._faults]
        if not members:
            self._slices = []
            return
        self.steps_with_rows += 1
        try:
            self._ready = self._pack(plan, members, hidden)
        except Exception:
            pieces = []
            for i in members:
                try:
                    pieces.append(self._pack(plan, [i], hidden))
                except Exception as err:
                    self.fault(plan[i].rid, self._stage, err)
            self._ready = _join(pieces)
        self._slices = []

    def _pack(self, plan: list[_Entry], members: list[int], hidden: Any) -> tuple[Any, list]:
        """The rows and head outputs of plan entries `members`, cast and packed into one byte buffer on
        the device: (data, layout)."""
        import torch

        self._stage = "capture"
        L, chosen = self.num_layers, set(members)
        # each entry's rows at each layer (_Block)
        blocks: list[_Block] = []
        final = [i for i in members if L in self._layers_of(plan[i])]
        if final:
            rows = hidden[torch.tensor([f for i in final for f in plan[i].flat], device=hidden.device)]
            if self.final_norm is not None:  # the rows the LM head consumes: normed in compute_logits
                rows = self.final_norm(rows)
            at = 0
            for i in final:
                blocks.append(_Block(i, L, rows, at, at + len(plan[i].flat)))
                at += len(plan[i].flat)
        slices = self._slices  # the layer hooks' (eager), or those the stages before sent on
        if self.traced is not None:  # and the rows of the layers traced here, written by the traced forward
            slices = slices + self._traced_slices(plan, chosen)
        for layer, owners, sel in slices:
            at = 0
            for i in owners:
                if i in chosen:
                    blocks.append(_Block(i, layer, sel, at, at + len(plan[i].flat)))
                at += len(plan[i].flat)
        self._stage = "heads"
        outputs = self._run_heads(plan, members, blocks)
        self._stage = "capture"
        # Rows asked as rows (a head's layer may be captured for the head alone).
        blocks = [blk for blk in blocks if blk.layer in plan[blk.entry].layers]
        # hidden_states_pool: an entry's rows at a layer as their float32 sum, one row (the engine core adds them).
        blocks = [
            _Block(b.entry, b.layer, b.src[b.first : b.end].float().sum(0, keepdim=True), 0, 1)
            if plan[b.entry].pool
            else b
            for b in blocks
        ]
        # Cast / top-k per (dtype, k) group, then every byte of the step in one buffer.
        groups: dict[tuple[str | None, int], list[int]] = {}
        for b, (i, *_) in enumerate(blocks):
            groups.setdefault((plan[i].dtype, plan[i].topk), []).append(b)
        parts, layout, offset = [], [None] * (len(blocks) + len(outputs)), 0
        heads_at = len(blocks)
        for j, (_, _, _, values, indices) in enumerate(outputs):  # each head's outputs: float32 (+ int32)
            layout[heads_at + j] = ("float32", int(values.shape[-1]), offset, -1)
            parts.append(values.view(torch.uint8).reshape(-1))
            offset += values.numel() * 4
            if indices is not None:
                layout[heads_at + j] = (*layout[heads_at + j][:3], offset)
                parts.append(indices.view(torch.uint8).reshape(-1))
                offset += indices.numel() * 4
        for (dtype, k), group in groups.items():
            values, indices = _encode(_rows_of(blocks, group), dtype, k)
            width, name = int(values.shape[-1]), _dtype_name(values)
            row_bytes = width * values.element_size()
            values_at = offset
            parts.append(values.view(torch.uint8).reshape(-1))
            offset += values.shape[0] * row_bytes
            indices_at = -1
            if indices is not None:
                indices_at = offset
                parts.append(indices.contiguous().view(torch.uint8).reshape(-1))
                offset += indices.shape[0] * width * 4
            row = 0
            for b in group:
                layout[b] = (
                    name,
                    width,
                    values_at + row * row_bytes,
                    -1 if indices is None else indices_at + row * width * 4,
                )
                row += blocks[b].end - blocks[b].first
        data = torch.cat(parts) if len(parts) > 1 else parts[0]
        return data, (
            [_Laid(plan[b.entry], b.layer, "", *layout[k]) for k, b in enumerate(blocks)]
            + [_Laid(plan[i], layer, name, *layout[heads_at + j]) for j, (i, layer, name, _, _) in enumerate(outputs)]
        )

    def _traced_slices(self, plan: list[_Entry], chosen: set[int]) -> list[tuple[int, list[int], Any]]:
        """The step's rows of plan entries `chosen` at the layers traced in this process, sliced from the buffers
        the traced forward wrote: (layer, plan entries, rows) as the hooks' slices (`_slices`). Under pipeline
        parallelism the other stages' layers are not here: their rows arrive with the intermediate tensors."""
        import torch

        slices = []
        for layer, (_, owners) in self._layer_rows.items():
            mine = [i for i in owners if i in chosen]
            if mine and layer in self.traced.slots:
                rows = self.traced.rows(layer)
                flat = [f for i in mine for f in plan[i].flat]
                slices.append((layer, mine, rows[torch.tensor(flat, device=rows.device)]))
        return slices

    def _run_heads(self, plan: list[_Entry], members: list[int], blocks: list) -> list[tuple[int, int, str, Any, Any]]:
        """Each head once over every member entry's rows at its layer (one matrix product per head and
        k): [(plan entry, layer, head, float32 values [m, w], int32 indices [m, k] or None)] per entry."""
        wanting: dict[tuple[str, int], list[int]] = {}
        for i in members:
            for name, k in plan[i].heads:
                wanting.setdefault((name, int(k)), []).append(i)
        watching = [i for i in members if plan[i].monitors]
        if not wanting and not watching:
            return []
        where = {(blk.entry, blk.layer): b for b, blk in enumerate(blocks)}
        out = self._run_monitors(plan, watching, blocks, where) if watching else []
        for (name, k), entries in wanting.items():
            head = self.heads[name]
            group = [where[(i, head.spec.layer)] for i in entries]
            values, indices = head.encode(self._head_rows([plan[i].rid for i in entries], blocks, group), k)
            self.head_products += 1
            self.head_rows += int(values.shape[0])
            self.head_column_rows += int(values.shape[0]) * head.columns
            at = 0
            for i in entries:
                n = len(plan[i].flat)
                out.append(
                    (
                        i,
                        head.spec.layer,
                        name,
                        values[at : at + n].contiguous(),
                        None if indices is None else indices[at : at + n].contiguous(),
                    )
                )
                at += n
        return out

    def _run_monitors(
        self, plan: list[_Entry], watching: list[int], blocks: list, where: dict
    ) -> list[tuple[int, int, str, Any, Any]]:
        """Each watch entry's monitor scores, float32 [rows, its monitors] (protocol.MONITOR_BLOCK). Per
        head one product over every watching entry's rows at its layer: a linear head's own; an SAE's
        over the watched features' encoder columns alone (`DeviceHead.some_features`), a top-k SAE's full
        encode only on the rows whose conditions its rank could decide (`_ranked`). Entries with the same
        conditions (the usual case) get their scores as one block, each its rows of it."""
        import torch

        groups: dict[tuple, list[int]] = {}  # the same conditions: their rows in a row in every head's product
        for i in watching:
            groups.setdefault(tuple(tuple(m) for m in plan[i].monitors), []).append(i)
        ordered = [i for entries in groups.values() for i in entries]
        size = {monitors: sum(len(plan[i].flat) for i in g) for monitors, g in groups.items()}  # a group's rows
        at: dict[tuple[str, int], int] = {}  # (head, entry) -> the entry's first row in the head's product
        products: dict[str, tuple[Any, dict[int, int] | None]] = {}  # head -> (values, feature -> column)
        for name in dict.fromkeys(m[0] for monitors in groups for m in monitors):
            entries = [i for i in ordered if any(m[0] == name for m in plan[i].monitors)]
            head = self.heads[name]
            rows = self._head_rows(
                [plan[i].rid for i in entries], blocks, [where[(i, head.spec.layer)] for i in entries]
            )
            row = 0
            for i in entries:
                at[(name, i)] = row
                row += len(plan[i].flat)
            spans = [
                (monitors, slice(at[(name, g[0])], at[(name, g[0])] + size[monitors]))
                for monitors, g in groups.items()
                if (name, g[0]) in at
            ]  # each group's rows here
            if head.spec.kind == "sae":
                features = sorted({int(m[1]) for i in entries for m in plan[i].monitors if m[0] == name})
                column = {f: j for j, f in enumerate(features)}
                values = head.some_features(rows, features)
                self.head_column_rows += int(values.shape[0]) * len(features) * head.paths
                if head.spec.architecture == "topk":
                    values = self._ranked(head, rows, values, column, spans)
            else:
                values, column = head.encode(rows, 0)[0], None
                self.head_column_rows += int(values.shape[0]) * head.columns
            products[name] = (values, column)
            self.head_products += 1
            self.head_rows += int(values.shape[0])
        out = []
        for monitors, entries in groups.items():
            parts = []
            for name, index, *_ in monitors:
                values, column = products[name]
                first = at[(name, entries[0])]
                parts.append(
                    values[first : first + size[monitors], int(index) if column is None else column[int(index)]]
                )
            block = torch.stack(parts, dim=-1).float()
            held = _verdicts(block, monitors, self._bounds) if any(plan[i].keep_held for i in entries) else None
            row = 0
            for i in entries:
                out.append((i, 0, MONITOR_BLOCK, block[row : row + len(plan[i].flat)], None))
                row += len(plan[i].flat)
                if held is not None and plan[i].keep_held:
                    self.held[plan[i].rid] = (plan[i].positions[-1], held[row - 1])
        return out

    def _ranked(self, head: Any, rows: Any, values: Any, column: dict[int, int], spans: list) -> Any:
        """A top-k SAE's watched features as SAELens's encode gives them: `values` (some_features, columns
        `column` by feature) hold what each takes where it is among the k largest, and 0 is what it takes
        where not. Where both values decide every condition on a row alike, the row's score is left as is
        (it decides as the true one would; a score is reported only where a condition holds). The other
        rows are encoded in full (`ranked_rows`): on the CPU only those, decided on the host per group of
        requests with the same conditions (`spans`: (conditions, their rows)); on an accelerator every
        row, as deciding there would wait for the device."""
        import torch

        m, name = int(values.shape[0]), head.spec.name
        if values.device.type == "cpu":
            # A score v >= 0 whose rank could change a condition's verdict: above t, v > max(t, 0) (the
            # value holds, or 0 does where t < 0); below t, v > 0 where t > 0 (0 holds), never else.
            # Compared in float64, as the scheduler judges float(score) (Monitor.holds).
            host, need = values.numpy(), np.zeros(m, bool)
            for monitors, span in spans:
                cutoff = np.full(len(column), np.inf)
                for _, index, above, threshold in (x for x in monitors if x[0] == name):
                    c = max(threshold, 0.0) if above else (0.0 if threshold > 0 else np.inf)
                    cutoff[column[int(index)]] = min(cutoff[column[int(index)]], c)
                need[span] |= (host[span] > cutoff).any(axis=1)
            picked = np.flatnonzero(need)
        else:
            picked = np.arange(m)
        if len(picked):
            self.ranked_rows += len(picked)
            self.head_column_rows += len(picked) * head.columns
            index = torch.tensor(picked, device=values.device)
            values = values.clone()
            values[index] = head.features(rows[index])[:, torch.tensor(list(column), device=values.device)]
        return values

    def attach(self, out: Any) -> Any:
        """Hangs the step's rows and faults on its ModelRunnerOutput (protocol.STEP_ATTR); under async
        scheduling in its `get_output`, so the copy overlaps the next step."""
        ready, self._ready = self._ready, None
        faults, self._faults = (self._faults, {}) if self.attaches else ({}, {})
        if (ready is None and not faults) or out is None:
            return out
        return on_output(out, lambda mro: setattr(mro, STEP_ATTR, self._to_host(ready, faults)))

    def _to_host(self, ready, faults: dict[str, HookFault]) -> StepCapture:
        if ready is None:  # only faults: no rows, no copy
            return StepCapture(np.zeros(0, np.uint8), {}, faults)
        data, layout = ready
        host = self.adapter.to_host(data)
        self.host_copies += 1
        self.bytes_copied += host.nbytes
        requests: dict[str, list[RowBlock]] = {}
        for x in layout:
            e = x.entry
            requests.setdefault(e.rid, []).append(
                RowBlock(
                    e.num_tokens,
                    x.layer,
                    e.positions,
                    x.dtype,
                    x.width,
                    x.values_at,
                    x.indices_at,
                    x.head,
                    e.pool and not x.head,
                )
            )
        self.captured += len(requests)
        self.steps_with_capture += 1
        return StepCapture(host, requests, faults)
