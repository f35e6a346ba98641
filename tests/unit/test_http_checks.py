"""The checks both ingresses run before any engine work (deployments/http.py)."""

from __future__ import annotations

import json

import pytest

from deployments.config import AppArgs
from deployments.http import check, handle_refusal
from deployments.wire import HandleCompletionRequest

ARGS = AppArgs(model="builtin:tiny-llama", max_n=4)
OFF = AppArgs(model="builtin:tiny-llama", enable_return_hidden_states=False)


def refusal(args: AppArgs, body) -> tuple[int, dict] | None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    out = check(args, raw)
    if isinstance(out, dict):
        return None
    return out.status_code, json.loads(out.body)["error"]


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    ([1, 2], 400, "JSON object"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "tiny-llama"),
    ({"prompt": "x", "return_hidden_states": "yes"}, 400, "boolean"),
    ({"prompt": "x", "hidden_states_encoding": "hex"}, 400, "'float' or 'base64'"),
    ({"prompt": "x", "hidden_states_layers": []}, 400, "non-empty list"),
    ({"prompt": "x", "hidden_states_layers": [True]}, 400, "non-empty list"),
    ({"prompt": "x", "hidden_states_position": "middle"}, 400, "prompt_end"),
    ({"prompt": "x", "n": 5}, 400, "from 1 to 4"),
    ({"prompt": "x", "n": 0}, 400, "from 1 to 4"),
])
def test_refusals_are_openai_errors_that_name_the_fix(body, status, words):
    got = refusal(ARGS, body)
    assert got is not None, body
    code, err = got
    assert code == status and err["code"] == status and words in err["message"], err


def test_valid_bodies_pass_and_come_back_parsed():
    body = {"model": "tiny-llama", "prompt": [1, 2, 3], "n": 4, "stream": True, "return_hidden_states": True,
            "hidden_states_layers": [-1, 0], "hidden_states_position": "prompt_end"}
    assert check(ARGS, json.dumps(body).encode()) == body
    assert check(ARGS, b'{"prompt": "x"}') == {"prompt": "x"}  # no model: the served one


def test_hidden_states_on_a_server_with_them_off():
    code, err = refusal(OFF, {"prompt": "x", "return_hidden_states": True})
    assert code == 400 and "enable_return_hidden_states: true" in err["message"]
    assert refusal(OFF, {"prompt": "x", "return_hidden_states": False}) is None


def test_handle_requests_get_the_same_checks():
    assert handle_refusal(OFF, HandleCompletionRequest(prompt="x")).status == 400
    assert handle_refusal(ARGS, HandleCompletionRequest(prompt="x", n=9)).status == 400
    assert handle_refusal(ARGS, HandleCompletionRequest(prompt="x", n=2)) is None
