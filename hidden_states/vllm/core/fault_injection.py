"""Tests only: the engine core's schedulers with injected faults, installed instead of scheduler.py's own
when the engine starts with FAULT_INJECTION_ENV=1 (`patches/scheduler_cls.scheduler_path`). A request whose
spec names a hook (`RequestSpec.inject`) makes that per-request hook raise for it: "plan" (`_plan_request`), "file"
(`_store_request`), "send" (`_send_request`) or "tail" (`_stopped`). The production classes carry no
test code; each hook's own handler (`_fault`) fails the request alone, as it would any exception."""

from __future__ import annotations

from typing import Any

from hidden_states.protocol import InjectedFault, injected_fault
from hidden_states.vllm.core import scheduler


class _Injecting:
    """Mixed in before one of scheduler.py's schedulers."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._injected: dict[str, str] = {}  # request id -> the hook it asks to fail

    def _raise_if(self, hook: str, rid: str) -> None:
        if self._injected.get(rid) == hook:
            raise InjectedFault(f"a fault injected into the {hook} hook")

    def add_request(self, request: Any) -> None:
        sp = request.sampling_params
        if sp is not None and (hook := injected_fault(sp.extra_args)):
            self._injected[request.request_id] = hook
        super().add_request(request)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for rid in [r for r in self._injected if r not in self.requests and r not in self._records]:
            del self._injected[rid]  # gone from vLLM and from the scheduler's records
        return outputs

    def _plan_request(self, rid: str, *args: Any) -> Any:
        self._raise_if("plan", rid)
        return super()._plan_request(rid, *args)

    def _store_request(self, rid: str, *args: Any) -> None:
        self._raise_if("file", rid)
        super()._store_request(rid, *args)

    def _send_request(self, eco: Any, rec: Any) -> None:
        self._raise_if("send", eco.request_id)
        super()._send_request(eco, rec)

    def _stopped(self, request: Any, *args: Any) -> bool:
        self._raise_if("tail", request.request_id)
        return super()._stopped(request, *args)


class TailScheduler(_Injecting, scheduler.TailScheduler):
    pass


class AsyncVectorScheduler(_Injecting, scheduler.AsyncVectorScheduler):
    pass


class VectorScheduler(_Injecting, scheduler.VectorScheduler):
    pass
