"""Ledger point 10: the rows' way to the frontend, taken off each engine output (frontend process).

Why: vLLM's outputs carry no hidden states. The scheduler (point 9) puts each request's rows, head outputs,
stop and steering records and faults on `EngineCoreOutput.kv_transfer_params` (a `dict[str, Any]` vLLM's
msgpack carries), as one `protocol.EngineMessage` under `protocol.OUTPUT_KEY`; KV connectors, the field's
real users, are refused (point 4).
How: `ExtractingAsyncLLM` (frontend/extraction.py) wraps its output processor's `process_outputs` on the
instance (`async_llm`, from its `__init__`): `before(engine_core_outputs)` (the product logic: extraction's
own, taking our keys off each output) runs before vLLM reads them. vLLM's completions serving names a
prompt's engine requests `{id}-{i}` (extraction.prompt_ordinal), so a choice's vector is `ordinal * n + index`.
Relies on: `AsyncLLM.output_processor`, `OutputProcessor.process_outputs(engine_core_outputs, ...)` and
`request_states`, `EngineCoreOutput.kv_transfer_params`.
Upstream: RFC #48743.
Remove when: vLLM's outputs carry hidden states (RFC #48743).
"""

from __future__ import annotations

from typing import Any

from hidden_states.vllm.patches.drift import _ASYNC_LLM, _ECO, _SERVING_CMPL, Symbol


def async_llm(llm: Any, before: Any, **_: Any) -> None:
    """`before(engine_core_outputs)` ahead of `llm.output_processor.process_outputs`, on the instance."""
    process = llm.output_processor.process_outputs

    def process_outputs(engine_core_outputs, *a, **kw):
        before(engine_core_outputs)
        return process(engine_core_outputs, *a, **kw)

    llm.output_processor.process_outputs = process_outputs


RELIED: tuple[Symbol, ...] = (
    Symbol(f"{_ECO}.kv_transfer_params", "10, 19", kind="field"),
    Symbol(_ASYNC_LLM, "10", kind="open instances"),  # ExtractingAsyncLLM; llm.extraction set on it
    Symbol(f"{_ASYNC_LLM}.__init__", "10", kind="override"),
    Symbol(
        f"{_ASYNC_LLM}.generate",
        "10",
        ("prompt", "sampling_params", "request_id", "*", "lora_request", "priority"),
        "override",
    ),
    Symbol(f"{_ASYNC_LLM}.from_vllm_config", "10", ("vllm_config", "*", "stat_loggers"), "called"),
    Symbol(f"{_ASYNC_LLM}.output_processor", "10", kind="init attr"),
    Symbol(
        "vllm.v1.engine.output_processor:OutputProcessor.process_outputs", "10", ("engine_core_outputs",), "wrapped"
    ),
    Symbol("vllm.v1.engine.output_processor:OutputProcessor", "10", kind="open instances"),  # process_outputs set
    Symbol("vllm.v1.engine.output_processor:OutputProcessor.request_states", "10", kind="init attr"),
    Symbol("vllm.v1.engine.output_processor:RequestState.parent_req", "10", kind="init attr"),
    Symbol("vllm.v1.engine.output_processor:RequestState.external_req_id", "10", kind="init attr"),
    Symbol("vllm.v1.engine.output_processor:RequestState.request_index", "10", kind="init attr"),
    Symbol(
        f"{_SERVING_CMPL}.create_completion",
        "10",
        ("request", "raw_request"),
        "called",
        mentions=("self._create_completion(request, raw_request)",),
    ),
    Symbol(
        f"{_SERVING_CMPL}._create_completion",
        "10",
        kind="method",
        mentions=('request_id_item = f"{request_id}-{i}"', "self.beam_search("),
    ),
)
