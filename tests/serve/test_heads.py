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
ASK = [{"name": "sae-std", "topk": 24}, "sae-topk", {"name": "sae-jump", "topk": 24}, {"name": "sae-gated", "topk": 24},
       "probe", "mid"]
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
    assert heads["sae-topk"] == {"name": "sae-topk", "kind": "sae", "layer": 2, "width": 1024, "architecture": "topk",
                                 "hook": "ln_final.hook_normalized", "default_topk": TINY_TOPK_K}
    assert heads["probe"]["labels"] == ["neg", "neutral", "pos"] and heads["mid"]["layer"] == 1


def test_completions_n2_and_a_streamed_chat_over_http(client, reference):
    heads = build_test_heads()
    body = dict(model=MODEL, prompt="The heads read the rows of", max_tokens=8, n=2, temperature=1.0, seed=11)
    plain = client.completions.create(**body, extra_body={"return_token_ids": True})
    r = client.completions.create(**body, extra_body={"return_token_ids": True, "hidden_states_heads": ASK,
                                                      "hidden_states_position": "completion"})
    for a, b in zip(plain.choices, r.choices):
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
        assert getattr(b, "hidden_states", None) is None
        ids = b.prompt_token_ids + b.token_ids
        positions = b.hidden_states_meta["positions"]
        assert positions == list(range(len(b.prompt_token_ids), len(ids)))
        check_heads(f"http choice {b.index}", b.hidden_states_heads, states(reference, ids), positions, heads,
                    ASKED, ERRORS)
    assert plain.usage == r.usage

    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Read me."}], max_tokens=8, stream=True,
        extra_body={"return_token_ids": True, "hidden_states_heads": ["probe", "sae-topk"]})
    prompt_ids, tokens, outs = None, [], None
    for chunk in stream:
        extra = chunk.model_extra or {}
        prompt_ids = extra.get("prompt_token_ids") or prompt_ids
        for ch in chunk.choices:
            tokens += (ch.model_extra or {}).get("token_ids") or []
            outs = (ch.model_extra or {}).get("hidden_states_heads") or outs
    ids = prompt_ids + tokens
    check_heads("streamed chat (final token)", outs, states(reference, ids), [len(ids) - 1], heads,
                {"probe": 0, "sae-topk": TINY_TOPK_K}, ERRORS)


def test_a_python_handle_gets_the_same_outputs(serve_app, reference):
    from ray import serve

    from deployments.client import complete

    c = complete(serve.get_app_handle(APP), "A handle reads heads", max_tokens=6, return_hidden_states=False,
                 hidden_states_heads=["probe", {"name": "sae-std", "topk": 8}], timeout_s=120)
    (ch,) = c.choices
    assert ch.hidden_states is None
    ids = list(c.prompt_token_ids) + list(ch.token_ids)
    check_heads("handle", ch.heads, states(reference, ids), [len(ids) - 1], build_test_heads(),
                {"probe": 0, "sae-std": 8}, ERRORS)


def test_an_adapter_s_requests_read_the_adapter_s_rows(lora_app, model_dir):
    client = openai.OpenAI(base_url=f"{lora_app}/v1", api_key="unused", timeout=120, max_retries=0)
    adapter = tiny_lora_modules()[1]
    r = client.completions.create(model=adapter["name"], prompt="The adapter's heads", max_tokens=8, temperature=0,
                                  extra_body={"return_token_ids": True, "hidden_states_heads": ASK,
                                              "hidden_states_position": "all"})
    (b,) = r.choices
    ids = b.prompt_token_ids + b.token_ids
    hs = states(Reference(model_dir, adapter["path"]), ids)
    check_heads("lora", b.hidden_states_heads, hs, list(range(len(ids))), build_test_heads(), ASKED, ERRORS)
    with pytest.raises(AssertionError):  # the base model's rows give other outputs
        check_heads("lora vs base", b.hidden_states_heads, states(Reference(model_dir), ids), list(range(len(ids))),
                    build_test_heads(), {"probe": 0}, None)


def _drafted_and_parallel(base: str, case: str, reference) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
    for prompt in ("a b a b a b a b", "one two three one two three one"):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True, "hidden_states_heads": ASK,
                                                  "hidden_states_position": "completion"})
        (b,) = r.choices
        ids = b.prompt_token_ids + b.token_ids
        check_heads(f"{case} {prompt[:8]!r}", b.hidden_states_heads, states(reference, ids),
                    b.hidden_states_meta["positions"], build_test_heads(), ASKED, ERRORS)


def test_speculative_decoding(spec_app, reference):
    """n-gram drafts: the outputs of accepted tokens' rows only, each the target's."""
    _drafted_and_parallel(spec_app, "spec", reference)


def test_tensor_parallelism(tp2_app, reference):
    """TP = 2: the output rank runs the heads over its rows (the same after the all-reduce)."""
    _drafted_and_parallel(tp2_app, "tp2", reference)
