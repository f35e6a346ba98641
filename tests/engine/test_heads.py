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

from tests.conftest import TEST_ENGINE_ARGS, TEST_MODEL, eager_only, engine_fixture, openai_answer, sampling
from tests.heads_ref import TINY_F as F
from tests.heads_ref import TINY_TOPK_K as TOPK_K
from tests.heads_ref import build_test_heads, check_heads, crossing

# On a GPU (compiled, CUDA graphs) these run in tests/engine/test_compiled.py, on an engine with capture_layers.
pytestmark = eager_only

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,"]
ERRORS: list[tuple[str, float, float]] = []


@pytest.fixture(scope="module")
def heads():
    return build_test_heads()


engine = engine_fixture(setup=lambda heads: {"heads": heads}, errors=ERRORS, **TEST_ENGINE_ARGS)


sp = sampling(max_tokens=10)  # greedy SamplingParams; keywords override


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
    out = loop_thread.run(
        engine.complete(PROMPTS[1], sp(n=2, temperature=1.0, seed=3), heads=ASK, position="completion")
    )
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
    out = loop_thread.run(
        engine.complete(
            PROMPTS[0],
            sp(max_tokens=12, stop=["zzzz"]),
            return_hidden_states=False,
            heads=["sae-topk", "probe"],
            position="all",
        )
    )
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
    body = {
        "model": "tiny-llama",
        "prompt": PROMPTS[1],
        "max_tokens": 8,
        "n": 2,
        "temperature": 1.0,
        "seed": 5,
        "return_token_ids": True,
        "logprobs": 2,
    }
    status, plain = _answer(engine, loop_thread, "completions", body)
    status2, r = _answer(engine, loop_thread, "completions", {**body, "hidden_states_heads": ASK})
    assert status == status2 == 200, r
    for a, b in zip(plain["choices"], r["choices"]):
        extra = {k: b.pop(k) for k in ("hidden_states_heads", "hidden_states_meta")}
        assert "hidden_states" not in b and a == b
        ids = b["prompt_token_ids"] + b["token_ids"]
        check(f"http choice {b['index']}", extra["hidden_states_heads"], ids, [len(ids) - 1], heads, reference, ALL)
        assert extra["hidden_states_meta"]["head_bytes"] > 0
    assert plain["usage"] == r["usage"]

    status, events = _answer(
        engine,
        loop_thread,
        "chat",
        {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 10,
            "stream": True,
            "return_token_ids": True,
            "hidden_states_position": "all",
            "hidden_states_heads": [{"name": "sae-std", "topk": 8}, "probe"],
        },
    )
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

    for heads, words in (
        (["nope"], "unknown head 'nope'"),
        ([{"name": "probe", "topk": 2}], "linear head"),
        ([{"name": "sae-std", "topk": F + 1}], "exceeds"),
        (["probe", "probe"], "twice"),
        ([], "non-empty"),
    ):
        with pytest.raises(HiddenStatesRequestError) as e:
            loop_thread.run(engine.complete(PROMPTS[0], sp(), return_hidden_states=False, heads=heads))
        assert words in str(e.value) and e.value.param == "hidden_states_heads", str(e.value)
    status, r = _answer(
        engine, loop_thread, "completions", {"model": "tiny-llama", "prompt": "x", "hidden_states_heads": ["nope"]}
    )
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
    for entry, words in (
        ({"name": "wide", "path": wide}, "expected [C, 128]"),
        ({"name": "deep", "path": heads[-1]["path"], "layer": 3}, "layer 3 out of range"),
        ({"name": "last", "path": last}, "before the final norm"),
    ):
        with pytest.raises(EngineStartupError) as e:
            loop_thread.run(HiddenStatesEngine.start(TEST_MODEL, heads=[entry], **TEST_ENGINE_ARGS))
        assert f"head {entry['name']!r}" in str(e.value) and words in str(e.value), str(e.value)


def test_post_hidden_states_gives_a_claimed_sequence_s_true_head_outputs(engine, loop_thread, reference, heads):
    """POST /v1/hidden_states with heads: the given tokens' true outputs, beside their rows."""
    out = loop_thread.run(engine.complete(PROMPTS[1], sp(max_tokens=6)))
    ids = list(out.prompt_token_ids) + list(out.choices[0].token_ids)
    status, r = _answer(
        engine,
        loop_thread,
        "hidden_states",
        {"model": "tiny-llama", "prompt": ids, "hidden_states_position": "all", "hidden_states_heads": ASK},
    )
    assert status == 200, r
    assert r["hidden_states_meta"]["positions"] == list(range(len(ids))) and r["hidden_states_meta"]["head_bytes"] > 0
    check("POST /v1/hidden_states", r["hidden_states_heads"], ids, list(range(len(ids))), heads, reference, ALL)
    status, r = _answer(
        engine, loop_thread, "hidden_states", {"model": "tiny-llama", "prompt": ids, "hidden_states_heads": ["nope"]}
    )
    assert status == 400 and "unknown head 'nope'" in r["error"]["message"], r


# -- stop conditions (hidden_states_stop): a head's output judged in the engine on every completion row --


def reference_scores(reference, heads, ids, name: str, index: int) -> np.ndarray:
    """Head `name`'s output `index` at every position of `ids`: SAELens's encode or numpy on transformers' rows."""
    from tests.heads_ref import HEAD_LAYERS, linear_reference, sae_reference

    head = {h["name"]: h for h in heads}[name]
    rows = states(reference, ids)[HEAD_LAYERS[name]]
    if name.startswith("sae"):
        return sae_reference(head["path"], rows)[:, index].astype(np.float64)
    return linear_reference(head["path"], head.get("activation", "none"), rows)[:, index]


STOP_CASES = {
    "probe label below": ("probe", {"label": "pos"}, 2, False),
    "sae feature above": ("sae-std", {"feature": None}, None, True),
    # scored from the feature's encoder column, ranked among the k largest where that decides
    "top-k feature above": ("sae-topk", {"feature": None}, None, True),
    "mid below": ("mid", {"feature": 0}, 0, False),
}


@pytest.mark.parametrize("case", list(STOP_CASES))
def test_a_stop_condition_finishes_at_the_first_position_the_reference_crosses(
    engine, loop_thread, reference, heads, case
):
    """The plain greedy completion's reference scores (SAELens / numpy on transformers' rows) give a
    threshold first crossed at a middle completion position p, clear of the band: the monitored
    request's completion is the plain one's tokens up to p (token p the last), finish "stop", its
    stop at p with the reference's score (relative 1e-5), and its final vector the reference's row p
    (computed by the tail step); a request in the same batch without the condition is unchanged, bit for bit."""
    name, which, index, above = STOP_CASES[case]
    prompt = PROMPTS[1]
    plain = loop_thread.run(engine.complete(prompt, sp(max_tokens=12, logprobs=2)))
    ids = list(plain.prompt_token_ids) + list(plain.choices[0].token_ids)
    P = len(plain.prompt_token_ids)
    if index is None:  # the SAE feature with the widest spread over the completion
        acts = reference_scores(reference, heads, ids, name, slice(None))[P:]
        index = int(np.argmax(acts.max(0) - acts.min(0)))
    scores = reference_scores(reference, heads, ids, name, index)
    p, threshold = crossing(scores, P, above)
    condition = {
        "head": name,
        **({"feature": index} if which.get("feature", 0) is None or "feature" in which else which),
        ("above" if above else "below"): threshold,
    }

    async def batch():
        import asyncio

        return await asyncio.gather(
            engine.complete(prompt, sp(max_tokens=12, logprobs=2), stop_conditions=[condition]),
            engine.complete(prompt, sp(max_tokens=12, logprobs=2)),
        )

    work = lambda st: [
        sum(w.get(k, 0) for w in st["workers"])  # noqa: E731
        for k in ("ranked_rows", "head_rows", "head_column_rows")
    ]
    before = loop_thread.run(engine.stats())
    out, beside = loop_thread.run(batch())
    after = loop_thread.run(engine.stats())
    assert after["monitor_stops"] == before["monitor_stops"] + 1  # counted where the frontend filed it
    (ranked, scored, columns), (ranked0, scored0, columns0) = work(after), work(before)
    if name == "sae-topk":  # the trigger row encoded in full to rank the feature, not every row
        assert 1 <= ranked - ranked0 < scored - scored0, (ranked - ranked0, scored - scored0)
    else:
        assert ranked == ranked0
    if name.startswith("sae"):  # the feature's encoder column a row (a gated SAE's: its gate's and magnitude's),
        # and every column of a row ranked
        per = 2 if name == "sae-gated" else 1
        assert columns - columns0 == per * (scored - scored0) + (ranked - ranked0) * F
    (ch,) = out.choices
    assert list(ch.token_ids) == ids[P : p + 1], (case, p, ch.token_ids)
    assert ch.finish_reason == "stop"
    assert ch.stop["position"] == p and ch.stop["condition"] == 0 and ch.stop["head"] == name
    assert ch.stop["feature"] == index and ch.stop["above" if above else "below"] == threshold
    assert abs(ch.stop["score"] - scores[p]) <= 1e-5 * np.abs(scores).max(), (ch.stop, scores[p])
    want = states(reference, ids[: p + 1])[-1][p]
    diff = float(np.abs(ch.hidden_states - want).max())
    assert diff <= 1e-5 * np.abs(want).max()
    ERRORS.append((f"stop {case}: score", abs(ch.stop["score"] - scores[p]), float(np.abs(scores).max())))
    ERRORS.append((f"stop {case}: final vector", diff, float(np.abs(want).max())))
    assert ch.extraction.via == "tail"
    (b,), (a,) = beside.choices, plain.choices
    assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason and b.stop is None
    assert np.array_equal(b.hidden_states, a.hidden_states)


def test_a_stop_condition_that_never_holds_changes_nothing_and_says_so(engine, loop_thread):
    plain = loop_thread.run(engine.complete(PROMPTS[0], sp(max_tokens=8)))
    out = loop_thread.run(
        engine.complete(
            PROMPTS[0],
            sp(max_tokens=8),
            return_hidden_states=False,
            stop_conditions=[{"head": "probe", "feature": 0, "above": 2.0}],
        )
    )
    (ch,), (a,) = out.choices, plain.choices
    assert ch.token_ids == a.token_ids and ch.finish_reason == a.finish_reason == "length"
    assert ch.stop is None and ch.stop_asked and ch.hidden_states is None


def test_a_stop_over_the_openai_routes_streams_to_its_chunk(engine, loop_thread, reference, heads):
    """A streamed chat with a stop condition: the last chunk finishes with "stop", stop_reason naming
    the condition, hidden_states_meta.stop its position; the text is the unmonitored stream's up to it."""
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    status, plain = _answer(engine, loop_thread, "chat", body)
    assert status == 200
    tokens = [t for e in plain for ch in e.get("choices") or () for t in ch.get("token_ids") or ()]
    prompt_ids = next(e["prompt_token_ids"] for e in plain if e.get("prompt_token_ids"))
    ids = prompt_ids + tokens
    P = len(prompt_ids)
    scores = reference_scores(reference, heads, ids, "probe", 2)
    p, threshold = crossing(scores, P, True)
    status, events = _answer(
        engine,
        loop_thread,
        "chat",
        {**body, "hidden_states_stop": [{"head": "probe", "label": "pos", "above": threshold}]},
    )
    assert status == 200, events
    chunks = [ch for e in events for ch in e.get("choices") or ()]
    got = [t for ch in chunks for t in ch.get("token_ids") or ()]
    assert got == tokens[: p + 1 - P]
    last = chunks[-1]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == "hidden_states_stop[0]", last
    assert last["hidden_states_meta"]["stop"]["position"] == p
    assert all(ch.get("finish_reason") is None for ch in chunks[:-1])
    status, r = _answer(
        engine,
        loop_thread,
        "completions",
        {
            "model": "tiny-llama",
            "prompt": PROMPTS[0],
            "max_tokens": 4,
            "hidden_states_stop": [{"head": "probe", "label": "pos", "above": 2.0}],
        },
    )
    assert status == 200 and r["choices"][0]["hidden_states_meta"]["stop"] is None, r
    status, r = _answer(
        engine,
        loop_thread,
        "completions",
        {
            "model": "tiny-llama",
            "prompt": PROMPTS[0],
            "max_tokens": 4,
            "use_beam_search": True,
            "n": 2,
            "hidden_states_stop": [{"head": "probe", "label": "pos", "above": 0.5}],
        },
    )
    assert status == 400 and "beam search" in r["error"]["message"] and r["error"]["param"] == "hidden_states_stop", r


@pytest.mark.parametrize(
    "stop,words",
    [
        ([{"head": "nope", "feature": 0, "above": 1}], "unknown head 'nope'"),
        ([{"head": "probe", "label": "joy", "above": 1}], "no output labelled 'joy'"),
        ([{"head": "sae-std", "feature": F, "above": 1}], f"beyond the {F} features of head 'sae-std'"),
        ([{"head": "probe", "feature": 0, "above": "high"}], "must be a number"),
        ([{"head": "probe", "feature": 0}], "exactly one threshold"),
        ([{"head": "probe", "feature": 0, "label": "pos", "above": 1}], "exactly one of `feature`"),
        ([{"head": "probe", "feature": 0, "above": float("nan")}], "finite"),
        ([{"head": "probe", "feature": 0, "above": 1, "when": 2}], "when"),
        ([], "non-empty"),
    ],
)
def test_bad_stop_conditions_are_a_400_naming_the_field(engine, loop_thread, stop, words):
    from hidden_states.params import HiddenStatesRequestError

    with pytest.raises(HiddenStatesRequestError) as e:
        loop_thread.run(engine.complete(PROMPTS[0], sp(), return_hidden_states=False, stop_conditions=stop))
    assert words in str(e.value) and e.value.param == "hidden_states_stop", str(e.value)


def test_requests_without_conditions_beside_monitored_ones_are_byte_for_byte_unchanged(engine, loop_thread):
    """Over vLLM's OpenAI completions route, one batch of six run twice, once with two of them carrying
    stop conditions that hold early (an SAE feature and the probe): the other four's answers (text, token
    ids, logprobs, finish, usage, rows at layers 0, 1 and -1 in base64) are identical byte for byte, but
    for ids, timestamps and the extraction's seconds."""
    import asyncio
    import json

    bodies = [
        {
            "model": "tiny-llama",
            "prompt": f"Request {i} of the batch reads",
            "max_tokens": 10,
            "temperature": 0,
            "logprobs": 3,
            "return_token_ids": True,
            "return_hidden_states": True,
            "hidden_states_layers": [0, 1, -1],
            "hidden_states_position": "all",
            "hidden_states_encoding": "base64",
        }
        for i in range(6)
    ]
    stops = {1: [{"head": "sae-std", "feature": 3, "above": 0.0}], 4: [{"head": "probe", "feature": 1, "above": 0.0}]}

    async def run(monitored: bool):
        frontend = await engine.openai("tiny-llama", "r0")

        async def one(i, body):
            if monitored and i in stops:
                body = {**body, "hidden_states_stop": stops[i]}
            parts = [part async for part in frontend.handle("completions", json.dumps(body).encode())]
            assert parts[0][0] == 200, parts
            return json.loads(parts[0][1])

        return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))

    def norm(r):
        r = {k: v for k, v in r.items() if k not in ("id", "created")}
        for ch in r["choices"]:
            ch["hidden_states_meta"].pop("extraction_seconds", None)
        return json.dumps(r, sort_keys=True)

    plain, mixed = loop_thread.run(run(False)), loop_thread.run(run(True))
    for i in (0, 2, 3, 5):
        assert norm(plain[i]) == norm(mixed[i]), i
    for i in stops:  # the monitored two did stop early (so the batch really held them)
        (ch,) = mixed[i]["choices"]
        assert ch["stop_reason"] == "hidden_states_stop[0]" and len(ch["token_ids"]) < 10, ch["stop_reason"]
