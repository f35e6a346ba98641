"""TOPLOC proofs through Serve (HTTP and the openai client): built on the server for completions
and chat, streamed and not, n > 1; checked against the real toploc library on transformers'
activations; validated by POST /v1/hidden_states, which agrees with the library. Unknown fields
of ours are refused by name."""

from __future__ import annotations

import httpx
import pytest

from hidden_states.proofs import toploc as ours
from tests.toploc_ref import fed_rows, library_ok, load_toploc

MODEL = "tiny-llama"
MSGS = [{"role": "user", "content": "Prove what you say about proofs"}]
PROOF = {"scheme": "toploc", "topk": 128, "decode_batching_size": 8}  # small windows: several proofs per choice


@pytest.fixture(scope="module")
def tl():
    return load_toploc()


def activations(reference, ids: list[int], prompt_len: int):
    return fed_rows(reference.model, ids, prompt_len)


def verified(tl, acts, proofs) -> list[bool]:
    return library_ok(tl, acts, proofs, PROOF["decode_batching_size"], PROOF["topk"])


def check(base: str, body: dict) -> dict:
    r = httpx.post(f"{base}/v1/hidden_states", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_completions_carry_proofs_the_library_accepts_and_the_server_validates(serve_app, client, reference, tl):
    out = client.completions.create(model=MODEL, prompt="Proofs of inference, built where the rows are",
                                    max_tokens=30, n=2, temperature=1.0, seed=3,
                                    extra_body={"hidden_states_proof": PROOF, "return_token_ids": True})
    prompt_ids = list(out.choices[0].prompt_token_ids)
    P = len(prompt_ids)
    for choice in out.choices:
        proof = choice.hidden_states_proof
        assert proof["scheme"] == "toploc" and proof["index"] == 0
        assert not hasattr(choice, "hidden_states") or choice.hidden_states is None  # rows are not returned
        ids = prompt_ids + list(choice.token_ids)
        assert len(proof["proofs"]) == len(ours.chunk_bounds(P, len(ids), 8)) >= 4
        assert all(verified(tl, activations(reference, ids, P), proof["proofs"])), choice.index
        assert choice.hidden_states_meta["proofs"] == len(proof["proofs"])
        # The server's validation: honest passes; another completion, another prompt fail.
        body = {"prompt": prompt_ids, "completion": list(choice.token_ids),
                "compare": {"toploc": {**PROOF, "proofs": proof["proofs"]}}}
        honest = check(serve_app, body)["comparison"]
        assert honest["ok"] is True and len(honest["proofs"]) == len(proof["proofs"]), honest
        assert "hidden_states" not in check(serve_app, body)
        other = out.choices[1 - choice.index].token_ids
        if list(other) != list(choice.token_ids) and len(other) == len(choice.token_ids):
            bad = check(serve_app, {**body, "completion": list(other)})["comparison"]
            lib = verified(tl, activations(reference, prompt_ids + list(other), P), proof["proofs"])
            assert [p["ok"] for p in bad["proofs"]] == lib and not all(lib), bad
        tampered = [prompt_ids[0], (prompt_ids[1] + 1) % 256, *prompt_ids[2:]]
        bad = check(serve_app, {**body, "prompt": tampered})["comparison"]
        lib = verified(tl, activations(reference, tampered + list(choice.token_ids), P), proof["proofs"])
        assert [p["ok"] for p in bad["proofs"]] == lib and not lib[0], bad  # the prefill's proof fails


def test_a_streamed_chat_carries_each_window_once_decided(serve_app, client, reference, tl):
    kw = dict(model=MODEL, messages=MSGS, max_tokens=40, temperature=0.0,
              extra_body={"hidden_states_proof": PROOF, "return_token_ids": True})
    whole = client.chat.completions.create(**kw)
    got, token_ids, chunks_with_proofs = [], [], 0
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            extra = c.model_extra or {}
            token_ids += extra.get("token_ids") or []
            if "hidden_states_proof" in extra:
                p = extra["hidden_states_proof"]
                assert p["index"] == len(got)  # in order, each once
                got += p["proofs"]
                chunks_with_proofs += 1
    assert token_ids == list(whole.choices[0].token_ids)
    prompt_ids = list(whole.prompt_token_ids)
    ids = prompt_ids + token_ids
    assert len(got) == len(ours.chunk_bounds(len(prompt_ids), len(ids), 8)) and chunks_with_proofs >= 3
    assert all(verified(tl, activations(reference, ids, len(prompt_ids)), got))
    assert all(verified(tl, activations(reference, ids, len(prompt_ids)), whole.choices[0].hidden_states_proof["proofs"]))
    comparison = check(serve_app, {"messages": MSGS, "completion": token_ids,
                                   "compare": {"toploc": {**PROOF, "proofs": got}}})["comparison"]
    assert comparison["ok"] is True, comparison


@pytest.mark.parametrize("body,param,words", [
    ({"hidden_states_proof": {"scheme": "toploc", "topk": 4096}}, "hidden_states_proof", "hidden size"),
    ({"hidden_states_proof": {"scheme": "mine"}}, "hidden_states_proof", "scheme"),
    ({"hidden_states_proof": {}, "return_hidden_states": True}, "hidden_states_proof", "cannot be combined"),
    ({"hidden_states_prof": {}}, "hidden_states_prof", "unknown field"),
])
def test_bad_proof_requests_are_400_naming_the_field(serve_app, body, param, words):
    r = httpx.post(f"{serve_app}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_bad_proofs_to_validate_are_400_saying_what_is_wrong(serve_app):
    ids = list(range(5, 25))
    base = {"prompt": ids[:10], "completion": ids[10:]}
    for proofs, words in ((["AAAA"], "proofs has 1 proofs"), (["not base64!"] * 3, "not base64"),
                          (["AAAA"] * 3, "holds 3 bytes")):
        r = httpx.post(f"{serve_app}/v1/hidden_states", timeout=60,
                       json={"model": MODEL, **base, "compare": {"toploc": {**PROOF, "proofs": proofs}}})
        assert r.status_code == 400 and words in r.json()["error"]["message"], (proofs, r.text)
        assert r.json()["error"]["param"] == "compare.toploc.proofs"


def test_a_python_handle_gets_the_proofs_http_gets(serve_app, client, reference, tl):
    from ray import serve

    from deployments.client import complete
    from tests.serve.conftest import APP

    prompt = "A handle asks for proofs"
    c = complete(serve.get_app_handle(APP), prompt, max_tokens=20, hidden_states_proof=PROOF, timeout_s=120)
    (ch,) = c.choices
    assert ch.hidden_states is None and ch.proofs
    ids = list(c.prompt_token_ids) + list(ch.token_ids)
    assert len(ch.proofs) == len(ours.chunk_bounds(len(c.prompt_token_ids), len(ids), 8))
    assert all(verified(tl, activations(reference, ids, len(c.prompt_token_ids)), list(ch.proofs)))
    http = client.completions.create(model=MODEL, prompt=list(c.prompt_token_ids), max_tokens=20, temperature=0.0,
                                     extra_body={"hidden_states_proof": PROOF})
    assert http.choices[0].hidden_states_proof["proofs"] == list(ch.proofs)  # the same request, the same proofs
