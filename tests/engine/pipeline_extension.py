"""The worker extension of tests/engine/test_pipeline.py: this server's (whose import installs ledger point 22
through the registry, as in production) and two probes of a runner's intermediate-tensor buffers."""

from __future__ import annotations

from hidden_states.vllm.worker.extension import HiddenStatesWorkerExtension


class PipelineProbe(HiddenStatesWorkerExtension):
    def pp_buffers(self) -> dict:
        """This worker's stage and its runner's intermediate-tensor buffers (name -> shape), or None."""
        from vllm.distributed.parallel_state import get_pp_group

        it = self.model_runner.intermediate_tensors
        shapes = None if it is None else {k: tuple(v.shape) for k, v in it.tensors.items()}
        return {"stage": get_pp_group().rank_in_group, "buffers": shapes}

    def pp_drop_buffers(self) -> None:
        """What vLLM's CPU worker leaves a later stage with when no dummy step ran: no buffers."""
        self.model_runner.intermediate_tensors = None
