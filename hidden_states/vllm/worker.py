"""The model-runner hook, installed in every vLLM worker (ledger points 1, 2, 8 in __init__.py).

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

Intermediate layers (transformers numbering, see `_RunnerHook`) come from
forward pre-hooks on the decoder layers (ledger point 8) of any model whose
layers carry the residual stream as vLLM's Llama does; `layer_capture_support`
decides that per model at install, from the model itself (no list of
architectures), and the worker reports the result to the engine, which refuses
intermediate layers on any other model with a 400 that says why. Hooks need an
eager engine (a compiled model does not run hooks added after compilation, or
recompiles for them): they are registered only when `enforce_eager` is set, and
the engine refuses intermediate layers otherwise.

Checked against transformers in float32 (tests/engine/test_layers.py,
`SUPPORTED_LAYER_ARCHS`): Llama, Qwen2, Qwen3, Gemma2 and Gemma3 (text), and
Gemma and Phi3 under HS_LONG_TESTS=1; Mistral's decoder layer is Llama's. The
Gemma families scale the embeddings by sqrt(hidden_size) in
`embed_input_ids`, before layer 0, as transformers' hidden_states[0] does; their
(1 + w) RMSNorms, attention softcapping and sliding windows (checked with a
window shorter than the prompt) are inside the layers. Refused by the check:
e.g. Granite and StableLM (layers take and return the whole stream; Granite
also scales it by residual_multiplier), Cohere (parallel block: its residual
argument is ignored), DeepSeek-V2/V3 (sequence-parallel and float16 rescaling
at the layer entry), hybrid models whose Mamba/conv layers take no positions
(Jamba, NemotronH, LFM2, Qwen3-Next: refused although they may well follow the
convention), and models run by vLLM's transformers backend (Olmo2, ...): they
keep the last layer only.
"""

from __future__ import annotations

import logging
from typing import Any

from typing import NamedTuple

from hidden_states.params import Span, absolute_layer
from hidden_states.protocol import STEP_ATTR, TAILS_ATTR, HiddenStatesExtractionRequest, RowBlock, StepCapture
from hidden_states.vllm import SUPPORTED_LAYER_ARCHS, VLLMIncompatibleError, _require, check_vllm_version  # noqa: F401
from hidden_states.vllm.cpu import CPUWorkerSteps, patch_cpu_generator_rewind


logger = logging.getLogger(__name__)

def _residual_norm_of(layer_cls: type) -> tuple[str | None, str | None]:
    """(name of the norm that adds the residual at the layer's entry, None) if the
    class's forward follows the residual-stream convention, else (None, why not)."""
    import ast
    import inspect
    import textwrap

    name = layer_cls.__name__
    try:
        params = list(inspect.signature(layer_cls.forward).parameters)[1:]
    except (TypeError, ValueError):
        return None, f"{name}.forward has no inspectable signature"
    if params[:3] != ["positions", "hidden_states", "residual"]:
        return None, f"{name}.forward takes ({', '.join(params)}), not (positions, hidden_states, residual)"
    try:
        fn = ast.parse(textwrap.dedent(inspect.getsource(layer_cls.forward))).body[0]
    except (OSError, TypeError, SyntaxError):
        return None, f"the source of {name}.forward is not available"

    def is_name(node, ident):
        return isinstance(node, ast.Name) and node.id == ident

    def uses_residual(node):
        return any(is_name(n, "residual") for n in ast.walk(node))

    for stmt in fn.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # docstring
        # if residual is None: residual = hidden_states; ...
        # else: hidden_states, residual = self.<norm>(hidden_states, residual)
        if (isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Compare) and is_name(stmt.test.left, "residual")
                and isinstance(stmt.test.ops[0], ast.Is) and isinstance(stmt.test.comparators[0], ast.Constant)
                and stmt.test.comparators[0].value is None):
            first = stmt.body[0]
            starts = (isinstance(first, ast.Assign) and len(first.targets) == 1
                      and is_name(first.targets[0], "residual") and is_name(first.value, "hidden_states"))
            fused = stmt.orelse[0] if len(stmt.orelse) == 1 else None
            if (starts and isinstance(fused, ast.Assign) and len(fused.targets) == 1
                    and isinstance(fused.targets[0], ast.Tuple)
                    and [getattr(e, "id", None) for e in fused.targets[0].elts] == ["hidden_states", "residual"]
                    and isinstance(fused.value, ast.Call) and isinstance(fused.value.func, ast.Attribute)
                    and is_name(fused.value.func.value, "self") and not fused.value.keywords
                    and [getattr(a, "id", None) for a in fused.value.args] == ["hidden_states", "residual"]):
                return fused.value.func.attr, None
            break
        if uses_residual(stmt):
            break
    return None, (f"{name}.forward does not begin by adding its residual argument to hidden_states "
                  "in a fused norm (`if residual is None: ... else: hidden_states, residual = "
                  "self.<norm>(hidden_states, residual)`)")


def layer_capture_support(model: Any, num_layers: int, hidden_size: int) -> tuple[list | None, str | None]:
    """The decoder layers of a vLLM model whose layer inputs carry the residual stream
    as hidden + residual (see the module docstring), or (None, why not)."""
    import torch

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        return None, f"{type(model).__name__} has no decoder layer list at .model.layers"
    if len(layers) != num_layers:
        return None, f"{type(model).__name__}.model.layers holds {len(layers)} layers, the config {num_layers}"
    norms: dict[type, str] = {}
    for cls in dict.fromkeys(type(layer) for layer in layers):
        norm, why = _residual_norm_of(cls)
        if norm is None:
            return None, why
        norms[cls] = norm
    # The norm must return (norm(h + r), h + r): probe it once per layer class on random rows.
    for cls, attr in norms.items():
        module = getattr(next(layer for layer in layers if type(layer) is cls), attr, None)
        weight = next((p for p in module.parameters()), None) if isinstance(module, torch.nn.Module) else None
        if weight is None:
            return None, f"{cls.__name__}.{attr} is not a norm module with weights"
        gen = torch.Generator().manual_seed(0)
        h, r = (torch.randn(2, hidden_size, generator=gen).to(weight.device, weight.dtype) for _ in range(2))
        expected = h.float() + r.float()
        try:
            with torch.inference_mode():
                out = module(h.clone(), r.clone())
        except Exception as e:  # noqa: BLE001 - any failure means "not this convention"
            return None, f"{cls.__name__}.{attr}(hidden, residual) failed: {e}"
        if not (isinstance(out, tuple) and len(out) == 2 and out[1].shape == h.shape
                and torch.allclose(out[1].float(), expected, rtol=1e-2, atol=1e-2)):
            return None, f"{cls.__name__}.{attr}(hidden, residual) does not return hidden + residual"
    return list(layers), None


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
                plan.append(_Entry(rid, absolute_layers(req.layers, L), [base + p for p in positions], positions,
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
        blocks: list[tuple[int, int, Any]] = []  # (plan entry, layer, rows [m, D] on the device)
        final = [i for i, e in enumerate(plan) if L in e.layers]
        if final:
            hidden = state.hidden_states  # every scheduled token's row, after the final norm
            rows = hidden[torch.tensor([f for i in final for f in plan[i].flat], device=hidden.device)]
            at = 0
            for i in final:
                blocks.append((i, L, rows[at:at + len(plan[i].flat)]))
                at += len(plan[i].flat)
        for layer, owners, sel in self._slices:
            at = 0
            for i in owners:
                blocks.append((i, layer, sel[at:at + len(plan[i].flat)]))
                at += len(plan[i].flat)
        self._slices = []
        # Cast / top-k per (dtype, k) group, then every byte of the step in one buffer.
        groups: dict[tuple[str | None, int], list[int]] = {}
        for b, (i, _, _) in enumerate(blocks):
            groups.setdefault((plan[i].dtype, plan[i].topk), []).append(b)
        parts, layout, offset = [], [None] * len(blocks), 0
        for (dtype, k), members in groups.items():
            x = torch.cat([blocks[b][2] for b in members]) if len(members) > 1 else blocks[members[0]][2]
            values, indices = _encode(x, dtype, k)
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
                row += blocks[b][2].shape[0]
        data = torch.cat(parts) if len(parts) > 1 else parts[0]
        self._ready = (data, [(plan[i], layer, *layout[b]) for b, (i, layer, _) in enumerate(blocks)])

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
        requests: dict[str, list[RowBlock]] = {}
        for e, layer, dtype, width, values_at, indices_at in layout:
            requests.setdefault(e.rid, []).append(
                RowBlock(e.num_tokens, layer, e.positions, dtype, width, values_at, indices_at))
        self.captured += len(requests)
        self.steps_with_capture += 1
        return StepCapture(host, requests)


def absolute_layers(layers, num_layers: int) -> list[int]:
    return [absolute_layer(l, num_layers) for l in layers]


def check_engine_config(vcfg: Any) -> None:
    """The second guard (HiddenStatesEngine.start() refuses first, before vLLM starts): engine
    shapes the hook cannot serve, refused with the argument that asks for them (engine_args.py)."""
    from hidden_states.vllm.engine_args import refuse

    refuse({}, vcfg)


class HiddenStatesWorkerExtension(CPUWorkerSteps):
    """Mixed into vLLM's Worker via `worker_extension_cls`; called by collective_rpc."""

    def hidden_states_install(self) -> dict[str, Any]:
        """Installs the hook once; returns {"installed": this call installed it, "layer_capture":
        intermediate layers can be served, "layer_capture_reason": why not, ...}."""
        check_vllm_version()
        runner = getattr(self, "model_runner", None)
        _require(runner is not None, "Worker.model_runner")
        _require(hasattr(runner, "execute_model_state"), "GPUModelRunner.execute_model_state (Model Runner V1)")
        _require(hasattr(runner, "sample_tokens"), "GPUModelRunner.sample_tokens")
        _require(hasattr(runner, "input_batch") and hasattr(runner.input_batch, "req_id_to_index"), "InputBatch.req_id_to_index")
        _require(hasattr(runner, "requests"), "GPUModelRunner.requests")
        check_engine_config(runner.vllm_config)
        if getattr(runner, "_hidden_states_hook", None) is not None:
            return {**runner._hidden_states_hook.layer_info, "installed": False}
        hook = _RunnerHook(runner)
        # Tensor-parallel ranks hold identical rows after the all-reduce; the executor returns
        # only the output rank's ModelRunnerOutput (rank 0 without pipeline parallelism).
        attaches = hook.attaches = getattr(self, "rank", 0) == 0
        execute, sample = runner.execute_model, runner.sample_tokens

        def execute_model(scheduler_output, *args, **kwargs):
            hook.before_step(scheduler_output)
            try:
                out = execute(scheduler_output, *args, **kwargs)
                if out is None and attaches:  # logits computed, sampling pending: rows are in execute_model_state
                    hook.after_step()
                return out
            finally:
                hook.end_step()

        def sample_tokens(*args, **kwargs):
            return hook.attach(sample(*args, **kwargs))

        runner.execute_model, runner.sample_tokens = execute_model, sample_tokens
        runner._hidden_states_hook = hook
        hook.layer_info = hook.install_layer_hooks()
        if getattr(runner, "device", None) is not None and runner.device.type == "cpu":
            patch_cpu_generator_rewind(runner)
        logger.info("hidden-states hook installed on %s (attaching=%s, layer capture: %s)", type(runner).__name__,
                    attaches, hook.layer_info["layer_capture_reason"] or f"{hook.layer_hooks} decoder layers")
        return {**hook.layer_info, "installed": True}

    def hidden_states_stats(self) -> dict:
        trimmer = getattr(self, "_hidden_states_trimmer", None)
        trim = {"malloc_trim": trimmer.stats()} if trimmer is not None else {}
        hook = getattr(getattr(self, "model_runner", None), "_hidden_states_hook", None)
        if hook is None:
            return {"installed": False, **trim}
        return {
            **trim,
            "installed": True,
            "flagged_live": len(hook.flagged) + len(hook.tail_flagged) + len(hook.span_flagged),
            "tails_captured": hook.tails_captured,
            "captured": hook.captured,
            "steps_with_capture": hook.steps_with_capture,
            "layer_hooks": hook.layer_hooks,
        }
