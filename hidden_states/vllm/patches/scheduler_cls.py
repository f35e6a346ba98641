"""Ledger point 9: the engine core's scheduler is ours (set in the frontend process, run in the engine core).

Why: the scheduler decides each step's capture plan (`protocol.PLAN_ATTR` on the SchedulerOutput), files the
rows onto each EngineCoreOutput (point 10), holds a flagged request's stop for its tail step, and applies stop
conditions (point 20); vLLM has no per-request hook for any of it.
How: `scheduler_config.scheduler_cls` (vLLM's public setting) is set after `create_engine_config` (`scheduler`,
from `HiddenStatesEngine.start`) to a class of core/scheduler.py (the product logic): `TailScheduler` (a v1
`Scheduler`) under synchronous scheduling, `AsyncVectorScheduler` (an `AsyncScheduler`) under async,
`VectorScheduler` without the tail step; under FAULT_INJECTION_ENV=1 (tests only) their fault-injecting twins
(core/fault_injection.py). They override `add_request`, `schedule`, `update_from_output`, `_free_request`
and `_update_request_with_output` (the TailScheduler also drops rejected drafts' rows and resets a held
request's `num_computed_tokens` and `spec_token_ids` under speculative decoding). Async: the tail row is the
step in flight's; `max_tokens` reads one more while `schedule()` runs so that step is not skipped (the CUDA
stream side is untested).
Relies on: the overridden methods' signatures and the source facts the drift check reads (unpatched.py lists
the Request, SchedulerOutput and ModelRunnerOutput fields read).
Remove when: vLLM returns the final token's hidden state itself.
"""

from __future__ import annotations

from typing import Any

from hidden_states.protocol import fault_injection
from hidden_states.vllm.patches.drift import (
    _ASYNC_SCHED,
    _ECO,
    _MRO,
    _REQUEST,
    _SCFG,
    _SCHED,
    _SO,
    _SP,
    _STATUS,
    Symbol,
)

TAIL_SCHEDULER = "hidden_states.vllm.core.scheduler.TailScheduler"  # synchronous: vectors on outputs + the tail step
ASYNC_SCHEDULER = "hidden_states.vllm.core.scheduler.AsyncVectorScheduler"  # async scheduling: vectors on outputs
PLAIN_SCHEDULER = "hidden_states.vllm.core.scheduler.VectorScheduler"  # tail_step=False: vectors on outputs only


def scheduler_path(path: str) -> str:
    """The scheduler class the engine core runs: `path`, or under FAULT_INJECTION_ENV=1 (tests only) its
    fault-injecting twin (core/fault_injection.py)."""
    return path.replace(".core.scheduler.", ".core.fault_injection.") if fault_injection() else path


def scheduler(vllm_config: Any, tail_step: bool, **_: Any) -> str:
    """From the configuration vLLM resolved (async scheduling after its own defaults): the tail step needs a
    synchronous scheduler. Returns the class's path."""
    name = TAIL_SCHEDULER if not vllm_config.scheduler_config.async_scheduling else ASYNC_SCHEDULER
    path = vllm_config.scheduler_config.scheduler_cls = scheduler_path(name if tail_step else PLAIN_SCHEDULER)
    return path


RELIED: tuple[Symbol, ...] = (
    Symbol(f"{_SCFG}.scheduler_cls", "9", kind="field"),
    Symbol(f"{_SCHED}.add_request", "9", ("request",), "override", exact=True),
    Symbol(f"{_SCHED}.schedule", "9", kind="override", mentions=("self._update_after_schedule(",)),
    Symbol(f"{_SCHED}._update_after_schedule", "9", ("scheduler_output",), "method"),
    Symbol(
        f"{_SCHED}.update_from_output",
        "9, 20",
        ("scheduler_output", "model_runner_output"),
        "override",
        exact=True,
        mentions=(
            "self._update_request_with_output(",
            "logprobs.slice_request(req_index, len(new_token_ids))",
            "self._free_request(",
        ),
    ),
    Symbol(
        f"{_SCHED}._update_request_with_output",
        "9, 20",
        ("request", "new_token_ids"),
        "override",
        mentions=("check_stop(", "return new_token_ids, stopped"),
    ),
    Symbol(f"{_SCHED}._free_request", "9", ("request",), "override"),
    Symbol(f"{_ASYNC_SCHED}.add_request", "9", ("request",), "override", exact=True),
    Symbol(f"{_ASYNC_SCHED}.schedule", "9", kind="override"),
    Symbol(
        f"{_ASYNC_SCHED}.update_from_output", "9", ("scheduler_output", "model_runner_output"), "override", exact=True
    ),
    Symbol(f"{_ASYNC_SCHED}._update_request_with_output", "9, 20", ("request", "new_token_ids"), "override"),
    Symbol(f"{_ASYNC_SCHED}._free_request", "9", ("request",), "override"),
    Symbol(f"{_SCHED}.requests", "9", kind="init attr"),
    Symbol(f"{_SCHED}.vllm_config", "9", kind="init attr"),
    Symbol(f"{_SCHED}.max_model_len", "9", kind="init attr"),
    Symbol(f"{_SCHED}.return_sampling_mask", "9", kind="init attr"),
    Symbol(f"{_REQUEST}.request_id", "9", kind="init attr"),
    Symbol(f"{_REQUEST}.sampling_params", "9", kind="init attr"),
    Symbol(f"{_REQUEST}.num_prompt_tokens", "9", kind="init attr"),
    Symbol(f"{_REQUEST}.num_tokens", "9, 20", kind="property"),
    Symbol(f"{_REQUEST}.num_computed_tokens", "9", kind="init attr"),
    Symbol(f"{_REQUEST}.spec_token_ids", "9", kind="init attr"),
    Symbol(f"{_REQUEST}.num_output_placeholders", "9", kind="init attr"),
    Symbol(f"{_REQUEST}.max_tokens", "9", kind="init attr"),
    Symbol(f"{_REQUEST}.status", "9, 20", kind="init attr"),
    Symbol(f"{_REQUEST}.structured_output_request", "9", kind="init attr"),
    Symbol(f"{_STATUS}.RUNNING", "9", kind="enum member"),
    Symbol(f"{_STATUS}.FINISHED_LENGTH_CAPPED", "9", kind="enum member"),
    Symbol(f"{_STATUS}.FINISHED_REPETITION", "9", kind="enum member"),
    Symbol(f"{_STATUS}.FINISHED_ABORTED", "9", kind="enum member"),
    Symbol(f"{_SO}.scheduled_spec_decode_tokens", "9", kind="field"),
    Symbol(f"{_MRO}.sampled_token_ids", "9", kind="field"),
    Symbol(f"{_MRO}.logprobs", "9", kind="field"),
    Symbol(f"{_MRO}.sampling_masks", "9", kind="field"),
    Symbol("vllm.v1.outputs:LogprobsLists.slice_request", "9", ("req_idx", "num_positions"), "called"),
    Symbol("vllm.v1.outputs:SamplingMaskLists.slice_request", "9", ("req_idx", "num_positions"), "called"),
    Symbol(f"{_ECO}.new_logprobs", "9", kind="field"),
    Symbol(f"{_ECO}.new_sampling_mask", "9", kind="field"),
    Symbol(f"{_SP}.num_logprobs", "9", kind="property"),
    Symbol(f"{_SP}.stop", "9", kind="field"),
    Symbol(f"{_SP}.structured_outputs", "9", kind="field"),
)
