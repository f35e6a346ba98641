"""Ledger point 22, CPU only, pipeline parallelism: every stage but the first gets its intermediate-tensor
buffers when its model loads.

Why: a later pipeline stage copies the tensors it receives from the stage before into
`GPUModelRunner.intermediate_tensors` (`sync_and_gather_intermediate_tensors`), buffers that only
`_dummy_run` allocates. vLLM's CPU worker runs no dummy step on an eager engine
(`CPUModelRunner.warming_up_model` returns at once) nor on one with `kv_cache_memory_bytes` set
(`CPUWorker._should_warm_up_model`), so there the second stage's first step asserts
`self.intermediate_tensors is not None`, and the engine core then dies with a KeyError on the request.
How: `CPUModelRunner.load_model` is wrapped at class level when the worker extension is imported
(`imported`), before the model loads; after it loads, a runner on any stage but the first with no buffers yet
allocates them as `_dummy_run` does: `model.make_empty_intermediate_tensors(batch_size=max_num_tokens,
dtype=model_config.dtype, device=device)`. `_dummy_run` then finds them and keeps them.
Relies on: `sync_and_gather_intermediate_tensors` copying into and slicing `self.intermediate_tensors` by key
(`[:num_tokens]`, so `max_num_tokens` rows bound a step); the model's `make_empty_intermediate_tensors`
(`SupportsPP`: every model vLLM runs under pipeline parallelism has it); `get_pp_group().is_first_rank`.
Upstream: the report text is in docs/how-it-works.md, "The ledger, in short".
Remove when: vLLM's CPU runner allocates these buffers without a dummy step (in `load_model`, or on first use).
"""

from __future__ import annotations

from typing import Any

from hidden_states.vllm.patches.drift import _CPU_RUNNER, _RUNNER, Symbol


def imported(**_: Any) -> bool:
    """Wraps vLLM's `CPUModelRunner.load_model` once per process. Returns whether this call wrapped it."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner.load_model, "_hidden_states", False):
        return False
    load = CPUModelRunner.load_model

    def load_model(self, *args, **kwargs):
        load(self, *args, **kwargs)
        allocate_intermediate_tensors(self)

    load_model._hidden_states = True
    CPUModelRunner.load_model = load_model
    return True


def allocate_intermediate_tensors(runner: Any) -> bool:
    """Allocates the runner's `intermediate_tensors` where it is a later pipeline stage without them, as
    `GPUModelRunner._dummy_run` does. Returns whether it allocated them."""
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", None) is not None:
        return False
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
    )
    return True


RELIED: tuple[Symbol, ...] = (
    Symbol(f"{_CPU_RUNNER}.load_model", "22", ("load_dummy_weights=False",), "wrapped"),
    Symbol(f"{_RUNNER}.intermediate_tensors", "22", kind="init attr"),
    Symbol(
        f"{_RUNNER}.sync_and_gather_intermediate_tensors",
        "22",
        ("num_tokens", "intermediate_tensors", "sync_self"),
        "method",
        mentions=("self.intermediate_tensors[k][:num_tokens].copy_(", "v[:num_tokens] for k, v in self.intermediate"),
    ),
    Symbol("vllm.distributed.parallel_state:get_pp_group", "22", (), "called"),
    Symbol("vllm.distributed.parallel_state:GroupCoordinator.is_first_rank", "22", kind="property"),
    Symbol("vllm.model_executor.models.interfaces:SupportsPP.make_empty_intermediate_tensors", "22", kind="field"),
    Symbol(
        "vllm.model_executor.models.interfaces:_MakeEmptyIntermediateTensors.__call__",
        "22",
        ("batch_size", "dtype", "device"),
        "called",
    ),
)
