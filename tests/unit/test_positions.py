"""Positions, their rules and their formatting, without vLLM (issue 24): which positions a
request asks for (against Python's own slicing), what the engine may capture and send before a
sequence ends, the field rules, and rows in responses and stream chunks."""

from __future__ import annotations

import base64
import json
import types

import numpy as np
import pytest

from hidden_states.interface import HiddenStatesCollector, RowBatch
from hidden_states.openai_format import ChoiceVectors
from hidden_states.params import HiddenStatesRequestError, Span, check_rows_budget, parse_fields

RANGES = [(s, e, k) for s in (-7, -3, -1, 0, 2, 5) for e in (None, -4, -1, 3, 9, 40) for k in (1, 2, 3)]


@pytest.mark.parametrize("start, end, stride", RANGES)
def test_a_range_is_python_slicing_of_prompt_and_completion(start, end, stride):
    span = Span(start, end, stride)
    for total in range(0, 14):
        assert list(span.positions(total)) == list(range(total))[start:end:stride], total


@pytest.mark.parametrize("start, end, stride", RANGES)
def test_what_is_captured_and_sent_before_the_end_is_never_wrong(start, end, stride):
    """For every final length `total` >= what is known: positions decided wanted are wanted,
    positions dropped are not, and a step captures every wanted position it computes."""
    span = Span(start, end, stride)
    for known in range(1, 10):
        p = np.arange(known)
        wanted, undecided = span.classify(p, known)
        for total in range(known, 16):
            final = set(span.positions(total))
            assert set(p[wanted].tolist()) <= final
            assert not (set(p[~wanted & ~undecided].tolist()) & final)
            for first in range(known):
                captured = set(span.capturable(first, known))
                assert {q for q in final if first <= q < known} <= captured


def test_field_rules_one_message_each():
    ok = {"return_hidden_states": True}
    for position in ("completion", "all", {"start": -1}, {"start": 2, "end": -1, "stride": 3}):
        parse_fields({**ok, "hidden_states_position": position}, enabled=True)
    bad = [
        ({"hidden_states_position": "middle"}, "'completion', 'all'"),
        ({"hidden_states_position": {"start": "1"}}, "start must be an integer"),
        ({"hidden_states_position": {"start": 1, "end": 1.5}}, "end must be an integer"),
        ({"hidden_states_position": {"start": 1, "stride": 0}}, "stride must be a positive integer"),
        ({"hidden_states_position": {"start": -2, "end": -5}}, "selects no position"),
        ({"hidden_states_position": {"start": 0, "size": 3}}, "start, end and stride only"),
        ({"hidden_states_dtype": "float64"}, "'float32', 'float16' or 'bfloat16'"),
        ({"hidden_states_topk": 0}, "positive integer"),
    ]
    for fields, words in bad:
        with pytest.raises(HiddenStatesRequestError, match=words) as e:
            parse_fields({**ok, **fields}, enabled=True)
        assert e.value.param == next(iter(fields))


def test_the_memory_bound_counts_positions_layers_width_and_choices():
    check_rows_budget(Span(0), 10, 90, 1, 1, 128, "float32", None, 100 * 128 * 4)  # exactly at the bound
    with pytest.raises(HiddenStatesRequestError, match="101 positions"):
        check_rows_budget(Span(0), 10, 91, 1, 1, 128, "float32", None, 100 * 128 * 4)
    with pytest.raises(HiddenStatesRequestError, match="2 choice"):
        check_rows_budget(Span(10), 10, 90, 2, 1, 128, "float32", None, 100 * 128 * 4)
    check_rows_budget(Span(0), 10, 90, 2, 1, 128, "float16", None, 100 * 128 * 4)
    check_rows_budget(Span(0), 10, 90, 1, 3, 128, "float32", 8, 100 * 8 * 8 * 3)  # top-k: values + int32 indices
    check_rows_budget(Span(-4), 10, 10**6, 1, 1, 128, "float32", None, 4 * 128 * 4)  # a window, whatever the length


def _vectors(position, encoding="float", dtype="float32", topk=None):
    spec = parse_fields(
        {
            "return_hidden_states": True,
            "hidden_states_position": position,
            "hidden_states_encoding": encoding,
            "hidden_states_dtype": dtype,
            "hidden_states_topk": topk,
        },
        enabled=True,
    )
    collector = HiddenStatesCollector.of("t", spec, (-1,))
    request = types.SimpleNamespace(n=1)
    engine = types.SimpleNamespace(
        missing=lambda what: AssertionError(what), vector_sent=lambda *a: None, hidden_size=4, heads={}
    )
    return ChoiceVectors(engine, collector, request, "completions", "r0"), collector


def _batch(positions, dtype="float32"):
    values = np.arange(len(positions) * 4, dtype=np.float32).reshape(-1, 4) + 0.5
    raw = values if dtype == "float32" else (values.view(np.uint32) >> 16).astype("<u2")
    return RowBatch(np.asarray(positions, np.int64), {-1: raw}, dtype)


def _chunk(finish=None):
    return "data: " + json.dumps({"choices": [{"index": 0, "text": "x", "finish_reason": finish}]}) + "\n\n"


def test_stream_chunks_carry_the_rows_since_the_last_one_and_the_rest_at_the_finish():
    cv, col = _vectors("completion")
    assert cv.fill_chunk(_chunk()) == _chunk()  # nothing received: untouched
    col.add_rows((0, 0), _batch([5, 6]))
    first = json.loads(cv.fill_chunk(_chunk())[6:])["choices"][0]
    assert first["hidden_states_meta"]["positions"] == [5, 6] and len(first["hidden_states"]) == 2
    col.add_rows((0, 0), _batch([6, 7, 8]))  # 6 again (a resumed request): sent once
    col.close_choice((0, 0), [5, 6, 7], None)  # the choice ended at 8 tokens: 8 was never asked for
    last = json.loads(cv.fill_chunk(_chunk("length"))[6:])["choices"][0]
    assert last["hidden_states_meta"]["positions"] == [7] and last["hidden_states_meta"]["shape"] == [1, 4]
    assert last["hidden_states"] == [[4.5, 5.5, 6.5, 7.5]]  # position 7 of the second batch


def test_base64_rows_are_the_dtype_s_little_endian_bytes():
    cv, col = _vectors("all", "base64", "bfloat16")
    batch = _batch([0, 1, 2], "bfloat16")
    col.add_rows((0, 0), batch)
    col.close_choice((0, 0), [0, 1, 2], None)
    out = {"choices": [{"index": 0}]}
    cv.fill_response(out)
    choice = out["choices"][0]
    raw = base64.b64decode(choice["hidden_states"])
    assert raw == batch.values[-1].astype("<u2").tobytes() and len(raw) == choice["hidden_states_meta"]["bytes"]
    high = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(high.reshape(3, 4), np.arange(12, dtype=np.float32).reshape(3, 4) + 0.5)
    assert choice["hidden_states_meta"]["shape"] == [3, 4] and choice["hidden_states_meta"]["dtype"] == "bfloat16"


def test_one_position_with_a_dtype_stays_one_vector():
    cv, col = _vectors("completion_end", dtype="float16")
    col.add_rows((0, 0), RowBatch(np.asarray([9]), {-1: np.full((1, 4), 1.5, "<f2")}, "float16"))
    col.close_choice((0, 0), [9], None)
    out = {"choices": [{"index": 0}]}
    cv.fill_response(out)
    assert out["choices"][0]["hidden_states"] == [1.5] * 4
    assert "positions" not in out["choices"][0]["hidden_states_meta"]


def test_a_closed_choice_keeps_rows_all_wanted_as_they_came():
    """ChoiceState: rows that are all wanted are handed out as received (no selection copy); rows past what
    the choice wants are dropped."""
    spec = parse_fields({"return_hidden_states": True, "hidden_states_position": "all"}, enabled=True)
    col = HiddenStatesCollector.of("t", spec, (-1,))
    batch = RowBatch(np.array([0, 1, 2]), {-1: np.ones((3, 4), np.float32)})
    col.add_rows((0, 0), batch)
    col.close_choice((0, 0), [0, 1, 2], None)
    assert col.hand_out((0, 0)) is batch
    col.add_rows((0, 1), RowBatch(np.array([0, 1, 2]), {-1: np.arange(12, dtype=np.float32).reshape(3, 4)}))
    col.close_choice((0, 1), [0, 1], None)
    got = col.hand_out((0, 1))
    assert got.positions.tolist() == [0, 1] and got.values[-1].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
