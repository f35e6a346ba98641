"""Hidden states under pipeline parallelism 2 on the CPU engine: the tiny Llama's two decoder layers on two stages.

Stage 0 runs decoder layer 0, stage 1 decoder layer 1 and the final norm; only stage 1's outputs reach the
engine core (vLLM's output rank), so it sends the rows: of layer 1 (read at the input of its decoder layer 1, the
stream stage 0 sent) and of the final norm (-1). Each stage applies the steering at its own layers. Checked here
against transformers: the final vector by the tail step and by the extraction step, rows at every position of
layers 1 and -1 in float32 and float16 and top-k, steering at layer 0 (stage 0) and layer 1 (stage 1), tokens
unchanged by asking, and the layer of stage 0 refused by name. (tests/engine/test_pipeline.py checks plain vLLM.)
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from hidden_states.params import HiddenStatesRequestError
from tests.conftest import TEST_ENGINE_ARGS, cpu_only, engine_fixture, long_text, sampling
from tests.engine.test_engine import PROMPTS
from tests.engine.test_positions import reference_states
from tests.steer_ref import steered_greedy, steered_states

pytestmark = cpu_only  # two CPU stages (vLLM's multiprocessing executor); GPUs: untested here

PP_ARGS = {**TEST_ENGINE_ARGS, "pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}
ERRORS: list = []

engine = engine_fixture(env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, warm_up_s=0, errors=ERRORS, **PP_ARGS)
sp = sampling(max_tokens=10)


def check(case: str, got, want) -> None:
    diff, scale = float(np.abs(np.asarray(got, np.float32) - want).max()), float(np.abs(want).max())
    assert diff <= 1e-5 * scale, f"{case}: max abs error {diff:.3g} (max |reference| {scale:.3g})"
    ERRORS.append((case, diff, scale))


def states_of(reference, ids) -> list[np.ndarray]:
    """transformers' hidden_states[0..2] of `ids` (2: the final norm's output), one row per position."""
    return [reference_states(reference, ids, layer) for layer in (0, 1, 2)]


def test_pp2_vectors_exact_by_tail_and_extraction(engine, loop_thread, reference):
    cfg = engine.llm.vllm_config.parallel_config
    assert cfg.pipeline_parallel_size == 2 and cfg.world_size == 2 and cfg.distributed_executor_backend == "mp"
    assert engine.layer_capture["stage_layers"] == [1, 2], engine.layer_capture  # the sending stage's
    prompts = PROMPTS + [long_text(300, seed=41)]  # one over the 256-token prefill chunk

    async def run():
        tails = [
            engine.complete(p, sp(max_tokens=8 + 3 * i), layers=[1, -1], position="all") for i, p in enumerate(prompts)
        ]
        stops = [engine.complete(p, sp(max_tokens=24, stop=["e"]), layers=[1, -1]) for p in prompts[:3]]
        return await asyncio.gather(*tails), await asyncio.gather(*stops)

    tails, stops = loop_thread.run(run(), timeout=300)
    for c in tails:
        ch = c.choices[0]
        ids = list(c.prompt_token_ids) + list(ch.token_ids)
        assert ch.extraction.via == "tail" and ch.extraction.computed_tokens == 1, ch.extraction
        states = states_of(reference, ids)
        for layer in (1, -1):  # every position: the prompt's rows on both stages' steps, the completion's
            check(f"tail, layer {layer}, {len(ids)} tokens", ch.hidden_states_by_layer[layer], states[layer % 3])
    for c in stops:
        ch = c.choices[0]
        assert ch.finish_reason == "stop" and ch.extraction.via == "extraction", ch.extraction
        ids = list(c.prompt_token_ids) + list(ch.token_ids)
        for layer in (1, -1):
            err, scale = reference.assert_matches(ids, ch.hidden_states_by_layer[layer], layer=layer)
            ERRORS.append((f"extraction, layer {layer}", err, scale))


def test_pp2_float16_and_topk_are_the_reference_cast(engine, loop_thread, reference):
    c = loop_thread.run(engine.complete(PROMPTS[1], sp(), layers=[1, -1], position="completion", dtype="float16"))
    ch = c.choices[0]
    ids = list(c.prompt_token_ids) + list(ch.token_ids)
    states = states_of(reference, ids)
    P = len(c.prompt_token_ids)
    for layer in (1, -1):  # the float32 row cast once: at most a float16 rounding step apart
        got = np.asarray(ch.hidden_states_by_layer[layer], np.float32)
        want = states[layer % 3][P:].astype(np.float16).astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=2**-10, atol=2**-24, err_msg=f"float16, layer {layer}")
    k = loop_thread.run(engine.complete(PROMPTS[2], sp(), position="completion_end", topk=8))
    kc = k.choices[0]
    ref = reference.last_hidden(list(k.prompt_token_ids) + list(kc.token_ids), -1)
    top = np.argsort(-np.abs(ref))[:8]
    assert np.asarray(kc.hidden_states_indices).tolist() == top.tolist()  # largest |value| first
    check("top-k values", kc.hidden_states, ref[top])


def test_pp2_rows_of_the_earlier_stage_are_a_400_naming_the_field(engine, loop_thread):
    with pytest.raises(HiddenStatesRequestError) as e:
        loop_thread.run(engine.complete(PROMPTS[0], sp(), layers=[0, -1]))
    assert e.value.param == "hidden_states_layers" and "pipeline stage" in str(e.value), e.value


def test_pp2_asking_changes_no_token(engine, loop_thread):
    async def run(hs):
        return await asyncio.gather(
            *(engine.complete(p, sp(max_tokens=16), return_hidden_states=hs) for p in PROMPTS),
            *(
                engine.complete(p, sp(max_tokens=16, temperature=1.0, seed=7 + i), return_hidden_states=hs)
                for i, p in enumerate(PROMPTS)
            ),
        )

    with_hs, without = loop_thread.run(run(True), timeout=300), loop_thread.run(run(False), timeout=300)
    for a, b in zip(with_hs, without, strict=True):
        assert a.choices[0].token_ids == b.choices[0].token_ids
        assert a.choices[0].finish_reason == b.choices[0].finish_reason


def _b64(seed: int, norm: float) -> tuple[str, np.ndarray]:
    v = np.random.default_rng(seed).normal(size=128).astype(np.float32)
    v = (v / np.linalg.norm(v) * norm).astype(np.float32)
    return base64.b64encode(v.tobytes()).decode(), v


@pytest.mark.parametrize("layers", [(0,), (1,), (0, 1)], ids=["stage 0", "stage 1", "both"])
def test_pp2_steering_at_either_stage_is_transformers(engine, loop_thread, reference, layers):
    """Each stage applies the entries at its own layers: layer 0 at stage 0's input, layer 1 at stage 1's."""
    entries, steering = [], []
    for layer in layers:
        raw, v = _b64(11 + layer, 4.0)
        steering.append({"layer": layer, "vector": raw, "scale": 1.5})
        entries.append((layer, "add", "all", 1.5, v))
    prompt = "The weather today is"
    plain = loop_thread.run(engine.complete(prompt, sp(), return_hidden_states=False))
    out = loop_thread.run(engine.complete(prompt, sp(), steering=steering, layers=[1, -1], position="all"))
    (ch,) = out.choices
    want = steered_greedy(reference.model, list(out.prompt_token_ids), entries, 10)
    assert list(ch.token_ids) == want, (layers, ch.token_ids, want)
    assert list(ch.token_ids) != list(plain.choices[0].token_ids), "the steering changed nothing"
    states = steered_states(reference.model, list(out.prompt_token_ids) + want, entries, len(out.prompt_token_ids))
    for layer in (1, -1):
        check(f"steered at {layers}, layer {layer}", ch.hidden_states_by_layer[layer], states[layer % 3])


def test_pp2_the_last_stage_sends_every_row_and_each_stage_steers_its_own(engine, loop_thread):
    """Stage 1 (the output rank) gathers and copies the rows; stage 0 none. Stage 0 steers layer 0's rows, stage 1
    layer 1's; nothing of ours rides between the stages (vLLM's own hidden states and residual only)."""
    keys = ("captured", "host_copies", "bytes_copied", "steered_rows")
    before = loop_thread.run(engine.stats())["workers"]
    steering = [{"layer": layer, "vector": _b64(20 + layer, 2.0)[0]} for layer in (0, 1)]
    out = loop_thread.run(engine.complete(PROMPTS[0], sp(max_tokens=6), steering=steering, layers=[1, -1]))
    after = loop_thread.run(engine.stats())["workers"]
    stage0, stage1 = ({k: a[k] - b[k] for k in keys} for a, b in zip(after, before, strict=True))
    total = len(out.prompt_token_ids) + len(out.choices[0].token_ids)
    assert stage0["captured"] == stage0["host_copies"] == stage0["bytes_copied"] == 0, stage0
    assert stage1["captured"] >= 1 and stage1["bytes_copied"] >= 2 * 128 * 4, stage1  # two layers' final rows
    # every position computed once on each stage (one tail row after the last token): one steered row per layer
    assert stage0["steered_rows"] == stage1["steered_rows"] == total, (stage0, stage1, total)
