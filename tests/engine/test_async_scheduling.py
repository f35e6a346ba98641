"""vLLM's own async scheduling path, on the CPU engine, against transformers.

vLLM's CPU platform turns async scheduling off ("not required on CPU"). With the test-only shim
(`hidden_states.vllm.patches.cpu_async_shim`, ledger point 12: CPU stand-ins for the CUDA
stream and event calls of Model Runner V1's async path, and `async_scheduling` set back on after
vLLM resolved the configuration) the engine runs vLLM's AsyncScheduler, its batch-queue engine
loop and the runner's async output path, with our AsyncVectorScheduler. Its tail: the step in
flight after a stop computes the final token (its input is the token the stop came with), and the
finishing output waits one step for that row. Checked at batch 12: every final-token vector from
that step (`via: tail`, 1 position computed), exact, with max_tokens and stop-token finishes and
n > 1; rows across the completion and prompt_end exact too; the same requests without hidden
states give the same tokens. What the device (CUDA streams, pinned copies) would add is not
tested here.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.conftest import TEST_ENGINE_ARGS, cpu_only, long_text, running_engine, sampling

pytestmark = cpu_only  # the shim stands in for CUDA: on a GPU the real async path runs (make gpu-check)

PROMPTS = [
    "Hello! How are you today?",
    "The router sends every completion to a replica",
    "What is the capital of France? The capital of France is",
    "Code: def add(a, b):",
    long_text(40, seed=3),
    "one two three one two three one two",
    long_text(300, seed=4),
    "a b a b a b a b",
]


@pytest.fixture(scope="module")
def async_engine(loop_thread):
    import hidden_states.vllm.worker.extension  # noqa: F401  (imported here without the shim: this process keeps CUDA's)
    from hidden_states.vllm.patches.cpu_async_shim import CPU_ASYNC_ENV

    # CPU_ASYNC_ENV while the engine starts: read by start() and, inherited, by the engine-core process.
    from tests.heads_ref import build_test_heads

    with running_engine(
        loop_thread,
        env={CPU_ASYNC_ENV: "1"},
        timeout=600,
        clean=("pending", "missing_vectors"),
        heads=build_test_heads(),
        **TEST_ENGINE_ARGS,
    ) as eng:
        yield eng


sp = sampling(max_tokens=16)  # greedy SamplingParams; keywords override


def _rows(reference, ids) -> np.ndarray:
    torch = reference.torch
    with torch.no_grad():
        return reference.model(torch.tensor([list(ids)]), output_hidden_states=True).hidden_states[-1][0].numpy()


WORST: list[tuple[float, float, str]] = []  # (max abs error / max |reference|, max |reference|, what)


def _close(got, ref, what) -> None:
    err, scale = float(np.abs(got - ref).max()), float(np.abs(ref).max())
    WORST.append((err / scale, scale, what))
    assert err <= 1e-5 * scale + 1e-6, f"{what}: max abs error {err:.3g}, max |reference| {scale:.3g}"


def test_async_tail_vectors_exact_and_one_position_each(async_engine, loop_thread, reference):
    eng = async_engine
    assert loop_thread.run(eng.stats())["startup"]["async_scheduling"] is True  # vLLM's async path, really
    probe = loop_thread.run(eng.complete(PROMPTS[5], sp(max_tokens=16), return_hidden_states=False))
    stop_id = probe.choices[0].token_ids[6]
    cases = [
        *((p, sp(max_tokens=10 + i), {}) for i, p in enumerate(PROMPTS)),
        (PROMPTS[5], sp(max_tokens=16, stop_token_ids=[stop_id]), {}),
        (PROMPTS[0], sp(max_tokens=12, n=2, temperature=0.9, seed=3), {}),
        (PROMPTS[1], sp(max_tokens=12), {"position": "completion"}),
        (PROMPTS[2], sp(max_tokens=8), {"position": "prompt_end"}),
    ]

    async def run(hs: bool):
        return await asyncio.gather(
            *(eng.complete(p, s, return_hidden_states=hs, **(kw if hs else {})) for p, s, kw in cases)
        )

    before = loop_thread.run(eng.stats())
    flagged, plain = loop_thread.run(run(True), timeout=600), loop_thread.run(run(False), timeout=600)
    computed, finishes = [], set()
    for (prompt, _params, kw), c, q in zip(cases, flagged, plain):
        assert [(ch.token_ids, ch.finish_reason) for ch in c.choices] == [
            (ch.token_ids, ch.finish_reason) for ch in q.choices
        ], (prompt, kw)
        position = kw.get("position", "completion_end")
        for ch in c.choices:
            ids = list(c.prompt_token_ids) + list(ch.token_ids)
            ref = _rows(reference, ids)
            finishes.add(ch.finish_reason)
            if position == "completion_end":
                _close(ch.hidden_states, ref[-1], prompt[:20])
                assert ch.extraction.via == "tail", ch.extraction  # the step in flight, not an extraction
                computed.append(ch.extraction.computed_tokens)
            elif position == "prompt_end":
                _close(ch.hidden_states, _rows(reference, c.prompt_token_ids)[-1], "prompt_end")
            else:
                P = len(c.prompt_token_ids)
                assert list(ch.positions) == list(range(P, len(ids)))
                _close(ch.hidden_states, ref[P:], "rows")
                assert ch.extraction.via == "tail" and ch.extraction.computed_tokens == 1, ch.extraction
    assert {"stop", "length"} <= finishes, finishes
    assert computed and set(computed) == {1}, computed  # tokens computed per vector under async scheduling
    after = loop_thread.run(eng.stats())
    assert after["extractions"] == before["extractions"]  # rows too: their final row from the step in flight
    rel, scale, what = max(WORST)
    print(
        f"\nasync scheduling: {len(computed)} vectors, tokens computed per vector {set(computed)}; worst "
        f"relative error {rel:.2g} (max |reference| {scale:.3g}, {what})"
    )


def test_a_stop_condition_under_async_scheduling(async_engine, loop_thread, reference):
    """A stop condition on the step in flight's side: the request stops at the first position the reference
    (numpy on transformers' rows) crosses; the token sampled past it, and the step in flight's row, are
    dropped; its final vector is the row the monitored step computed (no extraction, no extra step)."""
    from tests.engine.test_heads import reference_scores
    from tests.heads_ref import build_test_heads, crossing

    eng = async_engine
    plain = loop_thread.run(eng.complete(PROMPTS[1], sp(max_tokens=12)))
    P = len(plain.prompt_token_ids)
    ids = list(plain.prompt_token_ids) + list(plain.choices[0].token_ids)
    scores = reference_scores(reference, build_test_heads(), ids, "mid", 0)
    p, threshold = crossing(scores, P, True)
    before = loop_thread.run(eng.stats())
    out = loop_thread.run(
        eng.complete(PROMPTS[1], sp(max_tokens=12), stop_conditions=[{"head": "mid", "feature": 0, "above": threshold}])
    )
    (ch,) = out.choices
    assert list(ch.token_ids) == ids[P : p + 1] and ch.finish_reason == "stop" and ch.stop["position"] == p
    _close(ch.hidden_states, _rows(reference, ids[: p + 1])[-1], "async stop: final vector")
    # the monitored step computed it as a generation row: no tail, no extraction
    assert ch.extraction.via == "generation" and loop_thread.run(eng.stats())["extractions"] == before["extractions"]


@pytest.mark.parametrize(
    "case",
    [
        "add at 1 when the probe (after the norm) says pos",
        "add at 0 when an SAE feature at 1 is low",
        "ablate at 1 when the probe at 1 is high",
    ],
)
def test_conditional_steering_under_async_scheduling_is_transformers_position_by_position(
    async_engine, loop_thread, reference, case
):
    """`when` under async scheduling: the next step is scheduled before the step in flight's scores reach the
    scheduler, so the worker decides that position itself, on the device, from its own verdict of the row
    before (PlanEntry.steer_if), the verdict the scheduler reaches later from the same score. The same check
    as on the synchronous engine (tests/engine/test_steering.py: tokens, positions applied, rows at layers 0,
    1 and -1 of every position, the extraction step's replay) against transformers deciding position by
    position; the final row from the step in flight. Counted by the workers over the first completion: they
    decided its positions themselves (`gated_planned`: one a step from the first completion position on), and
    the rows they steered (gated ones counted on the device where they applied) are the positions applied."""
    from tests.engine.test_steering import WHEN_CASES, check_conditional

    assert case in WHEN_CASES

    def counts():
        workers = loop_thread.run(async_engine.stats())["workers"]
        return sum(w["steered_rows"] for w in workers), sum(w["gated_planned"] for w in workers)

    applied, (steered, planned) = check_conditional(
        async_engine, loop_thread, reference, case, via="tail", measure=counts
    )
    assert planned >= 8, planned  # max_tokens 8: positions P..P+7, each decided by the worker (+ a step past a finish)
    assert steered == len(applied) > 0, (steered, applied)


@pytest.fixture(scope="module")
def async_compiled_engine(loop_thread):
    """The GPU's default shape on the CPU: compiled (the static layer set traced, worker/traced.py) and async."""
    from hidden_states.vllm.patches.cpu_async_shim import CPU_ASYNC_ENV
    from tests.heads_ref import build_test_heads

    with running_engine(
        loop_thread,
        env={CPU_ASYNC_ENV: "1"},
        timeout=900,
        clean=("pending", "missing_vectors"),
        heads=build_test_heads(),
        capture_layers=[0, 1],
        warm_up_s=0,
        **{**TEST_ENGINE_ARGS, "enforce_eager": False},
    ) as eng:
        yield eng


@pytest.mark.parametrize(
    "case", ["add at 0 when an SAE feature at 1 is low", "ablate at 1 when the probe at 1 is high"]
)
def test_conditional_steering_async_and_compiled(async_compiled_engine, loop_thread, reference, case):
    """The same, on a compiled engine: a worker's decision goes into the traced entries' buffers as a 0/1 factor
    and the row mask (traced.fill), nothing read back on the host; vLLM's and dynamo's compile counts unchanged."""
    from tests.engine.test_steering import check_conditional

    eng = async_compiled_engine

    def counts():
        (worker,) = loop_thread.run(eng.stats())["workers"]
        return worker["steered_rows"], worker["gated_planned"], *worker["compilations"].values()

    assert eng.eager is False and eng.layer_capture["capture_layers"] == [0, 1]
    applied, (steered, planned, *compiles) = check_conditional(
        eng, loop_thread, reference, case, via="tail", measure=counts
    )
    assert planned >= 8 and steered == len(applied) > 0, (planned, steered, applied)
    assert not any(compiles), compiles


def test_conditional_steering_under_async_scheduling_is_refused_with_tensor_parallelism(async_engine, loop_thread):
    """Only the rank that sends scores the rows, and every rank must steer alike: under async scheduling with
    tensor parallelism a `when` entry is a 400 naming the field, before any engine work. (The frontend's copy
    of the configuration says TP = 2 for the check; the engine core is not asked.)"""
    from hidden_states.params import HiddenStatesRequestError

    parallel = async_engine.llm.vllm_config.parallel_config
    steering = [
        {
            "layer": 1,
            "vector": [0.5] * 128,
            "positions": "completion",
            "when": {"head": "mid", "feature": 0, "above": 0.5},
        }
    ]
    saved = parallel.world_size  # TP x PP, set when the configuration was made
    parallel.world_size = 2
    try:
        with pytest.raises(HiddenStatesRequestError) as e:
            loop_thread.run(async_engine.complete(PROMPTS[0], sp(max_tokens=4), steering=steering))
    finally:
        parallel.world_size = saved
    assert "tensor or pipeline parallelism" in str(e.value) and e.value.param == "hidden_states_steering", str(e.value)
    out = loop_thread.run(async_engine.complete(PROMPTS[0], sp(max_tokens=4), steering=steering))  # TP = 1: served
    assert out.choices[0].steering[0]["when"]["head"] == "mid"


def test_a_pool_under_async_scheduling_takes_the_step_in_flights_row(async_engine, loop_thread, reference):
    """hidden_states_pool: the final row, computed by the step in flight, joins the engine core's sum (no
    extraction step); n = 2 sampled and a greedy request side by side."""
    from tests.engine.test_pool import pooled

    eng = async_engine
    before = loop_thread.run(eng.stats())

    async def run():
        return await asyncio.gather(
            eng.complete(PROMPTS[1], sp(max_tokens=12), spec=pooled("completion", [1, -1])),
            eng.complete(PROMPTS[0], sp(max_tokens=9, n=2, temperature=1.0, seed=5), spec=pooled("all", [-1])),
        )

    greedy, sampled = loop_thread.run(run(), timeout=600)
    for c, position, layers in ((greedy, "completion", [1, -1]), (sampled, "all", [-1])):
        P = len(c.prompt_token_ids)
        for ch in c.choices:
            ids = list(c.prompt_token_ids) + list(ch.token_ids)
            lo = P if position == "completion" else 0
            assert ch.pool == len(ids) - lo and ch.extraction.via == "tail", ch.extraction
            for layer in layers:
                with reference.torch.no_grad():
                    rows = reference.model(reference.torch.tensor([ids]), output_hidden_states=True).hidden_states
                _close(ch.hidden_states_by_layer[layer], rows[layer][0].numpy()[lo:].mean(axis=0), f"pool {layer}")
    assert loop_thread.run(eng.stats())["extractions"] == before["extractions"]
