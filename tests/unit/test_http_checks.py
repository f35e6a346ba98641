"""The checks both ingresses run before any engine work (deployments/http.py)."""

from __future__ import annotations

import json

import pytest

from deployments.config import AppArgs
from deployments.http import check, failure, handle_failure, handle_spec
from deployments.wire import HandleCompletionRequest, HandleError
from hidden_states.errors import Refused
from hidden_states.params import NOTHING, parse_fields

ARGS = AppArgs(model="builtin:tiny-llama", max_n=4)
OFF = AppArgs(model="builtin:tiny-llama", enable_return_hidden_states=False)


def refusal(args: AppArgs, body) -> tuple[int, dict] | None:
    """The refusal the ingress answers (`failure` of the Refused `check` raises), or None for a body it admits."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        check(args, raw)
    except Refused as e:
        out = failure(e)
        return out.status_code, json.loads(out.body)["error"]
    return None


def handle_refusal(args: AppArgs, req: HandleCompletionRequest):
    """A handle request's refusal as its caller gets it (HandleError), or its spec."""
    try:
        return handle_spec(args, req)
    except Refused as e:
        return handle_failure(e)


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"{not json", 400, "not valid JSON"),
        ([1, 2], 400, "JSON object"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "tiny-llama"),
        ({"prompt": "x", "return_hidden_states": "yes"}, 400, "boolean"),
        ({"prompt": "x", "hidden_states_encoding": "hex"}, 400, "'float' or 'base64'"),
        ({"prompt": "x", "encoding_format": "hex"}, 400, "'float' or 'base64'"),
        ({"prompt": "x", "encoding_format": "base64", "hidden_states_encoding": "float"}, 400, "disagree"),
        ({"prompt": "x", "hidden_states_layers": []}, 400, "non-empty list"),
        ({"prompt": "x", "hidden_states_layers": [True]}, 400, "non-empty list"),
        ({"prompt": "x", "hidden_states_position": "middle"}, 400, "prompt_end"),
        ({"prompt": "x", "n": 5}, 400, "from 1 to 4"),
        ({"prompt": "x", "n": 0}, 400, "from 1 to 4"),
    ],
)
def test_refusals_are_openai_errors_that_name_the_fix(body, status, words):
    got = refusal(ARGS, body)
    assert got is not None, body
    code, err = got
    assert code == status and err["code"] == status and words in err["message"], err


def test_valid_bodies_pass_and_come_back_parsed():
    body = {
        "model": "tiny-llama",
        "prompt": [1, 2, 3],
        "n": 4,
        "stream": True,
        "return_hidden_states": True,
        "hidden_states_layers": [-1, 0],
        "hidden_states_position": "prompt_end",
    }
    req, spec = check(ARGS, json.dumps(body).encode())
    assert req == body and spec == parse_fields(body, enabled=True) and spec.position == "prompt_end"
    assert check(ARGS, b'{"prompt": "x"}') == ({"prompt": "x"}, NOTHING)  # no model: the served one


def test_hidden_states_on_a_server_with_them_off():
    code, err = refusal(OFF, {"prompt": "x", "return_hidden_states": True})
    assert code == 400 and "enable_return_hidden_states: true" in err["message"]
    assert refusal(OFF, {"prompt": "x", "return_hidden_states": False}) is None


def test_handle_requests_get_the_same_checks():
    assert handle_refusal(OFF, HandleCompletionRequest(prompt="x")).status == 400
    assert handle_refusal(ARGS, HandleCompletionRequest(prompt="x", n=9)).status == 400
    assert handle_refusal(ARGS, HandleCompletionRequest(prompt="x", n=2)).return_hidden_states is True


def test_lora_modules_are_served_by_name(tmp_path):
    """`lora_modules`: each adapter is a `model` the checks accept, /v1/models lists it with its
    base, the engine gets enable_lora with room for all of them, and unknown names are 404s."""
    from deployments.config import lora_rank
    from deployments.http import models_list

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({"r": 24}))
    args = AppArgs(
        model="builtin:tiny-llama",
        lora_modules=[{"name": "a", "path": str(tmp_path / "a")}, {"name": "b", "path": "org/hub-adapter"}],
    )
    assert args.served_model_names == ["tiny-llama", "a", "b"]
    engine = args.engine_args()
    assert (engine["enable_lora"], engine["max_loras"], engine["max_lora_rank"]) == (True, 2, 32)  # 24 -> 32
    assert lora_rank(args.lora_modules[1:]) == 16  # nothing readable: vLLM's default
    assert (
        AppArgs(model="builtin:tiny-llama", lora_modules=args.lora_modules, engine={"max_lora_rank": 64}).engine_args()[
            "max_lora_rank"
        ]
        == 64
    )  # `engine` wins
    assert "enable_lora" not in ARGS.engine_args()
    for body in ({"model": "a", "prompt": "x"}, {"model": "tiny-llama", "prompt": "x"}):
        assert check(args, json.dumps(body).encode())[0] == body
    code, err = refusal(args, {"model": "c", "prompt": "x"})
    assert code == 404 and err["param"] == "model" and "`tiny-llama`, `a`, `b`" in err["message"], err
    assert not isinstance(handle_refusal(args, HandleCompletionRequest(prompt="x", model="b")), HandleError)
    assert handle_refusal(args, HandleCompletionRequest(prompt="x", model="c")).status == 404
    cards = json.loads(models_list(args).body)["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [("tiny-llama", None), ("a", "tiny-llama"), ("b", "tiny-llama")]
    assert cards[1]["root"] == str(tmp_path / "a")


@pytest.mark.parametrize(
    "modules, engine, words",
    [
        ([{"name": "x", "path": "p"}, {"name": "x", "path": "q"}], {}, "distinct"),
        ([{"name": "tiny-llama", "path": "p"}], {}, "distinct"),
        ([{"name": "x", "path": "p"}], {"enable_lora": False}, "enable_lora"),
        ([{"name": "x"}], {}, "path"),
    ],
)
def test_bad_lora_modules_are_refused_at_the_boundary(modules, engine, words):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=words):
        AppArgs(model="builtin:tiny-llama", lora_modules=modules, engine=engine)


def test_a_handle_request_takes_a_prompt_or_chat_messages():
    chat = HandleCompletionRequest(messages=[{"role": "user", "content": "Hi"}])
    assert not isinstance(handle_refusal(ARGS, chat), HandleError)
    for bad, words in (
        (HandleCompletionRequest(), "exactly one"),
        (HandleCompletionRequest(prompt="x", messages=[{"role": "user", "content": "Hi"}]), "exactly one"),
        (HandleCompletionRequest(messages=[]), "non-empty list"),
        (HandleCompletionRequest(messages=[{"content": "no role"}]), "non-empty list"),
    ):
        refused = handle_refusal(ARGS, bad)
        assert refused is not None and refused.status == 400 and words in refused.message, (bad, refused)


@pytest.mark.parametrize(
    "accelerator, engine, want",
    [
        ("cpu", {}, {"num_cpus": 1}),
        ("cpu", {"tensor_parallel_size": 2}, {"num_cpus": 2}),
        ("gpu", {}, {"num_cpus": 1, "num_gpus": 1}),
        ("gpu", {"tensor_parallel_size": 4}, {"num_cpus": 1, "num_gpus": 4}),
    ],
)
def test_batch_engine_actors_ask_for_what_their_engine_runs_on(accelerator, engine, want):
    from deployments.batch import worker_resources

    assert worker_resources(AppArgs(model="builtin:tiny-llama", accelerator=accelerator, engine=engine)) == want
