"""Tensor parallelism 2 on the CPU engine: two worker processes (gloo), vectors exact.

The tiny model has 2 attention heads and 1 KV head: vLLM splits the heads one per rank
and replicates the KV head on both. After each layer's all-reduce both ranks hold the
same whole rows; only rank 0 (the output rank: no pipeline parallelism) slices and
sends them (worker.py `attaches`), so each vector crosses once. Checked here against
transformers: tail-step vectors (one position computed), an extraction step (a stop
string), intermediate layers (eager engine), and each worker's capture counts.

vLLM binds each CPU worker's threads to a NUMA node of its own by default
(VLLM_CPU_OMP_THREADS_BIND=auto) and refuses two workers on a one-node machine; the
engine starts here with `nobind`, as Serve replicas do (deployments/config.py).
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from tests.conftest import TEST_ENGINE_ARGS, TEST_MODEL, cpu_only, long_text
from tests.engine.test_engine import PROMPTS, sp

pytestmark = cpu_only  # two CPU ranks (vLLM's multiprocessing executor, gloo); GPUs: untested here

# The test engine's arguments, on two ranks with vLLM's multiprocessing executor named (the CPU
# default for tensor parallelism); no warm-up: a dummy step per batch size takes seconds on two ranks.
TP_ARGS = {**TEST_ENGINE_ARGS, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}


@pytest.fixture(scope="module")
def tp_engine(loop_thread):
    from hidden_states.vllm.engine import HiddenStatesEngine

    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # read by the engine-core process it starts
    try:
        eng = loop_thread.run(HiddenStatesEngine.start(TEST_MODEL, warm_up_s=0, **TP_ARGS), timeout=600)
    finally:
        if saved is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
    yield eng
    eng.shutdown()


def test_tail_and_extraction_vectors_exact_on_two_ranks(tp_engine, loop_thread, reference):
    cfg = tp_engine.llm.vllm_config
    assert cfg.parallel_config.tensor_parallel_size == 2 and cfg.parallel_config.world_size == 2
    assert cfg.parallel_config.distributed_executor_backend == "mp"
    assert tp_engine.extraction.tail_enabled
    prompts = PROMPTS + [long_text(300, seed=21)]  # one prompt over the 256-token prefill chunk

    async def run():
        tails = [tp_engine.complete(p, sp(max_tokens=10 + 3 * i)) for i, p in enumerate(prompts)]
        # a stop string is cut in the frontend: those choices take the extraction step
        stops = [tp_engine.complete(p, sp(max_tokens=24, stop=["e"])) for p in prompts[:3]]
        return await asyncio.gather(*tails), await asyncio.gather(*stops)

    tails, stops = loop_thread.run(run(), timeout=300)
    for c in tails:
        ch = c.choices[0]
        total = len(c.prompt_token_ids) + len(ch.token_ids)
        assert ch.extraction.via == "tail" and ch.extraction.computed_tokens == 1, ch.extraction
        assert ch.extraction.tokens == total
        err, scale = reference.assert_matches(c.prompt_token_ids + ch.token_ids, ch.hidden_states)
        print(f"tail, {total} tokens: max abs error {err:.3g} of max|ref| {scale:.3g}")
    for c in stops:
        ch = c.choices[0]
        assert ch.finish_reason == "stop" and ch.extraction.via == "extraction", ch.extraction
        err, scale = reference.assert_matches(c.prompt_token_ids + ch.token_ids, ch.hidden_states)
        print(f"extraction, {ch.extraction.tokens} tokens: max abs error {err:.3g} of max|ref| {scale:.3g}")
    # the final token is the one the vector is of
    c = tails[0]
    with pytest.raises(AssertionError):
        reference.assert_matches((c.prompt_token_ids + c.choices[0].token_ids)[:-1], c.choices[0].hidden_states)


def test_tail_step_on_two_ranks_changes_no_token(tp_engine, loop_thread):
    """Two ranks sample the same tokens with and without hidden states (a batch, greedy and seeded)."""

    async def run(hs):
        return await asyncio.gather(
            *(tp_engine.complete(p, sp(max_tokens=16), return_hidden_states=hs) for p in PROMPTS),
            *(
                tp_engine.complete(p, sp(max_tokens=16, temperature=1.0, seed=5 + i), return_hidden_states=hs)
                for i, p in enumerate(PROMPTS)
            ),
        )

    with_hs, without = loop_thread.run(run(True), timeout=300), loop_thread.run(run(False), timeout=300)
    for a, b in zip(with_hs, without):
        assert a.choices[0].token_ids == b.choices[0].token_ids
        assert a.choices[0].finish_reason == b.choices[0].finish_reason


def test_intermediate_layers_on_two_ranks(tp_engine, loop_thread, reference):
    """The residual stream entering each layer is whole on every rank (after the all-reduce)."""
    assert tp_engine.eager and tp_engine.layer_capture["layer_capture"], tp_engine.layer_capture
    layers = [0, 1, -1]
    for prompt, params in ((PROMPTS[1], sp(max_tokens=12)), (long_text(120, seed=22), sp(max_tokens=20, stop=["a"]))):
        c = loop_thread.run(tp_engine.complete(prompt, params, layers=layers), timeout=120)
        ch = c.choices[0]
        ids = c.prompt_token_ids + ch.token_ids
        assert sorted(ch.hidden_states_by_layer) == sorted(layers), ch.hidden_states_by_layer
        for layer in layers:
            err, scale = reference.assert_matches(ids, ch.hidden_states_by_layer[layer], layer=layer)
            print(
                f"{ch.extraction.via}: layer {layer} over {len(ids)} tokens: max abs error {err:.3g} "
                f"of max|ref| {scale:.3g}"
            )
        assert not np.array_equal(ch.hidden_states_by_layer[0], ch.hidden_states_by_layer[-1])


def test_each_vector_is_sent_once_by_rank_0(tp_engine, loop_thread, reference):
    """Rank 0 captures and sends every vector; rank 1 none (its rows are the same)."""
    before = loop_thread.run(tp_engine.stats(), timeout=60)
    w0, w1 = before["workers"]  # one per rank, in rank order (collective_rpc)
    assert w0["installed"] and w1["installed"]

    async def run():
        return await asyncio.gather(
            *(tp_engine.complete(p, sp(max_tokens=8 + i, n=2, temperature=1.0, seed=i)) for i, p in enumerate(PROMPTS)),
            tp_engine.complete(PROMPTS[0], sp(max_tokens=24, stop=["e"])),
            tp_engine.complete(PROMPTS[2], sp(max_tokens=8), layers=[1, -1]),
        )

    outs = loop_thread.run(run(), timeout=300)
    vectors = sum(len(c.choices) for c in outs)
    for c in outs:
        for ch in c.choices:
            reference.assert_matches(c.prompt_token_ids + ch.token_ids, ch.hidden_states)
    after = loop_thread.run(tp_engine.stats(), timeout=60)
    a0, a1 = after["workers"]
    sent = (after["tails"] - before["tails"]) + (after["extractions"] - before["extractions"])
    assert sent == vectors == 2 * len(PROMPTS) + 2, (sent, vectors)
    assert a0["captured"] - w0["captured"] == vectors, (w0, a0)
    assert (
        (a1["captured"], a1["steps_with_capture"], a1["host_copies"])
        == (w1["captured"], w1["steps_with_capture"], w1["host_copies"])
        == (0, 0, 0)
    ), a1
    assert after["pending"] == 0 and after["missing_vectors"] == before["missing_vectors"] == 0
