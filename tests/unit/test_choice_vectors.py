"""How a response's choices find their vectors (hidden_states/openai_format.ChoiceVectors):
by their own prompt_token_ids + token_ids, whole or streamed; a choice without one
fails the request; token ids asked for internally stay hidden. No vLLM."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from hidden_states.openai_format import ChoiceVectors
from hidden_states.engine import HiddenStatesCollector, MissingHiddenStatesError
from hidden_states.vllm.engine import HiddenStatesEngine


def engine():
    eng = HiddenStatesEngine.__new__(HiddenStatesEngine)
    eng.missing_vectors, eng.observers = 0, []
    return eng


def vectors(route="completions", show_token_ids=True, position="completion_end", layers=None):
    collector = HiddenStatesCollector("tag", (-1,), position)
    request = types.SimpleNamespace(hidden_states_encoding="float", hidden_states_layers=layers,
                                    return_token_ids=show_token_ids)
    return ChoiceVectors(engine(), collector, request, route, "r0"), collector


def vec(x):
    return {-1: np.full(4, x, np.float32)}


def test_whole_completion_choices_find_their_own_vectors():
    cv, col = vectors()
    col.vectors[(1, 2, 7)] = vec(7)
    col.vectors[(3, 8, 9)] = vec(9)
    payload = {"choices": [{"index": 0, "prompt_token_ids": [3], "token_ids": [8, 9]},
                           {"index": 1, "prompt_token_ids": [1, 2], "token_ids": [7]}]}
    cv.fill_response(payload)
    assert payload["choices"][0]["hidden_states"] == [9.0] * 4
    assert payload["choices"][1]["hidden_states"] == [7.0] * 4
    assert payload["choices"][1]["token_ids"] == [7]  # asked for: shown


def test_chat_prompt_ids_are_top_level_and_hidden_unless_asked():
    cv, col = vectors("chat", show_token_ids=False)
    col.vectors[(1, 2, 5)] = vec(5)
    payload = {"prompt_token_ids": [1, 2], "choices": [{"index": 0, "token_ids": [5]}]}
    cv.fill_response(payload)
    assert payload["choices"][0]["hidden_states"] == [5.0] * 4
    assert payload["prompt_token_ids"] is None and payload["choices"][0]["token_ids"] is None


def test_a_choice_without_its_vector_fails_the_request_and_is_counted():
    cv, col = vectors()
    col.vectors[(1, 2, 7)] = vec(7)
    with pytest.raises(MissingHiddenStatesError, match="choice 1"):
        cv.fill_response({"choices": [{"index": 0, "prompt_token_ids": [1, 2], "token_ids": [7]},
                                      {"index": 1, "prompt_token_ids": [1, 2], "token_ids": [7, 7]}]})
    assert cv.engine.missing_vectors == 1


def chunk(data) -> str:
    return "data: " + json.dumps(data) + "\n\n"


def test_stream_accumulates_tokens_per_choice_and_vectors_the_final_chunk():
    cv, col = vectors(show_token_ids=False)
    col.vectors[(1, 4, 5)] = vec(5)
    col.vectors[(1, 6)] = vec(6)
    out = [cv.fill_chunk(chunk(c)) for c in (
        {"choices": [{"index": 0, "prompt_token_ids": [1], "token_ids": [4], "finish_reason": None}]},
        {"choices": [{"index": 1, "prompt_token_ids": [1], "token_ids": [6], "finish_reason": "stop"}]},
        {"choices": [{"index": 0, "token_ids": [5], "finish_reason": "length"}]},
    )]
    events = [json.loads(o[6:]) for o in out]
    assert "hidden_states" not in events[0]["choices"][0]
    assert events[1]["choices"][0]["hidden_states"] == [6.0] * 4
    assert events[2]["choices"][0]["hidden_states"] == [5.0] * 4
    assert all(e["choices"][0].get("token_ids") is None and e["choices"][0].get("prompt_token_ids") is None
               for e in events)  # the client did not ask for them


def test_chat_stream_drops_events_that_exist_only_because_token_ids_were_asked():
    cv, _ = vectors("chat", show_token_ids=False)
    assert cv.fill_chunk(chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": None, "token_ids": [9]}]})) == ""
    kept = cv.fill_chunk(chunk({"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}))
    assert json.loads(kept[6:])["choices"][0]["delta"] == {"content": "a"}


def test_prompt_end_vectors_are_keyed_by_the_prompt_alone():
    cv, col = vectors(position="prompt_end", layers=[0, -1])
    col.vectors[(1, 2)] = {0: np.zeros(2, np.float32), -1: np.ones(2, np.float32)}
    payload = {"choices": [{"index": 0, "prompt_token_ids": [1, 2], "token_ids": [3, 4]}]}
    cv.fill_response(payload)
    assert payload["choices"][0]["hidden_states_by_layer"] == {"0": [0.0, 0.0], "-1": [1.0, 1.0]}
    assert payload["choices"][0]["hidden_states_meta"]["position"] == "prompt_end"


def test_a_failing_metrics_observer_fails_no_request():
    cv, col = vectors()
    col.vectors[(1, 2)] = vec(2)
    seen = []
    cv.engine.observers += [lambda e: 1 / 0, seen.append]
    payload = {"choices": [{"index": 0, "prompt_token_ids": [1], "token_ids": [2]}]}
    cv.fill_response(payload)
    assert payload["choices"][0]["hidden_states"] == [2.0] * 4
    assert seen[0].position == "completion_end" and seen[0].nbytes == 16
