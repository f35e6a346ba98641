"""The worker extension: installs the capture in every vLLM worker and reports its counts
(ledger points 1, 2 in __init__.py). Mixed into vLLM's Worker through `worker_extension_cls`;
the engine calls it with `collective_rpc`. CPU start-up steps come from `cpu.CPUWorkerSteps`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hidden_states.vllm import _require, check_vllm_version
from hidden_states.vllm.cpu import (
    CPU_ASYNC_ENV,
    MM_PREFIX_ROWS,
    CPUWorkerSteps,
    install_cpu_async_shim,
    patch_cpu_generator_rewind,
)
from hidden_states.vllm.worker.capture import _RunnerHook
from hidden_states.vllm.worker.traced import compile_counts, patch_load_model

logger = logging.getLogger(__name__)

patch_load_model()  # imported in each worker process before its model loads (ledger point 16)

if os.environ.get(CPU_ASYNC_ENV) == "1":  # tests only: imported before the runner is built (ledger point 12)
    install_cpu_async_shim()


def check_engine_config(vcfg: Any) -> None:
    """The second guard (after HiddenStatesEngine.start()): refuses engine shapes the hook cannot
    serve, naming the argument (engine_args.py)."""
    from hidden_states.vllm.engine_args import refuse

    refuse({}, vcfg)


class HiddenStatesWorkerExtension(CPUWorkerSteps):
    """Mixed into vLLM's Worker via `worker_extension_cls`; called by collective_rpc."""

    def hidden_states_install(self, heads: list | None = None) -> dict[str, Any]:
        """Installs the hook once, with the registered `heads` (heads.HeadSpec as builtins) on the
        device; returns {"installed": this call installed it, "layer_capture": intermediate layers
        can be served, "layer_capture_reason": why not, "heads": names loaded, ...}."""
        check_vllm_version()
        runner = getattr(self, "model_runner", None)
        _require(runner is not None, "Worker.model_runner")
        _require(hasattr(runner, "execute_model_state"), "GPUModelRunner.execute_model_state (Model Runner V1)")
        _require(hasattr(runner, "sample_tokens"), "GPUModelRunner.sample_tokens")
        _require(
            hasattr(runner, "input_batch") and hasattr(runner.input_batch, "req_id_to_index"),
            "InputBatch.req_id_to_index",
        )
        _require(hasattr(runner, "requests"), "GPUModelRunner.requests")
        _require(hasattr(runner, "_model_forward"), "GPUModelRunner._model_forward")
        check_engine_config(runner.vllm_config)
        if getattr(runner, "_hidden_states_hook", None) is not None:
            hook = runner._hidden_states_hook
            return {**hook.layer_info, "installed": False, "heads": hook.install_heads(heads or [])}
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
        forward = runner._model_forward

        def _model_forward(*args, **kwargs):
            # The input batch is this step's by now; outside the compiled region (ledger point 16).
            ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
            n = int((ids if ids is not None else embeds).shape[0])
            steered = hook.steering.before_forward(n)
            try:
                return forward(*args, **kwargs)
            finally:
                if steered:
                    hook.steering.after_forward()

        runner._model_forward = _model_forward
        runner._hidden_states_hook = hook
        hook.layer_info = hook.install_layer_hooks()
        if getattr(runner, "device", None) is not None and runner.device.type == "cpu":
            patch_cpu_generator_rewind(runner)
        logger.info(
            "hidden-states hook installed on %s (attaching=%s, layer capture: %s)",
            type(runner).__name__,
            attaches,
            hook.layer_info["layer_capture_reason"] or f"{hook.layer_hooks} decoder layers",
        )
        return {**hook.layer_info, "installed": True, "heads": hook.install_heads(heads or [])}

    def hidden_states_stats(self) -> dict:
        trimmer = getattr(self, "_hidden_states_trimmer", None)
        extra = {"malloc_trim": trimmer.stats()} if trimmer is not None else {}
        if MM_PREFIX_ROWS[0]:  # rows of image tokens attended both ways, over layers (ledger point 18)
            extra["image_span_rows"] = MM_PREFIX_ROWS[0]
        hook = getattr(getattr(self, "model_runner", None), "_hidden_states_hook", None)
        if hook is None:
            return {"installed": False, **extra}
        return {
            **extra,
            "installed": True,
            "captured": hook.captured,
            "steps": hook.steps,
            "steps_with_capture": hook.steps_with_capture,
            "steps_with_rows": hook.steps_with_rows,
            "host_copies": hook.host_copies,
            "bytes_copied": hook.bytes_copied,
            "layer_hooks": hook.layer_hooks,
            "encoder_items": hook.encoder_items,
            "head_products": hook.head_products,
            "head_rows": hook.head_rows,
            "ranked_rows": hook.ranked_rows,
            "head_column_rows": hook.head_column_rows,
            "steered_rows": hook.steering.steered(),
            "gated_planned": hook.steering.gated_planned,
            "hook_faults": hook.hook_faults,  # requests a hook here failed (each alone: capture.py)
            "capture_layers": sorted(hook.traced.layers) if hook.traced is not None else None,
            "traced_buffer_bytes": hook.traced.bytes if hook.traced is not None else 0,
            "compilations": compile_counts(),
        }
