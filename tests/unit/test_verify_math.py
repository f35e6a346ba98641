"""The verification API's request rules and arithmetic (hidden_states/verify.py), no engine."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from pydantic import ValidationError

from hidden_states.params import HiddenStatesRequestError
from hidden_states.verify import HiddenStatesRequest, comparison, decode_claimed


def test_one_input_only():
    HiddenStatesRequest(prompt="x")
    HiddenStatesRequest(messages=[{"role": "user", "content": "x"}], completion=[1, 2])
    for bad in ({}, {"prompt": "x", "messages": []}, {"prompt": "x", "completion": "y"}, {"prompt": []},
                {"prompt": "x", "compare": {"vector": [1.0]}, "hidden_states_layers": [0]}, {"prompt": "x", "n": 2}):
        with pytest.raises(ValidationError):
            HiddenStatesRequest(**bad)


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
