"""Heads on the device (hidden_states/heads.py) against the libraries people use.

One engine (module scope) on the built-in tiny Llama (D = 128, 2 decoder layers) with an SAE
of each SAELens architecture, 8x wider than D (1,024 features), made and saved by SAELens at
each kind of hook point, and two linear heads. Every output is judged against SAELens's own
`encode` (or numpy) on transformers' hidden states of the same tokens at the same hook
(tests/heads_ref.py: relative 1e-5 of the largest |reference|, float32).
"""

from __future__ import annotations


import numpy as np
import pytest

from tests.conftest import TEST_ENGINE_ARGS, TEST_MODEL, eager_only, engine_fixture, openai_answer
from tests.heads_ref import TINY_F as F
from tests.heads_ref import TINY_TOPK_K as TOPK_K
from tests.heads_ref import build_test_heads, check_heads

# On a GPU (compiled, CUDA graphs) these run in tests/engine/test_compiled.py, on an engine with capture_layers.
pytestmark = eager_only

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,"]
ERRORS: list[tuple[str, float, float]] = []


@pytest.fixture(scope="module")
def heads():
    return build_test_heads()


engine = engine_fixture(setup=lambda heads: {"heads": heads}, errors=ERRORS, **TEST_ENGINE_ARGS)


def sp(**kw):
    from vllm import SamplingParams

    kw.setdefault("max_tokens", 10)
    kw.setdefault("temperature", 0.0)
    return SamplingParams(**kw)


def states(reference, ids) -> list[np.ndarray]:
    """transformers' hidden_states: per layer [T, D]."""
    with reference.torch.no_grad():
        out = reference.model(reference.torch.tensor([list(ids)]), output_hidden_states=True)
    return [h[0].float().numpy() for h in out.hidden_states]


def check(case: str, hs_heads: dict, ids, positions, heads, reference, asked: dict) -> None:
    check_heads(case, hs_heads, states(reference, ids), positions, heads, asked, ERRORS)


ALL = {"sae-std": 32, "sae-topk": TOPK_K, "sae-jump": 32, "sae-gated": 32, "probe": 0, "mid": 0}
ASK = [{"name": n, "topk": 32} if n in ("sae-std", "sae-jump", "sae-gated") else n for n in ALL]


def test_every_head_at_the_final_token_alone_no_rows(engine, loop_thread, reference, heads):
    """Heads alone (no return_hidden_states): the final token's outputs from the tail step, and no rows."""
    out = loop_thread.run(engine.complete(PROMPTS[0], sp(), return_hidden_states=False, heads=ASK))
    ch = out.choices[0]
    assert ch.hidden_states is None and ch.hidden_states_by_layer is None
    ids = list(out.prompt_token_ids) + list(ch.token_ids)
    assert ch.extraction.via == "tail"
    check("completion_end", ch.heads, ids, [len(ids) - 1], heads, reference, ALL)


def test_heads_and_rows_across_the_completion_n2(engine, loop_thread, reference, heads):
    """Rows and heads in one request, at every completion position, for two sampled choices."""
    out = loop_thread.run(engine.complete(PROMPTS[1], sp(n=2, temperature=1.0, seed=3), heads=ASK,
                                          position="completion"))
    assert len({tuple(c.token_ids) for c in out.choices}) == 2
    for ch in out.choices:
        ids = list(out.prompt_token_ids) + list(ch.token_ids)
        positions = list(range(len(out.prompt_token_ids), len(ids)))
        assert list(ch.positions) == positions
        ref = states(reference, ids)[-1][positions]
        assert np.abs(ch.hidden_states - ref).max() <= 1e-5 * np.abs(ref).max()
        check(f"completion choice {ch.index}", ch.heads, ids, positions, heads, reference, ALL)


def test_an_sae_without_topk_gives_its_own_k_and_the_extraction_step_the_same(engine, loop_thread, reference, heads):
    """topk omitted: a top-k SAE's own k (every nonzero feature); a stop string (the extraction
    step computes the final row) gives the heads' outputs of that row too."""
    out = loop_thread.run(engine.complete(PROMPTS[0], sp(max_tokens=12, stop=["zzzz"]), return_hidden_states=False,
                                          heads=["sae-topk", "probe"], position="all"))
    ch = out.choices[0]
    assert ch.extraction.via == "extraction"
    ids = list(out.prompt_token_ids) + list(ch.token_ids)
    check("all", ch.heads, ids, list(range(len(ids))), heads, reference, {"sae-topk": TOPK_K, "probe": 0})
    assert all(len(p["indices"]) <= TOPK_K for p in ch.heads["sae-topk"])


def _answer(engine, loop_thread, route: str, body: dict):
    return openai_answer(engine, loop_thread, route, body)


def test_completions_chat_and_streams_over_the_openai_routes(engine, loop_thread, reference, heads):
    """vLLM's OpenAI serving: completions (n = 2) and a streamed chat whose chunks carry each
    position's head outputs as they come; with and without heads, everything else the same."""
    body = {"model": "tiny-llama", "prompt": PROMPTS[1], "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 5,
            "return_token_ids": True, "logprobs": 2}
    status, plain = _answer(engine, loop_thread, "completions", body)
    status2, r = _answer(engine, loop_thread, "completions", {**body, "hidden_states_heads": ASK})
    assert status == status2 == 200, r
    for a, b in zip(plain["choices"], r["choices"]):
        extra = {k: b.pop(k) for k in ("hidden_states_heads", "hidden_states_meta")}
        assert "hidden_states" not in b and a == b
        ids = b["prompt_token_ids"] + b["token_ids"]
        check(f"http choice {b['index']}", extra["hidden_states_heads"], ids, [len(ids) - 1], heads,
                    reference, ALL)
        assert extra["hidden_states_meta"]["head_bytes"] > 0
    assert plain["usage"] == r["usage"]

    status, events = _answer(engine, loop_thread, "chat", {
        "model": "tiny-llama", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 10,
        "stream": True, "return_token_ids": True, "hidden_states_position": "all",
        "hidden_states_heads": [{"name": "sae-std", "topk": 8}, "probe"]})
    assert status == 200
    prompt_ids, tokens, positions, outs, carrying = None, [], [], {"sae-std": [], "probe": []}, 0
    for event in events:
        prompt_ids = event.get("prompt_token_ids") or prompt_ids
        for ch in event.get("choices") or ():
            tokens += ch.get("token_ids") or []
            if "hidden_states_heads" in ch:
                carrying += 1
                assert "hidden_states" not in ch
                positions += ch["hidden_states_meta"]["positions"]
                for name in outs:
                    outs[name] += ch["hidden_states_heads"][name]
    ids = prompt_ids + tokens
    assert carrying > 1 and positions == list(range(len(ids)))
    check("streamed chat", outs, ids, positions, heads, reference, {"sae-std": 8, "probe": 0})


def test_bad_head_requests_are_refused_by_name(engine, loop_thread):
    from hidden_states.params import HiddenStatesRequestError

    for heads, words in ((["nope"], "unknown head 'nope'"), ([{"name": "probe", "topk": 2}], "linear head"),
                         ([{"name": "sae-std", "topk": F + 1}], "exceeds"), (["probe", "probe"], "twice"),
                         ([], "non-empty")):
        with pytest.raises(HiddenStatesRequestError) as e:
            loop_thread.run(engine.complete(PROMPTS[0], sp(), return_hidden_states=False, heads=heads))
        assert words in str(e.value) and e.value.param == "hidden_states_heads", str(e.value)
    status, r = _answer(engine, loop_thread, "completions", {"model": "tiny-llama", "prompt": "x",
                                                              "hidden_states_heads": ["nope"]})
    assert status == 400 and "sae-std" in r["error"]["message"], r


def test_heads_are_counted_one_product_per_head_per_step(engine, loop_thread):
    """The workers' own counts: head matrix products and rows encoded grow with the requests' positions."""
    before = loop_thread.run(engine.stats())["workers"][0]
    loop_thread.run(engine.complete(PROMPTS[0], sp(max_tokens=4), return_hidden_states=False, heads=["probe"]))
    after = loop_thread.run(engine.stats())["workers"][0]
    assert after["head_rows"] - before["head_rows"] == 1  # the final token's row, once (the tail step)
    assert after["head_products"] - before["head_products"] == 1


def test_a_head_that_does_not_fit_stops_the_start(loop_thread, tmp_path, heads):
    """A head whose width or layer does not fit the model: the engine does not start, and says which."""
    from hidden_states.preflight import EngineStartupError
    from hidden_states.vllm.engine import HiddenStatesEngine
    from tests.heads_ref import make_linear, make_sae

    wide = make_linear(str(tmp_path / "wide.safetensors"), 64, 2, seed=0)
    last = make_sae(str(tmp_path / "last"), "standard", 128, 256, "blocks.1.hook_resid_post", seed=0)
    for entry, words in (({"name": "wide", "path": wide}, "expected [C, 128]"),
                         ({"name": "deep", "path": heads[-1]["path"], "layer": 3}, "layer 3 out of range"),
                         ({"name": "last", "path": last}, "before the final norm")):
        with pytest.raises(EngineStartupError) as e:
            loop_thread.run(HiddenStatesEngine.start(TEST_MODEL, heads=[entry], **TEST_ENGINE_ARGS))
        assert f"head {entry['name']!r}" in str(e.value) and words in str(e.value), str(e.value)


def test_post_hidden_states_gives_a_claimed_sequence_s_true_head_outputs(engine, loop_thread, reference, heads):
    """POST /v1/hidden_states with heads: the given tokens' true outputs, beside their rows."""
    out = loop_thread.run(engine.complete(PROMPTS[1], sp(max_tokens=6)))
    ids = list(out.prompt_token_ids) + list(out.choices[0].token_ids)
    status, r = _answer(engine, loop_thread, "hidden_states", {
        "model": "tiny-llama", "prompt": ids, "hidden_states_position": "all", "hidden_states_heads": ASK})
    assert status == 200, r
    assert r["hidden_states_meta"]["positions"] == list(range(len(ids))) and r["hidden_states_meta"]["head_bytes"] > 0
    check("POST /v1/hidden_states", r["hidden_states_heads"], ids, list(range(len(ids))), heads, reference, ALL)
    status, r = _answer(engine, loop_thread, "hidden_states", {"model": "tiny-llama", "prompt": ids,
                                                                "hidden_states_heads": ["nope"]})
    assert status == 400 and "unknown head 'nope'" in r["error"]["message"], r
