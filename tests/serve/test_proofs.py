"""TOPLOC proofs through Serve (HTTP and the openai client): built on the server for completions
and chat, streamed and not, n > 1; checked against the real toploc library on transformers'
activations; validated by POST /v1/hidden_states, which agrees with the library on honest proofs and
rejects tampered ones (another completion, another prompt, another model, a well-formed proof with a
coefficient altered: `REJECTIONS`, each of which fails against a validation that is broken, shown
without Serve by `test_each_rejection_fails_against_a_broken_validation`). Unknown fields of ours are
refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from hidden_states.proofs import toploc as ours
from tests.helpers import post
from tests.serve.conftest import post_hidden_states
from tests.toploc_ref import (
    ProofChoice,
    a_prompt_token_changed,
    altered_proof,
    another_completion,
    another_model,
    fed_rows,
    honest,
    library_ok,
    load_toploc,
    perturbed,
)

MODEL = "tiny-llama"
MSGS = [{"role": "user", "content": "Prove what you say about proofs"}]
PROOF = {"scheme": "toploc", "topk": 128, "decode_batching_size": 8}  # small windows: several proofs per choice
# Another model: the tiny model's weights with 20% noise. Its random weights have no massive activations
# and TOPLOC's tolerance is wide on them: 5% noise passes every proof (at most 32 exponent mismatches,
# mean mantissa error up to 9.9), 10% fails them all, 20% by a margin (56-82 mismatches, means of 19-30).
OTHER_MODEL_NOISE = 0.2


@pytest.fixture(scope="module")
def tl():
    return load_toploc()


@pytest.fixture(scope="module")
def other_model(reference):
    return perturbed(reference.model, OTHER_MODEL_NOISE)


def activations(reference, ids: list[int], prompt_len: int):
    return fed_rows(reference.model, ids, prompt_len)


def verified(tl, acts, proofs) -> list[bool]:
    return library_ok(tl, acts, proofs, PROOF["decode_batching_size"], PROOF["topk"])


def check(base: str, body: dict) -> dict:
    r = post_hidden_states(base, body, model=MODEL)
    assert r.status_code == 200, r.text
    return r.json()


def proof_choice(validate, tl, reference, other_model, prompt, completion, proofs) -> ProofChoice:
    """One choice to check, `validate` the server's: its verdicts are the library's proof by proof (`exact`); one
    prompt token changed fails the prefill's proof; another model fails every proof; the prefill's proof altered
    one way, the last another."""
    return ProofChoice(
        validate=validate,
        tl=tl,
        proof=PROOF,
        model=reference.model,
        other_model=other_model,
        prompt=prompt,
        completion=completion,
        proofs=proofs,
        exact=True,
        every_proof_of_another_model_fails=True,
        alterations=[("linear", 0), ("exponent", -1)],
        min_exp_mismatches=None,
    )


REJECTIONS = [another_completion, a_prompt_token_changed, another_model, altered_proof]


def test_completions_carry_proofs_the_library_accepts_and_the_server_validates(
    serve_app, client, reference, tl, other_model
):
    out = client.completions.create(
        model=MODEL,
        prompt="Proofs of inference, built where the rows are",
        max_tokens=30,
        n=2,
        temperature=1.0,
        seed=3,
        extra_body={"hidden_states_proof": PROOF, "return_token_ids": True},
    )
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
        # The server's validation: honest passes; each tampered case fails, as the library says.
        c = proof_choice(
            lambda body: check(serve_app, body)["comparison"],
            tl,
            reference,
            other_model,
            prompt_ids,
            choice.token_ids,
            proof["proofs"],
        )
        assert "hidden_states" not in check(serve_app, c.body())
        for case in [honest, *REJECTIONS]:
            case(c)


def stand_in_server(reference):
    """POST /v1/hidden_states's answer to `compare.toploc` without Serve: the route's own steps
    (hidden_states/vllm/frontend/openai.py `_check_proofs`) on transformers' rows, as a float32 engine
    recomputes them: the chunks, then `hidden_states.proofs.check_claim`, looked up when called (so a
    broken one is the one used)."""
    import torch

    import hidden_states.proofs as server

    def validate(body: dict) -> dict:
        claim = server.ProofClaim(**body["compare"]["toploc"])
        ids, P = body["prompt"] + body["completion"], len(body["prompt"])
        rows = torch.cat(fed_rows(reference.model, ids, P)).view(torch.int16).numpy().view(np.uint16)  # bfloat16 bits
        bounds = ours.chunk_bounds(P, len(ids), claim.decode_batching_size)
        assert len(claim.proofs) == len(bounds)
        return server.check_claim(claim, [rows[lo:hi] for lo, hi in bounds])

    return validate


def test_each_rejection_fails_against_a_broken_validation(reference, tl, other_model, monkeypatch):
    """The breaking variants, without Serve: the checks above against the route's validation on
    transformers' rows pass; with that validation broken (tests/unit/test_proofs.py BROKEN_VALIDATION:
    accepting every proof, never looking at the rows, ignoring the thresholds) each fails."""
    from tests.unit.test_proofs import BROKEN_VALIDATION

    prompt = reference.tokenizer("Proofs of inference, built where the rows are")["input_ids"]
    completion = np.random.default_rng(5).integers(5, 250, 30).tolist()
    ids = prompt + completion
    proofs = tl.build_proofs_base64(activations(reference, ids, len(prompt)), 8, 128)  # a server's, as built
    c = proof_choice(stand_in_server(reference), tl, reference, other_model, prompt, completion, proofs)
    for case in [honest, *REJECTIONS]:
        case(c)
    for _, breaks in sorted(BROKEN_VALIDATION.items()):
        with monkeypatch.context() as m:
            breaks(m)
            for case in REJECTIONS:
                with pytest.raises(AssertionError):
                    case(c)


def test_a_streamed_chat_carries_each_window_once_decided(serve_app, client, reference, tl):
    kw = dict(
        model=MODEL,
        messages=MSGS,
        max_tokens=40,
        temperature=0.0,
        extra_body={"hidden_states_proof": PROOF, "return_token_ids": True},
    )
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
    assert all(
        verified(tl, activations(reference, ids, len(prompt_ids)), whole.choices[0].hidden_states_proof["proofs"])
    )
    comparison = check(
        serve_app, {"messages": MSGS, "completion": token_ids, "compare": {"toploc": {**PROOF, "proofs": got}}}
    )["comparison"]
    assert comparison["ok"] is True, comparison


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"hidden_states_proof": {"scheme": "toploc", "topk": 4096}}, "hidden_states_proof", "hidden size"),
        ({"hidden_states_proof": {"scheme": "mine"}}, "hidden_states_proof", "scheme"),
        ({"hidden_states_proof": {}, "return_hidden_states": True}, "hidden_states_proof", "cannot be combined"),
        ({"hidden_states_prof": {}}, "hidden_states_prof", "unknown field"),
    ],
)
def test_bad_proof_requests_are_400_naming_the_field(serve_app, body, param, words):
    r = post(serve_app, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_bad_proofs_to_validate_are_400_saying_what_is_wrong(serve_app):
    ids = list(range(5, 25))
    base = {"prompt": ids[:10], "completion": ids[10:]}
    for proofs, words in (
        (["AAAA"], "proofs has 1 proofs"),
        (["not base64!"] * 3, "not base64"),
        (["AAAA"] * 3, "holds 3 bytes"),
    ):
        r = post_hidden_states(
            serve_app, {**base, "compare": {"toploc": {**PROOF, "proofs": proofs}}}, model=MODEL, timeout=60
        )
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
    http = client.completions.create(
        model=MODEL,
        prompt=list(c.prompt_token_ids),
        max_tokens=20,
        temperature=0.0,
        extra_body={"hidden_states_proof": PROOF},
    )
    assert http.choices[0].hidden_states_proof["proofs"] == list(ch.proofs)  # the same request, the same proofs
