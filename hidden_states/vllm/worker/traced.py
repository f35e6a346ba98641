"""Layers and steering inside the compiled forward: the engine's static layer set (ledger point 16).

A compiled engine (torch.compile; CUDA graphs on GPUs) does not run forward hooks added after
it traced the model, so the capture cannot slice rows there. Instead, before the first forward
traces the model (`Worker.load_model`, wrapped once per worker process: patches/traced_forward.py),
each layer L in the engine's static set (`capture_layers`, carried to the workers in
`VllmConfig.additional_config`, which vLLM hashes into its compile-cache key) gets an entry
traced with the rest of the forward, where layers.entry_site puts it: at the output of decoder
layer L-1 (at the input of layer 0 for L = 0), so its rows are transformers' hidden_states[L],
before anything the model adds between layers (Qwen3-VL's DeepStack). Its buffers are allocated once, for the
largest step
(`[max tokens, D]`), so their addresses and shapes never change and one graph (and on a GPU, one
captured CUDA graph) serves every step and request:

    h1 = h + pre                        # steering adds before the request's ablation, clamp or cap
    x  = float32(h1 + r)
    sm, sg = x . wmag + b_mag, x . wgate + b_gate
    c  = value - sm  if linear  else  value - relu(sm) * [sg > threshold]
    h2 = h1 + c unit + post
    h  = where(mask, h2, h)             # unsteered rows keep their exact bits
    rows[:n] = h + r                    # the stream: transformers' hidden_states[L]

One slot per row and layer (`unit`, `wmag`, `wgate` and `par` = b_mag, b_gate, threshold, value,
linear) holds the row's ablation (wmag = unit, linear: c = -(x . unit)), cap (wmag = wgate = unit,
biases -max: c = -max(x . unit - max, 0)) or clamp (unit: the SAE feature's decoder row, the rest
its encoder: c = value - f(x)); empty (zeros) it adds nothing.
The step's steering is written into these buffers and `pre`, `post` and `mask` before the forward
(`TracedLayers.fill`, from the runner's `_model_forward`, outside the compiled region) and cleared
after it; the capture gathers its rows from `rows` after the forward (capture.py). The entry has
no Python branch on per-step state, so nothing is guarded on and nothing recompiles. Per request
and layer the entry holds any adds, at most one ablation, clamp or cap, then adds (the engine refuses a second
one of them on the same positions and layer on these engines).

Under pipeline parallelism each stage traces the layers of the set whose site it runs (decoder layer L runs there;
none, possibly); the rows of an earlier stage's traced layers ride its intermediate tensors to the last stage
(capture.py `forward_rows`), and each stage's `fill` writes only the entries at its own layers.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from hidden_states.protocol import capture_layers_of
from hidden_states.vllm import VERIFIED_LAYER_ARCHS, unverified_reason
from hidden_states.vllm.worker.layers import entry_site, stage_layers
from hidden_states.vllm.worker.steering import gated

logger = logging.getLogger(__name__)

TRACED_ATTR = "_hidden_states_traced"  # on the runner: this worker's TracedLayers, or a str saying why none


class TracedLayers:
    """One worker's buffers for its static layer set, registered on each layer module
    (non-persistent: outside the state dict)."""

    def __init__(
        self,
        decoder: list,
        wanted: list[int],
        max_tokens: int,
        hidden: int,
        dtype: Any,
        device: Any,
        engine_layers: list[int] | None = None,
    ):
        """`decoder`: the text stack's decoder layers; `wanted`: the static set's layer indices whose site is in
        this process (under pipeline parallelism, this stage's: possibly none); `engine_layers`: the engine's
        whole static set (default `wanted`)."""
        import torch

        self.layers = sorted(set(wanted))  # traced here: layer indices (api.md: transformers' hidden_states[L])
        self.engine_layers = sorted(set(wanted if engine_layers is None else engine_layers))
        self.max_tokens = max_tokens
        self.bytes = 0
        self.slots: dict[int, Slot] = {}
        hosts: dict[int, tuple[Any, list]] = {}  # id(module) -> (module, [(at, slot)])
        for index in self.layers:
            slot = Slot(*entry_site(decoder, index))
            for name, shape, kind in (
                ("rows", (max_tokens, hidden), dtype),
                ("pre", (max_tokens, hidden), dtype),
                ("unit", (max_tokens, hidden), dtype),
                ("post", (max_tokens, hidden), dtype),
                ("wmag", (max_tokens, hidden), torch.float32),
                ("wgate", (max_tokens, hidden), torch.float32),
                ("par", (max_tokens, 5), torch.float32),
                ("mask", (max_tokens, 1), torch.bool),
            ):
                buf = torch.zeros(shape, dtype=kind, device=device)
                slot.module.register_buffer(slot.prefix + name, buf, persistent=False)
                self.bytes += buf.numel() * buf.element_size()
            self.slots[index] = slot
            hosts.setdefault(id(slot.module), (slot.module, []))[1].append(slot)
        for module, slots in hosts.values():
            module.forward = _traced_forward(
                module.forward, [s for s in slots if s.at == "input"], [s for s in slots if s.at == "output"]
            )
        self._dirty: dict[int, int] = {}  # layer -> rows written by fill (cleared after the forward)

    def rows(self, layer: int) -> Any:
        """Layer `layer`'s rows (transformers' hidden_states[layer]) for every token of the last forward,
        [max tokens, D] (first n valid)."""
        return self.slots[layer].buf("rows")

    def fill(self, plan: dict[int, list[tuple[Any, str, Any, Any]]], n: int) -> tuple[int, Any]:
        """Writes a step's steering (layer -> [(rows, op, vector, gate)], steering.StepSteering's plan) into
        the buffers; returns the rows steered: (ungated ones, gated ones where their gate held, counted on the
        device). Entries of one request are in its order. A gated entry (a bool on the device: async `when`)
        writes its change times the gate, and its rows' mask where the gate holds."""
        import torch

        steered, held = 0, 0
        for layer, wanted in plan.items():
            if layer not in self.slots:  # pipeline parallelism: another stage's layer, steered there
                continue
            mod = self.slots[layer].view()
            ablated = np.zeros(n, dtype=bool)
            for rows, op, vec, gate in wanted:
                idx = torch.from_numpy(rows).to(mod._hs_mask.device)
                if gate is None:
                    mod._hs_mask[idx] = True
                else:
                    mod._hs_mask[idx] |= gate
                if op == "add":
                    after = ablated[rows]
                    for part, buf in ((rows[~after], mod._hs_pre), (rows[after], mod._hs_post)):
                        if len(part):
                            buf[torch.from_numpy(part).to(buf.device)] += gated(vec.to(buf.dtype), gate)
                else:  # ablate, clamp, cap: the row's one slot (a zero unit adds nothing)
                    if ablated[rows].any():
                        raise ValueError(
                            f"two ablations/clamps/caps of one row at layer {layer} (refused at the request)"
                        )
                    if op == "ablate":
                        unit = vec / vec.norm()
                        mod._hs_unit[idx] = gated(unit.to(mod._hs_unit.dtype), gate)
                        mod._hs_wmag[idx] = unit.float()
                        mod._hs_par[idx, 4] = 1.0  # linear: c = value - sm = -(x . unit)
                    else:  # steering.nonlinear's (direction, encoder, parameters)
                        direction, enc, par = vec
                        mod._hs_unit[idx] = gated(direction.to(mod._hs_unit.dtype), gate)
                        mod._hs_wmag[idx] = enc[0]
                        mod._hs_wgate[idx] = enc[1]
                        mod._hs_par[idx, :4] = par
                    ablated[rows] = True
                if gate is None:
                    steered += len(rows)
                else:
                    held = held + gate.to(torch.int64) * len(rows)
            self._dirty[layer] = max(self._dirty.get(layer, 0), n)
        return steered, held

    def clear(self) -> None:
        """After the forward that read them: the next forward (a dummy run included) steers nothing."""
        for layer, n in self._dirty.items():
            mod = self.slots[layer].view()
            for buf in (
                mod._hs_pre,
                mod._hs_unit,
                mod._hs_post,
                mod._hs_wmag,
                mod._hs_wgate,
                mod._hs_par,
                mod._hs_mask,
            ):
                buf[:n].zero_()
        self._dirty = {}


class Slot:
    """Where layer L's entry sits: (the decoder layer module, "input" or "output"), its buffers on that
    module under `prefix` (`_hs_in_` or `_hs_out_`: layer 0 can host entry 0 at its input and entry 1
    at its output)."""

    def __init__(self, module: Any, at: str):
        self.module, self.at = module, at
        self.prefix = "_hs_in_" if at == "input" else "_hs_out_"

    def buf(self, name: str) -> Any:
        return getattr(self.module, self.prefix + name)

    def view(self) -> Any:
        """The buffers as attributes `_hs_<name>` (fill and clear)."""
        import types

        names = ("rows", "pre", "unit", "post", "wmag", "wgate", "par", "mask")
        return types.SimpleNamespace(**{f"_hs_{n}": self.buf(n) for n in names})


def _entry(slot: Slot, hidden_states: Any, residual: Any) -> Any:
    """One layer's steering and capture on (hidden, residual), the stream being hidden + residual
    (residual None: the stream is hidden): returns the steered hidden; writes the rows."""
    import torch

    n = hidden_states.shape[0]
    pre, unit, par = slot.buf("pre")[:n], slot.buf("unit")[:n], slot.buf("par")[:n]
    h1 = hidden_states + pre
    stream = (h1 if residual is None else h1 + residual).float()
    sm = (stream * slot.buf("wmag")[:n]).sum(dim=-1, keepdim=True) + par[:, 0:1]
    sg = (stream * slot.buf("wgate")[:n]).sum(dim=-1, keepdim=True) + par[:, 1:2]
    f = torch.relu(sm) * (sg > par[:, 2:3]).to(sm.dtype)
    c = torch.where(par[:, 4:5] > 0, par[:, 3:4] - sm, par[:, 3:4] - f)
    h2 = h1 + c.to(h1.dtype) * unit + slot.buf("post")[:n]
    hidden_states = torch.where(slot.buf("mask")[:n], h2, hidden_states)
    slot.buf("rows")[:n].copy_(hidden_states if residual is None else hidden_states + residual)
    return hidden_states


def _traced_forward(forward: Any, at_input: list, at_output: list):
    """A decoder layer's forward with the entries it hosts: layer 0's at its input, layer i+1's at its
    output (traced with the model)."""

    def forward_with_entries(positions, hidden_states, residual, *args, **kwargs):
        for slot in at_input:
            hidden_states = _entry(slot, hidden_states, residual)
        out = forward(positions, hidden_states, residual, *args, **kwargs)
        for slot in at_output:
            hidden, res = out
            out = (_entry(slot, hidden, res), res)
        return out

    return forward_with_entries


def on_this_stage_of(decoder: list, wanted: list[int]) -> list[int]:
    """The static set's layers this process traces: under pipeline parallelism those whose decoder layer runs on this
    stage (their site is here: layers.entry_site), possibly none; without it, all of them."""
    here = set(stage_layers(decoder))
    return sorted({l for l in wanted if l in here})


def install(runner: Any) -> None:
    """After the model is loaded, before anything traces it: the static set's entries, or why not
    (on the runner, `TRACED_ATTR`)."""
    from hidden_states.vllm.worker.layers import layer_capture_support

    wanted = capture_layers_of(runner.vllm_config)
    if not wanted:
        return
    mc = runner.vllm_config.model_config
    num_layers, hidden = int(mc.hf_text_config.num_hidden_layers), int(mc.get_hidden_size())
    model = runner.get_model()
    layers, why = layer_capture_support(model, num_layers, hidden)
    arch = (getattr(mc.hf_config, "architectures", None) or ["?"])[0]
    if arch not in VERIFIED_LAYER_ARCHS:
        layers, why = None, unverified_reason(arch)
    if layers is None:
        setattr(runner, TRACED_ATTR, why)
        return
    if any(not 0 <= l < num_layers for l in wanted):
        setattr(runner, TRACED_ATTR, f"capture_layers {wanted} outside 0..{num_layers - 1}")
        return
    # Under pipeline parallelism each stage traces the layers whose site it runs (layers.entry_site: the decoder
    # layer L runs here), none of them possibly; the last stage serves the others from the rows the stages before
    # sent on (capture.py). Without it, every layer is here.
    mine = on_this_stage_of(layers, wanted)
    comp = runner.vllm_config.compilation_config
    max_tokens = max(int(runner.max_num_tokens), int(getattr(comp, "max_cudagraph_capture_size", 0) or 0))
    weight = next(model.parameters())
    traced = TracedLayers(layers, mine, max_tokens, hidden, mc.dtype, weight.device, engine_layers=wanted)
    setattr(runner, TRACED_ATTR, traced)
    logger.info(
        "hidden-states layers %s of %s traced into this stage's forward (%d MiB of buffers)",
        mine,
        sorted(set(wanted)),
        traced.bytes >> 20,
    )


def compile_counts() -> dict[str, int]:
    """The process's compilations so far: vLLM's counter (graphs traced, backend and inductor
    compiles, CUDA graphs captured) and dynamo's frames compiled; equal before and after a
    request means it compiled nothing."""
    import dataclasses

    from vllm.compilation.counter import compilation_counter

    counts = {k: int(v) for k, v in dataclasses.asdict(compilation_counter).items()}
    try:
        from torch._dynamo.utils import counters

        counts["dynamo_frames_ok"] = int(counters["frames"]["ok"])
        counts["dynamo_unique_graphs"] = int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - dynamo internals moved: vLLM's counter still counts
        pass
    return counts
