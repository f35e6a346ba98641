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
    """The sending rank's fault fails its request alone (reported with the step), and so does an earlier pipeline
    stage's of one rank (sent on: the next test); on a later tensor-parallel rank nothing could report it, and going
    on would leave that rank's share of the stream unlike the sender's: the step raises instead."""
    import types

    from hidden_states.vllm.worker.capture import _RunnerHook

    for contains in ("sender", "an earlier stage"):
        hook = types.SimpleNamespace(contains_faults=True, _faults={}, hook_faults=0)
        _RunnerHook.fault(hook, "r1", "steering", ValueError("x"))
        assert hook._faults["r1"].hook == "steering" and hook.hook_faults == 1, contains
    other = types.SimpleNamespace(contains_faults=False, _faults={}, hook_faults=0)
    with pytest.raises(RuntimeError, match="r1: the hidden-states hook steering raised on a rank whose outputs"):
        _RunnerHook.fault(other, "r1", "steering", ValueError("x"))


def test_an_earlier_stages_faults_ride_its_tensors_to_the_stage_that_reports_them():
    """Stage 0 failed r1 in its steering: its intermediate tensors carry the fault (PP_FAULTS_KEY, beside the rows
    of the others) and the next stage files it as its own, leaving r1 out of its step and reporting it; a fault the
    next stage had already for r1 is kept, and the key is taken off before vLLM copies the tensors."""
    import types

    import torch

    from hidden_states.protocol import PP_FAULTS_KEY, PP_INDEX_KEY, PP_ROWS_KEY, HookFault
    from hidden_states.vllm.worker.capture import _RunnerHook

    stage0 = types.SimpleNamespace(
        traced=None,
        _faults={"r1": HookFault.of("steering", ValueError("x")), "r3": HookFault("capture", "E")},
        _slices=[(0, [1], torch.ones(2, 4))],
        forwarded_faults=0,
        forwarded_rows=0,
        forwarded_bytes=0,
    )
    tensors = {"hidden_states": torch.zeros(3, 4)}
    _RunnerHook.forward_rows(stage0, tensors)
    assert tensors[PP_FAULTS_KEY].dtype == torch.uint8 and stage0.forwarded_faults == 2
    stage1 = types.SimpleNamespace(
        _faults={"r3": HookFault("heads", "mine")}, _given={"r1": None, "r2": None}, _slices=[], received_rows=0
    )
    _RunnerHook.receive_rows(stage1, tensors)
    assert set(tensors) == {"hidden_states"}  # vLLM's own keys only
    assert stage1._faults == {"r1": HookFault("steering", "ValueError: x"), "r3": HookFault("heads", "mine")}
    assert stage1.received_rows == 2 and stage1._slices[0][:2] == (0, [1])
    # a stage with faults and no rows still sends the faults on
    alone = types.SimpleNamespace(
        traced=None, _faults={"r1": HookFault("steering", "E")}, _slices=[], forwarded_faults=0, forwarded_rows=0
    )
    sent: dict = {}
    _RunnerHook.forward_rows(alone, sent)
    assert set(sent) == {PP_FAULTS_KEY} and PP_ROWS_KEY not in sent and PP_INDEX_KEY not in sent
