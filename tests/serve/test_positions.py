"""Rows across the whole completion over real HTTP (issue 24): hidden_states_position "completion"
and ranges, float and base64, streamed rows, top-k, the memory bound. Rows are checked against
transformers on the choice's own prompt_token_ids + token_ids."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np

HS = {"return_hidden_states": True, "return_token_ids": True}
PROMPT = "The router sends every completion to a replica"


def reference_rows(reference, ids, positions) -> np.ndarray:
    with reference.torch.no_grad():
        out = reference.model(reference.torch.tensor([list(ids)]), output_hidden_states=True)
    return out.hidden_states[-1][0].float().numpy()[list(positions)]


def assert_close(rows, ref, rtol=1e-5, atol: float | None = 1e-4):
    diff, scale = float(np.abs(np.asarray(rows, np.float32) - ref).max()), float(np.abs(ref).max())
    assert diff <= rtol * scale and (atol is None or diff <= atol), (
        f"max abs error {diff:.3g} (max |reference| {scale:.3g})"
    )


def decode(value: str, dtype: str) -> np.ndarray:
    raw = base64.b64decode(value)
    if dtype == "bfloat16":
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, {"float32": "<f4", "float16": "<f2", "int32": "<i4"}[dtype]).astype(np.float32)


def test_completion_rows_as_floats_and_base64(client, reference):
    kw = dict(model="tiny-llama", prompt=PROMPT, max_tokens=10, temperature=0.0)
    f = client.completions.create(**kw, extra_body={**HS, "hidden_states_position": "completion"})
    b = client.completions.create(
        **kw, extra_body={**HS, "hidden_states_position": "completion", "hidden_states_encoding": "base64"}
    )
    (fc,), (bc,) = f.choices, b.choices
    assert fc.token_ids == bc.token_ids
    ids, start = fc.prompt_token_ids + fc.token_ids, len(fc.prompt_token_ids)
    n = len(ids) - start
    for ch in (fc, bc):
        meta = ch.hidden_states_meta
        assert meta["positions"] == list(range(start, len(ids))) and meta["shape"] == [n, 128], meta
        assert meta["dtype"] == "float32" and meta["bytes"] == n * 128 * 4 and meta["position"] == "completion"
        assert meta["via"] == "tail" and meta["tokens"] == len(ids)
    rows = np.asarray(fc.hidden_states, dtype=np.float32)
    assert rows.shape == (n, 128)
    assert_close(rows, reference_rows(reference, ids, range(start, len(ids))))
    assert isinstance(bc.hidden_states, str)
    np.testing.assert_array_equal(decode(bc.hidden_states, "float32").reshape(n, 128), rows)


def test_streamed_rows_concatenate_to_the_whole_response(client, reference):
    kw = dict(model="tiny-llama", prompt=PROMPT, max_tokens=12, n=2, temperature=1.0, seed=5)
    extra = {**HS, "hidden_states_position": {"start": 3, "stride": 2}}
    whole = client.completions.create(**kw, extra_body=extra)
    stream = client.completions.create(**kw, stream=True, extra_body=extra)
    positions, rows, chunks_with_rows, tokens = {0: [], 1: []}, {0: [], 1: []}, {0: 0, 1: 0}, {0: [], 1: []}
    for chunk in stream:
        for ch in chunk.choices:
            got = ch.model_extra or {}
            tokens[ch.index] += got.get("token_ids") or []
            if "hidden_states" in got:
                meta = got["hidden_states_meta"]
                assert len(got["hidden_states"]) == len(meta["positions"]) and meta["shape"][0] == len(
                    meta["positions"]
                )
                positions[ch.index] += meta["positions"]
                rows[ch.index] += got["hidden_states"]
                chunks_with_rows[ch.index] += 1
    for ch in whole.choices:
        i, ids = ch.index, ch.prompt_token_ids + ch.token_ids
        assert tokens[i] == ch.token_ids
        assert chunks_with_rows[i] >= 3, chunks_with_rows  # rows come as they are computed, not all at the end
        assert positions[i] == ch.hidden_states_meta["positions"] == list(range(len(ids)))[3::2]
        np.testing.assert_allclose(
            np.asarray(rows[i], np.float32), np.asarray(ch.hidden_states, np.float32), rtol=0, atol=1e-5
        )
        assert_close(np.asarray(rows[i], np.float32), reference_rows(reference, ids, positions[i]))


def test_topk_rows(client, reference):
    kw = dict(model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=0.0)
    extra = {**HS, "hidden_states_position": {"start": -4}, "hidden_states_topk": 5, "hidden_states_dtype": "bfloat16"}
    f = client.completions.create(**kw, extra_body=extra).choices[0]
    b = client.completions.create(**kw, extra_body={**extra, "hidden_states_encoding": "base64"}).choices[0]
    ids = f.prompt_token_ids + f.token_ids
    meta = f.hidden_states_meta
    assert meta["positions"] == list(range(len(ids) - 4, len(ids))) and meta["shape"] == [4, 5]
    assert meta["dtype"] == "bfloat16" and meta["topk"] == 5 and meta["bytes"] == 4 * 5 * (2 + 4)
    assert len(f.hidden_states) == 4 and all(len(r["indices"]) == len(r["values"]) == 5 for r in f.hidden_states)
    indices = np.asarray([r["indices"] for r in f.hidden_states])
    values = np.asarray([r["values"] for r in f.hidden_states], np.float32)
    ref = reference_rows(reference, ids, meta["positions"])
    # the values at those indices (bfloat16: 8 bits of mantissa), largest |value| first
    assert_close(values, np.take_along_axis(ref, indices, axis=-1), rtol=2**-8, atol=None)
    assert (np.diff(np.abs(values), axis=-1) <= 0).all()
    assert set(b.hidden_states) == {"indices", "values"} and b.hidden_states_meta["shape"] == [4, 5]
    np.testing.assert_array_equal(decode(b.hidden_states["indices"], "int32").reshape(4, 5), indices)
    np.testing.assert_array_equal(decode(b.hidden_states["values"], "bfloat16").reshape(4, 5), values)


def test_a_request_above_the_memory_bound_is_a_400_streaming_or_not(serve_app):
    # up to 4,095 positions x 3 layers x 128 x 4 bytes x 16 choices = 100 MB > 64 MiB (the default)
    body = {
        "model": "tiny-llama",
        "prompt": PROMPT,
        "max_tokens": 4000,
        "n": 16,
        "temperature": 1.0,
        "return_hidden_states": True,
        "hidden_states_position": "all",
        "hidden_states_layers": [-1, 0, 1],
    }
    for stream in (False, True):
        r = httpx.post(f"{serve_app}/v1/completions", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 400, (stream, r.text[:300])
        err = json.loads(r.text)["error"]
        assert err["param"] == "hidden_states_position" and "max_hidden_states_bytes" in err["message"], err
    bad = httpx.post(
        f"{serve_app}/v1/completions",
        timeout=60,
        json={
            "model": "tiny-llama",
            "prompt": PROMPT,
            "return_hidden_states": True,
            "hidden_states_position": {"start": 4, "end": 2},
        },
    )
    assert bad.status_code == 400 and json.loads(bad.text)["error"]["param"] == "hidden_states_position"
