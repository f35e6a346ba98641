"""Injected faults (tests only) live in the test seam, not in the engine core's production scheduler:
under FAULT_INJECTION_ENV=1 the engine runs the fault-injecting twin of its scheduler
(hidden_states/vllm/core/fault_injection.py), whose per-request hooks raise for the request that asks.
The real engine's requests fail alone in tests/engine/test_engine.py
(`test_a_hook_in_the_engine_core_that_raises_fails_its_request_alone`)."""

from __future__ import annotations

import dataclasses
import importlib
import pathlib

import pytest

from hidden_states.protocol import FAULT_INJECTION_ENV, InjectedFault, RequestSpec

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_production_scheduler_carries_no_test_code():
    source = (ROOT / "hidden_states/vllm/core/scheduler.py").read_text()
    for name in ("InjectedFault", "injected_fault", "fault_injection", "FAULT_INJECT"):
        assert name not in source, name


@pytest.mark.parametrize("on", [False, True])
def test_the_engine_runs_the_twin_only_under_the_env_flag(monkeypatch, on):
    from hidden_states.vllm.core import fault_injection, scheduler
    from hidden_states.vllm.patches.scheduler_cls import (
        ASYNC_SCHEDULER,
        PLAIN_SCHEDULER,
        TAIL_SCHEDULER,
        scheduler_path,
    )

    if on:
        monkeypatch.setenv(FAULT_INJECTION_ENV, "1")
    else:
        monkeypatch.delenv(FAULT_INJECTION_ENV, raising=False)
    for path in (TAIL_SCHEDULER, ASYNC_SCHEDULER, PLAIN_SCHEDULER):
        module, name = scheduler_path(path).rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name)
        assert cls.__module__ == (fault_injection.__name__ if on else scheduler.__name__)
        assert issubclass(cls, getattr(scheduler, name))


@dataclasses.dataclass
class Request:
    request_id: str
    sampling_params: object


@dataclasses.dataclass
class Params:
    extra_args: dict


class Base:
    """The per-request hooks of scheduler.py's mixin, as stand-ins that record their calls."""

    def __init__(self):
        self.requests, self._records, self.calls = {}, {}, []

    def add_request(self, request):
        self.requests[request.request_id] = request

    def _plan_request(self, rid, *args):
        self.calls.append(("plan", rid))

    def _store_request(self, rid, *args):
        self.calls.append(("file", rid))

    def _send_request(self, eco, rec):
        self.calls.append(("send", eco.request_id))

    def _stopped(self, request, *args):
        self.calls.append(("tail", request.request_id))
        return False

    def update_from_output(self, so, mro):
        return {}


@pytest.mark.parametrize("hook", ["plan", "file", "send", "tail"])
def test_the_twin_raises_in_the_asked_hook_for_the_asking_request_only(hook):
    from hidden_states.vllm.core.fault_injection import _Injecting

    class Twin(_Injecting, Base):
        pass

    s = Twin()
    s.add_request(Request("bad", Params(RequestSpec(inject=hook).into(None))))
    s.add_request(Request("good", Params({})))

    def run(which, rid):
        req = Request(rid, None)
        return {
            "plan": lambda: s._plan_request(rid, None, None, 1),
            "file": lambda: s._store_request(rid, None, None, [], None, {}, None),
            "send": lambda: s._send_request(req, None),
            "tail": lambda: s._stopped(req, None, None, []),
        }[which]()

    for which in ("plan", "file", "send", "tail"):
        run(which, "good")
        if which == hook:
            with pytest.raises(InjectedFault, match=hook):
                run(which, "bad")
        else:
            run(which, "bad")
    assert [c for c in s.calls if c[1] == "bad"] == [(h, "bad") for h in ("plan", "file", "send", "tail") if h != hook]
    # Gone from vLLM and from the records: forgotten at the end of the next update.
    del s.requests["bad"]
    s.update_from_output(None, None)
    assert s._injected == {}


# -- the worker: its hook's twin (worker/fault_injection.py), chosen by the same flag --------------------------------


def test_the_production_worker_carries_no_test_code():
    for name in ("capture.py", "steering.py"):
        source = (ROOT / "hidden_states/vllm/worker" / name).read_text()
        for word in ("InjectedFault", "injected_fault", "fault_injection()", "FAULT_INJECT", "self._inject", ".check("):
            assert word not in source, (name, word)


@pytest.mark.parametrize("on", [False, True])
def test_the_worker_runs_the_twin_only_under_the_env_flag(monkeypatch, on):
    from hidden_states.vllm.worker import capture, fault_injection, steering

    if on:
        monkeypatch.setenv(FAULT_INJECTION_ENV, "1")
    else:
        monkeypatch.delenv(FAULT_INJECTION_ENV, raising=False)
    cls = fault_injection.runner_hook_class()
    assert issubclass(cls, capture._RunnerHook) and issubclass(cls.steering_class, steering.StepSteering)
    assert (cls is fault_injection.RunnerHook) == on and (cls is capture._RunnerHook) == (not on)


@pytest.mark.parametrize("hook", ["capture", "heads", "steering"])
def test_the_worker_twin_raises_in_the_asked_hook_for_the_asking_request_only(hook):
    import torch

    from hidden_states.vllm.worker.capture import _Block
    from hidden_states.vllm.worker.fault_injection import RunnerHook, StepSteering

    h = RunnerHook.__new__(RunnerHook)  # its per-request pieces only: no runner
    h._inject = {"bad": hook}
    hidden, residual = torch.arange(12.0).reshape(6, 2), torch.ones(6, 2)
    blocks = [_Block(0, 1, hidden, 0, 2), _Block(1, 1, hidden, 2, 4)]
    st = StepSteering.__new__(StepSteering)
    st.guard, st.traced = h, type("Traced", (), {"fill": lambda self, ops, n: (n, 0)})()
    pieces = {  # each hook's pieces, for one request
        "capture": lambda rid: h._gather_rows([rid], hidden, residual, [0, 1]),
        "heads": lambda rid: h._head_rows([rid], blocks, [0, 1]),
        "steering": lambda rid: st._fill([rid], {}, 3),
    }
    for which, call in pieces.items():
        call("good")
        if which == hook:
            with pytest.raises(InjectedFault, match=hook):
                call("bad")
        else:
            call("bad")
    assert torch.equal(h._gather_rows(["good"], hidden, residual, [0, 1]), (hidden + residual)[[0, 1]])
    bad = [type("Entry", (), {"rid": "bad"})()]
    if hook == "capture":  # the step's pack, before any of its work; a steering entry, before it is written
        with pytest.raises(InjectedFault, match="capture"):
            h._pack(bad, [0], hidden)
    if hook == "steering":
        with pytest.raises(InjectedFault, match="steering"):
            st._add_entry("bad", None, "add", None, None, hidden, residual, None, None)


def test_a_hook_fault_on_a_rank_that_does_not_send_stops_the_step():
    """The sending rank's fault fails its request alone (reported with the step); on another rank (a later
    tensor-parallel rank, an earlier pipeline stage) nothing could report it, and going on would leave that rank's
    stream unlike the sender's: the step raises instead."""
    import types

    from hidden_states.vllm.worker.capture import _RunnerHook

    sender = types.SimpleNamespace(attaches=True, _faults={}, hook_faults=0)
    _RunnerHook.fault(sender, "r1", "steering", ValueError("x"))
    assert sender._faults["r1"].hook == "steering" and sender.hook_faults == 1
    other = types.SimpleNamespace(attaches=False, _faults={}, hook_faults=0)
    with pytest.raises(RuntimeError, match="r1: the hidden-states hook steering raised on a rank whose outputs"):
        _RunnerHook.fault(other, "r1", "steering", ValueError("x"))
