"""LoRA adapters over HTTP and Python handles: the app's `lora_modules`, each served by name.

The app (tests/serve/conftest.py "hs-lora") serves the tiny model and two random,
non-zero adapters; every vector is checked against transformers + peft on the
same adapter, and against the other models, which it must not match. Proofs made on an adapter
pass validation on it and fail on the other models, as the library judges each model's rows.
"""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import Reference
from tests.serve.conftest import decode_vector, tiny_lora_modules

BASE = "tiny-llama"
HS = {"return_hidden_states": True, "return_token_ids": True, "hidden_states_encoding": "base64"}


@pytest.fixture(scope="module")
def refs(model_dir, reference) -> dict[str | None, Reference]:
    return {None: reference, **{m["name"]: Reference(model_dir, m["path"]) for m in tiny_lora_modules()}}


@pytest.fixture
def lora_client(lora_app):
    return openai.OpenAI(base_url=f"{lora_app}/v1", api_key="unused", timeout=120, max_retries=0)


def assert_adapters(refs, model: str | None, token_ids, vector) -> None:
    """`model`'s oracle (transformers + peft) matches, no other model's does."""
    err, scale = refs[model].assert_matches(list(token_ids), vector)
    print(f"{model or BASE}: {len(token_ids)} tokens, max abs err {err:.3g}, max|ref| {scale:.3g}")
    for other, ref in refs.items():
        if other != model:
            with pytest.raises(AssertionError):
                ref.assert_matches(list(token_ids), vector)


def test_models_lists_the_adapters_with_their_base(lora_app):
    data = httpx.get(f"{lora_app}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in data] == [BASE, "lora-qv", "lora-all"]
    assert data[0]["parent"] is None
    paths = {m["name"]: m["path"] for m in tiny_lora_modules()}
    for card in data[1:]:
        assert card["parent"] == BASE and card["root"] == paths[card["id"]], card


def test_completion_and_chat_on_adapters(lora_client, refs):
    r = lora_client.completions.create(
        model="lora-qv", prompt="The adapter reads a prompt", max_tokens=10, temperature=0, extra_body=HS
    )
    (c,) = r.choices
    assert r.model == "lora-qv"
    assert c.hidden_states_meta["adapter"] == "lora-qv" and c.hidden_states_meta["via"] == "tail", c.hidden_states_meta
    assert_adapters(refs, "lora-qv", c.prompt_token_ids + c.token_ids, decode_vector(c.hidden_states))
    chat = lora_client.chat.completions.create(
        model="lora-all",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=10,
        temperature=0.8,
        seed=5,
        stop=["e"],
        extra_body=HS,
    )  # a stop string: the extraction step, on the adapter
    (ch,) = chat.choices
    assert ch.finish_reason == "stop" and ch.hidden_states_meta["via"] == "extraction", ch
    assert ch.hidden_states_meta["adapter"] == "lora-all", ch.hidden_states_meta
    assert_adapters(refs, "lora-all", chat.prompt_token_ids + ch.token_ids, decode_vector(ch.hidden_states))
    base = lora_client.completions.create(
        model=BASE, prompt="The adapter reads a prompt", max_tokens=10, temperature=0, extra_body=HS
    ).choices[0]
    assert base.hidden_states_meta["adapter"] is None
    assert_adapters(refs, None, base.prompt_token_ids + base.token_ids, decode_vector(base.hidden_states))


def test_hidden_states_route_takes_an_adapter(lora_app, lora_client, refs):
    messages = [{"role": "user", "content": "Verify me."}]
    chat = lora_client.chat.completions.create(
        model="lora-all", messages=messages, max_tokens=8, temperature=0, extra_body=HS
    )
    claimed = decode_vector(chat.choices[0].hidden_states)
    body = {
        "messages": messages,
        "completion": chat.choices[0].token_ids,
        "compare": {"vector": chat.choices[0].hidden_states},
    }
    out = httpx.post(
        f"{lora_app}/v1/hidden_states",
        json={"model": "lora-all", **body, **{"hidden_states_encoding": "base64"}},
        timeout=120,
    ).json()
    assert out["model"] == "lora-all" and out["hidden_states_meta"]["adapter"] == "lora-all", out
    assert out["comparison"]["match"] and out["comparison"]["max_abs_error"] == 0.0, out["comparison"]
    assert out["token_ids"] == chat.prompt_token_ids + chat.choices[0].token_ids
    assert_adapters(refs, "lora-all", out["token_ids"], decode_vector(out["hidden_states"]))
    # The same claim against the base model: it does not match.
    base = httpx.post(f"{lora_app}/v1/hidden_states", json=body, timeout=120).json()
    assert base["model"] == BASE and base["hidden_states_meta"]["adapter"] is None
    assert not base["comparison"]["match"], base["comparison"]
    assert_adapters(refs, None, base["token_ids"], decode_vector(base["hidden_states"]))
    assert not (decode_vector(base["hidden_states"]) == claimed).all()


def test_python_handles_take_an_adapter(lora_app, refs):
    from ray import serve

    from deployments.client import HandleRequestError, complete, verify

    handle = serve.get_app_handle("hs-lora")
    c = complete(handle, "A handle names its adapter", model="lora-qv", max_tokens=8, timeout_s=120)
    ids = c.prompt_token_ids + c.choices[0].token_ids
    assert_adapters(refs, "lora-qv", ids, c.choices[0].hidden_states)
    out = verify(handle, model="lora-qv", prompt=list(ids), timeout_s=120)
    assert (out["hidden_states"] == c.choices[0].hidden_states).all()
    for call in (
        lambda: complete(handle, "x", model="lora-nope", timeout_s=60),
        lambda: verify(handle, model="lora-nope", prompt="x", timeout_s=60),
    ):
        with pytest.raises(HandleRequestError, match="lora-nope.*`tiny-llama`, `lora-qv`, `lora-all`") as e:
            call()
        assert e.value.status == 404


@pytest.mark.parametrize(
    "route, body",
    [
        ("completions", {"prompt": "x"}),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("hidden_states", {"prompt": "x"}),
    ],
)
def test_unknown_adapter_is_404_naming_what_is_served(lora_app, route, body):
    r = httpx.post(f"{lora_app}/v1/{route}", json={"model": "lora-nope", **body}, timeout=60)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["param"] == "model" and "`tiny-llama`, `lora-qv`, `lora-all`" in err["message"], err


def adapter_proofs(
    validate, tl, refs, model: str | None, prompt: list[int], completion: list[int], proofs: list[str]
) -> dict:
    """What a proof proves about an adapter (docs/api.md, Proofs of inference): `model`'s proofs are of
    `model`'s rows (the library accepts them on transformers + peft); validation recomputes with the model
    it names (`validate(name, body)`: POST /v1/hidden_states's comparison), so each model checks them
    against its own rows, proof by proof as the library does on that model's transformers rows. The proof
    names no adapter: only those rows decide. The test adapters move the largest activations beyond
    TOPLOC's tolerance: `model`'s proofs pass on `model` only. The figures, by model."""
    from tests.serve.test_proofs import PROOF, activations, verified

    ids, P = prompt + completion, len(prompt)
    assert all(verified(tl, activations(refs[model], ids, P), proofs)), model
    body = {"prompt": prompt, "completion": completion, "compare": {"toploc": {**PROOF, "proofs": proofs}}}
    figures = {}
    for other, ref in refs.items():
        name = other or BASE
        comparison = validate(name, body)
        lib = verified(tl, activations(ref, ids, P), proofs)
        assert [p["ok"] for p in comparison["proofs"]] == lib, (model, name, comparison, lib)
        assert comparison["ok"] is (other == model), (model, name, comparison)
        figures[name] = [(p["exp_mismatches"], round(p["mant_err_mean"], 1)) for p in comparison["proofs"]]
    return figures


def test_proofs_on_an_adapter_are_the_adapter_s(lora_client, lora_app, refs):
    """hidden_states_proof with `model` an adapter: the proofs are of the adapter's activations (the
    library accepts them on transformers + peft), and the server validates them on the model the
    validation names: the adapter passes them; the base model and the other adapter reject them, as the
    library does on their rows. The base model's proofs: rejected by an adapter the same way."""
    from tests.serve.test_proofs import PROOF
    from tests.toploc_ref import load_toploc

    tl = load_toploc()

    def validate(name: str, body: dict) -> dict:
        r = httpx.post(f"{lora_app}/v1/hidden_states", json={"model": name, **body}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["hidden_states_meta"]["adapter"] == (None if name == BASE else name), r.json()
        return r.json()["comparison"]

    for model in ("lora-all", None):
        r = lora_client.completions.create(
            model=model or BASE,
            prompt="An adapter proves its work",
            max_tokens=24,
            temperature=0,
            extra_body={"hidden_states_proof": PROOF, "return_token_ids": True},
        )
        (c,) = r.choices
        figures = adapter_proofs(
            validate, tl, refs, model, list(c.prompt_token_ids), list(c.token_ids), c.hidden_states_proof["proofs"]
        )
        print(
            f"{model or BASE}'s proofs (exponent mismatches, mean mantissa error per proof), validated on each "
            f"model: {figures}"
        )


def test_adapter_proof_checks_fail_against_a_broken_validation(refs, monkeypatch):
    """The breaking variant, without Serve: the check above against the route's validation on each
    model's transformers (+ peft) rows passes; with that validation broken (accepting every proof, never
    looking at the rows, ignoring the thresholds: tests/unit/test_proofs.py) it fails."""
    from tests.serve.test_proofs import PROOF, activations, stand_in_server
    from tests.toploc_ref import load_toploc
    from tests.unit.test_proofs import BROKEN_VALIDATION

    tl = load_toploc()
    servers = {other or BASE: stand_in_server(ref) for other, ref in refs.items()}
    prompt = refs[None].tokenizer("An adapter proves its work")["input_ids"]
    completion = [int(t) for t in np.random.default_rng(6).integers(5, 250, 24)]
    proofs = tl.build_proofs_base64(
        activations(refs["lora-all"], prompt + completion, len(prompt)), PROOF["decode_batching_size"], PROOF["topk"]
    )
    adapter_proofs(lambda name, body: servers[name](body), tl, refs, "lora-all", prompt, completion, proofs)
    for _, breaks in sorted(BROKEN_VALIDATION.items()):
        with monkeypatch.context() as m:
            breaks(m)
            with pytest.raises(AssertionError):
                adapter_proofs(lambda name, body: servers[name](body), tl, refs, "lora-all", prompt, completion, proofs)
