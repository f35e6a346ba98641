"""Tests only: the worker's hook with injected faults, run instead of capture.py's own when the engine starts
with FAULT_INJECTION_ENV=1 (`runner_hook_class`, from the worker extension's install), as the engine core runs
core/fault_injection.py's schedulers. A request whose spec names a hook (`RequestSpec.inject`) makes that
hook's per-request pieces raise for it: "capture" (`_gather_rows`, `_pack`), "heads" (`_head_rows`) or
"steering" (`StepSteering._fill`, `_add_entry`). The production classes carry no test code; each piece's own
handler fails the request alone, as it would any exception (ledger point 19)."""

from __future__ import annotations

from typing import Any

from hidden_states.protocol import InjectedFault, fault_injection, injected_fault
from hidden_states.vllm.worker import capture, steering


def runner_hook_class() -> type:
    """The worker's hook class: capture._RunnerHook, or under FAULT_INJECTION_ENV=1 (tests only) its twin."""
    return RunnerHook if fault_injection() else capture._RunnerHook


def _raise_if(injected: dict[str, str], hook: str, rids: Any) -> None:
    if injected and any(injected.get(rid) == hook for rid in rids):
        raise InjectedFault(f"a fault injected into the {hook} hook")


class StepSteering(steering.StepSteering):
    def _fill(self, rids: list[str], ops: Any, num_tokens: int) -> tuple[int, Any]:
        _raise_if(self.guard._inject, "steering", rids)
        return super()._fill(rids, ops, num_tokens)

    def _add_entry(self, rid: str, *args: Any) -> None:
        _raise_if(self.guard._inject, "steering", (rid,))
        super()._add_entry(rid, *args)


class RunnerHook(capture._RunnerHook):
    steering_class = StepSteering

    def __init__(self, runner: Any):
        self._inject: dict[str, str] = {}  # this step's injected faults: request id -> hook
        super().__init__(runner)

    def before_step(self, so: Any) -> None:
        requests = getattr(self.runner, "requests", {})
        self._inject = {
            rid: hook
            for rid in getattr(so, "num_scheduled_tokens", None) or ()
            if (
                hook := injected_fault(getattr(getattr(requests.get(rid), "sampling_params", None), "extra_args", None))
            )
        }
        super().before_step(so)

    def _gather_rows(self, rids: list[str], *args: Any) -> Any:
        _raise_if(self._inject, "capture", rids)
        return super()._gather_rows(rids, *args)

    def _pack(self, plan: list, members: list[int], hidden: Any) -> Any:
        self._stage = "capture"
        _raise_if(self._inject, "capture", [plan[i].rid for i in members])
        return super()._pack(plan, members, hidden)

    def _head_rows(self, rids: list[str], *args: Any) -> Any:
        _raise_if(self._inject, "heads", rids)
        return super()._head_rows(rids, *args)
