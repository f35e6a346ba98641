"""Ledger point 16: the static layer set (`capture_layers`) traced into the compiled forward (worker).

Why: a compiled engine (torch.compile; CUDA graphs on GPUs) does not run forward hooks added after it traced
the model, so the capture and steering of the layers a compiled engine serves must be in the forward before
it is traced.
How: `gpu_worker.Worker.load_model` (CPU and XPU workers inherit it) is wrapped at class level when the worker
extension is imported (`imported`), before the model loads; after it loads, worker/traced.py (the product
logic) gives each layer L of the set its steering and capture in the instance `forward` of decoder layer L - 1
(layer 0: before decoder layer 0), on buffers registered on that module, allocated once. The set travels in
`VllmConfig.additional_config["hidden_states"]` (hashed into vLLM's compile-cache key).
`GPUModelRunner._model_forward` is wrapped on the runner instance (`runner`, from `hidden_states_install`) to
write a step's steering into those buffers before the forward and clear them after (outside the compiled
region; dummy runs call the model directly and see them cleared).
Relies on: `Worker.load_model` then `model_runner.get_model()`, `runner.max_num_tokens` bounding a forward's
tokens (and the largest CUDA-graph size), execute_model calling `self._model_forward(input_ids=...,
inputs_embeds=...)` by keyword; counts from `vllm.compilation.counter.compilation_counter`.
Upstream: RFC #48743.
Remove when: vLLM returns chosen layers from the compiled forward (RFC #48743).
"""

from __future__ import annotations

from typing import Any

from hidden_states.vllm.patches.drift import _RUNNER, _VCFG, _WORKER, Symbol


def imported(**_: Any) -> None:
    """Wraps vLLM's `Worker.load_model` once per process, so the entries are in place before the first
    forward compiles the model."""
    from vllm.v1.worker.gpu_worker import Worker

    from hidden_states.vllm.worker import traced

    if getattr(Worker.load_model, "_hidden_states", False):
        return
    load = Worker.load_model

    def load_model(self, *args, **kwargs):
        load(self, *args, **kwargs)
        traced.install(self.model_runner)

    load_model._hidden_states = True
    Worker.load_model = load_model


def runner(runner: Any, hook: Any, **_: Any) -> None:
    """Wraps the runner's `_model_forward`: the step's steering into the traced buffers around it."""
    forward = runner._model_forward

    def _model_forward(*args, **kwargs):
        # The input batch is this step's by now; outside the compiled region.
        ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        n = int((ids if ids is not None else embeds).shape[0])
        steered = hook.steering.before_forward(n)
        try:
            return forward(*args, **kwargs)
        finally:
            if steered:
                hook.steering.after_forward()

    runner._model_forward = _model_forward


RELIED: tuple[Symbol, ...] = (
    Symbol(f"{_WORKER}.load_model", "16", kind="wrapped"),
    Symbol("vllm.v1.worker.cpu_worker:CPUWorker.load_model", "16", kind="inherited", defined_in="Worker"),
    Symbol("vllm.v1.worker.xpu_worker:XPUWorker.load_model", "16", kind="inherited", defined_in="Worker"),
    Symbol(f"{_VCFG}.additional_config", "16", kind="field"),
    Symbol(f"{_VCFG}.compute_hash", "16", kind="method", mentions=("self.additional_config",)),
    Symbol(f"{_RUNNER}._model_forward", "16", ("*", "input_ids", "inputs_embeds"), "wrapped"),
    Symbol(f"{_RUNNER}.get_model", "16", (), "called"),
    Symbol("vllm.config:CompilationConfig.max_cudagraph_capture_size", "16", kind="field"),
    Symbol("vllm.compilation.counter:compilation_counter", "16", kind="dataclass instance"),
)
