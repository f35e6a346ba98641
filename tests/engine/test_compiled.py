"""vLLM's default execution, `enforce_eager: false` (torch.compile with inductor on the CPU; CUDA
graphs on GPUs), with the static layer set traced into the compiled forward (worker/traced.py):
every layer, head, stop-condition and steering case of the eager engine's modules (and a worker
hook's fault staying with its request), run again here on one compiled
engine against transformers (the same test functions, this module's `engine`), and no request
compiling anything after the start.

The engine: `capture_layers: [0, 1]` (both decoder layers of the built-in tiny Llama), the test
heads, the steering module's registered vectors.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from hidden_states.protocol import FAULT_INJECTION_ENV
from tests.conftest import TEST_ENGINE_ARGS, engine_fixture, sampling
from tests.engine.test_engine import test_tail_step_changes_nothing_in_the_output  # noqa: F401
from tests.engine.test_heads import (  # noqa: F401
    test_a_stop_condition_finishes_at_the_first_position_the_reference_crosses,
    test_an_sae_without_topk_gives_its_own_k_and_the_extraction_step_the_same,
    test_completions_chat_and_streams_over_the_openai_routes,
    test_every_head_at_the_final_token_alone_no_rows,
    test_heads_and_rows_across_the_completion_n2,
)
from tests.engine.test_pool import (  # noqa: F401
    test_a_stop_string_pools_by_the_extraction_step,
    test_pooled_on_the_device_one_row_per_layer_per_step_reaches_the_host,
    test_the_mean_of_each_layers_rows_is_numpys_mean_of_transformers_rows,
)
from tests.engine.test_positions import (  # noqa: F401
    BOUND,
    test_a_stop_string_takes_the_final_row_from_the_extraction_step,
    test_all_layers_of_a_long_prompt_in_chunks_and_with_its_prefix_cached,
    test_beam_search_and_a_streamed_chat_over_the_openai_routes,
    test_every_position_against_transformers,
    test_n2_each_choice_its_own_rows,
    test_rows_arrive_across_outputs_and_concatenate_to_the_whole,
)
from tests.engine.test_steering import (  # noqa: F401  # noqa: F401
    registered,
    registered_vectors,
    test_a_conditional_entry_applies_where_its_condition_held_on_the_row_before,
    test_a_worker_hook_that_raises_fails_its_request_alone,
    test_bad_clamps_and_caps_are_a_400_naming_the_entry,
    test_clamp_and_cap_are_transformers_with_saelens_in_the_same_hook,
    test_n2_and_a_streamed_chat_over_the_openai_routes,
    test_post_hidden_states_recomputes_a_steered_choice,
    test_registered_vectors_and_sae_features_as_entries,
    test_steered_tokens_and_rows_are_transformers_with_the_same_hook,
    test_the_extraction_step_is_steered_the_same,
    test_unsteered_requests_beside_steered_ones_are_byte_for_byte_unchanged,
    unit_vector,
)
from tests.heads_ref import build_test_heads

COMPILED_ARGS = {**TEST_ENGINE_ARGS, "enforce_eager": False}
sp = sampling()  # greedy SamplingParams; keywords override


@pytest.fixture(scope="module")
def heads():
    return build_test_heads()


# warm_up_s=0: the compile at the first forward is what this tests, not oneDNN's per-size kernels.
engine = engine_fixture(
    setup=lambda heads, registered: {"heads": heads, "steering_vectors": registered_vectors(registered)},  # noqa: F811
    timeout=900,
    warm_up_s=0,
    capture_layers=[0, 1],
    max_hidden_states_bytes=BOUND,
    env={FAULT_INJECTION_ENV: "1"},
    **COMPILED_ARGS,
)  # faults injected into the traced steering and the heads


# A traced layer's buffers on the tiny model (max tokens 256, D 128, float32): rows, two adds, the ablation/clamp/cap's
# direction and its two encoder columns [max tokens, D], its 5 parameters and a mask
LAYER_BUFFER_BYTES = 6 * 256 * 128 * 4 + 256 * 5 * 4 + 256


def compiled_at_start(c: dict) -> bool:
    """A worker's compile counts (`compilations` in its stats) show its model compiled, or loaded compiled."""
    return (
        c["num_aot_compiles"]
        + c["num_backend_compilations"]
        + c["num_compiled_artifacts_loaded"]
        + c["num_aot_artifacts_loaded"]
        >= 1
    )


def test_engine_is_compiled_with_its_layers_traced(engine, loop_thread):
    mode = engine.startup
    assert mode["enforce_eager"] is False and engine.eager is False, mode
    assert mode["compilation_mode"] not in ("0", "None", "CompilationMode.NONE"), mode
    assert engine.layer_capture["capture_layers"] == [0, 1] and engine.layer_capture["layer_hooks"] == 0
    (worker,) = loop_thread.run(engine.stats())["workers"]
    assert worker["capture_layers"] == [0, 1]
    assert worker["traced_buffer_bytes"] == 2 * LAYER_BUFFER_BYTES
    assert compiled_at_start(worker["compilations"]), worker["compilations"]


def b64(v: np.ndarray) -> str:
    return base64.b64encode(np.asarray(v, "<f4").tobytes()).decode()


def test_no_request_compiles_anything(engine, loop_thread):
    """Layers, heads, steering (add, ablate, clamp, cap, every span), batches of new sizes, a long chunked prompt:
    vLLM's and dynamo's compile counts are the same after them as before, in every worker (each pipeline stage's
    under pipeline parallelism: tests/engine/test_pipeline_compiled.py)."""

    def counts():
        return [worker["compilations"] for worker in loop_thread.run(engine.stats())["workers"]]

    before = counts()
    steer = [
        {"layer": 0, "vector": b64(unit_vector(3, 3.0)), "positions": "completion"},
        {"layer": 1, "vector": b64(unit_vector(6)), "op": "ablate", "positions": "prompt"},
        {"head": "sae-std", "feature": 17, "op": "clamp", "value": 40.0, "positions": "completion"},
        {"layer": 0, "vector": b64(unit_vector(9)), "op": "cap", "max": -0.5, "positions": "prompt"},
    ]

    async def run():
        jobs = []
        for i in range(11):
            kw = {"steering": steer} if i % 3 == 0 else {}
            if i % 2:
                kw["heads"] = ["mid", "probe"]
            jobs.append(
                engine.complete(
                    f"Batch member {i} says" + " more" * (i * 30),
                    sp(max_tokens=3 + i),
                    layers=[0, 1, -1],
                    position="all",
                    **kw,
                )
            )
        return await asyncio.gather(*jobs)

    outs = loop_thread.run(run(), timeout=600)
    assert all(o.choices[0].hidden_states_by_layer[1].shape[-1] == 128 for o in outs)
    after = counts()
    assert len(after) == len(before) >= 1
    for b, a in zip(before, after, strict=True):
        assert a == b, {k: (b[k], a[k]) for k in b if b[k] != a.get(k)}


@pytest.mark.parametrize(
    "second",
    [
        {"layer": 1, "vector": b64(unit_vector(6)), "op": "ablate", "positions": "completion"},
        {"head": "sae-std", "feature": 3, "op": "clamp", "value": 1.0, "positions": "completion"},
        {"layer": 1, "vector": b64(unit_vector(6)), "op": "cap", "max": 0.0},
    ],
)
def test_a_second_ablation_of_the_same_positions_is_refused_by_name(engine, loop_thread, second):
    """One ablate, clamp or cap per position and layer (the traced entry's one slot); adds around it are fine."""
    from hidden_states.params import HiddenStatesRequestError

    twice = [{"layer": 1, "vector": b64(unit_vector(5)), "op": "ablate"}, second]
    with pytest.raises(HiddenStatesRequestError, match="two ablations/clamps/caps of the same positions") as e:
        loop_thread.run(engine.complete("Hello", steering=twice))
    assert e.value.param == "hidden_states_steering"


def test_the_gpu_check_passes_on_this_engine(engine, loop_thread, model_dir, heads):
    """tests/gpu/gpu_check.py's checks (what `make gpu-check` runs with CUDA graphs), on this compiled CPU
    engine: its reference code (transformers, SAELens, the steering hook) and its verdicts, each line
    printed with its error."""
    from tests.gpu.gpu_check import Reference, run_checks

    sae = {"name": "sae-std", "path": next(h["path"] for h in heads if h["name"] == "sae-std"), "layer": 1, "k": 32}
    checks = loop_thread.run(run_checks(engine, Reference(model_dir, "cpu"), 1, sae), timeout=600)
    for c in checks:
        print(c.line())
    assert [c.name.split(" ")[0] for c in checks] == [
        "last",
        "layer",
        "extraction",
        "sae",
        "stop",
        "steering",
        "steering",
        "unsteered",
        "no",
    ], [c.name for c in checks]
    assert all(c.ok for c in checks), [c.line() for c in checks if not c.ok]
    assert all(c.error is not None for c in checks[:-1])
