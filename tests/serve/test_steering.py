"""Steering over the real app: the openai client through a Router, a LoRA adapter (transformers +
peft with the same hook), TP = 2, and n-gram speculative decoding (the drafter proposes, the steered
target verifies: the tokens are the steered target's); each with a conditional entry (`when`) too.
Each against tests/steer_ref.py."""

from __future__ import annotations

import base64

import numpy as np
import openai

from tests.conftest import Reference
from tests.serve.conftest import decode_vector, tiny_lora_modules
from tests.steer_ref import steered_greedy, steered_states

MODEL = "tiny-llama"


def _vector(seed: int, norm: float) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=128).astype(np.float32)
    return (v / np.linalg.norm(v) * norm).astype("<f4")


STEER = [
    {"layer": 1, "vector": base64.b64encode(_vector(31, 4.0).tobytes()).decode(), "scale": 1.5},
    {"layer": 0, "vector": base64.b64encode(_vector(32, 2.0).tobytes()).decode(), "positions": "completion"},
]
ENTRIES = [(1, "add", "all", 1.5, _vector(31, 4.0)), (0, "add", "completion", 1.0, _vector(32, 2.0))]


def _check(base: str, reference, model: str = MODEL, prompts=("a b a b a b a b", "The steered replica says")) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
    for prompt in prompts:
        r = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            extra_body={"return_token_ids": True, "return_hidden_states": True, "hidden_states_steering": STEER},
        )
        (ch,) = r.choices
        want = steered_greedy(reference.model, ch.prompt_token_ids, ENTRIES, 10)
        assert ch.token_ids == want, (base, prompt, ch.token_ids, want)
        ids = ch.prompt_token_ids + ch.token_ids
        ref = steered_states(reference.model, ids, ENTRIES, len(ch.prompt_token_ids))[2][-1]
        got = decode_vector(ch.hidden_states)
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), (base, prompt)
        assert [s["layer"] for s in ch.hidden_states_meta["steering"]] == [1, 0]


def _check_when(base: str, reference, model: str = MODEL, prompt: str = "a b a b a b a b") -> None:
    """A conditional entry (`when`: the "mid" probe at layer 1 above a threshold on the row before): the
    tokens, the positions it applied at and the final vector are transformers' deciding position by
    position (tests/steer_ref.py), the threshold picked so some positions apply and some do not."""
    from tests.heads_ref import head_scorer
    from tests.steer_ref import pick_condition

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
    ids = (
        client.completions.create(model=model, prompt=prompt, max_tokens=1, extra_body={"return_token_ids": True})
        .choices[0]
        .prompt_token_ids
    )
    entries = [(1, "add", "completion", 1.0, _vector(33, 4.0))]
    t, tokens, applied, states = pick_condition(reference.model, ids, entries, 10, 1, head_scorer("mid", 0), True)
    r = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        extra_body={
            "return_token_ids": True,
            "return_hidden_states": True,
            "hidden_states_steering": [
                {
                    "layer": 1,
                    "vector": base64.b64encode(_vector(33, 4.0).tobytes()).decode(),
                    "positions": "completion",
                    "when": {"head": "mid", "feature": 0, "above": t},
                }
            ],
        },
    )
    (ch,) = r.choices
    assert ch.token_ids == tokens, (base, ch.token_ids, tokens)
    assert ch.hidden_states_meta["steering"][0]["applied"] == applied[0]
    got, ref = decode_vector(ch.hidden_states), states[2][-1]
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), base


def _check_clamp_and_cap(base: str, reference, prompt: str = "The clamped replica says") -> None:
    """A clamp of an SAE feature and a cap before it: the tokens and the final vector are transformers' with
    SAELens's encode and W_dec in the same hook (tests/steer_ref.py)."""
    import torch
    from sae_lens import SAE

    from tests.heads_ref import build_test_heads

    sae = SAE.load_from_disk({h["name"]: h for h in build_test_heads()}["sae-std"]["path"], device="cpu")
    with torch.no_grad():
        entries = [
            (1, ("clamp", sae, 11, 8.0), "all", 1.0, sae.W_dec[11].numpy()),
            (0, ("cap", 0.5), "all", 1.0, _vector(34, 1.0)),
        ]  # (a compiled engine: one of them a layer)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        extra_body={
            "return_token_ids": True,
            "return_hidden_states": True,
            "hidden_states_steering": [
                {"op": "clamp", "head": "sae-std", "feature": 11, "value": 8.0},
                {"op": "cap", "layer": 0, "vector": base64.b64encode(_vector(34, 1.0).tobytes()).decode(), "max": 0.5},
            ],
        },
    )
    (ch,) = r.choices
    want = steered_greedy(reference.model, ch.prompt_token_ids, entries, 10)
    assert ch.token_ids == want, (base, ch.token_ids, want)
    ref = steered_states(reference.model, ch.prompt_token_ids + ch.token_ids, entries, len(ch.prompt_token_ids))[2][-1]
    assert np.abs(decode_vector(ch.hidden_states) - ref).max() <= 1e-5 * np.abs(ref).max(), base
    assert [s["op"] for s in ch.hidden_states_meta["steering"]] == ["clamp", "cap"]


def test_steering_through_the_router_with_the_openai_client(serve_app, reference):
    _check(serve_app, reference)
    _check_when(serve_app, reference)
    _check_clamp_and_cap(serve_app, reference)


def test_steering_a_lora_adapter(lora_app, model_dir):
    adapter = tiny_lora_modules()[0]
    _check(lora_app, Reference(model_dir, adapter["path"]), model=adapter["name"])
    _check_when(lora_app, Reference(model_dir, adapter["path"]), model=adapter["name"])


def test_steering_under_tensor_parallelism(tp2_app, reference):
    """TP = 2: every rank applies the rows the scheduler's plan names for a conditional entry, and a clamp's
    encoder, carried in the entry."""
    _check(tp2_app, reference)
    _check_when(tp2_app, reference)
    _check_clamp_and_cap(tp2_app, reference)


def test_steering_under_speculative_decoding(spec_app, reference):
    """n-gram drafts: a request with a conditional entry gets none (one completion row a step, each decided)."""
    _check(spec_app, reference)
    _check_when(spec_app, reference)
