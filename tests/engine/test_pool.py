"""hidden_states_pool "mean": per layer one vector, the mean of the rows of hidden_states_position, summed on
the device step by step and reduced in the engine core. Each mean is checked against numpy's mean of
transformers' hidden_states rows on the same token ids; the workers' own counters show one row per layer per
step crossed to the host, whatever the step's length."""

from __future__ import annotations

import numpy as np
import pytest

from hidden_states.params import parse_fields
from hidden_states.protocol import widen
from tests.conftest import TEST_ENGINE_ARGS, engine_fixture, long_text, openai_answer, sampling
from tests.engine.test_positions import asked, reference_states

PROMPTS = ["Hello! How are you today?", "The router sends every completion to a replica"]
D = 128  # the tiny Llama's hidden size
ERRORS: list[tuple[str, float, float]] = []  # (case, max abs error, max |reference|)

engine = engine_fixture(**TEST_ENGINE_ARGS)


@pytest.fixture(scope="module", autouse=True)
def worst_error():
    """Prints the worst mean of the module (the fidelity rule's figure), after its tests."""
    yield
    if ERRORS:
        case, diff, scale = max(ERRORS, key=lambda e: e[1] / e[2])
        print(f"\npool: {len(ERRORS)} means; worst {case}: max abs error {diff:.3g}, max |reference| {scale:.3g}")


sp = sampling(max_tokens=12)  # greedy SamplingParams; keywords override


def pooled(position="completion", layers=None, dtype="float32"):
    """The spec of a pooled request (as an HTTP request's fields parse)."""
    return parse_fields(
        {
            "return_hidden_states": True,
            "hidden_states_pool": "mean",
            "hidden_states_position": position,
            "hidden_states_layers": layers,
            "hidden_states_dtype": dtype,
        },
        enabled=True,
    )


def assert_mean(reference, case: str, ids, positions, got, layer: int = -1, rtol: float = 1e-5) -> None:
    """`got` is numpy's mean of transformers' rows at `positions` (relative to the rows' max |value|)."""
    rows = reference_states(reference, ids, layer)[list(positions)]
    ref = rows.mean(axis=0)
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == ref.shape == (D,), (got.shape, ref.shape)
    diff, scale = float(np.abs(got - ref).max()), float(np.abs(rows).max())
    ERRORS.append((case, diff, scale))
    assert diff <= rtol * scale, f"{case}: max abs error {diff:.3g} (max |reference| {scale:.3g})"


def run(engine, loop_thread, prompt, params, spec):
    return loop_thread.run(engine.complete(prompt, params, spec=spec))


@pytest.mark.parametrize(
    "position",
    ["completion", "all", "completion_end", "prompt_end", {"start": 2, "end": 14, "stride": 3}, {"start": -5}],
    ids=["completion", "all", "final", "prompt_end", "strided-window", "end-aligned"],
)
def test_the_mean_of_each_layers_rows_is_numpys_mean_of_transformers_rows(engine, loop_thread, reference, position):
    """Layers on both sides of the decoder (0, 1, -1); the tail step computes the final row, no extraction."""
    layers = [0, 1, -1]
    before = loop_thread.run(engine.stats())
    c = run(engine, loop_thread, PROMPTS[1], sp(), pooled(position, layers))
    after = loop_thread.run(engine.stats())
    (choice,) = c.choices
    ids = c.prompt_token_ids + choice.token_ids
    P = len(c.prompt_token_ids)
    want = (
        [P - 1]
        if position == "prompt_end"
        else asked(position if position != "completion_end" else {"start": -1}, len(ids), P)
    )
    assert choice.pool == len(want) > 0 and choice.positions is None and not choice.multi
    for layer in layers:
        assert_mean(reference, f"{position} layer {layer}", ids, want, choice.hidden_states_by_layer[layer], layer)
    assert after["extractions"] == before["extractions"]  # every row from the steps that ran anyway


def test_pooled_on_the_device_one_row_per_layer_per_step_reaches_the_host(engine, loop_thread, reference):
    """A long prompt over "all": its prefill chunks and every decode step each send one float32 row per layer
    (the workers count the bytes they copy), against every row for the same request unpooled."""
    prompt, layers = long_text(300, seed=4), [1, -1]

    def copied(spec):
        before = loop_thread.run(engine.stats())["workers"][0]
        c = run(engine, loop_thread, prompt, sp(max_tokens=6), spec)
        after = loop_thread.run(engine.stats())["workers"][0]
        return c, after["bytes_copied"] - before["bytes_copied"], after["host_copies"] - before["host_copies"]

    c, nbytes, steps = copied(pooled("all", layers))
    (choice,) = c.choices
    ids = c.prompt_token_ids + choice.token_ids
    assert steps >= 6 and nbytes == steps * len(layers) * D * 4, (nbytes, steps)
    for layer in layers:
        assert_mean(
            reference, f"long all layer {layer}", ids, range(len(ids)), choice.hidden_states_by_layer[layer], layer
        )
    plain = parse_fields(
        {"return_hidden_states": True, "hidden_states_position": "all", "hidden_states_layers": layers}, enabled=True
    )
    _, plain_bytes, _ = copied(plain)
    assert plain_bytes == len(ids) * len(layers) * D * 4  # every row, once
    print(
        f"\npool over {len(ids)} positions, 2 layers: {nbytes} bytes to the host in {steps} steps; "
        f"unpooled {plain_bytes}"
    )


def test_a_stop_string_pools_by_the_extraction_step(engine, loop_thread, reference):
    """The frontend cuts a stop string: the engine core never sees the stop, and one extraction step pools the
    choice's rows on the device."""
    free = loop_thread.run(engine.complete(PROMPTS[0], sp(max_tokens=24), return_hidden_states=False))
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    before = loop_thread.run(engine.stats())
    c = run(engine, loop_thread, PROMPTS[0], sp(max_tokens=24, stop=[stop]), pooled("completion", [-1]))
    (choice,) = c.choices
    assert choice.finish_reason == "stop" and stop not in choice.text
    ids = c.prompt_token_ids + choice.token_ids
    P = len(c.prompt_token_ids)
    assert_mean(reference, "stop string", ids, range(P, len(ids)), choice.hidden_states)
    assert choice.extraction.via == "extraction" and choice.pool == len(ids) - P
    assert loop_thread.run(engine.stats())["extractions"] == before["extractions"] + 1


def test_n2_each_choice_its_own_mean_and_half_precision_cast_once(engine, loop_thread, reference):
    c = run(engine, loop_thread, PROMPTS[0], sp(n=2, temperature=1.0, seed=3), pooled("completion", [-1]))
    assert len(c.choices) == 2 and c.choices[0].token_ids != c.choices[1].token_ids
    for choice in c.choices:
        ids = c.prompt_token_ids + choice.token_ids
        assert_mean(
            reference, f"n=2 choice {choice.index}", ids, range(len(c.prompt_token_ids), len(ids)), choice.hidden_states
        )
    for dtype in ("float16", "bfloat16"):
        (choice,) = run(engine, loop_thread, PROMPTS[0], sp(), pooled("completion", [-1], dtype)).choices
        assert choice.dtype == dtype
        full = run(engine, loop_thread, PROMPTS[0], sp(), pooled("completion", [-1])).choices[0]
        raw = choice.raw(-1)
        assert raw.dtype == (np.float16 if dtype == "float16" else np.uint16)
        # the float32 mean, cast once (round to nearest even), as torch casts
        from hidden_states.protocol import narrow

        assert np.array_equal(raw, narrow(full.hidden_states, dtype)), dtype
        assert np.allclose(widen(raw, dtype), full.hidden_states, rtol=1e-2, atol=1e-2)


def test_streamed_the_mean_rides_the_final_chunk_and_equals_the_whole_answer(engine, loop_thread):
    body = {
        "model": "tiny-llama",
        "prompt": PROMPTS[1],
        "max_tokens": 10,
        "temperature": 0,
        "return_hidden_states": True,
        "hidden_states_pool": "mean",
        "hidden_states_position": "completion",
    }
    status, whole = openai_answer(engine, loop_thread, "completions", body)
    assert status == 200, whole
    status, events = openai_answer(engine, loop_thread, "completions", {**body, "stream": True})
    assert status == 200, events
    carrying = [e for e in events if any("hidden_states" in ch for ch in e.get("choices") or ())]
    assert len(carrying) == 1 and carrying[0]["choices"][0]["finish_reason"] is not None
    (final,) = carrying[0]["choices"]
    (answer,) = whole["choices"]
    assert final["hidden_states"] == answer["hidden_states"] and len(answer["hidden_states"]) == D
    meta = answer["hidden_states_meta"]
    assert meta["pool"] == "mean" and meta["pooled_rows"] == whole["usage"]["completion_tokens"]
    assert meta["shape"] == [D] and "positions" not in meta


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"hidden_states_pool": "max"}, "hidden_states_pool must be 'mean'"),
        ({"hidden_states_pool": "mean", "hidden_states_topk": 4}, "cannot be combined with hidden_states_topk"),
        ({"hidden_states_pool": "mean", "return_hidden_states": False}, "set it to true"),
    ],
)
def test_bad_pools_are_400s_naming_the_field(engine, loop_thread, fields, message):
    body = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2, "return_hidden_states": True, **fields}
    status, answer = openai_answer(engine, loop_thread, "completions", body)
    assert status == 400 and answer["error"]["param"] == "hidden_states_pool", answer
    assert message in answer["error"]["message"], answer
