"""POST /v1/hidden_states, the verifier's way in: true vectors for given tokens (checked against
transformers), and a comparison that passes honest claims and fails tampered ones; rows of many
positions (every position, the completion's, a strided window; float16, top-k) and per-position
claims, dense and top-k, checked against transformers' rows."""

from __future__ import annotations

import base64
import concurrent.futures

import numpy as np
import pytest

from tests.conftest import long_text
from tests.helpers import post
from tests.serve.conftest import API_KEY, APP, GUARDED_ROWS_BYTES, decode_vector, post_hidden_states, replica_stats
from tests.serve.test_positions import assert_close, decode, reference_rows

MODEL = "tiny-llama"
MSGS = [{"role": "user", "content": "Check every row of this answer"}]
ANSWER = "Every row is checked, one position at a time."


def test_prompt_text_vector_matches_transformers(serve_app, reference):
    r = post_hidden_states(serve_app, {"prompt": "A verifier recomputes the vector"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["token_ids"] == reference.tokenizer("A verifier recomputes the vector")["input_ids"]
    reference.assert_matches(body["token_ids"], decode_vector(body["hidden_states"]))
    assert body["hidden_states_meta"]["via"] == "extraction" and "comparison" not in body


def test_a_chat_completion_verifies_against_its_own_vector(serve_app, client, reference):
    """The verifier's loop: a claimed chat completion (its token ids and vector) checked here."""
    msgs = [{"role": "user", "content": "Check me"}]
    done = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=10,
        temperature=1.0,
        seed=4,
        extra_body={"return_hidden_states": True, "return_token_ids": True},
    )
    claimed_ids, claimed_vec = done.choices[0].token_ids, done.choices[0].hidden_states
    honest = post_hidden_states(
        serve_app, {"messages": msgs, "completion": claimed_ids, "compare": {"vector": claimed_vec}}
    ).json()
    assert honest["token_ids"] == done.prompt_token_ids + claimed_ids
    assert honest["comparison"]["match"] is True and honest["comparison"]["relative_error"] <= 1e-5, honest[
        "comparison"
    ]
    assert honest["comparison"]["cosine_similarity"] > 0.999999
    reference.assert_matches(honest["token_ids"], decode_vector(honest["hidden_states"]))

    tampered = np.asarray(claimed_vec, np.float32).copy()
    tampered[3] += 0.5
    b64 = base64.b64encode(tampered.astype("<f4").tobytes()).decode()
    bad = post_hidden_states(
        serve_app, {"messages": msgs, "completion": claimed_ids, "compare": {"vector": b64}}
    ).json()
    assert bad["comparison"]["match"] is False and bad["comparison"]["max_abs_error"] == pytest.approx(0.5, rel=1e-3)
    # A different completion claimed with the honest vector: caught too.
    other = post_hidden_states(
        serve_app, {"messages": msgs, "completion": claimed_ids[:-1], "compare": {"vector": claimed_vec}}
    ).json()
    assert other["comparison"]["match"] is False


def test_32_concurrent_checks(serve_app, reference):
    seqs = [reference.tokenizer(long_text(20 + i, seed=200 + i))["input_ids"] for i in range(32)]
    truth = [reference.last_hidden(ids) for ids in seqs]

    def one(i):
        claim = truth[i] if i % 2 == 0 else truth[(i + 1) % 32]  # half honest, half someone else's vector
        return post_hidden_states(
            serve_app, {"prompt": seqs[i], "compare": {"vector": claim.tolist(), "tolerance": 1e-4}}
        )

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
    # rows over the handle: numpy [n, D] in the dtype asked, and top-k as numpy indices and values
    want = list(range(len(ids)))[1::2]
    ref = reference_rows(reference, ids, want)
    half = verify(
        serve.get_app_handle(APP),
        prompt=ids,
        hidden_states_position={"start": 1, "stride": 2},
        hidden_states_dtype="float16",
        timeout_s=120,
    )
    assert half["hidden_states"].dtype == np.float16 and half["hidden_states"].shape == (len(want), 128)
    assert half["hidden_states_meta"]["positions"] == want
    assert_close(
        half["hidden_states"].astype(np.float32), ref.astype(np.float16).astype(np.float32), rtol=2**-10, atol=None
    )
    top = verify(
        serve.get_app_handle(APP), prompt=ids, hidden_states_position="all", hidden_states_topk=4, timeout_s=120
    )["hidden_states"]
    full = reference_rows(reference, ids, range(len(ids)))
    assert top["indices"].shape == top["values"].shape == (len(ids), 4)
    assert_close(top["values"], np.take_along_axis(full, top["indices"].astype(np.int64), axis=1))
    assert (np.sort(np.abs(top["values"]), axis=1)[:, 0] >= np.sort(np.abs(full), axis=1)[:, -5] - 1e-6).all()


def rows_of(body: dict, dtype: str = "float32") -> np.ndarray:
    """The answer's rows [n, D] (floats, or base64 of `dtype`)."""
    hs, meta = body["hidden_states"], body["hidden_states_meta"]
    return (decode(hs, dtype) if isinstance(hs, str) else np.asarray(hs, np.float32)).reshape(meta["shape"])


def answer(reference) -> list[int]:
    return reference.tokenizer(ANSWER, add_special_tokens=False)["input_ids"]


def test_every_position_and_the_completion_s_rows_match_transformers(serve_app, reference):
    comp = answer(reference)
    body = {"messages": MSGS, "completion": comp}
    every = post_hidden_states(serve_app, {**body, "hidden_states_position": "all"})
    assert every.status_code == 200, every.text
    every = every.json()
    ids = every["token_ids"]
    n, start = len(ids), len(ids) - len(comp)
    assert ids[start:] == comp
    meta = every["hidden_states_meta"]
    assert meta["positions"] == list(range(n)) and meta["shape"] == [n, 128] and meta["position"] == "all", meta
    assert meta["dtype"] == "float32" and meta["bytes"] == n * 128 * 4 and meta["tokens"] == n
    ref = reference_rows(reference, ids, range(n))
    assert_close(rows_of(every), ref)
    # "completion": the positions of the completion's tokens, here as base64 of the row-major array
    done = post_hidden_states(
        serve_app, {**body, "hidden_states_position": "completion", "hidden_states_encoding": "base64"}
    ).json()
    meta = done["hidden_states_meta"]
    assert done["token_ids"] == ids and meta["positions"] == list(range(start, n)) and meta["shape"] == [n - start, 128]
    assert_close(rows_of(done), ref[start:])
    # "prompt_end": the last token before the completion, one vector, from a prefill of the prompt alone
    end = post_hidden_states(serve_app, {**body, "hidden_states_position": "prompt_end"}).json()
    assert end["hidden_states_meta"]["position"] == "prompt_end" and end["hidden_states_meta"]["tokens"] == start
    reference.assert_matches(ids[:start], decode_vector(end["hidden_states"]))
    # the default is the final token's vector, as ever
    default = post_hidden_states(serve_app, body).json()
    meta = default["hidden_states_meta"]
    assert meta["position"] == "completion_end" and meta["shape"] == [128] and len(default["hidden_states"]) == 128
    reference.assert_matches(ids, decode_vector(default["hidden_states"]))


def test_a_strided_window_in_float16_and_top_k_match_transformers_cast_and_selected_alike(serve_app, reference):
    ids = reference.tokenizer(long_text(60, seed=31))["input_ids"]
    window, want = {"start": 3, "end": -5, "stride": 7}, list(range(len(ids)))[3:-5:7]
    ref = reference_rows(reference, ids, want)
    half = post_hidden_states(
        serve_app,
        {
            "prompt": ids,
            "hidden_states_position": window,
            "hidden_states_dtype": "float16",
            "hidden_states_encoding": "base64",
        },
    ).json()
    meta = half["hidden_states_meta"]
    assert meta["positions"] == want and meta["shape"] == [len(want), 128] and meta["dtype"] == "float16", meta
    assert meta["bytes"] == len(want) * 128 * 2 and meta["position"] == window
    assert meta["tokens"] == want[-1] + 1  # the prefill stops at the last row asked for
    # transformers' float32 rows cast to float16: within one float16 step (2^-10 of the largest entry)
    assert_close(rows_of(half, "float16"), ref.astype(np.float16).astype(np.float32), rtol=2**-10, atol=None)
    top = post_hidden_states(
        serve_app, {"prompt": ids, "hidden_states_position": window, "hidden_states_topk": 6}
    ).json()
    meta = top["hidden_states_meta"]
    assert meta["shape"] == [len(want), 6] and meta["topk"] == 6 and meta["bytes"] == len(want) * 6 * (4 + 4)
    indices = np.asarray([r["indices"] for r in top["hidden_states"]])
    values = np.asarray([r["values"] for r in top["hidden_states"]], np.float32)
    at = np.take_along_axis(ref, indices, axis=-1)
    assert_close(values, at)
    sixth = -np.sort(-np.abs(ref), axis=-1)[:, 5:6]  # each transformers row's 6th largest magnitude
    assert (np.abs(at) >= sixth).all()  # the indices are transformers' top 6


def test_per_position_compare_passes_transformers_rows_and_names_a_tampered_one(serve_app, reference):
    comp = answer(reference)
    body = {"messages": MSGS, "completion": comp, "hidden_states_position": "completion"}
    ids = post_hidden_states(serve_app, body).json()["token_ids"]
    positions = list(range(len(ids) - len(comp), len(ids)))
    claim = reference_rows(reference, ids, positions)  # the claim: transformers' rows
    honest = post_hidden_states(serve_app, {**body, "compare": {"vectors": claim.tolist()}}).json()["comparison"]
    assert honest["match"] is True and honest["tolerance"] == 1e-5, honest
    assert [r["position"] for r in honest["per_position"]] == positions
    assert all(r["match"] for r in honest["per_position"])
    assert honest["worst_relative_error"] == max(r["relative_error"] for r in honest["per_position"]) <= 1e-5
    print(
        f"per-position compare vs transformers: worst relative error {honest['worst_relative_error']:.3g} at "
        f"position {honest['worst_position']} ({len(positions)} positions)"
    )
    tampered = claim.copy()
    tampered[2, 7] += 0.5
    b64 = base64.b64encode(tampered.astype("<f4").tobytes()).decode()  # base64 of the row-major [n, D] array
    bad = post_hidden_states(serve_app, {**body, "compare": {"vector": b64}}).json()["comparison"]
    assert bad["match"] is False and bad["worst_position"] == positions[2], bad
    assert [r["match"] for r in bad["per_position"]] == [i != 2 for i in range(len(positions))]
    assert bad["per_position"][2]["max_abs_error"] == pytest.approx(0.5, rel=1e-3)
    # float16 rows are compared with the claim as the true rows cast to float16
    half = post_hidden_states(
        serve_app,
        {
            **body,
            "hidden_states_dtype": "float16",
            "compare": {"vectors": claim.astype(np.float16).astype(np.float32).tolist(), "tolerance": 2**-10},
        },
    ).json()
    assert half["comparison"]["match"] is True, half["comparison"]
    assert half["comparison"]["worst_relative_error"] <= 2**-10
    assert np.array_equal(rows_of(half), rows_of(half).astype(np.float16).astype(np.float32))  # the cast rows


def test_topk_compare_checks_the_index_set_per_position(serve_app, reference):
    ids = reference.tokenizer(long_text(30, seed=32))["input_ids"]
    body, k = {"prompt": ids, "hidden_states_position": {"start": -8}}, 8
    positions = list(range(len(ids) - 8, len(ids)))
    ref = reference_rows(reference, ids, positions)
    order = np.argsort(-np.abs(ref), axis=-1)
    claims = [{"indices": o[:k].tolist(), "values": r[o[:k]].tolist()} for o, r in zip(order, ref)]  # transformers'
    honest = post_hidden_states(serve_app, {**body, "compare": {"topk": claims}}).json()["comparison"]
    assert honest["match"] is True and honest["worst_index_overlap"] == 1.0, honest
    assert all(r["index_overlap"] == 1.0 and r["relative_error"] <= 1e-5 for r in honest["per_position"])
    # row 5 claims an index outside the top 8, with its true value: the index set fails it
    outside = int(order[5, k + 3])
    claims[5] = {
        "indices": claims[5]["indices"][:-1] + [outside],
        "values": claims[5]["values"][:-1] + [float(ref[5, outside])],
    }
    bad = post_hidden_states(serve_app, {**body, "compare": {"topk": claims}}).json()["comparison"]
    assert bad["match"] is False and bad["worst_position"] == positions[5], bad
    assert bad["worst_index_overlap"] == (k - 1) / k and bad["per_position"][5]["relative_error"] <= 1e-5
    assert [r["match"] for r in bad["per_position"]] == [i != 5 for i in range(8)]


@pytest.mark.parametrize(
    "body, words",
    [
        ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "exactly one of"),
        ({}, "exactly one of"),
        ({"prompt": "x", "completion": "y"}, "goes with `messages`"),
        (
            {"messages": MSGS, "completion": "The capital of France is Paris.", "compare": {"vector": [0.0] * 128}},
            "send `completion` as the choice's `token_ids`",
        ),
        ({"prompt": [1, 2, 99999]}, "outside the vocabulary"),
        ({"prompt": list(range(5, 700)) * 6}, "max_model_len"),
        ({"prompt": "x", "compare": {"vector": [1.0, 2.0]}}, "has 2 values"),
        ({"prompt": "x", "compare": {"vector": "not base64!"}}, "base64"),
        ({"prompt": "x", "hidden_states_layers": [99]}, "out of range"),
        ({"prompt": "x", "hidden_states_position": "completion"}, "send `messages` with a `completion`"),
        ({"messages": MSGS, "hidden_states_position": "completion"}, "send `messages` with a `completion`"),
        ({"prompt": [1, 2, 3], "hidden_states_position": {"start": 5}}, "selects no position of the 3 given tokens"),
        ({"prompt": [1, 2, 3], "hidden_states_position": {"start": 2, "end": 1}}, "end (1) must come after start (2)"),
        ({"prompt": "x", "hidden_states_dtype": "int8"}, "hidden_states_dtype must be"),
        ({"prompt": "x", "hidden_states_topk": 129}, "exceeds the model's hidden size (128)"),
        (
            {"prompt": [1, 2, 3], "hidden_states_position": "all", "compare": {"vectors": [[0.0] * 128] * 2}},
            "compare.vectors has 2 rows; hidden_states_position selects 3 position(s)",
        ),
        (
            {
                "prompt": [1, 2, 3],
                "hidden_states_position": "all",
                "compare": {"vector": [[0.0] * 128] * 2 + [[0.0] * 127]},
            },
            "compare.vector row 2 has 127 values; this model's vectors have 128",
        ),
        (
            {
                "prompt": [1, 2, 3],
                "hidden_states_position": "all",
                "compare": {"topk": [{"indices": [0], "values": [1.0]}]},
            },
            "compare.topk has 1 rows; hidden_states_position selects 3",
        ),
        (
            {
                "prompt": [1, 2, 3],
                "hidden_states_position": {"start": -1},
                "compare": {"topk": [{"indices": [128], "values": [1.0]}]},
            },
            "compare.topk[0] indices must lie in 0..127",
        ),
        ({"prompt": "x", "hidden_states_topk": 4, "compare": {"vector": [0.0] * 128}}, "against the whole rows"),
        ({"prompt": "x", "compare": {"vector": [1.0], "vectors": [[1.0]]}}, "exactly one of `compare.vector`"),
    ],
)
def test_bad_requests_are_400s_that_say_why(serve_app, body, words):
    r = post_hidden_states(serve_app, body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    if words.startswith("compare."):  # the claim's field is named
        assert r.json()["error"]["param"] == words.split(" ")[0].split("[")[0]


BOUND = GUARDED_ROWS_BYTES  # max_hidden_states_bytes of the guarded app: 10 float32 rows (the others keep the default)
KEY = {"authorization": f"Bearer {API_KEY}"}


def test_rows_above_max_hidden_states_bytes_are_a_400_before_any_engine_work(guarded_app, reference):
    """On the guarded app (its max_hidden_states_bytes is BOUND; the replica its own ingress, with a key)."""
    bounded_app = guarded_app
    ids = reference.tokenizer(long_text(30, seed=33))["input_ids"][:11]
    before = replica_stats(bounded_app, KEY)["replica"]["extractions"]
    for body in (
        {"prompt": ids, "hidden_states_position": "all"},  # 11 rows x 128 x 4 bytes
        {"prompt": ids[:6], "hidden_states_position": "all", "hidden_states_layers": [0, -1]},  # 12 rows
        {"prompt": ids, "hidden_states_position": "all", "compare": {"vectors": [[0.0] * 128] * 10}},
    ):
        r = post_hidden_states(bounded_app, body, headers=KEY)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] in ("hidden_states_position", "compare.vectors"), err
    refused = post_hidden_states(bounded_app, {"prompt": ids, "hidden_states_position": "all"}, headers=KEY)
    assert "max_hidden_states_bytes (5120)" in refused.text
    assert replica_stats(bounded_app, KEY)["replica"]["extractions"] == before  # no engine work
    for body in (
        {"prompt": ids[:10], "hidden_states_position": "all"},  # exactly at the bound
        {"prompt": ids, "hidden_states_position": "all", "hidden_states_dtype": "bfloat16"},
        {"prompt": ids},  # one vector: not rows, as ever
        {"prompt": ids, "hidden_states_position": {"start": 1}},
    ):  # 10 rows
        r = post_hidden_states(bounded_app, body, headers=KEY)
        assert r.status_code == 200, r.text
    assert_close(rows_of(r.json()), reference_rows(reference, ids, range(1, 11)))


def test_switched_off_server_refuses(off_app):
    """One place decides (the engine's frontend, hidden_states/vllm/frontend/openai.py): over HTTP through the
    Router and over the app's handle, the same 400, with no engine work."""
    from ray import serve

    from deployments.client import HandleRequestError, verify

    before = replica_stats(off_app)["replica"]["extractions"]
    r = post(off_app, "/v1/hidden_states", {"prompt": "x"}, timeout=60)  # no model
    assert r.status_code == 400 and "enable_return_hidden_states" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "return_hidden_states"
    with pytest.raises(HandleRequestError, match="enable_return_hidden_states") as e:
        verify(serve.get_app_handle("hs-off"), prompt="x", timeout_s=60)
    assert e.value.status == 400
    assert replica_stats(off_app)["replica"]["extractions"] == before
