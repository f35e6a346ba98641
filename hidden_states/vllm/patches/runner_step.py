"""Ledger point 2: the step's rows, from the model runner (worker processes).

Why: vLLM returns no hidden states per request; the runner holds them between its two calls of a step.
How: `GPUModelRunner.execute_model` and `sample_tokens` are wrapped *on the runner instance* (CPU and XPU
runners subclass it; `on_runner`, from the worker extension's `hidden_states_install`). Between the two calls
`runner.execute_model_state` holds the step's `scheduler_output`, `sample_hidden_states` (one row per request,
`input_batch.req_ids` order) and `hidden_states` (every scheduled token's row after the final norm, at
`query_start_loc` offsets). The capture (worker/capture.py, the product logic) gathers the rows the
scheduler's plan names (point 9, `protocol.PLAN_ATTR`) on the device and hangs them on the returned
ModelRunnerOutput (`protocol.STEP_ATTR`): one device-to-host copy per step, after sampling; under async
scheduling inside `AsyncModelRunnerOutput.get_output`, wrapped on that instance (`on_output`). The plan is
dropped when execute_model returns or raises, so dummy batches see none. Under pipeline parallelism an earlier
stage's first rank returns its IntermediateTensors from execute_model, and vLLM's `Worker.execute_model` sends
their whole `tensors` dict to the next stage: the rows it gathered at its layers ride it (`protocol.PP_ROWS_KEY`,
`PP_INDEX_KEY`), and the next stage takes them off what it received before its runner copies that into its
buffers (`sync_and_gather_intermediate_tensors` knows only vLLM's keys). On a GPU, reading the received
`tensors` waits for the transfer there rather than inside the runner (untested).
Relies on: vLLM 0.32 calling execute_model then sample_tokens every step (async scheduling too, untested on
GPUs) and passing num_computed_tokens as of before the step; Model Runner V1 (point 3).
Upstream: RFC #48743 (hidden states returned by vLLM).
Remove when: vLLM returns last-token hidden states inline (RFC #48743).
"""

from __future__ import annotations

from typing import Any

from hidden_states.vllm.patches.drift import _BATCH, _CPU_RUNNER, _MRO, _RUNNER, _SO, _XPU_RUNNER, Symbol


def runner(runner: Any, hook: Any, attaches: bool, **_: Any) -> None:
    """Wraps the runner's `execute_model` and `sample_tokens` around `hook` (capture._RunnerHook)."""
    execute, sample = runner.execute_model, runner.sample_tokens

    def execute_model(scheduler_output, *args, **kwargs):
        hook.before_step(scheduler_output)
        try:
            # pipeline parallelism: the rows the stages before gathered, off what this stage received
            received = args[0] if args else kwargs.get("intermediate_tensors")
            if received is not None and hasattr(received, "tensors"):
                hook.receive_rows(received.tensors)
            out = execute(scheduler_output, *args, **kwargs)
            if out is None and attaches:  # logits computed, sampling pending: rows are in execute_model_state
                hook.after_step()
            elif hook.forwards and hasattr(out, "tensors"):  # an earlier stage: its rows ride what it sends on
                hook.forward_rows(out.tensors)
            return out
        finally:
            hook.end_step()

    def sample_tokens(*args, **kwargs):
        return hook.attach(sample(*args, **kwargs))

    runner.execute_model, runner.sample_tokens = execute_model, sample_tokens


def on_output(out: Any, then: Any) -> Any:
    """`then(model_runner_output)` on the step's ModelRunnerOutput: at once, or under async scheduling (an
    AsyncModelRunnerOutput) when vLLM calls its `get_output`, wrapped on the instance. Returns `out`."""
    if hasattr(out, "get_output"):  # AsyncModelRunnerOutput
        original = out.get_output

        def get_output():
            mro = original()
            then(mro)
            return mro

        out.get_output = get_output
    elif hasattr(out, "req_id_to_index"):
        then(out)
    return out


RELIED: tuple[Symbol, ...] = (
    Symbol(
        f"{_RUNNER}.execute_model",
        "2, 16",
        ("scheduler_output",),
        "wrapped",
        mentions=("self._model_forward(input_ids=input_ids", "inputs_embeds=inputs_embeds"),
    ),
    Symbol(f"{_RUNNER}.sample_tokens", "2", kind="wrapped"),
    # pipeline parallelism: what an earlier stage returns is sent whole; what a later one receives is passed on
    Symbol(
        "vllm.v1.worker.gpu_worker:Worker.execute_model",
        "2",
        ("scheduler_output",),
        "method",
        mentions=("self.model_runner.execute_model(", "scheduler_output, intermediate_tensors", "output.tensors,"),
    ),
    Symbol("vllm.sequence:IntermediateTensors.tensors", "2", kind="field"),
    Symbol(_RUNNER, "2, 16", kind="open instances"),  # execute_model, sample_tokens, _model_forward set on it
    Symbol(f"{_CPU_RUNNER}.execute_model", "2, 5", ("scheduler_output",), "inherited", defined_in="GPUModelRunner"),
    Symbol(f"{_CPU_RUNNER}.sample_tokens", "2", kind="inherited", defined_in="GPUModelRunner"),
    Symbol(f"{_XPU_RUNNER}.execute_model", "2", kind="inherited", defined_in="GPUModelRunner"),
    Symbol(f"{_XPU_RUNNER}.sample_tokens", "2", kind="inherited", defined_in="GPUModelRunner"),
    Symbol(f"{_RUNNER}.execute_model_state", "2", kind="init attr"),
    Symbol("vllm.v1.worker.gpu_model_runner:ExecuteModelState.scheduler_output", "2", kind="field"),
    Symbol("vllm.v1.worker.gpu_model_runner:ExecuteModelState.hidden_states", "2", kind="field"),
    Symbol("vllm.v1.worker.gpu_model_runner:ExecuteModelState.sample_hidden_states", "2", kind="field"),
    Symbol(f"{_RUNNER}.input_batch", "2", kind="init attr"),
    Symbol(f"{_RUNNER}.query_start_loc", "2, 15", kind="init attr"),
    Symbol(f"{_RUNNER}.vllm_config", "2", kind="init attr"),
    Symbol(f"{_RUNNER}.device", "2, 6, 22", kind="init attr"),
    Symbol(f"{_BATCH}.req_id_to_index", "2", kind="init attr"),
    Symbol(f"{_BATCH}.req_ids", "2", kind="property"),
    Symbol("vllm.v1.utils:CpuGpuBuffer.np", "2, 5, 15", kind="init attr"),
    Symbol(f"{_MRO}.req_id_to_index", "2, 9", kind="field"),
    Symbol(_MRO, "2, 9", kind="open instances"),  # the step's rows hang on it (protocol.STEP_ATTR)
    Symbol("vllm.v1.outputs:AsyncModelRunnerOutput", "2", kind="open instances"),  # get_output replaced on it
    Symbol("vllm.v1.outputs:AsyncModelRunnerOutput.get_output", "2", (), "replaced", exact=True),
    Symbol(_SO, "2, 9", kind="open instances"),  # the scheduler's plan rides it to the workers (PLAN_ATTR)
    Symbol(f"{_SO}.num_scheduled_tokens", "2, 9, 15", kind="field"),
    Symbol(f"{_SO}.total_num_scheduled_tokens", "2", kind="field"),
    Symbol(f"{_SO}.finished_req_ids", "2, 15", kind="field"),
)
