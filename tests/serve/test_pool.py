"""hidden_states_pool "mean" through Ray Serve: the openai client over HTTP (whole, base64, streamed, chat), a
Python deployment handle, and 400s naming the field. Each mean is numpy's mean of transformers' rows on the
choice's own prompt + completion token ids."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import post
from tests.serve.conftest import APP
from tests.serve.test_positions import decode

PROMPT = "A pooled vector of the whole completion"
POOL = {"return_hidden_states": True, "return_token_ids": True, "hidden_states_pool": "mean"}


def reference_mean(reference, ids, start: int, layer: int = -1) -> tuple[np.ndarray, float]:
    """(numpy's mean of transformers' hidden_states[layer] rows start.., the rows' max |value|)."""
    with reference.torch.no_grad():
        out = reference.model(reference.torch.tensor([list(ids)]), output_hidden_states=True)
    rows = out.hidden_states[layer][0].float().numpy()[start:]
    return rows.mean(axis=0), float(np.abs(rows).max())


def assert_mean(got, ref_scale) -> float:
    ref, scale = ref_scale
    err = float(np.abs(np.asarray(got, np.float32) - ref).max())
    assert err <= 1e-5 * scale, f"max abs error {err:.3g} (max |reference| {scale:.3g})"
    return err / scale


def test_a_pooled_completion_over_http_float_base64_and_streamed(client, reference):
    kw = dict(model="tiny-llama", prompt=PROMPT, max_tokens=10, n=2, temperature=1.0, seed=9)
    extra = {**POOL, "hidden_states_position": "completion", "hidden_states_layers": [1, -1]}
    f = client.completions.create(**kw, extra_body=extra)
    b = client.completions.create(**kw, extra_body={**extra, "hidden_states_encoding": "base64"})
    stream = client.completions.create(**kw, stream=True, extra_body=extra)
    streamed: dict[int, dict] = {}
    for chunk in stream:
        for ch in chunk.choices:
            got = ch.model_extra or {}
            if "hidden_states_by_layer" in got:
                assert ch.finish_reason is not None and ch.index not in streamed  # on the final chunk, once
                streamed[ch.index] = got["hidden_states_by_layer"]
    worst = 0.0
    for fc, bc in zip(f.choices, b.choices):
        assert fc.token_ids == bc.token_ids
        ids, start = fc.prompt_token_ids + fc.token_ids, len(fc.prompt_token_ids)
        meta = fc.hidden_states_meta
        assert meta["pool"] == "mean" and meta["pooled_rows"] == len(ids) - start and meta["shape"] == [128]
        assert meta["bytes"] == 2 * 128 * 4 and "positions" not in meta and meta["via"] == "tail"
        for layer in (1, -1):
            vec = fc.hidden_states_by_layer[str(layer)]
            worst = max(worst, assert_mean(vec, reference_mean(reference, ids, start, layer)))
            np.testing.assert_array_equal(decode(bc.hidden_states_by_layer[str(layer)], "float32"), vec)
            assert streamed[fc.index][str(layer)] == vec
    print(f"pool over HTTP: worst relative error {worst:.2e}")


def test_a_pooled_chat_completion(client, reference):
    r = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=0.0,
        extra_body={**POOL, "hidden_states_position": "all"},
    )
    (ch,) = r.choices
    extra = ch.model_extra or {}
    ids = r.model_extra["prompt_token_ids"] + extra["token_ids"]
    assert ch.hidden_states_meta["pooled_rows"] == len(ids)
    assert_mean(ch.hidden_states, reference_mean(reference, ids, 0))


def test_a_pooled_completion_over_a_handle_is_the_http_answer(serve_app, reference):
    from ray import serve

    from deployments.client import complete

    handle = serve.get_app_handle(APP)
    c = complete(handle, PROMPT, max_tokens=10, hidden_states_pool="mean", hidden_states_position="completion")
    (ch,) = c.choices
    ids, start = list(c.prompt_token_ids) + list(ch.token_ids), len(c.prompt_token_ids)
    assert ch.pool == len(ids) - start and ch.positions is None and ch.hidden_states.shape == (128,)
    assert_mean(ch.hidden_states, reference_mean(reference, ids, start))
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, **POOL}
    http = post(serve_app, "/v1/completions", body).json()
    assert http["choices"][0]["hidden_states_meta"]["position"] == "completion_end"  # the default: one row
    http = post(serve_app, "/v1/completions", {**body, "hidden_states_position": "completion"}).json()
    np.testing.assert_array_equal(np.asarray(http["choices"][0]["hidden_states"], np.float32), ch.hidden_states)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"hidden_states_pool": "sum"}, "hidden_states_pool must be 'mean'"),
        ({"hidden_states_pool": "mean", "hidden_states_topk": 8}, "cannot be combined with hidden_states_topk"),
        ({"hidden_states_pool": "mean", "hidden_states_heads": ["mid"]}, "cannot be combined with hidden_states_heads"),
    ],
)
def test_a_bad_pool_is_a_400_naming_the_field_streaming_or_not(serve_app, fields, message):
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 4, "return_hidden_states": True, **fields}
    for stream in (False, True):
        r = post(serve_app, "/v1/completions", {**body, "stream": stream}, timeout=60)
        assert r.status_code == 400, (stream, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == "hidden_states_pool" and message in err["message"], err
