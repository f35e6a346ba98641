"""Rows across the whole completion (issue 24): hidden_states_position "completion", "all" and
ranges, hidden_states_dtype, hidden_states_topk, rows delivered as they are computed, and the
memory bound. Every row is checked against transformers' hidden_states on the same token ids;
which positions a range selects is checked against Python's own slicing of prompt+completion."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from hidden_states.params import spec_of
from tests.conftest import TEST_ENGINE_ARGS, engine_fixture, long_text, openai_answer, sampling

PROMPTS = [
    "Hello! How are you today?",
    "The router sends every completion to a replica",
    "What is the capital of France? The capital of France is",
]
BOUND = 4 * 2**20  # max_hidden_states_bytes of this module's engine
ERRORS: list[tuple[str, float, float]] = []  # (case, max abs error, max |reference|): printed at the end


engine = engine_fixture(max_hidden_states_bytes=BOUND, one_more_step=PROMPTS[0], errors=ERRORS, **TEST_ENGINE_ARGS)


sp = sampling(max_tokens=16)  # greedy SamplingParams; keywords override


def reference_states(reference, ids, layer: int = -1) -> np.ndarray:
    """transformers' hidden_states[layer][0]: one row per position of `ids`."""
    with reference.torch.no_grad():
        out = reference.model(reference.torch.tensor([list(ids)]), output_hidden_states=True)
    return out.hidden_states[layer][0].float().numpy()


def assert_rows(reference, case: str, ids, positions, rows, layer: int = -1, rtol=1e-5, atol=1e-4):
    """Row i is transformers' hidden state of token positions[i] (the repo's fidelity rule)."""
    ref = reference_states(reference, ids, layer)[list(positions)]
    rows = np.asarray(rows, dtype=np.float32)
    assert rows.shape == ref.shape, (rows.shape, ref.shape)
    diff, scale = float(np.abs(rows - ref).max()), float(np.abs(ref).max())
    assert diff <= rtol * scale and diff <= atol, f"{case}: max abs error {diff:.3g} (max |reference| {scale:.3g})"
    ERRORS.append((case, diff, scale))
    return ref


def complete(engine, loop_thread, prompt, params, **kw):
    return loop_thread.run(engine.complete(prompt, params, **kw))


def asked(position, total: int, prompt_len: int) -> list[int]:
    """The oracle: which positions of prompt+completion a position asks for (Python slicing)."""
    every = list(range(total))
    if position == "all":
        return every
    if position == "completion":
        return every[prompt_len:]
    return every[slice(position["start"], position.get("end"), position.get("stride", 1))]


@pytest.mark.parametrize(
    "position",
    [
        "all",
        "completion",
        {"start": -1},
        {"start": -9, "end": -2, "stride": 3},
        {"start": 2, "end": -3, "stride": 4},
        {"start": 5, "end": 12},
    ],
    ids=["all", "completion", "final", "negative-window", "strided", "prompt-window"],
)
def test_every_position_against_transformers(engine, loop_thread, reference, position):
    c = complete(engine, loop_thread, PROMPTS[1], sp(max_tokens=14), position=position)
    (choice,) = c.choices
    ids = c.prompt_token_ids + choice.token_ids
    want = asked(position, len(ids), len(c.prompt_token_ids))
    assert len(want) > 0 and choice.positions == tuple(want), (choice.positions, want)
    assert choice.hidden_states.dtype == np.float32 and choice.hidden_states.shape == (len(want), 128)
    ref = assert_rows(reference, f"position {position}", ids, want, choice.hidden_states)
    if len(want) > 1:  # row i is position want[i], not its neighbour
        assert np.abs(choice.hidden_states[1:] - ref[:-1]).max() > 1e-2
    assert choice.extraction.via == "tail" if len(ids) - 1 in want else choice.extraction.via == "generation"


def test_all_layers_of_a_long_prompt_in_chunks_and_with_its_prefix_cached(engine, loop_thread, reference):
    """A prompt of several prefill chunks and cache blocks, twice: the second time the prefix cache
    holds it, and the request's own cache salt makes its prefill compute every prompt position
    again (no extraction step). Three layers at once: the decoder-layer hooks take many rows."""
    prompt, layers = long_text(500, seed=11), [-1, 0, 1]
    chunk = engine.llm.vllm_config.scheduler_config.max_num_batched_tokens
    for attempt in range(2):
        c = complete(engine, loop_thread, prompt, sp(max_tokens=8), position="all", layers=layers)
        (choice,) = c.choices
        ids = c.prompt_token_ids + choice.token_ids
        assert len(c.prompt_token_ids) > 2 * chunk and choice.positions == tuple(range(len(ids)))
        assert choice.extraction.via == "tail", choice.extraction  # every row from the steps that ran anyway
        for layer in layers:
            assert_rows(
                reference,
                f"all, layer {layer}, run {attempt}",
                ids,
                range(len(ids)),
                choice.hidden_states_by_layer[layer],
                layer=layer,
            )


def test_n2_each_choice_its_own_rows(engine, loop_thread, reference):
    c = complete(
        engine, loop_thread, PROMPTS[0], sp(n=2, temperature=1.0, seed=7, max_tokens=12), position="completion"
    )
    assert len(c.choices) == 2 and c.choices[0].token_ids != c.choices[1].token_ids
    for choice in c.choices:
        ids = c.prompt_token_ids + choice.token_ids
        assert choice.positions == tuple(range(len(c.prompt_token_ids), len(ids)))
        assert_rows(reference, f"n=2 choice {choice.index}", ids, choice.positions, choice.hidden_states)


def test_a_stop_string_takes_the_final_row_from_the_extraction_step(engine, loop_thread, reference):
    free = complete(engine, loop_thread, PROMPTS[0], sp(max_tokens=24), return_hidden_states=False)
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    c = complete(engine, loop_thread, PROMPTS[0], sp(max_tokens=24, stop=[stop]), position="completion")
    (choice,) = c.choices
    ids = c.prompt_token_ids + choice.token_ids
    assert choice.finish_reason == "stop" and stop not in choice.text
    assert choice.positions == tuple(range(len(c.prompt_token_ids), len(ids)))
    # No tail step (the frontend cuts stop strings): the final row is the extraction step's, and
    # only what no step computed is recomputed (within the last cache block).
    assert choice.extraction.via == "extraction" and choice.extraction.computed_tokens <= 32, choice.extraction
    assert_rows(reference, "stop string", ids, choice.positions, choice.hidden_states)


def test_rows_arrive_across_outputs_and_concatenate_to_the_whole(engine, loop_thread, reference):
    """As a stream sees them: after each engine output, the rows received since the previous one.
    Each position comes once, in the output after the one that brought its token (or with the
    finish), and all of them are the whole response's rows."""
    from vllm.sampling_params import RequestOutputKind

    async def run():
        ids = engine.llm.tokenizer.encode(PROMPTS[2])
        with engine.collecting(spec_of(position="completion", enabled=True)) as col:
            params = sp(max_tokens=12, output_kind=RequestOutputKind.DELTA)
            params.extra_args = col.tagged()
            seen, parts = 0, []
            async for out in engine.llm.generate({"prompt_token_ids": ids}, params, f"t-{uuid.uuid4().hex}"):
                seen += len(out.outputs[0].token_ids)
                finished = out.outputs[0].finish_reason is not None
                batch = col.hand_out((0, 0))
                parts.append((seen, finished, batch))
            return ids, parts

    ids, parts = loop_thread.run(run())
    whole = complete(engine, loop_thread, PROMPTS[2], sp(max_tokens=12), position="completion").choices[0]
    tokens = sum(1 for _ in whole.token_ids)
    assert parts[-1][0] == tokens and parts[-1][1]
    got = [b for _, _, b in parts if b is not None]
    assert len(got) >= 4, [(s, None if b is None else b.positions.tolist()) for s, _, b in parts]  # streamed
    for seen, finished, batch in parts:
        if batch is not None and not finished:  # a token's row comes after the token
            assert batch.positions.max() < len(ids) + seen, (seen, batch.positions)
    positions = np.concatenate([b.positions for b in got])
    rows = np.concatenate([b.floats(-1) for b in got])
    assert positions.tolist() == list(whole.positions)  # each once, in order, all of them
    np.testing.assert_allclose(rows, whole.hidden_states, rtol=0, atol=1e-5)
    assert_rows(reference, "streamed rows", [*ids, *whole.token_ids], positions, rows)


def test_dtypes_are_the_float32_rows_cast(engine, loop_thread, reference):
    """float16 and bfloat16 rows are the engine's float32 rows cast (exactly: the same request,
    computed the same way), and the float32 rows are transformers' (the fidelity rule)."""
    import torch

    prompt, params = PROMPTS[2], sp(max_tokens=10)  # within one cache block: every run computes it whole
    whole = complete(engine, loop_thread, prompt, params, position="all")
    f32 = whole.choices[0]
    assert_rows(
        reference,
        "float32 rows of the dtype runs",
        whole.prompt_token_ids + f32.token_ids,
        f32.positions,
        f32.hidden_states,
    )
    cast = {
        "float16": f32.hidden_states.astype(np.float16).astype(np.float32),
        "bfloat16": torch.from_numpy(f32.hidden_states).to(torch.bfloat16).float().numpy(),
    }
    for dtype, expected in cast.items():
        c = complete(engine, loop_thread, prompt, params, position="all", dtype=dtype).choices[0]
        assert c.token_ids == f32.token_ids and c.positions == f32.positions and c.dtype == dtype
        # the dtype asked, as numpy has it: float16 as float16; bfloat16 (no numpy dtype) as float32 of its values
        assert c.hidden_states.dtype == (np.float16 if dtype == "float16" else np.float32)
        np.testing.assert_array_equal(c.hidden_states, expected)
        assert not np.array_equal(c.hidden_states, f32.hidden_states)  # it was cast
    # completion_end and prompt_end keep their one vector, now cast
    one = complete(engine, loop_thread, prompt, params, dtype="float16").choices[0]
    assert one.positions is None and one.hidden_states.shape == (128,) and one.hidden_states.dtype == np.float16
    np.testing.assert_array_equal(one.hidden_states, cast["float16"][-1])
    first = complete(engine, loop_thread, prompt, params, position="prompt_end", dtype="bfloat16")
    assert first.choices[0].hidden_states.shape == (128,) and first.choices[0].extraction is None
    np.testing.assert_array_equal(first.choices[0].hidden_states, cast["bfloat16"][len(first.prompt_token_ids) - 1])


def test_topk_is_the_largest_magnitudes_of_the_float32_rows(engine, loop_thread, reference):
    import torch

    prompt, params, k = PROMPTS[2], sp(max_tokens=10), 6
    whole = complete(engine, loop_thread, prompt, params, position="all")
    f32 = whole.choices[0]
    expected = torch.topk(torch.from_numpy(f32.hidden_states).abs(), k, dim=-1).indices.numpy()
    gathered = np.take_along_axis(f32.hidden_states, expected, axis=-1)
    for dtype in ("float32", "bfloat16"):
        c = complete(engine, loop_thread, prompt, params, position="all", topk=k, dtype=dtype).choices[0]
        assert c.token_ids == f32.token_ids
        assert c.hidden_states.shape == c.hidden_states_indices.shape == (len(f32.positions), k)
        np.testing.assert_array_equal(c.hidden_states_indices, expected)  # largest |value| first
        want = gathered if dtype == "float32" else torch.from_numpy(gathered).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(c.hidden_states, want)
    # Against transformers: the values at those indices, and no entry left out is larger.
    ref = reference_states(reference, whole.prompt_token_ids + f32.token_ids)
    picked = np.take_along_axis(ref, expected, axis=-1)
    diff, scale = float(np.abs(picked - gathered).max()), float(np.abs(ref).max())
    assert diff <= 1e-5 * scale and diff <= 1e-4, diff
    ERRORS.append(("top-k values", diff, scale))
    rest = np.abs(ref)
    np.put_along_axis(rest, expected, -np.inf, axis=-1)
    assert (np.abs(picked).min(axis=-1) >= rest.max(axis=-1) - 1e-4).all()
    one = complete(engine, loop_thread, prompt, params, topk=k).choices[0]  # completion_end: one position
    assert one.hidden_states.shape == one.hidden_states_indices.shape == (k,)
    np.testing.assert_array_equal(one.hidden_states_indices, expected[-1])


def test_a_request_above_the_memory_bound_is_refused_before_any_engine_work(engine, loop_thread):
    from hidden_states.params import HiddenStatesRequestError, Span, check_rows_budget

    before = loop_thread.run(engine.stats())
    # 8 prompt tokens + 3000: 3008 positions x 3 layers x 128 x 4 bytes = 4.6 MB > 4 MiB
    with pytest.raises(HiddenStatesRequestError, match="max_hidden_states_bytes") as e:
        complete(engine, loop_thread, PROMPTS[0], sp(max_tokens=3000), position="all", layers=[-1, 0, 1])
    assert e.value.param == "hidden_states_position"
    with pytest.raises(HiddenStatesRequestError, match="max_hidden_states_bytes"):  # n multiplies it
        # 2100 positions x 128 x 4 bytes x 4 choices = 4.3 MB
        complete(engine, loop_thread, PROMPTS[0], sp(max_tokens=2100, n=4, temperature=1.0), position="completion")
    after = loop_thread.run(engine.stats())
    assert after["unfinished_requests"] == 0 and after["pending"] == 0
    assert after["workers"][0]["captured"] == before["workers"][0]["captured"]  # nothing ran
    # The same rows in float16 fit.
    check_rows_budget(Span(0), 8, 3000, 1, 3, 128, "float16", None, BOUND)


def test_nothing_stays_after_an_abort(engine, loop_thread, reference):
    """A caller that stops reading (vLLM aborts the engine request): its state goes at once,
    the runner forgets the request with the next step, and a request after it is exact."""
    from vllm.sampling_params import RequestOutputKind

    async def run():
        ids = engine.llm.tokenizer.encode(long_text(300, seed=5))
        with engine.collecting(spec_of(position="all", enabled=True)) as col:
            params = sp(max_tokens=500, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            params.extra_args = col.tagged()
            gen = engine.llm.generate({"prompt_token_ids": ids}, params, f"t-{uuid.uuid4().hex}")
            outs = 0
            async for _ in gen:
                outs += 1
                if outs == 5:
                    break
            await gen.aclose()
            assert any(st.pending for st in col.choices.values()), "rows arrived before the abort"
            return engine.extraction.pending()

    assert loop_thread.run(run()) == 0
    c = complete(engine, loop_thread, PROMPTS[1], sp(max_tokens=6), position="completion")
    ids = c.prompt_token_ids + c.choices[0].token_ids
    assert_rows(reference, "after an abort", ids, c.choices[0].positions, c.choices[0].hidden_states)
    stats = loop_thread.run(engine.stats())
    assert stats["pending"] == 0 and stats["unfinished_requests"] == 0


def test_bad_position_requests_are_refused_clearly(engine):
    from hidden_states.params import HiddenStatesRequestError, spec_of

    def check(layers, position, dtype="float32", topk=None):  # a Python caller's fields, then the model's rules
        return engine.check_spec(spec_of(True, layers, position, dtype, topk, enabled=engine.enabled))

    cases = [
        ({"start": 3, "end": 3}, "selects no position"),
        ({"start": 1, "stride": 0}, "stride"),
        ({"end": 4}, "start must be an integer"),
        ({"start": 0, "step": 2}, "start, end and stride"),
        ("middle", "'completion', 'all'"),
    ]
    for position, words in cases:
        with pytest.raises(HiddenStatesRequestError, match=words) as e:
            check([-1], position)
        assert e.value.param == "hidden_states_position"
    with pytest.raises(HiddenStatesRequestError, match="hidden size") as e:
        check([-1], "completion", "float32", 129)
    assert e.value.param == "hidden_states_topk"
    with pytest.raises(HiddenStatesRequestError, match="float16") as e:
        check([-1], "completion", "float64")
    assert e.value.param == "hidden_states_dtype"


def _answer(engine, loop_thread, route: str, body: dict):
    return openai_answer(engine, loop_thread, route, body)


def test_beam_search_and_a_streamed_chat_over_the_openai_routes(engine, loop_thread, reference):
    """Beam search (its beams' rows all from the extraction step, on each beam's own tokens) and a
    chat stream whose chunks carry the rows as they come, over vLLM's own serving."""
    status, r = _answer(
        engine,
        loop_thread,
        "completions",
        {
            "model": "tiny-llama",
            "prompt": PROMPTS[1],
            "max_tokens": 6,
            "use_beam_search": True,
            "n": 2,
            "return_hidden_states": True,
            "return_token_ids": True,
            "hidden_states_position": "completion",
        },
    )
    assert status == 200, r
    for ch in r["choices"]:
        ids = ch["prompt_token_ids"] + ch["token_ids"]
        meta = ch["hidden_states_meta"]
        assert meta["via"] == "extraction" and meta["positions"] == list(range(len(ch["prompt_token_ids"]), len(ids)))
        assert_rows(reference, f"beam {ch['index']}", ids, meta["positions"], ch["hidden_states"])
    status, events = _answer(
        engine,
        loop_thread,
        "chat",
        {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 10,
            "stream": True,
            "return_hidden_states": True,
            "return_token_ids": True,
            "hidden_states_position": "all",
            "hidden_states_encoding": "base64",
        },
    )
    assert status == 200
    prompt_ids, tokens, positions, rows, carrying = None, [], [], [], 0
    for event in events:
        prompt_ids = event.get("prompt_token_ids") or prompt_ids
        for ch in event.get("choices") or ():
            tokens += ch.get("token_ids") or []
            if "hidden_states" in ch:
                meta = ch["hidden_states_meta"]
                positions += meta["positions"]
                rows.append(
                    np.frombuffer(__import__("base64").b64decode(ch["hidden_states"]), "<f4").reshape(meta["shape"])
                )
                carrying += 1
    ids = prompt_ids + tokens
    # the prompt's rows first, then the completion's as they come (at least one more chunk: vLLM merges a
    # request's outputs into one chunk when its reader lags, as on a loaded machine)
    assert carrying >= 2 and positions == list(range(len(ids)))
    assert_rows(reference, "chat stream, all", ids, positions, np.concatenate(rows))
