"""Rows over a Python deployment handle (`deployments.client.complete`) on the real app: positions,
a strided range in float16, top-k, the memory bound. Rows are checked against transformers on the
choice's own prompt + completion token ids, as over HTTP (tests/serve/test_positions.py)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from tests.conftest import eager_only
from tests.serve.conftest import APP
from tests.serve.test_positions import reference_rows

PROMPT = "A handle asks for the rows of every token"


@pytest.fixture
def handle(serve_app):
    from ray import serve

    return serve.get_app_handle(APP)


def relative(rows, ref) -> float:
    """max |rows - ref| / max |ref|: what the tests report."""
    return float(np.abs(np.asarray(rows, np.float32) - ref).max() / np.abs(ref).max())


def test_completion_rows_over_a_handle(handle, reference):
    from deployments.client import complete

    (ch,) = complete(handle, PROMPT, max_tokens=10, hidden_states_position="completion", timeout_s=120).choices
    c = complete(handle, PROMPT, max_tokens=10, timeout_s=120)  # the single vector, as ever
    ids = list(c.prompt_token_ids) + list(ch.token_ids)
    start = len(c.prompt_token_ids)
    assert ch.positions == tuple(range(start, len(ids))) and ch.dtype == "float32"
    assert ch.hidden_states.dtype == np.float32 and ch.hidden_states.shape == (len(ids) - start, 128)
    ref = reference_rows(reference, ids, ch.positions)
    err = relative(ch.hidden_states, ref)
    assert err <= 1e-5 and float(np.abs(ch.hidden_states - ref).max()) <= 1e-4, err
    assert c.choices[0].positions is None and c.choices[0].hidden_states.shape == (128,)
    np.testing.assert_array_equal(c.choices[0].hidden_states, ch.hidden_states[-1])  # the final row is the vector
    print(f"handle rows (completion, float32): worst relative error {err:.2e}")


def test_a_strided_range_in_float16_over_a_handle_is_the_http_route_s(handle, serve_app, reference):
    from deployments.client import complete

    position = {"start": 2, "stride": 3}
    (ch,) = complete(
        handle, PROMPT, max_tokens=12, hidden_states_position=position, hidden_states_dtype="float16", timeout_s=120
    ).choices
    prompt_ids = list(
        complete(handle, PROMPT, max_tokens=1, return_hidden_states=False, timeout_s=120).prompt_token_ids
    )
    ids = prompt_ids + list(ch.token_ids)
    assert ch.positions == tuple(range(len(ids))[2::3]) and ch.dtype == "float16"
    assert ch.hidden_states.dtype == np.float16 and ch.hidden_states.shape == (len(ch.positions), 128)
    ref = reference_rows(reference, ids, ch.positions)
    # the float32 reference cast the same way: at most one float16 step apart (a rounding either side)
    cast = ref.astype(np.float16).astype(np.float32)
    step = np.spacing(np.abs(cast).astype(np.float16)).astype(np.float32)
    assert (np.abs(ch.hidden_states.astype(np.float32) - cast) <= step).all()
    err = relative(ch.hidden_states, ref)
    assert err <= 2**-10, err
    http = httpx.post(
        f"{serve_app}/v1/completions",
        timeout=120,
        json={
            "model": "tiny-llama",
            "prompt": PROMPT,
            "max_tokens": 12,
            "temperature": 0,
            "return_hidden_states": True,
            "hidden_states_position": position,
            "hidden_states_dtype": "float16",
            "hidden_states_encoding": "base64",
        },
    )
    got = http.json()["choices"][0]
    assert got["hidden_states_meta"]["positions"] == list(ch.positions)
    np.testing.assert_array_equal(
        np.frombuffer(base64.b64decode(got["hidden_states"]), "<f2").reshape(-1, 128), ch.hidden_states
    )
    print(f"handle rows (strided range, float16): worst relative error {err:.2e}")


def test_topk_rows_over_a_handle(handle, reference):
    from deployments.client import complete

    (ch,) = complete(
        handle, PROMPT, max_tokens=8, hidden_states_position={"start": -5}, hidden_states_topk=6, timeout_s=120
    ).choices
    prompt_ids = list(
        complete(handle, PROMPT, max_tokens=1, return_hidden_states=False, timeout_s=120).prompt_token_ids
    )
    ids = prompt_ids + list(ch.token_ids)
    assert ch.positions == tuple(range(len(ids) - 5, len(ids)))
    assert ch.hidden_states_indices.dtype == np.int32 and ch.hidden_states.dtype == np.float32
    assert ch.hidden_states_indices.shape == ch.hidden_states.shape == (5, 6)
    ref = reference_rows(reference, ids, ch.positions)
    picked = np.take_along_axis(ref, ch.hidden_states_indices.astype(np.int64), axis=-1)
    err = relative(ch.hidden_states, picked) * np.abs(picked).max() / np.abs(ref).max()
    assert err <= 1e-5 and float(np.abs(ch.hidden_states - picked).max()) <= 1e-4, err
    assert (np.diff(np.abs(ch.hidden_states), axis=-1) <= 0).all()  # largest |value| first
    rest = np.abs(ref)
    np.put_along_axis(rest, ch.hidden_states_indices.astype(np.int64), -np.inf, axis=-1)
    assert (np.abs(picked).min(axis=-1) >= rest.max(axis=-1) - 1e-4).all()  # no larger entry left out
    print(f"handle top-k rows: worst relative error {err:.2e}")


@eager_only  # it asks for layers 0 and 1 too
def test_a_handle_request_above_the_memory_bound_is_a_400(handle):
    from deployments.client import HandleRequestError, complete

    # up to 4,095 positions x 3 layers x 128 x 4 bytes x 16 choices = 100 MB > 64 MiB (the default)
    with pytest.raises(HandleRequestError, match="max_hidden_states_bytes") as e:
        complete(
            handle,
            PROMPT,
            max_tokens=4000,
            n=16,
            temperature=1.0,
            hidden_states_position="all",
            hidden_states_layers=[-1, 0, 1],
            timeout_s=120,
        )
    assert e.value.status == 400
