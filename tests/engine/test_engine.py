"""Real vLLM on the built-in model; every vector checked against transformers."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from hidden_states.params import spec_of
from hidden_states.protocol import FAULT_INJECTION_ENV, RequestSpec
from tests.conftest import TEST_ENGINE_ARGS, cpu_only, engine_fixture, long_text, openai_answer, sampling
from tests.helpers import worker_faults

PROMPTS = [
    "Hello! How are you today?",
    "The router sends every completion to a replica",
    "What is the capital of France? The capital of France is",
    "Code: def add(a, b):",
]


def _worker_captured_every_vector(stats):
    (worker,) = stats["workers"]
    assert worker["installed"] and worker["captured"] >= stats["extractions"] + stats["tails"] > 0


# Nothing left behind, after every test of the module, whatever their order.
# Its hooks fail a request that asks (tests only: protocol.FAULT_INJECTION_ENV; the other tests ask none).
engine = engine_fixture(
    one_more_step=PROMPTS[0],
    clean=("pending", "missing_vectors"),
    check=_worker_captured_every_vector,
    env={FAULT_INJECTION_ENV: "1"},
    **TEST_ENGINE_ARGS,
)
# The same engine arguments (the block size and scheduling policy the hidden-states engine defaults to, made
# explicit), hidden states off: no hook. Started after `engine`.
plain_engine = engine_fixture(
    setup=lambda engine: None,
    clean=(),
    enable_return_hidden_states=False,
    block_size=32,
    scheduling_policy="priority",
    **TEST_ENGINE_ARGS,
)


sp = sampling(max_tokens=24)  # greedy SamplingParams; keywords override


def test_one_prompt_greedy(engine, loop_thread, reference):
    c = loop_thread.run(engine.complete(PROMPTS[0], sp()))
    (choice,) = c.choices
    assert choice.hidden_states.dtype == np.float32 and choice.hidden_states.shape == (128,)
    reference.assert_matches(c.prompt_token_ids + choice.token_ids, choice.hidden_states)
    # Exactly the final token: dropping it gives a different vector.
    with pytest.raises(AssertionError):
        reference.assert_matches((c.prompt_token_ids + choice.token_ids)[:-1], choice.hidden_states)


def test_batch_of_prompts_of_different_lengths(engine, loop_thread, reference):
    prompts = PROMPTS + [long_text(60, seed=1), long_text(200, seed=2)]

    async def run():
        return await asyncio.gather(*(engine.complete(p, sp(max_tokens=8 + 5 * i)) for i, p in enumerate(prompts)))

    completions = loop_thread.run(run())
    assert len({len(c.prompt_token_ids) for c in completions}) == len(prompts)
    for c in completions:
        reference.assert_matches(c.prompt_token_ids + c.choices[0].token_ids, c.choices[0].hidden_states)


def test_long_prompt_spans_blocks_and_chunks_and_hits_prefix_cache(engine, loop_thread, reference):
    block = engine.llm.vllm_config.cache_config.block_size
    chunk = engine.llm.vllm_config.scheduler_config.max_num_batched_tokens
    c = loop_thread.run(engine.complete(long_text(700, seed=3), sp(max_tokens=32)))
    choice = c.choices[0]
    total = len(c.prompt_token_ids) + len(choice.token_ids)
    assert len(c.prompt_token_ids) > max(block, chunk) * 2
    reference.assert_matches(c.prompt_token_ids + choice.token_ids, choice.hidden_states)
    # The tail step: one more decode row for the final token, every earlier K/V in place.
    assert choice.extraction.via == "tail" and choice.extraction.tokens == total
    assert choice.extraction.computed_tokens == 1, choice.extraction
    # A stop string is cut in the frontend: the extraction step runs instead, on the prefix cache.
    s = loop_thread.run(engine.complete(long_text(700, seed=3), sp(max_tokens=32, stop=["e"])))
    st, total = s.choices[0].extraction, len(s.prompt_token_ids) + len(s.choices[0].token_ids)
    assert st.via == "extraction" and st.tokens == total
    assert block == 32  # HiddenStatesEngine's CPU default: the step recomputes at most 32 tokens
    assert total - block <= st.cached_tokens < total, st
    reference.assert_matches(s.prompt_token_ids + s.choices[0].token_ids, s.choices[0].hidden_states)


def test_tail_step_on_every_engine_side_stop(engine, loop_thread, reference):
    """EOS-like stop token ids, max_tokens, and min_tokens: the final token's row is captured in
    one extra decode step (1 position computed), the token sampled from it is dropped, and the
    finish reason and stop reason are the original ones."""
    free = loop_thread.run(engine.complete(PROMPTS[3], sp(max_tokens=12)))
    stop_at = free.choices[0].token_ids[4]
    cases = {
        "stop token id": sp(max_tokens=12, stop_token_ids=[stop_at]),
        "max_tokens": sp(max_tokens=5),
        "min_tokens": sp(max_tokens=12, min_tokens=8, stop_token_ids=[stop_at]),
    }
    outs = {name: loop_thread.run(engine.complete(PROMPTS[3], params)) for name, params in cases.items()}
    stopped = outs["stop token id"].choices[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop_at
    assert stopped.token_ids == free.choices[0].token_ids[: len(stopped.token_ids)]
    assert outs["max_tokens"].choices[0].finish_reason == "length" and len(outs["max_tokens"].choices[0].token_ids) == 5
    assert len(outs["min_tokens"].choices[0].token_ids) >= 8
    for name, c in outs.items():
        ch = c.choices[0]
        assert ch.extraction.via == "tail" and ch.extraction.computed_tokens == 1, (name, ch.extraction)
        reference.assert_matches(c.prompt_token_ids + ch.token_ids, ch.hidden_states)
    assert loop_thread.run(engine.stats())["tails"] >= len(cases)


def test_metrics_poll_leaves_an_idle_engine_asleep(engine, loop_thread, reference):
    """The replica's periodic stats(fresh_workers=False) asks the workers (an RPC that wakes
    the engine core and workers into a second of busy-waiting) only after flagged requests
    ran since the last ask; when idle it returns the figures it has."""
    calls = []
    rpc = engine.llm.collective_rpc

    async def counting(method, *args, **kwargs):
        calls.append(method)
        return await rpc(method, *args, **kwargs)

    engine.llm.collective_rpc = counting
    try:
        first = loop_thread.run(engine.stats(fresh_workers=False))["workers"]
        idle = [loop_thread.run(engine.stats(fresh_workers=False))["workers"] for _ in range(3)]
        assert calls.count("hidden_states_stats") <= 1 and all(w == first for w in idle)
        c = loop_thread.run(engine.complete(PROMPTS[0], sp(max_tokens=4)))
        reference.assert_matches(c.prompt_token_ids + c.choices[0].token_ids, c.choices[0].hidden_states)
        before = len(calls)
        after = loop_thread.run(engine.stats(fresh_workers=False))["workers"]
        assert calls[before:] == ["hidden_states_stats"]  # a flagged request ran: the workers are asked
        assert after[0]["captured"] > first[0]["captured"]
        loop_thread.run(engine.stats(fresh_workers=False))
        assert len(calls) == before + 1  # and not again until another one does
        loop_thread.run(engine.stats())
        assert len(calls) == before + 2  # /debug/stats always asks
    finally:
        engine.llm.collective_rpc = rpc


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_tail_step_changes_no_token(engine, plain_engine, loop_thread, sampling):
    """Flagged requests return the tokens unflagged ones do, and unflagged ones those of an
    engine without hidden states (vLLM's own scheduler), token for token, in a batch."""
    params = sp(max_tokens=20) if sampling == "greedy" else sp(max_tokens=20, temperature=1.0, seed=99)
    prompts = PROMPTS + [long_text(80, seed=9)]

    async def batch(eng, hs):
        return await asyncio.gather(*(eng.complete(p, params, return_hidden_states=hs) for p in prompts))

    flagged = loop_thread.run(batch(engine, True))
    unflagged = loop_thread.run(batch(engine, False))
    plain = loop_thread.run(batch(plain_engine, False))
    assert all(c.choices[0].extraction.via == "tail" for c in flagged)
    for f, u, p in zip(flagged, unflagged, plain):
        assert f.choices[0].token_ids == u.choices[0].token_ids == p.choices[0].token_ids
        assert f.choices[0].finish_reason == u.choices[0].finish_reason == p.choices[0].finish_reason


def test_n2_one_vector_per_choice(engine, loop_thread, reference):
    c = loop_thread.run(engine.complete(PROMPTS[1], sp(n=2, temperature=1.0, seed=7, max_tokens=16)))
    assert len(c.choices) == 2 and c.choices[0].token_ids != c.choices[1].token_ids
    for choice in c.choices:
        # n > 1: each choice is its own engine request, held and captured like any other
        assert choice.extraction.via == "tail" and choice.extraction.computed_tokens == 1
        reference.assert_matches(c.prompt_token_ids + choice.token_ids, choice.hidden_states)
    assert not np.array_equal(c.choices[0].hidden_states, c.choices[1].hidden_states)


def test_seeded_sampling(engine, loop_thread, reference):
    a = loop_thread.run(engine.complete(PROMPTS[2], sp(temperature=0.9, seed=1234)))
    b = loop_thread.run(engine.complete(PROMPTS[2], sp(temperature=0.9, seed=1234)))
    assert a.choices[0].token_ids == b.choices[0].token_ids
    reference.assert_matches(a.prompt_token_ids + a.choices[0].token_ids, a.choices[0].hidden_states)


def test_prefix_cache_reset(engine, loop_thread, reference):
    c = loop_thread.run(engine.complete(long_text(300, seed=4), sp(max_tokens=16), return_hidden_states=False))
    ids = c.prompt_token_ids + c.choices[0].token_ids
    assert c.choices[0].hidden_states is None
    loop_thread.run(engine.llm.reset_prefix_cache())
    vec, stats = loop_thread.run(engine.extract_one(ids))
    assert stats.cached_tokens == 0
    reference.assert_matches(ids, vec)


def test_batch_extract(engine, loop_thread, reference, model_dir):
    seqs = [reference.tokenizer(p)["input_ids"] for p in PROMPTS] + [list(range(5, 300))]

    async def run():
        return [vec for vec, _ in await asyncio.gather(*(engine.extract_one(ids) for ids in seqs))]

    vecs = loop_thread.run(run())
    assert len(vecs) == len(seqs)
    for ids, vec in zip(seqs, vecs):
        reference.assert_matches(ids, vec)


def test_stop_string_cuts_text_not_token_ids(engine, loop_thread, reference):
    free = loop_thread.run(engine.complete(PROMPTS[0], sp(max_tokens=24), return_hidden_states=False))
    text = free.choices[0].text
    assert len(text) > 6
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    c = loop_thread.run(engine.complete(PROMPTS[0], sp(max_tokens=24, stop=[stop])))
    choice = c.choices[0]
    assert choice.finish_reason == "stop" and stop not in choice.text
    reference.assert_matches(c.prompt_token_ids + choice.token_ids, choice.hidden_states)


def test_unflagged_requests_generate_the_same_tokens(engine, plain_engine, loop_thread, reference):
    prompts = PROMPTS + [long_text(400, seed=5)]

    async def mixed(eng, flag_every_other: bool):
        return await asyncio.gather(
            *(
                eng.complete(p, sp(max_tokens=20), return_hidden_states=flag_every_other and i % 2 == 0)
                for i, p in enumerate(prompts)
            )
        )

    patched = loop_thread.run(mixed(engine, True))
    plain = loop_thread.run(mixed(plain_engine, False))
    for a, b in zip(patched, plain):
        assert a.choices[0].token_ids == b.choices[0].token_ids
    for i, c in enumerate(patched):
        if i % 2 == 0:
            reference.assert_matches(c.prompt_token_ids + c.choices[0].token_ids, c.choices[0].hidden_states)
        else:
            assert c.choices[0].hidden_states is None


def test_disabled_engine_refuses_clearly(plain_engine, loop_thread):
    from hidden_states.params import HiddenStatesDisabledError

    with pytest.raises(HiddenStatesDisabledError, match="enable_return_hidden_states"):
        loop_thread.run(plain_engine.complete(PROMPTS[0], sp()))


@cpu_only
def test_engine_defaults_for_the_extraction_step(engine, plain_engine):
    assert engine.llm.vllm_config.scheduler_config.policy == "priority"
    assert engine.extraction.extraction_priority < 0  # ahead of generation, which vLLM gives priority 0
    assert engine.llm.vllm_config.cache_config.block_size == 32


def _large_mappings_rss(pid: int, min_bytes: int) -> int:
    """Resident bytes of the process's mappings of at least `min_bytes` (the KV-cache tensors)."""
    total, size = 0, 0
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if line.startswith("Size:"):
                size = int(line.split()[1]) * 1024
            elif line.startswith("Rss:") and size >= min_bytes:
                total += int(line.split()[1]) * 1024
    return total


@cpu_only
def test_kv_cache_is_resident_from_the_start(engine, plain_engine):
    """prefault_kv_cache (default): the worker process maps its whole KV cache
    (kv_cache_memory_bytes) before any load, so it does not grow under load.
    Without it the zeroed KV pages stay unmapped until blocks are first used."""
    import psutil

    kv = TEST_ENGINE_ARGS["kv_cache_memory_bytes"]
    assert engine.startup["kv_cache_prefaulted_bytes"] == kv
    workers = [
        p for p in psutil.Process().children(recursive=True) if "VLLM::Worker" in " ".join(p.cmdline() or [p.name()])
    ]
    assert len(workers) >= 2, workers  # engine and plain_engine
    for p in workers:
        resident = _large_mappings_rss(p.pid, kv // 8)
        assert resident >= 0.95 * kv, (p, resident / 2**20, kv / 2**20)


@cpu_only
def test_cpu_engine_is_warmed_up_before_the_first_request(engine, loop_thread):
    """warm_up_s (default 10 s): one dummy forward per batch size, so oneDNN's
    per-size kernels exist before load, not during it (ledger point 7); and the
    worker's malloc_trim thread runs."""
    from hidden_states.vllm.cpu import warm_up_sizes

    budget = engine.llm.vllm_config.scheduler_config.max_num_batched_tokens
    sizes = warm_up_sizes(budget)
    assert sorted(sizes) == list(range(1, budget + 1))  # every size once
    assert sizes[:3] == [1, 2, 3] and sizes[64] == 72  # decode sizes first, then a ladder of chunk sizes
    assert sorted(warm_up_sizes(2048)) == list(range(1, 2049)) and warm_up_sizes(2048)[119] == 512
    assert engine.startup["warm_up_of"] == len(sizes)
    assert engine.startup["warm_up_batch_sizes"] == len(sizes)  # the tiny model does all within the budget
    assert 0 < engine.startup["warm_up_seconds"] < 10 + 5
    assert engine.startup["kv_cache_prefaulted_bytes"] > 0
    assert engine.startup["malloc_trim_interval_s"] == 5.0
    (worker,) = loop_thread.run(engine.stats())["workers"]
    assert worker["malloc_trim"]["running"] and worker["malloc_trim"]["interval_s"] == 5.0


def test_a_finish_without_its_vector_takes_the_extraction_step_at_once(engine, loop_thread, reference):
    """The output that finishes a choice brings its vector or nothing ("not captured"): with
    the first vector lost on the way, and another one garbled, those choices get the
    extraction step at once, not after extraction_timeout_s, and the rest are untouched."""
    original = engine.extraction.receive
    dropped: list = []

    def lossy(request_id, raw, index):
        if len(dropped) == 0:
            dropped.append(raw)  # lost
            return None
        if len(dropped) == 1:
            dropped.append(raw)
            return original(request_id, {"garbled": True}, index)
        return original(request_id, raw, index)

    engine.extraction.receive = lossy
    before = loop_thread.run(engine.stats())
    try:

        async def run():
            t0 = asyncio.get_running_loop().time()
            outs = await asyncio.gather(*(engine.complete(p, sp(max_tokens=6)) for p in PROMPTS))
            return outs, asyncio.get_running_loop().time() - t0

        outs, seconds = loop_thread.run(run())
    finally:
        engine.extraction.receive = original
    after = loop_thread.run(engine.stats())
    assert seconds < 30 < engine.extraction.extraction_timeout_s, seconds  # no timer
    vias = sorted(c.choices[0].extraction.via for c in outs)
    assert vias == ["extraction", "extraction", "tail", "tail"], vias
    assert after["malformed_vectors"] == before["malformed_vectors"] + 1
    assert after["timeouts"] == before["timeouts"] and after["missing_vectors"] == before["missing_vectors"]
    for c in outs:
        reference.assert_matches(c.prompt_token_ids + c.choices[0].token_ids, c.choices[0].hidden_states)


def test_a_hook_that_raises_fails_its_request_alone_and_the_engine_serves_on(engine, loop_thread, reference):
    """Our hook in vLLM's output loop (the rows' delivery) raising for one request of a batch of four:
    that request fails with HookFaultError (a 500 naming it and the hook; logged, counted in
    `hook_faults`), the three others complete exact with the tokens they get alone, the output handler
    keeps running, and the engine serves the next request, over the Python API and over HTTP."""
    from hidden_states.errors import status_of
    from hidden_states.interface import HookFaultError

    alone = [loop_thread.run(engine.complete(p, sp(max_tokens=6))) for p in PROMPTS[1:]]
    original = engine.extraction.deliver

    def faulty(col, choice, rows, heads):  # raises for the float16 request, as a bug of ours would
        if col.dtype == "float16":
            raise RuntimeError("a bug in deliver")
        return original(col, choice, rows, heads)

    engine.extraction.deliver = faulty
    before = loop_thread.run(engine.stats())
    try:

        async def batch():
            return await asyncio.gather(
                engine.complete(PROMPTS[0], sp(max_tokens=6), dtype="float16"),
                *(engine.complete(p, sp(max_tokens=6)) for p in PROMPTS[1:]),
                return_exceptions=True,
            )

        faulted, *others = loop_thread.run(batch())
    finally:
        engine.extraction.deliver = original
    assert isinstance(faulted, HookFaultError) and faulted.hook == "deliver", faulted
    failure = status_of(faulted)
    assert failure.status == 500 and "`deliver`" in failure.message and faulted.request_id in failure.message
    after = loop_thread.run(engine.stats())
    assert after["hook_faults"] == before["hook_faults"] + 1 and not any(
        c.faults for c in engine.extraction.live.values()
    )
    for c, solo in zip(others, alone):
        assert c.choices[0].token_ids == solo.choices[0].token_ids
        assert (c.choices[0].hidden_states == solo.choices[0].hidden_states).all()
        reference.assert_matches(c.prompt_token_ids + c.choices[0].token_ids, c.choices[0].hidden_states)
    assert not engine.llm.errored
    again = loop_thread.run(engine.complete(PROMPTS[0], sp(max_tokens=6), dtype="float16"))
    assert again.choices[0].hidden_states is not None
    # over HTTP (a replica's frontend): the same fault is a 500 naming the hook; the next request is served
    engine.extraction.deliver = faulty
    try:
        status, body = openai_answer(
            engine,
            loop_thread,
            "completions",
            {
                "model": "tiny-llama",
                "prompt": PROMPTS[0],
                "max_tokens": 4,
                "return_hidden_states": True,
                "hidden_states_dtype": "float16",
            },
        )
    finally:
        engine.extraction.deliver = original
    assert status == 500 and "`deliver`" in body["error"]["message"], body
    status, body = openai_answer(
        engine,
        loop_thread,
        "completions",
        {"model": "tiny-llama", "prompt": PROMPTS[0], "max_tokens": 4, "return_hidden_states": True},
    )
    assert status == 200 and body["choices"][0]["hidden_states"], body


@pytest.mark.parametrize(
    "hook,layers",
    [("plan", (-1,)), ("file", (-1,)), ("send", (-1,)), ("tail", (-1,)), ("capture", (-1,)), ("capture", (1, -1))],
    ids=["plan", "file", "send", "tail", "capture", "capture-layer"],
)
def test_a_hook_in_the_engine_core_that_raises_fails_its_request_alone(engine, loop_thread, reference, hook, layers):
    """The scheduler's hooks (its plan, filing a step's rows, sending them, holding a stopped request for its
    tail step) and the worker's capture (the
    step's pack; a layer's gather inside the forward), each raising for one request of a batch of four
    (a fault injected by the request, sent last so that the steps it is in hold the others' rows too:
    every position's rows are asked): that request fails with HookFaultError (a 500 naming it and the
    hook, counted in `hook_faults`; a worker's also in its own stats), and vLLM finishes it with "error".
    The three others complete with the tokens and rows they get alone, exact against transformers at
    layers 1 and -1, and the engine serves the faulted prompt next."""
    from hidden_states.errors import status_of
    from hidden_states.interface import HookFaultError

    def ask(prompt, layers=(1, -1), extra=None):
        return engine.complete(
            prompt, sp(max_tokens=6, **({"extra_args": extra} if extra else {})), layers=layers, position="all"
        )

    alone = [loop_thread.run(ask(p)) for p in PROMPTS[1:]]
    before = loop_thread.run(engine.stats())

    async def batch():
        return await asyncio.gather(
            *(ask(p) for p in PROMPTS[1:]),
            ask(PROMPTS[0], layers, RequestSpec(inject=hook).into(None)),
            return_exceptions=True,
        )

    *others, faulted = loop_thread.run(batch())
    assert isinstance(faulted, HookFaultError) and faulted.hook == hook, faulted
    failure = status_of(faulted)
    assert failure.status == 500 and f"`{hook}`" in failure.message and "injected" in failure.message, failure
    after = loop_thread.run(engine.stats())
    assert after["hook_faults"] == before["hook_faults"] + 1 and not any(
        c.faults for c in engine.extraction.live.values()
    )
    assert worker_faults(after) - worker_faults(before) == (hook == "capture")
    for c, solo in zip(others, alone):
        (ch,), (want,) = c.choices, solo.choices
        assert ch.token_ids == want.token_ids and ch.positions == want.positions
        ids = list(c.prompt_token_ids) + list(ch.token_ids)
        for layer in (1, -1):
            rows = ch.hidden_states_by_layer[layer]
            assert (rows == want.hidden_states_by_layer[layer]).all()
            for p in (len(c.prompt_token_ids) - 1, len(ids) - 1):  # the prompt's last row and the final token's
                reference.assert_matches(ids[: p + 1], rows[p], layer=layer)
    assert not engine.llm.errored
    again = loop_thread.run(ask(PROMPTS[0], layers))
    ids = list(again.prompt_token_ids) + list(again.choices[0].token_ids)
    reference.assert_matches(ids, again.choices[0].hidden_states[-1])


def _generate(engine, loop_thread, prompt: str, params, hs: bool):
    """vLLM's own RequestOutput of one request, flagged (a collector's tag) or not."""
    import uuid

    async def run():
        ids = engine.llm.tokenizer.encode(prompt)
        with engine.collecting(spec_of(enabled=True)) as col:
            p = params.clone()
            if hs:
                p.extra_args = col.tagged(p.extra_args)
            final = None
            async for out in engine.llm.generate({"prompt_token_ids": ids}, p, f"t-{uuid.uuid4().hex}"):
                final = out
            return final, {key: st.stats for key, st in col.choices.items() if st.stats is not None}

    return loop_thread.run(run())


@pytest.mark.parametrize("stop", ["stop-token-id", "eos-skip-special-false", "max-tokens"])
def test_tail_step_changes_nothing_in_the_output(engine, loop_thread, stop):
    """The held token comes out with its finish, as without hidden states: the same text (a
    stop token's text left out), token ids, logprobs, finish and stop reason."""
    free = _generate(engine, loop_thread, PROMPTS[2], sp(max_tokens=12), hs=False)[0]
    stop_at = free.outputs[0].token_ids[3]
    kw = dict(max_tokens=12, logprobs=2)
    if stop == "stop-token-id":
        kw.update(stop_token_ids=[stop_at])
    elif stop == "eos-skip-special-false":
        kw.update(stop_token_ids=[stop_at], skip_special_tokens=False)
    else:
        kw.update(max_tokens=5)
    params = sp(**kw)
    (with_hs, stats), (without, _) = (_generate(engine, loop_thread, PROMPTS[2], params, hs=h) for h in (True, False))
    a, b = with_hs.outputs[0], without.outputs[0]
    assert [s.via for s in stats.values()] == ["tail"]
    assert (a.text, list(a.token_ids), a.finish_reason, a.stop_reason) == (
        b.text,
        list(b.token_ids),
        b.finish_reason,
        b.stop_reason,
    )
    assert a.logprobs == b.logprobs and a.cumulative_logprob == b.cumulative_logprob
    if stop != "max-tokens":
        assert a.stop_reason == stop_at and a.token_ids[-1] == stop_at


def test_seeded_sampling_with_a_chunked_prompt(engine, loop_thread, reference):
    """vLLM's CPU runner died here (ledger point 5); seeded output stays reproducible."""
    prompt = long_text(500, seed=8)

    async def run():
        return await asyncio.gather(
            engine.complete(prompt, sp(temperature=1.0, seed=42, max_tokens=12)),
            engine.complete(PROMPTS[0], sp(temperature=1.0, seed=43, max_tokens=40)),
        )

    a, _ = loop_thread.run(run())
    b = loop_thread.run(engine.complete(prompt, sp(temperature=1.0, seed=42, max_tokens=12)))
    assert a.choices[0].token_ids == b.choices[0].token_ids
    reference.assert_matches(a.prompt_token_ids + a.choices[0].token_ids, a.choices[0].hidden_states)
