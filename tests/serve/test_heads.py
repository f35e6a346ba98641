"""Heads over the real app (every tiny-Llama app registers the test heads: tests/heads_ref.py).

Over HTTP with the openai client: completions with n = 2 and a streamed chat, their head outputs
against SAELens's `encode` and numpy on transformers' rows of each choice's own tokens, and the
same requests without heads unchanged; /v1/models lists the heads; a Python handle; a LoRA
adapter's requests (its own rows: transformers + peft); n-gram speculative decoding; TP = 2.
"""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import Reference
from tests.heads_ref import TINY_TOPK_K, build_test_heads, check_heads
from tests.serve.conftest import APP, tiny_lora_modules

MODEL = "tiny-llama"
ASK = [
    {"name": "sae-std", "topk": 24},
    "sae-topk",
    {"name": "sae-jump", "topk": 24},
    {"name": "sae-gated", "topk": 24},
    "probe",
    "mid",
]
ASKED = {"sae-std": 24, "sae-topk": TINY_TOPK_K, "sae-jump": 24, "sae-gated": 24, "probe": 0, "mid": 0}
ERRORS: list = []


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    for case, diff, scale in ERRORS:
        print(f"  {case}: max abs error {diff:.3g}, max |reference| {scale:.3g}")


def states(reference, ids) -> list[np.ndarray]:
    with reference.torch.no_grad():
        out = reference.model(reference.torch.tensor([list(ids)]), output_hidden_states=True)
    return [h[0].float().numpy() for h in out.hidden_states]


def test_models_lists_the_heads(serve_app):
    data = httpx.get(f"{serve_app}/v1/models", timeout=30).json()["data"]
    heads = {h["name"]: h for h in data[0]["heads"]}
    assert set(heads) == {h["name"] for h in build_test_heads()}
    assert heads["sae-topk"] == {
        "name": "sae-topk",
        "kind": "sae",
        "layer": 2,
        "width": 1024,
        "architecture": "topk",
        "hook": "ln_final.hook_normalized",
        "default_topk": TINY_TOPK_K,
    }
    assert heads["probe"]["labels"] == ["neg", "neutral", "pos"] and heads["mid"]["layer"] == 1


def test_completions_n2_and_a_streamed_chat_over_http(client, reference):
    heads = build_test_heads()
    body = dict(model=MODEL, prompt="The heads read the rows of", max_tokens=8, n=2, temperature=1.0, seed=11)
    plain = client.completions.create(**body, extra_body={"return_token_ids": True})
    r = client.completions.create(
        **body,
        extra_body={"return_token_ids": True, "hidden_states_heads": ASK, "hidden_states_position": "completion"},
    )
    for a, b in zip(plain.choices, r.choices):
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
        assert getattr(b, "hidden_states", None) is None
        ids = b.prompt_token_ids + b.token_ids
        positions = b.hidden_states_meta["positions"]
        assert positions == list(range(len(b.prompt_token_ids), len(ids)))
        check_heads(
            f"http choice {b.index}", b.hidden_states_heads, states(reference, ids), positions, heads, ASKED, ERRORS
        )
    assert plain.usage == r.usage

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Read me."}],
        max_tokens=8,
        stream=True,
        extra_body={"return_token_ids": True, "hidden_states_heads": ["probe", "sae-topk"]},
    )
    prompt_ids, tokens, outs = None, [], None
    for chunk in stream:
        extra = chunk.model_extra or {}
        prompt_ids = extra.get("prompt_token_ids") or prompt_ids
        for ch in chunk.choices:
            tokens += (ch.model_extra or {}).get("token_ids") or []
            outs = (ch.model_extra or {}).get("hidden_states_heads") or outs
    ids = prompt_ids + tokens
    check_heads(
        "streamed chat (final token)",
        outs,
        states(reference, ids),
        [len(ids) - 1],
        heads,
        {"probe": 0, "sae-topk": TINY_TOPK_K},
        ERRORS,
    )


def _greedy_stop(
    client,
    reference,
    model: str = MODEL,
    prompt: str = "a b a b a b a b",
    head: str = "mid",
    index: int = 0,
    case: str = "",
) -> None:
    """A greedy request with a stop condition whose threshold the plain greedy completion's reference
    scores (numpy or SAELens on transformers' rows) first cross mid-completion at p, clear of the band: the
    monitored completion is the plain one's tokens up to p (under n-gram drafts, cut inside a block of
    accepted drafts where p falls in one), finish "stop", stop_reason and meta.stop naming p."""
    from tests.engine.test_heads import reference_scores
    from tests.heads_ref import crossing

    body = dict(model=model, prompt=prompt, max_tokens=12, temperature=0)
    plain = client.completions.create(**body, extra_body={"return_token_ids": True}).choices[0]
    P, ids = len(plain.prompt_token_ids), plain.prompt_token_ids + plain.token_ids
    scores = reference_scores(reference, build_test_heads(), ids, head, index)
    p, t = crossing(scores, P, True)
    (b,) = client.completions.create(
        **body,
        extra_body={"return_token_ids": True, "hidden_states_stop": [{"head": head, "feature": index, "above": t}]},
    ).choices
    assert b.token_ids == plain.token_ids[: p + 1 - P], (case, p, b.token_ids, plain.token_ids)
    assert (b.finish_reason, b.stop_reason) == ("stop", "hidden_states_stop[0]"), case
    assert b.hidden_states_meta["stop"]["position"] == p, (case, b.hidden_states_meta)
    ERRORS.append(
        (f"{case} stop score", abs(b.hidden_states_meta["stop"]["score"] - scores[p]), float(np.abs(scores).max()))
    )
    assert abs(b.hidden_states_meta["stop"]["score"] - scores[p]) <= 1e-5 * np.abs(scores).max()


def test_stop_conditions_over_http_n2_and_a_bad_head(client, reference):
    """Two sampled choices under a stop condition: each that stopped on it ends at the first position its
    own tokens' reference scores cross (none earlier, beyond the band); one that ran to max_tokens never
    crossed. A greedy stop mid-completion; an unknown head is a 400 naming the field."""
    from tests.engine.test_heads import reference_scores
    from tests.heads_ref import crossing

    _greedy_stop(client, reference, prompt="The heads read the rows of", case="router")
    heads = build_test_heads()
    plain = client.completions.create(
        model=MODEL, prompt="The monitor reads", max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    ).choices[0]
    P = len(plain.prompt_token_ids)
    scores = reference_scores(reference, heads, plain.prompt_token_ids + plain.token_ids, "mid", 0)
    _, t = crossing(scores, P, True)
    r = client.completions.create(
        model=MODEL,
        prompt="The monitor reads",
        max_tokens=12,
        n=2,
        temperature=1.0,
        seed=7,
        extra_body={"return_token_ids": True, "hidden_states_stop": [{"head": "mid", "feature": 0, "above": t}]},
    )
    for b in r.choices:
        mine = reference_scores(reference, heads, b.prompt_token_ids + b.token_ids, "mid", 0)[P:]
        band = 1e-5 * np.abs(mine).max()
        if b.stop_reason == "hidden_states_stop[0]":
            assert b.finish_reason == "stop" and mine[-1] > t - band and np.all(mine[:-1] <= t + band), (mine, t)
            assert b.hidden_states_meta["stop"]["position"] == P + len(b.token_ids) - 1
        else:
            assert b.hidden_states_meta["stop"] is None and np.all(mine <= t + band), (mine, t)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL,
            prompt="x",
            max_tokens=2,
            extra_body={"hidden_states_stop": [{"head": "nope", "feature": 0, "above": 1}]},
        )
    assert "hidden_states_stop" in str(e.value) and "unknown head 'nope'" in str(e.value)


def test_a_python_handle_gets_the_same_outputs(serve_app, reference):
    from ray import serve

    from deployments.client import complete

    c = complete(
        serve.get_app_handle(APP),
        "A handle reads heads",
        max_tokens=6,
        return_hidden_states=False,
        hidden_states_heads=["probe", {"name": "sae-std", "topk": 8}],
        timeout_s=120,
    )
    (ch,) = c.choices
    assert ch.hidden_states is None
    ids = list(c.prompt_token_ids) + list(ch.token_ids)
    check_heads(
        "handle",
        ch.heads,
        states(reference, ids),
        [len(ids) - 1],
        build_test_heads(),
        {"probe": 0, "sae-std": 8},
        ERRORS,
    )
    # a stop condition that holds on the first completion row (a softmax score is above 0): one token
    c = complete(
        serve.get_app_handle(APP),
        "A handle reads heads",
        max_tokens=6,
        return_hidden_states=False,
        hidden_states_stop=[{"head": "probe", "label": "pos", "above": 0.0}],
        timeout_s=120,
    )
    (ch,) = c.choices
    assert len(ch.token_ids) == 1 and ch.finish_reason == "stop" and ch.stop_asked
    assert ch.stop["position"] == len(c.prompt_token_ids) and ch.stop["label"] == "pos", ch.stop


def test_an_adapter_s_requests_read_the_adapter_s_rows(lora_app, model_dir):
    client = openai.OpenAI(base_url=f"{lora_app}/v1", api_key="unused", timeout=120, max_retries=0)
    adapter = tiny_lora_modules()[1]
    r = client.completions.create(
        model=adapter["name"],
        prompt="The adapter's heads",
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "hidden_states_heads": ASK, "hidden_states_position": "all"},
    )
    (b,) = r.choices
    ids = b.prompt_token_ids + b.token_ids
    hs = states(Reference(model_dir, adapter["path"]), ids)
    check_heads("lora", b.hidden_states_heads, hs, list(range(len(ids))), build_test_heads(), ASKED, ERRORS)
    with pytest.raises(AssertionError):  # the base model's rows give other outputs
        check_heads(
            "lora vs base",
            b.hidden_states_heads,
            states(Reference(model_dir), ids),
            list(range(len(ids))),
            build_test_heads(),
            {"probe": 0},
            None,
        )
    _greedy_stop(
        client, Reference(model_dir, adapter["path"]), model=adapter["name"], prompt="The adapter's heads", case="lora"
    )


def _drafted_and_parallel(base: str, case: str, reference) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
    for prompt in ("a b a b a b a b", "one two three one two three one"):
        r = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"return_token_ids": True, "hidden_states_heads": ASK, "hidden_states_position": "completion"},
        )
        (b,) = r.choices
        ids = b.prompt_token_ids + b.token_ids
        check_heads(
            f"{case} {prompt[:8]!r}",
            b.hidden_states_heads,
            states(reference, ids),
            b.hidden_states_meta["positions"],
            build_test_heads(),
            ASKED,
            ERRORS,
        )
    _greedy_stop(client, reference, case=case)


def test_speculative_decoding(spec_app, reference):
    """n-gram drafts: the outputs of accepted tokens' rows only, each the target's."""
    _drafted_and_parallel(spec_app, "spec", reference)


def test_tensor_parallelism(tp2_app, reference):
    """TP = 2: the output rank runs the heads over its rows (the same after the all-reduce)."""
    _drafted_and_parallel(tp2_app, "tp2", reference)
