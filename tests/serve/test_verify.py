"""POST /v1/hidden_states, the verifier's way in: true vectors for given tokens (checked against
transformers), and a comparison that passes honest claims and fails tampered ones."""

from __future__ import annotations

import base64
import concurrent.futures

import httpx
import numpy as np
import pytest

from tests.conftest import long_text
from tests.serve.conftest import APP, decode_vector

MODEL = "tiny-llama"


def post(base: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{base}/v1/hidden_states", json={"model": MODEL, **body}, timeout=timeout)


def test_prompt_text_vector_matches_transformers(serve_app, reference):
    r = post(serve_app, {"prompt": "A verifier recomputes the vector"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["token_ids"] == reference.tokenizer("A verifier recomputes the vector")["input_ids"]
    reference.assert_matches(body["token_ids"], decode_vector(body["hidden_states"]))
    assert body["hidden_states_meta"]["via"] == "extraction" and "comparison" not in body


def test_a_chat_completion_verifies_against_its_own_vector(serve_app, client, reference):
    """The verifier's loop: a claimed chat completion (its token ids and vector) checked here."""
    msgs = [{"role": "user", "content": "Check me"}]
    done = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=1.0, seed=4,
                                          extra_body={"return_hidden_states": True, "return_token_ids": True})
    claimed_ids, claimed_vec = done.choices[0].token_ids, done.choices[0].hidden_states
    honest = post(serve_app, {"messages": msgs, "completion": claimed_ids, "compare": {"vector": claimed_vec}}).json()
    assert honest["token_ids"] == done.prompt_token_ids + claimed_ids
    assert honest["comparison"]["match"] is True and honest["comparison"]["relative_error"] <= 1e-5, honest["comparison"]
    assert honest["comparison"]["cosine_similarity"] > 0.999999
    reference.assert_matches(honest["token_ids"], decode_vector(honest["hidden_states"]))

    tampered = np.asarray(claimed_vec, np.float32).copy()
    tampered[3] += 0.5
    b64 = base64.b64encode(tampered.astype("<f4").tobytes()).decode()
    bad = post(serve_app, {"messages": msgs, "completion": claimed_ids, "compare": {"vector": b64}}).json()
    assert bad["comparison"]["match"] is False and bad["comparison"]["max_abs_error"] == pytest.approx(0.5, rel=1e-3)
    # A different completion claimed with the honest vector: caught too.
    other = post(serve_app, {"messages": msgs, "completion": claimed_ids[:-1], "compare": {"vector": claimed_vec}}).json()
    assert other["comparison"]["match"] is False


def test_32_concurrent_checks(serve_app, reference):
    seqs = [reference.tokenizer(long_text(20 + i, seed=200 + i))["input_ids"] for i in range(32)]
    truth = [reference.last_hidden(ids) for ids in seqs]

    def one(i):
        claim = truth[i] if i % 2 == 0 else truth[(i + 1) % 32]  # half honest, half someone else's vector
        return post(serve_app, {"prompt": seqs[i], "compare": {"vector": claim.tolist(), "tolerance": 1e-4}})

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(32)))
    for i, r in enumerate(results):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["token_ids"] == seqs[i]
        reference.assert_matches(seqs[i], decode_vector(body["hidden_states"]))
        assert body["comparison"]["match"] is (i % 2 == 0), (i, body["comparison"])


def test_layers_and_python_handle(serve_app, reference):
    from ray import serve

    from deployments.client import verify

    ids = reference.tokenizer("Layers over a handle")["input_ids"]
    out = verify(serve.get_app_handle(APP), prompt=ids, hidden_states_layers=[0, 1, -1], timeout_s=120)
    assert out["token_ids"] == ids and sorted(out["hidden_states_by_layer"]) == [-1, 0, 1]
    for layer, vec in out["hidden_states_by_layer"].items():
        assert vec.dtype == np.float32
        reference.assert_matches(ids, vec, layer=layer)


@pytest.mark.parametrize("body, words", [
    ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "exactly one of"),
    ({}, "exactly one of"),
    ({"prompt": "x", "completion": "y"}, "goes with `messages`"),
    ({"prompt": [1, 2, 99999]}, "outside the vocabulary"),
    ({"prompt": list(range(5, 700)) * 6}, "max_model_len"),
    ({"prompt": "x", "compare": {"vector": [1.0, 2.0]}}, "has 2 values"),
    ({"prompt": "x", "compare": {"vector": "not base64!"}}, "base64"),
    ({"prompt": "x", "hidden_states_layers": [99]}, "out of range"),
])
def test_bad_requests_are_400s_that_say_why(serve_app, body, words):
    r = post(serve_app, body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_switched_off_server_refuses(off_app):
    r = httpx.post(f"{off_app}/v1/hidden_states", json={"prompt": "x"}, timeout=60)
    assert r.status_code == 400 and "enable_return_hidden_states" in r.json()["error"]["message"]
