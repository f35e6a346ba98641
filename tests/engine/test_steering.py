"""Per-request steering (hidden_states/steering.py, worker/steering.py) against transformers with the
same change (tests/steer_ref.py): greedy tokens identical, rows and vectors within relative 1e-5 in
float32, on the built-in tiny Llama (D = 128, 2 decoder layers: steerable layers 0 and 1).

One engine (module scope) with the test heads (an SAE's decoder rows as entries) and registered
vectors: a .npy at layer 1 and a repeng/llama.cpp control-vector GGUF (direction.0: layer 1).
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from hidden_states.protocol import FAULT_INJECTION_ENV, RequestSpec
from tests.conftest import TEST_ENGINE_ARGS, TEST_MODEL, eager_only, engine_fixture, long_text, openai_answer, sampling
from tests.heads_ref import build_test_heads
from tests.helpers import worker_faults
from tests.steer_ref import steered_greedy, steered_states, write_gguf

# On a GPU (compiled, CUDA graphs) these run in tests/engine/test_compiled.py, on an engine with capture_layers.
pytestmark = eager_only

D = 128
ERRORS: list = []


def unit_vector(seed: int, norm: float = 1.0) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=D).astype(np.float32)
    return (v / np.linalg.norm(v) * norm).astype(np.float32)


def b64(v: np.ndarray) -> str:
    return base64.b64encode(np.asarray(v, "<f4").tobytes()).decode()


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    root = tmp_path_factory.mktemp("steering")
    np.save(root / "calm.npy", unit_vector(21, 3.0))
    write_gguf(str(root / "cv.gguf"), {0: unit_vector(22, 3.0)})
    return {
        "calm": (str(root / "calm.npy"), {1: unit_vector(21, 3.0)}),
        "cv": (str(root / "cv.gguf"), {1: unit_vector(22, 3.0)}),
    }


def registered_vectors(registered) -> list[dict]:
    """The engine's `steering_vectors`: the .npy at layer 1, the GGUF at the layer it names."""
    return [{"name": "calm", "path": registered["calm"][0], "layer": 1}, {"name": "cv", "path": registered["cv"][0]}]


engine = engine_fixture(
    setup=lambda registered: {"heads": build_test_heads(), "steering_vectors": registered_vectors(registered)},
    clean=("pending", "missing_vectors"),
    errors=ERRORS,
    env={FAULT_INJECTION_ENV: "1"},
    **TEST_ENGINE_ARGS,
)


sp = sampling(max_tokens=10)  # greedy SamplingParams; keywords override


def as_entries(steering: list[dict], resolved: dict | None = None) -> list[tuple]:
    """The reference's entries: (layer, op, positions, scale, vector)."""
    out = []
    for e in steering:
        v = (
            resolved[e.get("name") or e.get("head")]
            if resolved
            else np.frombuffer(base64.b64decode(e["vector"]), "<f4")
        )
        for layer, vec in v.items() if isinstance(v, dict) else [(e["layer"], v)]:
            out.append((layer, e.get("op", "add"), e.get("positions", "all"), e.get("scale", 1.0), vec))
    return out


def assert_rows(case: str, got: np.ndarray, want: np.ndarray) -> None:
    diff, scale = float(np.abs(np.asarray(got, np.float32) - want).max()), float(np.abs(want).max())
    assert diff <= 1e-5 * scale, f"{case}: max abs error {diff:.3g} (max |reference| {scale:.3g})"
    ERRORS.append((case, diff, scale))


def every_layer(reference) -> list[int]:
    """The layers the steering tests read on `reference`'s model: 0..n-1 and -1 (the final norm's output)."""
    return [*range(reference.model.config.num_hidden_layers), -1]


def absolute(reference, layer: int) -> int:
    """A layer as the reference numbers them: 0..n (-1 is n, the final norm's output; -2 is n - 1)."""
    return layer + reference.model.config.num_hidden_layers + 1 if layer < 0 else layer


CASES = {
    "one layer, all": [{"layer": 1, "vector": b64(unit_vector(1, 4.0)), "scale": 1.5}],
    "embeddings, prompt": [{"layer": 0, "vector": b64(unit_vector(2, 2.0)), "positions": "prompt"}],
    "two layers, completion": [
        {"layer": 0, "vector": b64(unit_vector(3, 3.0)), "positions": "completion"},
        {"layer": -2, "vector": b64(unit_vector(4, 3.0)), "scale": -1.0},
    ],
    "add then ablate": [
        {"layer": 1, "vector": b64(unit_vector(5, 3.0))},
        {"layer": 1, "vector": b64(unit_vector(6)), "op": "ablate"},
    ],
}


@pytest.mark.parametrize("hook", ["steering", "heads"])
def test_a_worker_hook_that_raises_fails_its_request_alone(engine, loop_thread, reference, hook, layer=1):
    """A worker's steering (its entries added inside the forward) or heads (one product per head over the
    step's rows) raising for one request of a batch of four, each steered at `layer` and asking two heads
    (a fault injected by the request, sent last; every position asked, so its steps hold the others'
    rows): the batched work is redone request by request, that request fails
    with HookFaultError (a 500 naming it and the hook; counted by the worker and the frontend), and the
    three others complete with the tokens, vectors and head outputs they get alone, their tokens those of
    transformers with the same steering; then the engine serves the faulted prompt."""
    from hidden_states.errors import status_of
    from hidden_states.interface import HookFaultError

    steering, heads = [{"layer": layer, "vector": b64(unit_vector(31, 4.0)), "scale": 1.5}], ["sae-std", "probe"]
    prompts = ["The weather today is", "Once upon a time", "My favourite food is", "The river flows"]

    def ask(prompt, extra=None):  # every position's rows and head outputs: each step holds all four's
        return engine.complete(
            prompt,
            sp(max_tokens=6, **({"extra_args": extra} if extra else {})),
            steering=steering,
            heads=heads,
            position="all",
        )

    alone = [loop_thread.run(ask(p)) for p in prompts[1:]]
    before = loop_thread.run(engine.stats())

    async def batch():
        return await asyncio.gather(
            *(ask(p) for p in prompts[1:]), ask(prompts[0], RequestSpec(inject=hook).into(None)), return_exceptions=True
        )  # the faulted one last: its steps hold the others

    *others, faulted = loop_thread.run(batch())
    assert isinstance(faulted, HookFaultError) and faulted.hook == hook, faulted
    failure = status_of(faulted)
    assert failure.status == 500 and f"`{hook}`" in failure.message and faulted.request_id in failure.message
    after = loop_thread.run(engine.stats())
    assert after["hook_faults"] == before["hook_faults"] + 1 and not any(
        c.faults for c in engine.extraction.live.values()
    )
    assert worker_faults(after) == worker_faults(before) + 1  # where it ran (a pipeline stage's: sent on)
    entries = [(layer, *rest) for layer, *rest in as_entries(steering)]
    for c, solo in zip(others, alone):
        (ch,), (want,) = c.choices, solo.choices
        assert ch.token_ids == want.token_ids
        assert list(ch.token_ids) == steered_greedy(reference.model, list(c.prompt_token_ids), entries, 6)
        assert_rows(f"{hook} fault, a batch-mate's vector", ch.hidden_states, want.hidden_states)
        for name in heads:  # per position
            assert len(ch.heads[name]) == len(want.heads[name]) == len(c.prompt_token_ids) + 6
            for got, ref in zip(ch.heads[name], want.heads[name]):
                key = "scores" if "scores" in ref else "values"
                if key == "values":
                    assert got["indices"] == ref["indices"]
                np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, atol=1e-6)
    assert not engine.llm.errored
    again = loop_thread.run(ask(prompts[0]))
    assert list(again.choices[0].token_ids) == steered_greedy(reference.model, list(again.prompt_token_ids), entries, 6)


@pytest.mark.parametrize("case", list(CASES))
def test_steered_tokens_and_rows_are_transformers_with_the_same_hook(engine, loop_thread, reference, case):
    steering = CASES[case]
    prompt = "The weather today is"
    plain = loop_thread.run(engine.complete(prompt, sp(), return_hidden_states=False))
    layers = every_layer(reference)
    out = loop_thread.run(engine.complete(prompt, sp(), steering=steering, layers=layers, position="all"))
    (ch,) = out.choices
    # as the reference numbers them: absolute layers (-2 is layer 1 of 0..2 on the tiny Llama)
    P, entries = (
        len(out.prompt_token_ids),
        [(absolute(reference, layer), *rest) for layer, *rest in as_entries(steering)],
    )
    want = steered_greedy(reference.model, list(out.prompt_token_ids), entries, 10)
    assert list(ch.token_ids) == want, (case, ch.token_ids, want)
    if case != "embeddings, prompt":
        assert list(ch.token_ids) != list(plain.choices[0].token_ids), "the steering changed nothing"
    ids = list(out.prompt_token_ids) + list(ch.token_ids)
    states = steered_states(reference.model, ids, entries, P)
    for layer in layers:
        assert_rows(f"{case}, layer {layer}", ch.hidden_states_by_layer[layer], states[absolute(reference, layer)])
    assert ch.extraction.via == "tail"
    assert [(s["layer"], s["op"], s["positions"]) for s in ch.steering] == [e[:3] for e in entries]


@pytest.mark.parametrize("case", ["one layer, all", "two layers, completion"])
def test_the_extraction_step_is_steered_the_same(engine, loop_thread, reference, case):
    """A stop string: the final row by the extraction step, a prefill of prompt + completion, steered on
    the same absolute positions (completion steering on the completion's, not on the whole prefill)."""
    steering = CASES[case]
    entries = [(absolute(reference, layer), *rest) for layer, *rest in as_entries(steering)]
    layers = every_layer(reference)[1:]
    out = loop_thread.run(engine.complete("Rain falls on", sp(stop=["zzzz"]), steering=steering, layers=layers))
    (ch,) = out.choices
    assert ch.extraction.via == "extraction"
    ids = list(out.prompt_token_ids) + list(ch.token_ids)
    assert list(ch.token_ids) == steered_greedy(reference.model, list(out.prompt_token_ids), entries, 10)
    states = steered_states(reference.model, ids, entries, len(out.prompt_token_ids))
    for layer in layers:
        assert_rows(
            f"extraction step, {case}, layer {layer}",
            ch.hidden_states_by_layer[layer],
            states[absolute(reference, layer)][-1],
        )


def test_unsteered_requests_beside_steered_ones_are_byte_for_byte_unchanged(engine, loop_thread):
    """The same batch twice, once with two of its requests steered: the other requests' tokens,
    logprobs and rows are identical, bit for bit; a request that only steers carries no rows."""
    prompts = [f"Request {i} of the batch reads" for i in range(6)]
    steer = CASES["two layers, completion"]

    async def batch(steered: bool):
        async def one(i):
            kw = {"steering": steer} if steered and i in (1, 4) else {}
            return await engine.complete(prompts[i], sp(logprobs=3), position="all", layers=[0, 1, -1], **kw)

        return await asyncio.gather(*(one(i) for i in range(6)))

    plain, mixed = loop_thread.run(batch(False)), loop_thread.run(batch(True))
    for i in (0, 2, 3, 5):
        a, b = plain[i].choices[0], mixed[i].choices[0]
        assert a.token_ids == b.token_ids
        for layer in (0, 1, -1):
            np.testing.assert_array_equal(a.hidden_states_by_layer[layer], b.hidden_states_by_layer[layer])
    assert any(plain[i].choices[0].token_ids != mixed[i].choices[0].token_ids for i in (1, 4))
    only = loop_thread.run(engine.complete(prompts[0], sp(), return_hidden_states=False, steering=steer))
    assert only.choices[0].hidden_states is None and only.choices[0].steering[0]["layer"] == 0


def _answer(engine, loop_thread, route: str, body: dict):
    return openai_answer(engine, loop_thread, route, body)


def test_the_prefix_cache_never_serves_one_steering_to_another(engine, loop_thread, reference):
    """The steering's digest joins the cache salt: a hit on the same steering, none across steerings
    or against no steering; each vector its own reference."""
    prompt = long_text(120, seed=77)
    s1 = [{"layer": 1, "vector": b64(unit_vector(7, 3.0)), "positions": "prompt"}]
    s2 = [{"layer": 1, "vector": b64(unit_vector(8, 3.0)), "positions": "prompt"}]
    seen = []
    for steering in (s1, s1, s2, None, None):
        body = {
            "model": "tiny-llama",
            "prompt": prompt,
            "max_tokens": 2,
            "temperature": 0,
            "return_hidden_states": True,
            "return_token_ids": True,
        }
        if steering:
            body["hidden_states_steering"] = steering
        status, r = _answer(engine, loop_thread, "completions", body)
        assert status == 200, r
        ch = r["choices"][0]
        ids = ch["prompt_token_ids"] + ch["token_ids"]
        want = steered_states(
            reference.model, ids, as_entries(steering) if steering else [], len(ch["prompt_token_ids"])
        )[2][-1]
        assert_rows("prefix cache", ch["hidden_states"], want)
        seen.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
        if steering:
            assert ch["hidden_states_meta"]["steering"][0]["digest"]
    assert seen[0] == 0 and seen[1] > 0 and seen[2] == 0 and seen[3] == 0 and seen[4] > 0, seen


def test_n2_and_a_streamed_chat_over_the_openai_routes(engine, loop_thread, reference):
    steering = CASES["one layer, all"]
    status, r = _answer(
        engine,
        loop_thread,
        "completions",
        {
            "model": "tiny-llama",
            "prompt": "Two sampled choices",
            "max_tokens": 6,
            "n": 2,
            "temperature": 1.0,
            "seed": 4,
            "return_token_ids": True,
            "return_hidden_states": True,
            "hidden_states_position": "completion",
            "hidden_states_steering": steering,
        },
    )
    assert status == 200, r
    for ch in r["choices"]:
        ids = ch["prompt_token_ids"] + ch["token_ids"]
        states = steered_states(reference.model, ids, as_entries(steering), len(ch["prompt_token_ids"]))
        assert_rows(f"n=2 choice {ch['index']}", ch["hidden_states"], states[2][ch["hidden_states_meta"]["positions"]])
    status, events = _answer(
        engine,
        loop_thread,
        "chat",
        {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "Steer me."}],
            "max_tokens": 8,
            "stream": True,
            "temperature": 0,
            "return_token_ids": True,
            "return_hidden_states": True,
            "hidden_states_steering": steering,
        },
    )
    assert status == 200
    prompt_ids, tokens, final = None, [], None
    for event in events:
        prompt_ids = event.get("prompt_token_ids") or prompt_ids
        for ch in event.get("choices") or ():
            tokens += ch.get("token_ids") or []
            final = ch.get("hidden_states", final)
    assert tokens == steered_greedy(reference.model, prompt_ids, as_entries(steering), 8)[: len(tokens)]
    ids = prompt_ids + tokens
    assert_rows(
        "streamed chat", final, steered_states(reference.model, ids, as_entries(steering), len(prompt_ids))[2][-1]
    )


def test_registered_vectors_and_sae_features_as_entries(engine, loop_thread, reference, registered):
    """A .npy and a control-vector GGUF by name (direction.0 = this server's layer 1), and an SAE
    head's feature (its decoder row, at the SAE's layer by default)."""
    from safetensors.numpy import load_file

    sae = {h["name"]: h for h in build_test_heads()}["sae-std"]  # blocks.0.hook_resid_post: layer 1
    row = load_file(f"{sae['path']}/sae_weights.safetensors")["W_dec"][17] * 1.0
    cases = {
        "npy": ([{"name": "calm", "scale": 1.5}], [(1, "add", "all", 1.5, registered["calm"][1][1])]),
        "gguf": ([{"name": "cv", "positions": "completion"}], [(1, "add", "completion", 1.0, registered["cv"][1][1])]),
        "sae feature": ([{"head": "sae-std", "feature": 17, "scale": 8.0}], [(1, "add", "all", 8.0, row)]),
    }
    for case, (steering, entries) in cases.items():
        out = loop_thread.run(engine.complete("Named vectors steer", sp(), steering=steering))
        (ch,) = out.choices
        assert list(ch.token_ids) == steered_greedy(reference.model, list(out.prompt_token_ids), entries, 10), case
        ids = list(out.prompt_token_ids) + list(ch.token_ids)
        assert_rows(
            case, ch.hidden_states, steered_states(reference.model, ids, entries, len(out.prompt_token_ids))[2][-1]
        )
        assert ch.steering[0]["layer"] == 1


@pytest.mark.parametrize(
    "steering, words",
    [
        ([{"layer": 1, "vector": [0.0] * (D - 1)}], "127 entries; the model's hidden size is 128"),
        ([{"layer": 2, "vector": b64(unit_vector(0))}], "layer 2 out of range"),
        ([{"layer": -1, "vector": b64(unit_vector(0))}], "layer -1 out of range"),
        ([{"layer": 1, "vector": [float("nan")] + [0.0] * (D - 1)}], "NaN or infinite"),
        ([{"layer": 1, "vector": b64(unit_vector(0))}] * 17, "at most 16"),
        ([{"name": "nope"}], "unknown steering vector 'nope'; this server's are calm, cv"),
        ([{"head": "sae-std", "feature": 1024}], "feature 1024 is beyond"),
        ([{"head": "probe", "feature": 1}], "no SAE head"),
        ([{"vector": b64(unit_vector(0))}], "needs a `layer`"),
        ([{"layer": 1, "vector": b64(unit_vector(0)), "name": "calm"}], "exactly one of"),
        ([{"layer": 1, "vector": [0.0] * D, "op": "ablate"}], "ablating a zero vector"),
    ],
)
def test_bad_steering_is_a_400_naming_the_entry(engine, loop_thread, steering, words):
    from hidden_states.params import HiddenStatesRequestError

    with pytest.raises(HiddenStatesRequestError) as e:
        loop_thread.run(engine.complete("x", sp(max_tokens=2), steering=steering))
    assert words in str(e.value) and e.value.param == "hidden_states_steering", str(e.value)


def test_a_control_vector_for_the_last_block_stops_the_start(loop_thread, tmp_path):
    from hidden_states.preflight import EngineStartupError
    from hidden_states.vllm.engine import HiddenStatesEngine

    path = write_gguf(str(tmp_path / "last.gguf"), {1: unit_vector(0)})
    with pytest.raises(EngineStartupError, match="direction.1 steers the last block's output"):
        loop_thread.run(
            HiddenStatesEngine.start(TEST_MODEL, steering_vectors=[{"name": "v", "path": path}], **TEST_ENGINE_ARGS)
        )


def test_post_hidden_states_recomputes_a_steered_choice(engine, loop_thread, reference):
    """A verifier sends the choice's prompt and completion with the same steering: the steered model's
    vector (completion steering on the completion's positions); without it, the unsteered model's."""
    steering = CASES["two layers, completion"]
    out = loop_thread.run(engine.complete("A verifier recomputes", sp(max_tokens=6), steering=steering))
    prompt, completion = list(out.prompt_token_ids), list(out.choices[0].token_ids)
    entries = [(layer + 3 if layer < 0 else layer, *rest) for layer, *rest in as_entries(steering)]
    want = steered_states(reference.model, prompt + completion, entries, len(prompt))[2][-1]
    status, r = _answer(
        engine,
        loop_thread,
        "hidden_states",
        {"model": "tiny-llama", "prompt": prompt, "completion": completion, "hidden_states_steering": steering},
    )
    assert status == 200, r
    assert [s["layer"] for s in r["hidden_states_meta"]["steering"]] == [0, 1]
    assert_rows("POST /v1/hidden_states", r["hidden_states"], want)
    np.testing.assert_allclose(r["hidden_states"], out.choices[0].hidden_states, rtol=0, atol=1e-5)
    status, plain = _answer(
        engine, loop_thread, "hidden_states", {"model": "tiny-llama", "prompt": prompt + completion}
    )
    assert status == 200 and np.abs(np.asarray(plain["hidden_states"]) - want).max() > 1e-3  # unsteered: another


# -- conditional steering (`when`): an entry applies where its condition held on the previous row --

# (steering entry, condition's head, its output, above?, its layer)
WHEN_CASES = {
    "add at 1 when the probe (after the norm) says pos": (
        {"layer": 1, "vector": b64(unit_vector(41, 4.0)), "scale": 1.5},
        "probe",
        2,
        True,
        2,
    ),
    "add at 0 when an SAE feature at 1 is low": (
        {"layer": 0, "vector": b64(unit_vector(42, 3.0))},
        "sae-std",
        None,
        False,
        1,
    ),
    "ablate at 1 when the probe at 1 is high": (
        {"layer": 1, "vector": b64(unit_vector(43)), "op": "ablate"},
        "mid",
        0,
        True,
        1,
    ),
}


@pytest.mark.parametrize("case", list(WHEN_CASES))
def test_a_conditional_entry_applies_where_its_condition_held_on_the_row_before(engine, loop_thread, reference, case):
    """`when`: the entry applies at completion position q only where the head's row of q - 1 (as
    hidden_states_heads reports it) held the condition; the engine's scheduler decides from the step
    before's scores. Against transformers deciding position by position (tests/steer_ref.py): a threshold
    is picked from the reference's own scores so some positions apply and some do not, every score clear
    of it by far more than the band (relative 1e-5); then the tokens, the positions applied (the meta's
    `applied`), and the rows at every layer (0, 1 and -1 of two) at every position equal the reference's
    (relative 1e-5), the final row by the tail step. A stop string's extraction step replays where it applied: its final
    rows are the reference's too. (Under async scheduling: tests/engine/test_async_scheduling.py.)"""
    check_conditional(engine, loop_thread, reference, case)


def check_conditional(engine, loop_thread, reference, case: str, via: str = "tail", measure=None):
    """WHEN_CASES[case] on `engine` against transformers (the test above); the final row computed `via`.
    -> (the positions the entry applied at, the same in both completions; with `measure`, a function of no
    arguments returning numbers, their change over the first completion alone)."""
    from tests.heads_ref import head_scorer
    from tests.steer_ref import pick_condition

    entry, head, index, above, head_layer = WHEN_CASES[case]
    prompt, n = "The weather today is", 8
    plain = loop_thread.run(
        engine.complete(
            prompt,
            sp(max_tokens=n),
            heads=[{"name": head, "topk": 1024}] if head.startswith("sae") else [head],
            position="all",
            return_hidden_states=False,
        )
    )
    ids = list(plain.prompt_token_ids) + list(plain.choices[0].token_ids)
    P = len(plain.prompt_token_ids)
    if index is None:  # the SAE feature that varies most over the plain completion's rows
        from tests.heads_ref import sae_reference

        states = steered_states(reference.model, ids, [], P)
        acts = sae_reference({h["name"]: h for h in build_test_heads()}[head]["path"], states[head_layer][P - 1 :])
        index = int(np.argmax(acts.max(0) - acts.min(0)))
    score = head_scorer(head, index)
    base = [
        (
            entry["layer"],
            entry.get("op", "add"),
            "completion",
            entry.get("scale", 1.0),
            np.frombuffer(base64.b64decode(entry["vector"]), "<f4"),
        )
    ]
    t, tokens, applied, final_states = pick_condition(
        reference.model, list(plain.prompt_token_ids), base, n, head_layer, score, above
    )

    when = {"head": head, "feature": index, ("above" if above else "below"): t}
    steering = [{**entry, "positions": "completion", "when": when}]
    before = measure() if measure else ()
    layers = every_layer(reference)
    out = loop_thread.run(engine.complete(prompt, sp(max_tokens=n), steering=steering, layers=layers, position="all"))
    change = [a - b for a, b in zip(measure(), before)] if measure else None
    (ch,) = out.choices
    assert list(ch.token_ids) == tokens, (case, ch.token_ids, tokens)
    assert ch.steering[0]["when"]["head"] == head and ch.steering[0]["applied"] == applied[0], ch.steering
    for layer in layers:
        assert_rows(
            f"when: {case}, layer {layer}", ch.hidden_states_by_layer[layer], final_states[absolute(reference, layer)]
        )
    assert ch.extraction.via == via

    out = loop_thread.run(
        engine.complete(prompt, sp(max_tokens=n, stop=["zzzz"]), steering=steering, layers=layers[1:])
    )
    (ch,) = out.choices
    assert ch.extraction.via == "extraction" and list(ch.token_ids) == tokens
    for layer in layers[1:]:
        assert_rows(
            f"when, extraction step: {case}, layer {layer}",
            ch.hidden_states_by_layer[layer],
            final_states[absolute(reference, layer)][-1],
        )
    assert ch.steering[0]["applied"] == applied[0], ch.steering
    return applied[0], change


@pytest.mark.parametrize(
    "steering,words",
    [
        (
            [{"layer": 1, "vector": b64(unit_vector(1)), "when": {"head": "probe", "feature": 0, "above": 0.5}}],
            'needs positions "completion"',
        ),
        (
            [
                {
                    "layer": 1,
                    "vector": b64(unit_vector(1)),
                    "positions": "completion",
                    "when": {"head": "nope", "feature": 0, "above": 0.5},
                }
            ],
            "unknown head 'nope'",
        ),
        (
            [
                {
                    "layer": 1,
                    "vector": b64(unit_vector(1)),
                    "positions": "completion",
                    "when": {"head": "probe", "feature": 0, "above": "x"},
                }
            ],
            "must be a number",
        ),
        (
            [
                {
                    "layer": 1,
                    "vector": b64(unit_vector(1)),
                    "positions": "completion",
                    "when": {"head": "probe", "label": "joy", "above": 0.5},
                }
            ],
            "no output labelled 'joy'",
        ),
    ],
)
def test_bad_conditions_on_steering_are_a_400_naming_the_entry(engine, loop_thread, steering, words):
    from hidden_states.params import HiddenStatesRequestError

    with pytest.raises(HiddenStatesRequestError) as e:
        loop_thread.run(engine.complete("x", sp(), return_hidden_states=False, steering=steering))
    assert words in str(e.value) and e.value.param == "hidden_states_steering" and "[0]" in str(e.value), str(e.value)


# -- clamp (an SAE feature set to a value) and cap (a direction's component limited) --


def _sae(name: str):
    from sae_lens import SAE

    return SAE.load_from_disk({h["name"]: h for h in build_test_heads()}[name]["path"], device="cpu")


def _busiest_feature(reference, name: str, ids, layer: int) -> int:
    """The SAE feature with the largest mean activation over `ids`' rows (SAELens's encode on transformers')."""
    import torch

    rows = steered_states(reference.model, ids, [], len(ids))[layer]
    with torch.no_grad():
        return int(_sae(name).encode(torch.tensor(rows)).mean(0).argmax())


# (entries as asked, given the chosen feature; the SAE head whose outputs are checked, or None)
CONTROL_CASES = {
    "clamp a standard SAE's feature high": (
        lambda f: [{"op": "clamp", "head": "sae-std", "feature": f, "value": 12.0}],
        "sae-std",
        1,
    ),
    "clamp a JumpReLU feature to 0 on the completion": (
        lambda f: [{"op": "clamp", "head": "sae-jump", "feature": f, "value": 0.0, "positions": "completion"}],
        "sae-jump",
        1,
    ),
    "clamp a gated SAE's feature at the embeddings": (
        lambda f: [{"op": "clamp", "head": "sae-gated", "feature": f, "value": 6.0}],
        "sae-gated",
        0,
    ),
    "add then cap": (
        lambda f: [
            {"layer": 1, "vector": b64(unit_vector(51, 4.0)), "scale": 1.5},
            {"op": "cap", "layer": 1, "vector": b64(unit_vector(51)), "max": 0.25},
        ],
        None,
        1,
    ),
}


@pytest.mark.parametrize("case", list(CONTROL_CASES))
def test_clamp_and_cap_are_transformers_with_saelens_in_the_same_hook(engine, loop_thread, reference, case):
    """`clamp` adds (value - f_i(x)) x W_dec[i] to the stream at its SAE's layer, f_i SAELens's encode of that
    row (after the entries before it); `cap` limits the stream's component along a unit vector. Against
    transformers with SAELens's own encode and W_dec in the same pre-hook: greedy tokens identical (and
    unlike the unsteered ones), rows at layers 0, 1 and -1 within relative 1e-5; the clamped SAE's outputs
    read at its layer are SAELens's encode of the reference's steered rows (not `value` itself: W_dec and
    W_enc are not inverses, which is the definition)."""
    import torch

    make, name, layer = CONTROL_CASES[case]
    prompt = "The weather today is"
    plain = loop_thread.run(engine.complete(prompt, sp()))
    ids = list(plain.prompt_token_ids) + list(plain.choices[0].token_ids)
    feature = _busiest_feature(reference, name, ids, layer) if name else 0
    steering = make(feature)
    heads_asked = [{"name": name, "topk": 16}] if name else None
    out = loop_thread.run(
        engine.complete(prompt, sp(), steering=steering, layers=[0, 1, -1], position="all", heads=heads_asked)
    )
    (ch,) = out.choices
    P = len(out.prompt_token_ids)
    entries = []
    for e in steering:
        if e.get("op") == "clamp":
            sae = _sae(e["head"])
            with torch.no_grad():
                entries.append(
                    (
                        layer,
                        ("clamp", sae, e["feature"], e["value"]),
                        e.get("positions", "all"),
                        1.0,
                        sae.W_dec[e["feature"]].numpy(),
                    )
                )
        else:
            v = np.frombuffer(base64.b64decode(e["vector"]), "<f4")
            entries.append(
                (
                    e["layer"],
                    ("cap", e["max"]) if e.get("op") == "cap" else e.get("op", "add"),
                    "all",
                    e.get("scale", 1.0),
                    v,
                )
            )
    want = steered_greedy(reference.model, list(out.prompt_token_ids), entries, 10)
    assert list(ch.token_ids) == want, (case, ch.token_ids, want)
    assert list(ch.token_ids) != list(plain.choices[0].token_ids), "the steering changed nothing"
    states = steered_states(reference.model, list(out.prompt_token_ids) + want, entries, P)
    for l in (0, 1, -1):
        assert_rows(f"{case}, layer {l}", ch.hidden_states_by_layer[l], states[l % 3])
    if name:
        from tests.heads_ref import check_heads

        check_heads(
            case, ch.heads, [states[i] for i in range(3)], list(ch.positions), build_test_heads(), {name: 16}, ERRORS
        )
    assert [s["op"] for s in ch.steering] == [e.get("op", "add") for e in steering]
    assert ch.steering[-1].get("value", ch.steering[-1].get("max")) == steering[-1].get(
        "value", steering[-1].get("max")
    )


@pytest.mark.parametrize(
    "steering,words",
    [
        ([{"op": "clamp", "head": "probe", "feature": 0, "value": 1.0}], "'probe' is a linear head"),
        ([{"op": "clamp", "head": "sae-topk", "feature": 0, "value": 1.0}], "top-k SAE"),
        ([{"op": "clamp", "head": "sae-std", "feature": 0}], "op 'clamp' needs `value`"),
        ([{"op": "clamp", "head": "sae-std", "feature": 0, "value": "big"}], "must be a number"),
        ([{"op": "clamp", "head": "sae-std", "feature": 0, "value": 1.0, "layer": 0}], "acts at its SAE's layer"),
        ([{"op": "clamp", "head": "sae-std", "feature": 0, "value": 1.0, "scale": 2}], "scale does not apply"),
        ([{"op": "cap", "layer": 1, "vector": b64(unit_vector(1))}], "op 'cap' needs `max`"),
        ([{"op": "cap", "layer": 1, "vector": b64(unit_vector(1)), "max": float("inf")}], "finite"),
        ([{"op": "add", "layer": 1, "vector": b64(unit_vector(1)), "max": 1.0}], "`max` is for op 'cap'"),
        ([{"op": "cap", "layer": 1, "vector": [0.0] * D, "max": 1.0}], "zero vector"),
    ],
)
def test_bad_clamps_and_caps_are_a_400_naming_the_entry(engine, loop_thread, steering, words):
    from hidden_states.params import HiddenStatesRequestError

    with pytest.raises(HiddenStatesRequestError) as e:
        loop_thread.run(engine.complete("x", sp(), return_hidden_states=False, steering=steering))
    assert words in str(e.value) and e.value.param == "hidden_states_steering", str(e.value)
