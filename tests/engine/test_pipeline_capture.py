"""Hidden states under pipeline parallelism 2 on the CPU engine: the tiny Llama's two decoder layers on two stages.

Stage 0 runs decoder layer 0, stage 1 decoder layer 1 and the final norm; only stage 1's outputs reach the
engine core (vLLM's output rank), so it sends the rows: layer 0's, gathered on stage 0 and riding its
intermediate tensors to stage 1; layer 1's (read at the input of its decoder layer 1, the stream stage 0 sent);
the final norm's (-1). Each stage applies the steering at its own layers. Checked here against transformers: the
final vector by the tail step and by the extraction step, rows at every position of layers 0, 1 and -1 in float32
and float16 and top-k, tokens unchanged by asking, the rows each stage gathered, sent on and received; and, imported
from the one-stage modules, heads (SAEs, linear) and stop conditions (one from a head at stage 0's layer), steering
(add, ablate, clamp, cap, conditional, registered vectors) at layers 0 and 1, n = 2, beam search and streams; TOPLOC
proofs (built on the last stage) against the toploc library, validated by the engine's own routes; the LoRA adapter
tests of tests/engine/test_lora.py (the engine runs with enable_lora and two adapters: the other tests' base requests
get no delta, ledger point 11). (tests/engine/test_pipeline.py checks plain vLLM.)
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from hidden_states.proofs import toploc as ours
from hidden_states.protocol import FAULT_INJECTION_ENV
from tests.conftest import TEST_ENGINE_ARGS, Reference, cpu_only, engine_fixture, long_text, sampling
from tests.engine import test_heads
from tests.engine.test_engine import (  # noqa: F401
    PROMPTS,
    test_a_hook_in_the_engine_core_that_raises_fails_its_request_alone,
    test_a_hook_that_raises_fails_its_request_alone_and_the_engine_serves_on,
    test_tail_step_changes_nothing_in_the_output,
)
from tests.engine.test_heads import (  # noqa: F401
    test_a_stop_condition_finishes_at_the_first_position_the_reference_crosses,
    test_heads_and_rows_across_the_completion_n2,
)
from tests.engine.test_lora import (  # noqa: F401
    LORA_ARGS,
    adapters,
    test_intermediate_layers_come_from_the_adapter,
    test_stop_string_extraction_on_the_adapters_prefix_cache,
    test_tail_step_vector_is_the_adapters,
    test_two_adapters_and_the_base_in_one_batch,
)
from tests.engine.test_positions import (  # noqa: F401
    BOUND,
    reference_states,
    test_beam_search_and_a_streamed_chat_over_the_openai_routes,
    test_n2_each_choice_its_own_rows,
)
from tests.engine.test_proofs import (  # noqa: F401
    choice,
    test_each_rejection_fails_when_the_server_s_validation_is_broken,
)
from tests.engine.test_steering import (  # noqa: F401
    registered,
    registered_vectors,
    test_a_conditional_entry_applies_where_its_condition_held_on_the_row_before,
    test_a_worker_hook_that_raises_fails_its_request_alone,
    test_clamp_and_cap_are_transformers_with_saelens_in_the_same_hook,
    test_registered_vectors_and_sae_features_as_entries,
    test_steered_tokens_and_rows_are_transformers_with_the_same_hook,
    test_the_extraction_step_is_steered_the_same,
    test_unsteered_requests_beside_steered_ones_are_byte_for_byte_unchanged,
    unit_vector,
)
from tests.heads_ref import build_test_heads
from tests.toploc_ref import (
    a_prompt_token_changed,
    altered_proof,
    another_completion,
    another_model,
    another_prompt,
    fed_rows,
    honest,
    library_ok,
    load_toploc,
    perturbed,
)

pytestmark = cpu_only  # two CPU stages (vLLM's multiprocessing executor); GPUs: untested here

PP_ARGS = {**TEST_ENGINE_ARGS, "pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}
# With LoRA on (two rank-8 adapters, tests/engine/test_lora.py): every other test here runs base requests, which
# the adapters leave alone (ledger point 11)
ERRORS: list = []


@pytest.fixture(scope="module")
def heads():
    return build_test_heads()


# The engine tests imported above (heads and stop conditions, steering of every kind at layers 0 and 1, n = 2,
# beam search, streams) run here again on two stages, with the heads and vectors their modules register.
engine = engine_fixture(
    setup=lambda heads, registered: {"heads": heads, "steering_vectors": registered_vectors(registered)},  # noqa: F811
    # the containment tests imported above inject faults (tests only: the other tests ask none)
    env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", FAULT_INJECTION_ENV: "1"},
    warm_up_s=0,
    max_hidden_states_bytes=BOUND,
    errors=ERRORS,
    **PP_ARGS,
    **LORA_ARGS,
)
sp = sampling(max_tokens=10)
# a stop condition from a head at stage 0's layer (the gated SAE reads layer 0): its rows are sent on to be scored
test_heads.STOP_CASES.setdefault("gated sae above, stage 0", ("sae-gated", {"feature": None}, None, True))


@pytest.mark.parametrize("case", ["gated sae above, stage 0"])
def test_pp2_a_stop_condition_from_a_head_of_stage_0(engine, loop_thread, reference, heads, case):
    test_a_stop_condition_finishes_at_the_first_position_the_reference_crosses(
        engine, loop_thread, reference, heads, case
    )


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
            engine.complete(p, sp(max_tokens=8 + 3 * i), layers=[0, 1, -1], position="all")
            for i, p in enumerate(prompts)
        ]
        stops = [engine.complete(p, sp(max_tokens=24, stop=["e"]), layers=[0, 1, -1]) for p in prompts[:3]]
        return await asyncio.gather(*tails), await asyncio.gather(*stops)

    tails, stops = loop_thread.run(run(), timeout=300)
    for c in tails:
        ch = c.choices[0]
        ids = list(c.prompt_token_ids) + list(ch.token_ids)
        assert ch.extraction.via == "tail" and ch.extraction.computed_tokens == 1, ch.extraction
        states = states_of(reference, ids)
        for layer in (0, 1, -1):  # every position: stage 0's layer and stage 1's, prompt and completion
            check(f"tail, layer {layer}, {len(ids)} tokens", ch.hidden_states_by_layer[layer], states[layer % 3])
    for c in stops:
        ch = c.choices[0]
        assert ch.finish_reason == "stop" and ch.extraction.via == "extraction", ch.extraction
        ids = list(c.prompt_token_ids) + list(ch.token_ids)
        for layer in (0, 1, -1):
            err, scale = reference.assert_matches(ids, ch.hidden_states_by_layer[layer], layer=layer)
            ERRORS.append((f"extraction, layer {layer}", err, scale))


def test_pp2_float16_and_topk_are_the_reference_cast(engine, loop_thread, reference):
    c = loop_thread.run(engine.complete(PROMPTS[1], sp(), layers=[0, 1, -1], position="completion", dtype="float16"))
    ch = c.choices[0]
    ids = list(c.prompt_token_ids) + list(ch.token_ids)
    states = states_of(reference, ids)
    P = len(c.prompt_token_ids)
    for layer in (0, 1, -1):  # the float32 row cast once: at most a float16 rounding step apart
        got = np.asarray(ch.hidden_states_by_layer[layer], np.float32)
        want = states[layer % 3][P:].astype(np.float16).astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=2**-10, atol=2**-24, err_msg=f"float16, layer {layer}")
    k = loop_thread.run(engine.complete(PROMPTS[2], sp(), position="completion_end", topk=8))
    kc = k.choices[0]
    ref = reference.last_hidden(list(k.prompt_token_ids) + list(kc.token_ids), -1)
    top = np.argsort(-np.abs(ref))[:8]
    assert np.asarray(kc.hidden_states_indices).tolist() == top.tolist()  # largest |value| first
    check("top-k values", kc.hidden_states, ref[top])


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


def _b64(seed: int, norm: float) -> str:
    return base64.b64encode(unit_vector(seed, norm).tobytes()).decode()


def test_pp2_the_last_stage_sends_every_row_and_each_stage_steers_its_own(engine, loop_thread):
    """Stage 0 gathers layer 0's rows and sends them on with its intermediate tensors; stage 1 (the output rank)
    receives them, gathers its own and copies every row to the host; each stage steers its own layer."""
    keys = ("captured", "host_copies", "bytes_copied", "steered_rows", "forwarded_rows", "received_rows")
    keys += ("forwarded_bytes",)
    before = loop_thread.run(engine.stats())["workers"]
    steering = [{"layer": layer, "vector": _b64(20 + layer, 2.0)} for layer in (0, 1)]
    out = loop_thread.run(
        engine.complete(PROMPTS[0], sp(max_tokens=6), steering=steering, layers=[0, 1, -1], position="all")
    )
    after = loop_thread.run(engine.stats())["workers"]
    stage0, stage1 = ({k: a[k] - b[k] for k in keys} for a, b in zip(after, before, strict=True))
    total = len(out.prompt_token_ids) + len(out.choices[0].token_ids)
    assert stage0["captured"] == stage0["host_copies"] == stage0["bytes_copied"] == stage0["received_rows"] == 0
    # every position's layer-0 row, once (float32 rows of 128, and each step's index)
    assert stage0["forwarded_rows"] == stage1["received_rows"] == total, (stage0, stage1, total)
    assert stage0["forwarded_bytes"] > total * 128 * 4, stage0
    assert stage1["forwarded_rows"] == 0 and stage1["bytes_copied"] >= 3 * total * 128 * 4, stage1
    # every position computed once on each stage (one tail row after the last token): one steered row per layer
    assert stage0["steered_rows"] == stage1["steered_rows"] == total, (stage0, stage1, total)


# Faults stay with their request on every stage: the containment tests imported above run on the last stage's hooks
# (capture at layer 1 and -1, heads, steering at layer 1) and the engine core's; these fail a request on stage 0,
# which sends the fault on with its intermediate tensors for the last stage to report (capture.forward_rows).
@pytest.mark.parametrize("hook,layers", [("capture", (0, -1))], ids=["capture-stage-0"])
def test_pp2_a_capture_fault_on_stage_0_fails_its_request_alone(engine, loop_thread, reference, hook, layers):
    before = loop_thread.run(engine.stats())["workers"]
    test_a_hook_in_the_engine_core_that_raises_fails_its_request_alone(engine, loop_thread, reference, hook, layers)
    after = loop_thread.run(engine.stats())["workers"]
    assert after[0]["hook_faults"] == before[0]["hook_faults"] + 1  # raised on stage 0...
    assert after[0]["forwarded_faults"] > before[0]["forwarded_faults"]  # ...sent on, reported by stage 1
    assert after[1]["hook_faults"] == before[1]["hook_faults"]


def test_pp2_a_steering_fault_on_stage_0_fails_its_request_alone(engine, loop_thread, reference):
    before = loop_thread.run(engine.stats())["workers"]
    test_a_worker_hook_that_raises_fails_its_request_alone(engine, loop_thread, reference, "steering", layer=0)
    after = loop_thread.run(engine.stats())["workers"]
    assert (
        after[0]["hook_faults"] == before[0]["hook_faults"] + 1 and after[1]["hook_faults"] == before[1]["hook_faults"]
    )
    assert after[0]["forwarded_faults"] > before[0]["forwarded_faults"]


# TOPLOC proofs: built from the final norm's rows, on the last stage. The proof tests' fixtures, here: this engine
# (float32, so the server's validation recomputes the rows transformers does), its own OpenAI routes (which validate
# through the same two stages), the tiny Llama's oracle, and another model (its weights with 20% noise: on this
# random model 5% passes TOPLOC, tests/serve/test_proofs.py).
PROOF = {"scheme": "toploc", "topk": 128, "decode_batching_size": 8}  # small windows: several proofs per choice


@pytest.fixture(scope="module")
def tl():
    return load_toploc()


@pytest.fixture(scope="module")
def proof_engine(engine, loop_thread):
    engine.dtype = "float32"  # (the label test_proofs' checks read)
    return engine, loop_thread.run(engine.openai("tiny-llama", "r0"))


@pytest.fixture(scope="module")
def proof_ref(reference):
    return reference


@pytest.fixture(scope="module")
def other_model(reference):
    return perturbed(reference.model, 0.2)


def test_pp2_proofs_pass_the_library_and_the_server_agrees(proof_engine, loop_thread, reference, tl, other_model):
    """Proofs from two stages pass the toploc library on transformers' rows, proof by proof as the server (its
    validation run through the same two stages) says; each tampered case is rejected by both."""
    eng, routes = proof_engine
    prompts = [PROMPTS[0], PROMPTS[2], long_text(300, seed=43)]  # the last over the 256-token prefill chunk

    async def run():
        return await asyncio.gather(
            *(eng.complete(p, sp(max_tokens=20), proof=PROOF) for p in prompts),
            eng.complete(prompts[1], sp(max_tokens=20, n=2, temperature=1.0, seed=5), proof=PROOF),
        )

    outs = loop_thread.run(run(), timeout=600)
    token_prompts = [list(o.prompt_token_ids) for o in outs[:2]]
    counted = 0
    for out in outs:
        prompt = list(out.prompt_token_ids)
        P = len(prompt)
        for ch in out.choices:
            completion, proofs = list(ch.token_ids), list(ch.proofs)
            ids = prompt + completion
            assert (
                ch.hidden_states is None
                and len(proofs) == len(ours.chunk_bounds(P, len(ids), PROOF["decode_batching_size"])) >= 3
            )
            lib = library_ok(
                tl, fed_rows(reference.model, ids, P), proofs, PROOF["decode_batching_size"], PROOF["topk"]
            )
            assert all(lib), lib
            c = choice(
                loop_thread,
                routes,
                eng,
                tl,
                reference,
                other_model,
                token_prompts,
                prompt,
                completion,
                proofs,
                PROOF,
                True,
            )
            assert [p["ok"] for p in c.server(prompt, completion, proofs)["proofs"]] == lib
            for case in (honest, another_completion, another_prompt, another_model):
                case(c)
            if P < 64:
                a_prompt_token_changed(c)
            else:  # one token of 300 words moves too little of TOPLOC's top-k: the library may accept it; so may we
                tampered = [prompt[0], (prompt[1] + 1) % 256, *prompt[2:]]
                lib = c.library(reference.model, tampered, completion, proofs)
                assert [p["ok"] for p in c.server(tampered, completion, proofs)["proofs"]] == lib, lib
            altered_proof(c)
            counted += 1
    assert counted == 5


# LoRA: the adapter tests of tests/engine/test_lora.py (the tail step's vector and the adapter's greedy tokens, two
# adapters and the base in one batch, rows of layers 0, 1 and -1, a stop string's extraction step on the adapter's
# prefix cache), on two stages: each stage applies the adapter's weights of its own layers.
@pytest.fixture(scope="module")
def served(engine, loop_thread, adapters):  # noqa: F811
    """(this engine, an OpenAI frontend that loaded the adapters, as a replica's does)."""
    return engine, loop_thread.run(
        engine.openai("tiny-llama", "lora", [{"name": n, "path": p} for n, p in adapters.items()])
    )


@pytest.fixture(scope="module")
def refs(served, model_dir, adapters, reference) -> dict:  # noqa: F811
    """The oracle of each model a request can name (None: the base), transformers + peft for an adapter."""
    return {None: reference, **{name: Reference(model_dir, path) for name, path in adapters.items()}}
