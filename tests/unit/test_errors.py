"""The one table from exceptions to statuses (hidden_states/errors.py), and that HTTP
and Python-handle callers get the same status for the same failure."""

from __future__ import annotations

import json
import subprocess
import sys
import traceback

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from deployments import http
from hidden_states import errors
from hidden_states.interface import HiddenStatesTimeout, MissingHiddenStatesError
from hidden_states.params import HiddenStatesDisabledError, HiddenStatesRequestError, UnknownModelError
from hidden_states.testing import EngineDeadError


def remote(e: BaseException) -> BaseException:
    """`e` as a caller of a Ray task or actor method gets it: RayTaskError(type(e))."""
    try:
        raise e
    except BaseException as raised:
        return RayTaskError("openai_unary", traceback.format_exc(), raised).as_instanceof_cause()


@pytest.mark.parametrize(
    "e, status, kind, param, words",
    [
        (
            HiddenStatesRequestError("hidden_states_layers [9] out of range", "hidden_states_layers"),
            400,
            "BadRequestError",
            "hidden_states_layers",
            "out of range",
        ),
        (HiddenStatesDisabledError(), 400, "BadRequestError", "return_hidden_states", "enable_return_hidden_states"),
        (ValueError("max_tokens must be at least 1"), 400, "BadRequestError", None, "max_tokens"),
        (UnknownModelError("lora-x", ["base", "lora-a"]), 404, "NotFoundError", "model", "serves `base`, `lora-a`"),
        (
            HiddenStatesTimeout("no vector within extraction_timeout_s"),
            504,
            "TimeoutError",
            None,
            "extraction_timeout_s",
        ),
        (TimeoutError(), 504, "TimeoutError", None, "request_timeout_s"),
        (TimeoutError(), 504, "TimeoutError", None, "request_timeout_s"),
        (
            MissingHiddenStatesError("choice 0 finished without its hidden states"),
            500,
            "InternalServerError",
            "return_hidden_states",
            "without its hidden states",
        ),
        (ActorDiedError(), 503, "ServiceUnavailableError", None, "ActorDiedError"),
        (ActorUnavailableError("gone", None), 503, "ServiceUnavailableError", None, "retry"),
        (EngineDeadError("engine core died"), 503, "ServiceUnavailableError", None, "EngineDeadError"),
        (RuntimeError("a bug"), 500, "InternalServerError", None, "RuntimeError: a bug"),
        (KeyError("k"), 500, "InternalServerError", None, "KeyError"),
    ],
)
def test_the_table(e, status, kind, param, words):
    f = errors.status_of(e)
    assert (f.status, f.type, f.param) == (status, kind, param) and words in f.message, f


@pytest.mark.parametrize(
    "e, status",
    [
        (ValueError("bad"), 400),
        (HiddenStatesTimeout("late"), 504),
        (MissingHiddenStatesError("none"), 500),
        (RuntimeError("bug"), 500),
    ],
)
def test_an_error_from_another_ray_process_is_judged_and_worded_by_its_cause(e, status):
    wrapped = remote(e)
    f = errors.status_of(wrapped)
    assert f.status == status and "Traceback" not in f.message and "File " not in f.message, f


@pytest.mark.parametrize("e", [HiddenStatesTimeout("late"), ValueError("bad"), ActorDiedError(), RuntimeError("x")])
def test_http_sse_and_handle_answers_agree(e):
    """The same failure is the same status and message over HTTP, mid-stream and over a handle."""
    f = errors.status_of(e)
    response = http.failure(e)
    body = json.loads(response.body)["error"]
    sse = json.loads(errors.sse_error(e)[len(b"data: ") :])["error"]
    handle = http.handle_failure(e)
    assert response.status_code == body["code"] == sse["code"] == handle.status == f.status
    assert body == sse and body["type"] == f.type and body["message"] == handle.message == f.message


def test_no_vllm_and_no_ray_at_import():
    code = (
        "import sys, hidden_states.errors; bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'ray')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_replica_gone_is_what_the_router_retries():
    assert errors.replica_gone(ActorDiedError()) and errors.replica_gone(remote(EngineDeadError("dead")))
    assert not errors.replica_gone(remote(ValueError("bad"))) and not errors.replica_gone(TimeoutError())
