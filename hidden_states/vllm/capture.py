"""The capture: each step's plan, the rows sliced on the device, one copy to the host (ledger point 2).

Contract: for every request whose `SamplingParams.extra_args` carries a
`HiddenStatesExtractionRequest`, the row the LM head consumes for that request
(the last-layer hidden state after the final norm) is sliced on the device in
the step that computes its position of interest: for a tail-flagged request,
its tail step (the scheduler names those in `TAILS_ATTR`: the final token as one
more decode row); otherwise its last *prompt* position (an extraction request's
prompt is prompt+completion; a generating request's gives the prompt-end
vector). All rows of a step move to the CPU in one transfer, after sampling,
and leave on the step's ModelRunnerOutput (`protocol.StepCapture`), where the
scheduler finds them (scheduler.py). Nothing is captured for unflagged
requests; nothing is per-request on the device.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from hidden_states.params import Span, absolute_layer
from hidden_states.protocol import STEP_ATTR, TAILS_ATTR, HiddenStatesExtractionRequest, RowBlock, StepCapture
from hidden_states.vllm import SUPPORTED_LAYER_ARCHS
from hidden_states.vllm.layers import layer_capture_support

logger = logging.getLogger(__name__)


class _Entry(NamedTuple):
    """One request's rows in a step's plan."""

    rid: str
    layers: list[int]  # absolute
    flat: list[int]  # the rows' indices among the step's scheduled tokens
    positions: list[int]  # their absolute positions in prompt+completion
    num_tokens: int  # tokens the request's scheduled span reaches
    dtype: str | None  # None: the engine's own (the one-vector path)
    topk: int


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
    """The members' rows, in order, as one tensor: a view where they are one stretch of one source
    (the usual step: every request's rows of the final layer, one dtype), else a concatenation."""
    import torch

    src, first, end = blocks[members[0]][2], blocks[members[0]][3], blocks[members[0]][4]
    for b in members[1:]:
        if blocks[b][2] is not src or blocks[b][3] != end:
            return torch.cat([blocks[m][2][blocks[m][3]:blocks[m][4]] for m in members])
        end = blocks[b][4]
    return src[first:end]


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


class _RunnerHook:
    """Per-worker state: which live requests are flagged, this step's capture plan, its rows.

    Layers are numbered as transformers' `output_hidden_states`: 0 is the
    embedding output, l in 1..L-1 the residual stream entering decoder layer l
    (vLLM keeps it split as hidden + residual), L the final-norm output (the
    rows the LM head consumes). Intermediate layers are sliced in forward
    pre-hooks on the decoder layers, only at the planned flat token positions.
    The step's plan lives from `before_step` to `end_step` (one execute_model
    call): forwards outside a step (dummy and warm-up batches) capture nothing.
    The rows it sliced (still on the device) wait for the step's sampling
    (`attach`): they leave with the step's ModelRunnerOutput, on vLLM's own path.

    Requests flagged with a `span` of positions (protocol.HiddenStatesExtractionRequest)
    get, in every step, the rows of the positions the step computes that their span
    may want: the step's full per-token hidden states (`execute_model_state.hidden_states`,
    [num_scheduled_tokens, D] after the final norm, laid out in `input_batch` order at
    `query_start_loc` offsets) gathered at those flat rows, cast (and top-k selected) on the
    device per (dtype, k) group, and packed with every other row of the step into one byte
    buffer: one device-to-host copy per step, whatever the requests ask.
    """

    def __init__(self, runner: Any):
        self.runner = runner
        self.flagged: dict[str, HiddenStatesExtractionRequest] = {}  # captured at their last prompt token
        self.tail_flagged: dict[str, HiddenStatesExtractionRequest] = {}  # captured in their tail step
        # captured at every position of their span a step computes
        self.span_flagged: dict[str, tuple[HiddenStatesExtractionRequest, Span]] = {}
        self._tails: Any = ()  # this step's held requests (the scheduler output's TAILS_ATTR)
        self.attaches = True  # this worker's ModelRunnerOutput is the one the executor returns (install sets it)
        self.tails_captured = 0
        self.captured = 0
        self.steps_with_capture = 0
        self.steps_with_rows = 0  # steps whose plan had rows (after_step): each should make one host copy
        self.host_copies = 0  # device-to-host transfers made (_to_host)
        self.bytes_copied = 0
        self.num_layers = runner.vllm_config.model_config.hf_config.num_hidden_layers
        self._so: Any = None
        self._plan: list[_Entry] | None = None
        self._layer_rows: dict[int, tuple[list[int], list[int]]] = {}  # layer -> (flat rows, plan entries)
        self._slices: list[tuple[int, list[int], Any]] = []  # (layer, plan entries, [k, D] on device)
        self._ready: tuple[Any, list[tuple[_Entry, int, str, int, int, int]]] | None = None  # bytes, layout

    def install_layer_hooks(self) -> dict[str, Any]:
        """Hooks the decoder layers if the model supports it; returns what it found
        (`layer_capture`: intermediate layers can be served; else `layer_capture_reason`)."""
        mc = self.runner.vllm_config.model_config
        arch = (getattr(mc.hf_config, "architectures", None) or ["?"])[0]
        layers, why = layer_capture_support(self.runner.model, self.num_layers, mc.get_hidden_size())
        info = {"architecture": arch, "layer_structure": layers is not None,
                "layer_capture_verified": arch in SUPPORTED_LAYER_ARCHS}
        if layers is not None and not mc.enforce_eager:
            # A compiled model does not run hooks added after compilation (or recompiles for them).
            layers, why = None, "the engine is not eager (enforce_eager=False): compiled models do not run layer hooks"
        self.layer_hooks = 0
        if layers is not None:
            for i, layer in enumerate(layers):
                layer.register_forward_pre_hook(self._make_pre_hook(i), with_kwargs=True)
            self.layer_hooks = len(layers)
            if not info["layer_capture_verified"]:
                logger.warning("intermediate hidden-state layers of %s are served by structure (decoder layers "
                               "carry hidden + residual) but not checked against transformers", arch)
        else:
            logger.info("intermediate hidden-state layers unavailable on %s: %s", arch, why)
        return {**info, "layer_capture": layers is not None, "layer_hooks": self.layer_hooks,
                "layer_capture_reason": why}

    def before_step(self, so: Any) -> None:
        for rid in so.finished_req_ids:
            self.flagged.pop(rid, None)
            self.tail_flagged.pop(rid, None)
            self.span_flagged.pop(rid, None)
        for new in so.scheduled_new_reqs:
            sp = new.sampling_params
            req = HiddenStatesExtractionRequest.from_extra_args(sp.extra_args if sp is not None else None)
            if req is not None and req.span is not None:
                req.layers = absolute_layers(req.layers, self.num_layers)  # once, not per step
                self.span_flagged[new.req_id] = (req, Span.from_list(req.span))
            elif req is not None:
                (self.tail_flagged if req.tail else self.flagged)[new.req_id] = req
        self._tails = getattr(so, TAILS_ATTR, None) or ()  # set by the scheduler (scheduler.py)
        self._so, self._plan, self._layer_rows, self._slices, self._ready = so, None, {}, [], None

    def end_step(self) -> None:
        """After every execute_model call, captured or not: no plan outlives its step."""
        self._so, self._plan, self._layer_rows, self._slices, self._tails = None, None, {}, [], ()

    @property
    def _capturing(self) -> bool:
        # Only the rank that sends (`attaches`) slices rows: the other tensor-parallel ranks hold the same ones.
        return self.attaches and bool(self.flagged or self._tails or self.span_flagged) and self._so is not None

    def _step_plan(self) -> list[_Entry]:
        """Flagged requests whose last scheduled position is their last prompt token, held
        requests (tail step) whose last scheduled position is their final token, and span
        requests at the positions of their span the step computes."""
        if self._plan is not None:
            return self._plan
        plan, so, L = [], self._so, self.num_layers
        index = self.runner.input_batch.req_id_to_index
        ends = self.runner.query_start_loc.np
        one: list[tuple[str, int, list[int], int]] = []  # (request, batch row, layers, num_tokens)
        for rid, req in self.flagged.items():
            n_sched = so.num_scheduled_tokens.get(rid)
            if not n_sched:
                continue
            rs = self.runner.requests[rid]
            # Capture when that position is the last prompt token (prompt+completion
            # for an extraction request), whatever chunking or caching came before.
            if rs.num_computed_tokens + n_sched == rs.num_prompt_tokens:
                one.append((rid, index[rid], absolute_layers(req.layers, L), rs.num_prompt_tokens))
        for rid in self._tails:
            req, n_sched = self.tail_flagged.get(rid), so.num_scheduled_tokens.get(rid)
            if req is None or not n_sched:
                continue
            rs = self.runner.requests[rid]
            # The span reaches the final token: a one-token decode, or a resumed request's last chunk.
            if rs.num_computed_tokens + n_sched == rs.num_tokens:
                one.append((rid, index[rid], absolute_layers(req.layers, L), rs.num_tokens))
                self.tails_captured += 1
        # The one-vector path: the request's last scheduled token, in the engine's dtype.
        for rid, row, ls, n in one:
            plan.append(_Entry(rid, ls, [int(ends[row + 1]) - 1], [n - 1], n, None, 0))
        for rid, (req, span) in self.span_flagged.items():
            n_sched = so.num_scheduled_tokens.get(rid)
            if not n_sched:
                continue
            # The step computes positions c..c+n-1 (c: tokens already computed, as of before the step).
            c = self.runner.requests[rid].num_computed_tokens
            positions = span.capturable(c, c + n_sched)
            if positions:
                base = int(ends[index[rid]]) - c
                plan.append(_Entry(rid, req.layers, [base + p for p in positions], positions,
                                   c + n_sched, req.dtype, req.topk))
        self._plan = plan
        self._layer_rows = {}
        for i, e in enumerate(plan):
            for l in e.layers:
                if l < L:
                    flat, owners = self._layer_rows.setdefault(l, ([], []))
                    flat += e.flat
                    owners.append(i)
        return plan

    def _make_pre_hook(self, layer: int):
        def pre_hook(module, args, kwargs):
            if not self._capturing:
                return None
            self._step_plan()
            wanted = self._layer_rows.get(layer)
            if wanted is None:
                return None
            import torch

            # forward(positions, hidden_states, residual, ...), positionally or by name
            hidden = args[1] if len(args) > 1 else kwargs["hidden_states"]
            residual = args[2] if len(args) > 2 else kwargs.get("residual")
            pos = torch.tensor(wanted[0], device=hidden.device)
            # The residual stream: vLLM carries it as hidden + residual (None before layer 0).
            sel = hidden[pos] if residual is None else hidden[pos] + residual[pos]
            self._slices.append((layer, wanted[1], sel))
            return None

        return pre_hook

    def after_step(self) -> None:
        """After the forward pass (sampling pending): the step's rows, sliced on the device."""
        state = getattr(self.runner, "execute_model_state", None)
        if state is None or not self._capturing:
            return
        plan = self._step_plan()
        if not plan:
            return
        import torch

        L = self.num_layers
        # (plan entry, layer, source rows on the device, first, end): the entry's rows are source[first:end]
        blocks: list[tuple[int, int, Any, int, int]] = []
        final = [i for i, e in enumerate(plan) if L in e.layers]
        if final:
            hidden = state.hidden_states  # every scheduled token's row, after the final norm
            rows = hidden[torch.tensor([f for i in final for f in plan[i].flat], device=hidden.device)]
            at = 0
            for i in final:
                blocks.append((i, L, rows, at, at + len(plan[i].flat)))
                at += len(plan[i].flat)
        for layer, owners, sel in self._slices:
            at = 0
            for i in owners:
                blocks.append((i, layer, sel, at, at + len(plan[i].flat)))
                at += len(plan[i].flat)
        self._slices = []
        self.steps_with_rows += 1
        # Cast / top-k per (dtype, k) group, then every byte of the step in one buffer.
        groups: dict[tuple[str | None, int], list[int]] = {}
        for b, (i, *_) in enumerate(blocks):
            groups.setdefault((plan[i].dtype, plan[i].topk), []).append(b)
        parts, layout, offset = [], [None] * len(blocks), 0
        for (dtype, k), members in groups.items():
            values, indices = _encode(_rows_of(blocks, members), dtype, k)
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
            for b in members:
                layout[b] = (name, width, values_at + row * row_bytes,
                             -1 if indices is None else indices_at + row * width * 4)
                row += blocks[b][4] - blocks[b][3]
        data = torch.cat(parts) if len(parts) > 1 else parts[0]
        self._ready = (data, [(plan[i], layer, *layout[b]) for b, (i, layer, *_) in enumerate(blocks)])

    def attach(self, out: Any) -> Any:
        """Hangs the step's rows on its ModelRunnerOutput (protocol.STEP_ATTR). Under async
        scheduling (GPU), in the output's `get_output`, where vLLM copies its own results
        to the host: the one device-to-host copy of the step then overlaps the next step."""
        ready, self._ready = self._ready, None
        if ready is None or out is None:
            return out
        if hasattr(out, "get_output"):  # AsyncModelRunnerOutput
            original = out.get_output

            def get_output():
                mro = original()
                setattr(mro, STEP_ATTR, self._to_host(ready))
                return mro

            out.get_output = get_output
        elif hasattr(out, "req_id_to_index"):
            setattr(out, STEP_ATTR, self._to_host(ready))
        return out

    def _to_host(self, ready) -> StepCapture:
        data, layout = ready
        host = data.to("cpu").numpy()  # the step's one device-to-host transfer (uint8)
        self.host_copies += 1
        self.bytes_copied += host.nbytes
        requests: dict[str, list[RowBlock]] = {}
        for e, layer, dtype, width, values_at, indices_at in layout:
            requests.setdefault(e.rid, []).append(
                RowBlock(e.num_tokens, layer, e.positions, dtype, width, values_at, indices_at))
        self.captured += len(requests)
        self.steps_with_capture += 1
        return StepCapture(host, requests)


def absolute_layers(layers, num_layers: int) -> list[int]:
    return [absolute_layer(l, num_layers) for l in layers]
