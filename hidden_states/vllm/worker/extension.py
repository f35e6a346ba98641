"""The worker extension: installs the capture in every vLLM worker and reports its counts
(ledger point 1: the public extension point; the patches it installs are in hidden_states/vllm/patches/).
Mixed into vLLM's Worker through `worker_extension_cls`; the engine calls it with `collective_rpc`. CPU
start-up steps come from `cpu.CPUWorkerSteps`.
"""

from __future__ import annotations

import logging
from typing import Any

from hidden_states.protocol import fault_injection
from hidden_states.vllm import _require, check_vllm_version
from hidden_states.vllm.cpu import CPUWorkerSteps
from hidden_states.vllm.patches import install
from hidden_states.vllm.patches.mm_prefix_attention import MM_PREFIX_ROWS
from hidden_states.vllm.worker.capture import _RunnerHook
from hidden_states.vllm.worker.traced import compile_counts

logger = logging.getLogger(__name__)

# Imported in each worker process before its model loads: the static layer set's load_model wrap (ledger
# point 16) and, tests only, the CPU stand-ins of vLLM's async path (point 12).
install("worker", "imported")


def _hook_class() -> type:
    """capture._RunnerHook, or under FAULT_INJECTION_ENV=1 (tests only) its fault-injecting twin
    (worker/fault_injection.py), as the engine core runs core/fault_injection.py's
    (patches/scheduler_cls.scheduler_path)."""
    if not fault_injection():
        return _RunnerHook
    from hidden_states.vllm.worker.fault_injection import runner_hook_class

    return runner_hook_class()


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
        hook = _hook_class()(runner)
        # Tensor-parallel ranks hold identical rows after the all-reduce; the executor returns only the output
        # rank's ModelRunnerOutput: the last pipeline stage's first tensor-parallel rank (rank 0 without
        # pipeline parallelism), as vLLM's executors pick it (ledger point 4).
        pc = runner.vllm_config.parallel_config
        rank, tp = getattr(self, "rank", 0), pc.tensor_parallel_size
        attaches = hook.attaches = rank == pc.world_size - tp
        # Every rank of an earlier pipeline stage (vLLM numbers ranks stage by stage) gathers its layers' rows and
        # sends them on with its intermediate tensors: the tensor-parallel ranks' rows are the same, and vLLM may
        # split a tensor across them and gather it again on the next stage, so each attaches its copy.
        hook.forwards = rank < pc.world_size - tp
        # A hook fault fails its request alone where the request's other ranks cannot diverge from this one: on the
        # rank that sends, and on an earlier stage of one rank, whose faults ride its intermediate tensors on
        # (capture.forward_rows). Elsewhere (a tensor-parallel rank that does not send) the step fails.
        hook.contains_faults = attaches or (hook.forwards and tp == 1)
        runner._hidden_states_hook = hook
        hook.layer_info = hook.install_layer_hooks()
        # execute_model / sample_tokens (point 2), _model_forward (16), embed_multimodal (14), the CPU
        # generators' rewind (5): hidden_states/vllm/patches/
        install("worker", "runner", runner=runner, hook=hook, attaches=attaches)
        logger.info(
            "hidden-states hook installed on %s (attaching=%s, layer capture: %s)",
            type(runner).__name__,
            attaches,
            hook.layer_info["layer_capture_reason"] or f"{hook.layer_hooks} decoder layers",
        )
        return {**hook.layer_info, "installed": True, "attaches": attaches, "heads": hook.install_heads(heads or [])}

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
            "forwarded_rows": hook.forwarded_rows,  # pipeline parallelism: rows sent on to the next stage
            "forwarded_bytes": hook.forwarded_bytes,
            "forwarded_faults": hook.forwarded_faults,  # requests failed here or before, sent on to be reported
            "received_rows": hook.received_rows,  # and received from the stage before
            "capture_layers": sorted(hook.traced.layers) if hook.traced is not None else None,
            "traced_buffer_bytes": hook.traced.bytes if hook.traced is not None else 0,
            "compilations": compile_counts(),
        }
