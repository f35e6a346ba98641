"""Ledger point 5, CPU only: a seeded request's generator rewound by its state, not its offset (worker).

Why: `GPUModelRunner._bookkeeping_sync` rewinds the generator of a request whose sample is discarded (a
partial prefill chunk) with `gen.set_offset(...)`, which CPU generators refuse ("CPU Generator does not use
offset"), killing the engine on seeded prompts longer than one prefill chunk (found by the load test).
How: on a CPU runner, `execute_model` and `_bookkeeping_sync` are wrapped on the runner instance (`runner`,
from the worker extension's `hidden_states_install`, after point 2): the states of the discarded requests'
generators are saved before sampling and restored instead of the rewind; those generators are hidden from
vLLM's bookkeeping during it.
Relies on: `GPUModelRunner._bookkeeping_sync`, `discard_request_mask` (a CpuGpuBuffer), `InputBatch.generators`
and `num_reqs`; execute_model returning None when sampling follows in sample_tokens().
Remove when: vLLM's CPU runner rewinds CPU generators itself.
"""

from __future__ import annotations

from typing import Any

from hidden_states.vllm import _require
from hidden_states.vllm.patches.drift import _BATCH, _CPU_RUNNER, Symbol


def runner(runner: Any, **_: Any) -> None:
    if getattr(runner, "device", None) is not None and runner.device.type == "cpu":
        patch_cpu_generator_rewind(runner)


def patch_cpu_generator_rewind(runner: Any) -> None:
    """Ledger point 5: rewind discarded seeded samples by state, not offset, on CPU."""
    _require(
        hasattr(runner, "_bookkeeping_sync") and hasattr(runner, "discard_request_mask"),
        "GPUModelRunner._bookkeeping_sync / discard_request_mask",
    )
    execute, bookkeeping = runner.execute_model, runner._bookkeeping_sync
    saved: dict[int, Any] = {}

    def discarded_with_generator():
        n = runner.input_batch.num_reqs
        for i in runner.discard_request_mask.np[:n].nonzero()[0]:
            gen = runner.input_batch.generators.get(int(i))
            if gen is not None:
                yield int(i), gen

    def execute_model(*args, **kwargs):
        out = execute(*args, **kwargs)
        saved.clear()
        if out is None:  # sampling follows in sample_tokens(): keep the states it will advance
            saved.update({i: gen.get_state() for i, gen in discarded_with_generator()})
        return out

    def bookkeeping_sync(*args, **kwargs):
        gens = runner.input_batch.generators
        hidden = {i: gens.pop(i) for i in list(saved) if i in gens}
        for i, gen in hidden.items():
            gen.set_state(saved[i])
        try:
            return bookkeeping(*args, **kwargs)
        finally:
            gens.update(hidden)
            saved.clear()

    runner.execute_model = execute_model
    runner._bookkeeping_sync = bookkeeping_sync


RELIED: tuple[Symbol, ...] = (
    Symbol(f"{_CPU_RUNNER}._bookkeeping_sync", "5", kind="wrapped"),
    Symbol(f"{_CPU_RUNNER}.discard_request_mask", "5", kind="init attr"),
    Symbol(f"{_BATCH}.generators", "5", kind="init attr"),
    Symbol(f"{_BATCH}.num_reqs", "5", kind="property"),
)
