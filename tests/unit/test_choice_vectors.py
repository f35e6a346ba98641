"""How a response's choices find their vectors (hidden_states/openai_format.ChoiceVectors):
by engine request and choice, (prompt ordinal, index), whole or streamed; a choice
without one fails the request; nothing else in the response changes. No vLLM."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from hidden_states.interface import HiddenStatesCollector, MissingHiddenStatesError, RowBatch
from hidden_states.openai_format import ChoiceVectors
from hidden_states.params import parse_fields
from hidden_states.vllm.engine import HiddenStatesEngine
from hidden_states.vllm.frontend.extraction import Extraction, prompt_ordinal


def engine():
    eng = HiddenStatesEngine.__new__(HiddenStatesEngine)
    eng.extraction, eng.observers = Extraction.__new__(Extraction), []
    eng.extraction.missing_vectors = 0
    eng.hidden_size, eng.heads = 4, {}
    return eng


def vectors(route="completions", n=1, position="completion_end", layers=None):
    spec = parse_fields(
        {"return_hidden_states": True, "hidden_states_position": position, "hidden_states_layers": layers}, enabled=True
    )
    collector = HiddenStatesCollector.of("tag", spec, tuple(layers or (-1,)))
    request = types.SimpleNamespace(n=n)
    return ChoiceVectors(engine(), collector, request, route, "r0"), collector


def vec(x):
    return {-1: np.full(4, x, np.float32)}


def put(col: HiddenStatesCollector, key, vectors: dict, position: int = 9) -> None:
    """A choice's vector as the engine files it: the row of its one position, then settled."""
    col.add_rows(key, RowBatch(np.asarray([position]), {l: v[None] for l, v in vectors.items()}))
    col.close_choice(key, [position], None)


def test_completion_choices_are_numbered_ordinal_times_n_plus_index():
    cv, col = vectors(n=2)
    for ordinal in range(2):
        for index in range(2):
            put(col, (ordinal, index), vec(10 * ordinal + index))
    payload = {"choices": [{"index": i, "text": "x"} for i in range(4)]}
    cv.fill_response(payload)
    assert [c["hidden_states"][0] for c in payload["choices"]] == [0.0, 1.0, 10.0, 11.0]
    assert [c["text"] for c in payload["choices"]] == ["x"] * 4  # untouched


def test_chat_choices_are_the_one_prompt_s():
    cv, col = vectors("chat", n=3)
    put(col, (0, 2), vec(5))
    payload = {"choices": [{"index": 2, "message": {"content": "a"}}]}
    cv.fill_response(payload)
    assert payload["choices"][0]["hidden_states"] == [5.0] * 4


def test_vllm_pydantic_responses_take_the_fields_as_extras():
    from pydantic import BaseModel, ConfigDict

    class Choice(BaseModel):
        model_config = ConfigDict(extra="allow")
        index: int
        text: str

    class Response(BaseModel):
        model_config = ConfigDict(extra="allow")
        choices: list[Choice]

    cv, col = vectors()
    put(col, (0, 0), vec(3))
    r = Response(choices=[Choice(index=0, text="hi")])
    cv.fill_response(r)
    out = json.loads(r.model_dump_json())
    assert out["choices"][0]["text"] == "hi" and out["choices"][0]["hidden_states"] == [3.0] * 4


def test_a_choice_without_its_vector_fails_the_request_and_is_counted():
    cv, col = vectors()
    put(col, (0, 0), vec(7))
    with pytest.raises(MissingHiddenStatesError, match="choice 1"):
        cv.fill_response({"choices": [{"index": 0}, {"index": 1}]})
    assert cv.engine.extraction.missing_vectors == 1


def chunk(data) -> str:
    return "data: " + json.dumps(data, separators=(",", ":")) + "\n\n"


def test_stream_events_pass_untouched_until_a_choice_finishes():
    cv, col = vectors(n=2)
    put(col, (0, 1), vec(6))
    put(col, (0, 0), vec(5))
    raw = [
        chunk(c)
        for c in (
            {"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
            {"choices": [{"index": 1, "text": 'b"finish_reason":"', "finish_reason": "stop"}]},
            {"choices": [{"index": 0, "text": "c", "finish_reason": "length"}]},
            {"choices": [], "usage": {"completion_tokens": 3}},
        )
    ]
    out = [cv.fill_chunk(c) for c in raw]
    assert out[0] is raw[0] and out[3] is raw[3]  # the same string: not parsed, not re-serialised
    events = [json.loads(o[6:]) for o in out]
    assert events[1]["choices"][0]["hidden_states"] == [6.0] * 4
    assert events[1]["choices"][0]["text"] == 'b"finish_reason":"'
    assert events[2]["choices"][0]["hidden_states"] == [5.0] * 4


def test_prompt_end_vectors_by_layer():
    cv, col = vectors(position="prompt_end", layers=[0, -1])
    put(col, (0, 0), {0: np.zeros(2, np.float32), -1: np.ones(2, np.float32)})
    payload = {"choices": [{"index": 0}]}
    cv.fill_response(payload)
    assert payload["choices"][0]["hidden_states_by_layer"] == {"0": [0.0, 0.0], "-1": [1.0, 1.0]}
    assert payload["choices"][0]["hidden_states_meta"]["position"] == "prompt_end"


def test_a_failing_metrics_observer_fails_no_request():
    cv, col = vectors()
    put(col, (0, 0), vec(2))
    seen = []
    cv.engine.observers += [lambda e: 1 / 0, seen.append]
    payload = {"choices": [{"index": 0}]}
    cv.fill_response(payload)
    assert payload["choices"][0]["hidden_states"] == [2.0] * 4
    assert seen[0].position == "completion_end" and seen[0].nbytes == 16


@pytest.mark.parametrize(
    "request_id,ordinal",
    [("cmpl-hs0a1b-0", 0), ("cmpl-hs0a1b-3", 3), ("chatcmpl-hs0a1b", 0), ("hs-deadbeef", 0), ("t-123456789", 0)],
)
def test_prompt_ordinal_reads_vllms_per_prompt_suffix(request_id, ordinal):
    assert prompt_ordinal(request_id) == ordinal
