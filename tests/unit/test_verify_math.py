"""The verification API's request rules and arithmetic (hidden_states/verify.py), no engine."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from pydantic import ValidationError

from hidden_states.params import HiddenStatesRequestError, Span, check_rows_budget, given_span
from hidden_states.verify import (
    Compare,
    VerifyRequest,
    claims,
    compared,
    comparison,
    decode_claimed,
    topk_comparison,
)


def test_one_input_only():
    VerifyRequest(prompt="x")
    VerifyRequest(messages=[{"role": "user", "content": "x"}], completion=[1, 2])
    for bad in (
        {},
        {"prompt": "x", "messages": []},
        {"prompt": "x", "completion": "y"},
        {"prompt": []},
        {"prompt": "x", "compare": {"vector": [1.0]}, "hidden_states_layers": [0]},
        {"prompt": "x", "n": 2},
    ):
        with pytest.raises(ValidationError):
            VerifyRequest(**bad)


def test_claims_decode_as_floats_or_base64_of_the_right_size():
    v = np.arange(4, dtype=np.float32)
    assert np.array_equal(decode_claimed(v.tolist(), 4), v)
    assert np.array_equal(decode_claimed(base64.b64encode(v.astype("<f4").tobytes()).decode(), 4), v)
    for bad, words in (([1.0], "has 1 values"), ("@@", "base64"), (base64.b64encode(b"abc").decode(), "multiple of 4")):
        with pytest.raises(HiddenStatesRequestError, match=words):
            decode_claimed(bad, 4)


def test_comparison_is_relative_to_the_true_vector():
    true = np.array([30.0, -10.0, 5.0, 0.0], np.float32)
    near = true + np.float32(1e-4)  # 3.3e-6 of max |true|
    c = comparison(near, true, 1e-5)
    assert c["match"] and c["relative_error"] == pytest.approx(1e-4 / 30, rel=1e-2) and c["cosine_similarity"] > 0.9999
    far = true.copy()
    far[1] += 1.0
    assert not comparison(far, true, 1e-5)["match"]
    assert comparison(true, true, 1e-9)["max_abs_error"] == 0.0


def test_positions_of_given_tokens_mean_what_they_mean_on_a_completion():
    # 10 tokens, the completion from 6 on (messages + completion); without one, prompt only
    assert list(given_span("completion", 10, 6).positions(10)) == [6, 7, 8, 9]
    assert list(given_span("all", 10, 6).positions(10)) == list(range(10))
    assert list(given_span("prompt_end", 10, 6).positions(10)) == [5]
    assert list(given_span("prompt_end", 10, None).positions(10)) == [9]  # no completion: the last token
    assert list(given_span("completion_end", 10, 6).positions(10)) == [9]
    assert list(given_span({"start": 1, "end": -2, "stride": 3}, 10, None).positions(10)) == [1, 4, 7]
    with pytest.raises(HiddenStatesRequestError, match="send `messages` with a `completion`") as e:
        given_span("completion", 10, None)
    assert e.value.param == "hidden_states_position"
    for position, start in (("completion", 10), ({"start": 12, "end": None, "stride": 1}, None)):
        with pytest.raises(HiddenStatesRequestError, match="selects no position of the 10 given tokens"):
            given_span(position, 10, start)


def test_the_memory_bound_on_given_tokens_is_exact():
    check_rows_budget(Span(0), 100, None, 1, 1, 128, "float32", None, 100 * 128 * 4)
    with pytest.raises(HiddenStatesRequestError, match=r"101 given tokens\) exceed .* or hidden_states_topk$"):
        check_rows_budget(Span(0), 101, None, 1, 1, 128, "float32", None, 100 * 128 * 4)


def test_the_request_takes_the_completion_routes_position_dtype_and_topk():
    r = VerifyRequest(
        prompt="x", hidden_states_position={"start": -4}, hidden_states_dtype="float16", hidden_states_topk=3
    )
    assert r.hidden_states_position.start == -4 and r.hidden_states_dtype == "float16"
    assert VerifyRequest(prompt="x").hidden_states_position == "completion_end"
    for bad in (
        {"hidden_states_position": "middle"},
        {"hidden_states_dtype": "int8"},
        {"hidden_states_topk": 0},
        {"compare": {"vector": [1.0], "topk": [{"indices": [0], "values": [1.0]}]}},
        {"compare": {}},
        {"compare": {"vector": [1.0]}, "hidden_states_topk": 2},
    ):
        with pytest.raises(ValidationError):
            VerifyRequest(prompt="x", **bad)


def b64(a) -> str:
    return base64.b64encode(np.asarray(a, "<f4").tobytes()).decode()


def test_dense_claims_are_one_row_per_position_of_the_model_s_width():
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    for value in (rows.tolist(), b64(rows)):
        assert np.array_equal(claims(Compare(vectors=value), 3, 4), rows)
        assert np.array_equal(claims(Compare(vector=value), 3, 4), rows)
    assert claims(Compare(vector=rows[0].tolist()), 1, 4).shape == (1, 4)
    for compare, words in (
        (Compare(vectors=rows.tolist()), "compare.vectors has 3 rows; hidden_states_position selects 2 position"),
        (Compare(vectors=[[1.0] * 4, [1.0] * 3]), "compare.vectors row 1 has 3 values"),
        (Compare(vector=b64(rows)), "compare.vector has 12 values; hidden_states_position"),
        (Compare(vector=rows[0].tolist()), "compare.vector is one vector"),
    ):
        with pytest.raises(HiddenStatesRequestError, match=words) as e:
            claims(compare, 2, 4)
        assert e.value.param in ("compare.vector", "compare.vectors") and e.value.param in words


def test_topk_claims_are_checked_per_position():
    ok = {"indices": [2, 0], "values": [3.0, 1.0]}
    assert [i.tolist() for i, _ in claims(Compare(topk=[ok, ok]), 2, 4)] == [[2, 0], [2, 0]]
    for topk, words in (
        ([ok], "has 1 rows; hidden_states_position selects 2"),
        ([ok, {"indices": [1], "values": []}], r"compare.topk\[1\] has 1 indices and 0 values"),
        ([ok, {"indices": [], "values": []}], "is empty"),
        ([ok, {"indices": [0, 1, 2, 3, 0], "values": [1.0] * 5}], "has 5 entries; this model's"),
        ([ok, {"indices": [4], "values": [1.0]}], r"indices must lie in 0..3"),
        ([ok, {"indices": [2**70], "values": [1.0]}], r"indices must lie in 0..3"),
        ([ok, {"indices": [1, 1], "values": [1.0, 1.0]}], "repeats an index"),
    ):
        with pytest.raises(HiddenStatesRequestError, match=words) as e:
            claims(Compare(topk=topk), 2, 4)
        assert e.value.param == "compare.topk"


def test_topk_comparison_needs_the_true_top_k_set_and_close_values():
    true = np.array([0.5, -8.0, 3.0, 0.0, 3.0, -1.0], np.float32)
    honest = topk_comparison(np.array([1, 2]), np.array([-8.0, 3.0]), true, 1e-5)
    assert honest["match"] and honest["index_overlap"] == 1.0 and honest["max_abs_reference"] == 8.0
    tie = topk_comparison(np.array([4, 1]), np.array([3.0, -8.0]), true, 1e-5)  # 2 and 4 tie at the 2nd magnitude
    assert tie["match"] and tie["index_overlap"] == 1.0
    wrong = topk_comparison(np.array([1, 5]), np.array([-8.0, -1.0]), true, 1e-5)  # values true, index not top-2
    assert not wrong["match"] and wrong["index_overlap"] == 0.5 and wrong["relative_error"] == 0.0
    off = topk_comparison(np.array([1, 2]), np.array([-8.0, 3.08]), true, 1e-3)
    assert not off["match"] and off["relative_error"] == pytest.approx(0.08 / 8, rel=1e-4)


def test_per_position_comparison_names_the_worst_position():
    true = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    claim = true.copy()
    claim[2, 5] += 0.5
    c = compared(claim, true, [10, 11, 12, 13], 1e-5, multi=True)
    assert not c["match"] and c["worst_position"] == 12
    assert [r["position"] for r in c["per_position"]] == [10, 11, 12, 13]
    assert [r["match"] for r in c["per_position"]] == [True, True, False, True]
    assert c["worst_relative_error"] == pytest.approx(0.5 / np.abs(true[2]).max(), rel=1e-5)
    assert c["per_position"][2]["max_abs_error"] == pytest.approx(0.5, rel=1e-5)
    assert compared(true, true, [10, 11, 12, 13], 1e-9, multi=True)["match"]
    assert compared(true[:1], true[:1], [13], 1e-5, multi=False) == comparison(true[0], true[0], 1e-5)  # one: as ever
    top = [(np.argsort(-np.abs(r))[:3], r[np.argsort(-np.abs(r))[:3]]) for r in true]
    top[1] = (top[1][0][[0, 1]], top[1][1][[0, 1]])  # a shorter claim is fine: top-2
    top[3] = (np.array([top[3][0][0], top[3][0][1], np.argsort(-np.abs(true[3]))[-1]]), top[3][1])
    t = compared(top, true, [10, 11, 12, 13], 1e-5, multi=True)
    assert not t["match"] and t["worst_position"] == 13 and t["worst_index_overlap"] == pytest.approx(2 / 3)
    assert [r["match"] for r in t["per_position"]] == [True, True, True, False]
