"""The compiled engine (`enforce_eager: false`, worker/traced.py) under pipeline parallelism 2: the tiny Llama's two
decoder layers on two stages, `capture_layers: [0, 1]` spanning both.

Each stage traces the layers whose decoder layer it runs (stage 0 layer 0 at the input of decoder layer 0, stage 1
layer 1 at the input of decoder layer 1: the stream stage 0 sent); stage 0 slices layer 0's rows from its traced
buffers after its forward and they ride its intermediate tensors to stage 1, which sends every row. Checked here
against transformers, with the eager two-stage module's tests and the one-stage modules' imported: the final vector
by the tail step and by the extraction step, rows at every position of layers 0, 1 and -1, float16 and top-k, each
stage's rows sent on and received and each stage steering its own layer; heads (SAEs at layers 0 and 1, linear) and a
stop condition from a head of stage 0; steering (add, ablate, clamp, cap, a conditional entry at stage 0 from a head
of stage 1) at layers of both stages, unsteered requests beside steered ones bit for bit; and no request compiling
anything on either stage.
"""

from __future__ import annotations

import pytest

from tests.conftest import TEST_ENGINE_ARGS, cpu_only, engine_fixture
from tests.engine import test_steering as steering_tests  # by the module: the cases at both stages' layers only
from tests.engine.test_compiled import (  # noqa: F401
    LAYER_BUFFER_BYTES,
    compiled_at_start,
    test_no_request_compiles_anything,
)
from tests.engine.test_heads import test_heads_and_rows_across_the_completion_n2  # noqa: F401
from tests.engine.test_pipeline_capture import (  # noqa: F401
    ERRORS,
    test_pp2_a_stop_condition_from_a_head_of_stage_0,
    test_pp2_float16_and_topk_are_the_reference_cast,
    test_pp2_the_last_stage_sends_every_row_and_each_stage_steers_its_own,
    test_pp2_vectors_exact_by_tail_and_extraction,
)
from tests.engine.test_positions import BOUND
from tests.engine.test_steering import (  # noqa: F401
    registered,
    registered_vectors,
    test_unsteered_requests_beside_steered_ones_are_byte_for_byte_unchanged,
)
from tests.heads_ref import build_test_heads

pytestmark = cpu_only  # two CPU stages (vLLM's multiprocessing executor); GPUs: untested here

PP_COMPILED_ARGS = {
    **TEST_ENGINE_ARGS,
    "pipeline_parallel_size": 2,
    "distributed_executor_backend": "mp",
    "enforce_eager": False,
}


@pytest.fixture(scope="module")
def heads():
    return build_test_heads()


# warm_up_s=0 as in test_compiled.py: the compile at the first forward is what this tests.
engine = engine_fixture(
    setup=lambda heads, registered: {"heads": heads, "steering_vectors": registered_vectors(registered)},  # noqa: F811
    env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
    timeout=900,
    warm_up_s=0,
    capture_layers=[0, 1],
    max_hidden_states_bytes=BOUND,
    errors=ERRORS,  # the imported checks' (case, max abs error, max |reference|), printed at teardown
    **PP_COMPILED_ARGS,
)


def test_each_stage_compiles_and_traces_its_own_layer(engine, loop_thread):
    mode = engine.startup
    assert mode["enforce_eager"] is False and engine.eager is False, mode
    cfg = engine.llm.vllm_config.parallel_config
    assert cfg.pipeline_parallel_size == 2 and cfg.world_size == 2
    # the engine's static set; the sending stage runs decoder layer 1, no layer hooks
    lc = engine.layer_capture
    assert lc["capture_layers"] == [0, 1] and lc["traced_layers"] == [1] and lc["stage_layers"] == [1, 2], lc
    assert lc["layer_hooks"] == 0, lc
    stage0, stage1 = loop_thread.run(engine.stats())["workers"]
    assert stage0["capture_layers"] == [0] and stage1["capture_layers"] == [1], (stage0, stage1)
    assert stage0["traced_buffer_bytes"] == stage1["traced_buffer_bytes"] == LAYER_BUFFER_BYTES  # one layer each
    for w in (stage0, stage1):
        assert compiled_at_start(w["compilations"]), w  # each stage's model, at start


def test_pp2_steered_at_both_stages(engine, loop_thread, reference):
    """Adds at layer 0 (stage 0) and layer 1 (-2, stage 1) on the completion, and an add then an ablation at layer 1:
    tokens and rows those of transformers with the same steering."""
    for case in ("two layers, completion", "add then ablate"):
        steering_tests.test_steered_tokens_and_rows_are_transformers_with_the_same_hook(
            engine, loop_thread, reference, case
        )


@pytest.mark.parametrize(
    "case", ["clamp a gated SAE's feature at the embeddings", "clamp a standard SAE's feature high", "add then cap"]
)
def test_pp2_clamps_and_caps_at_both_stages(engine, loop_thread, reference, case):
    """A clamp at layer 0 (stage 0's traced entry), a clamp and a cap at layer 1 (stage 1's)."""
    steering_tests.test_clamp_and_cap_are_transformers_with_saelens_in_the_same_hook(
        engine, loop_thread, reference, case
    )


def test_pp2_a_conditional_entry_at_stage_0_from_a_head_of_stage_1(engine, loop_thread, reference):
    steering_tests.test_a_conditional_entry_applies_where_its_condition_held_on_the_row_before(
        engine, loop_thread, reference, "add at 0 when an SAE feature at 1 is low"
    )
