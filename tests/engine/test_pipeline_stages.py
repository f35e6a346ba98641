"""Hidden states on three pipeline stages of an unevenly split model: the 4-layer tiny Llama, stages of 1, 2, 1 layers.

vLLM splits 4 decoder layers over 3 stages as [1, 2, 1] (`get_pp_indices`: the layer left over goes to a middle
stage): stage 0 runs decoder layer 0, stage 1 (the middle) decoder layers 1 and 2, stage 2 decoder layer 3, the
final norm and the sampler. So layer 0 is read on stage 0; layer 1 at the input of the middle stage's first decoder
layer (the stream stage 0 sent), layer 2 at the output of that same decoder layer (a stage's second layer is read
at an output, as without pipeline parallelism); layer 3 at the last stage's input; -1 after the final norm. The
middle stage takes stage 0's rows off what it received and sends them on with its own; the last stage sends every
row. One engine checks, against transformers: the final vector by the tail step and by the extraction step; rows at
every position of every layer; heads at a layer of every stage (an SAE and a linear head at the middle stage's
first layer, an SAE at its second); steering (add, ablate) at layers of every stage and conditional entries at
stage 0's layer and at the middle stage's second, their conditions read on the middle stage; stop conditions from
heads at both of the middle stage's layers; tokens unchanged by asking; unsteered requests beside steered ones bit
for bit; and the rows each stage gathered, received and sent on, and steered, counted.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from hidden_states.protocol import FAULT_INJECTION_ENV
from tests.conftest import TEST_ENGINE_ARGS, Reference, cpu_only, engine_fixture, long_text, sampling
from tests.engine import test_heads, test_steering
from tests.engine.test_engine import PROMPTS
from tests.engine.test_pipeline_capture import test_pp2_asking_changes_no_token  # noqa: F401
from tests.engine.test_positions import BOUND, reference_states
from tests.engine.test_steering import (  # noqa: F401
    test_unsteered_requests_beside_steered_ones_are_byte_for_byte_unchanged,
    unit_vector,
)
from tests.heads_ref import HEAD_LAYERS, TINY_D, TINY_F, build_test_heads, check_heads, make_linear, make_sae

pytestmark = cpu_only  # three CPU stages (vLLM's multiprocessing executor); GPUs: untested here

MODEL = "builtin:tiny-llama-4l"
LAYERS = 4
STAGES = [[0], [1, 2], [3]]  # the decoder layers each stage runs (vLLM's get_pp_indices for 4 over 3)
PP_ARGS = {**TEST_ENGINE_ARGS, "pipeline_parallel_size": 3, "distributed_executor_backend": "mp"}
ERRORS: list = []


class _Measured:
    """This module's (case, max abs error, max |reference|): its own, and those the imported tests record in their
    modules' lists from the engine's start on (printed when the engine stops)."""

    def __init__(self, *lists: list):
        self.lists, self.first = lists, [0] * len(lists)

    def start(self) -> None:
        self.first = [len(x) for x in self.lists]

    def __iter__(self):
        for x, first in zip(self.lists, self.first, strict=True):
            yield from x[first:]


MEASURED = _Measured(ERRORS, test_steering.ERRORS, test_heads.ERRORS)
# Heads beyond the tiny Llama's test heads (which sit at layers 0, 1 and -1): an SAE at the middle stage's second
# layer (read at the output of its first decoder layer) and a linear head at the last stage's first layer.
EXTRA = {"sae-l2": 2, "lin-l3": 3}
for _name, _layer in EXTRA.items():
    HEAD_LAYERS.setdefault(_name, _layer)


@pytest.fixture(scope="module")
def model_dir() -> str:
    from hidden_states.models.builtin import build

    return str(build(MODEL.split(":", 1)[1]))


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("stage-heads")
    make_sae(str(root / "sae-l2"), "standard", TINY_D, TINY_F, "blocks.1.hook_resid_post", seed=30)
    make_linear(str(root / "lin-l3.safetensors"), TINY_D, 2, seed=31)
    return build_test_heads() + [
        {"name": "sae-l2", "path": str(root / "sae-l2")},
        {"name": "lin-l3", "path": str(root / "lin-l3.safetensors"), "layer": 3, "activation": "sigmoid"},
    ]


engine = engine_fixture(
    MODEL,
    setup=lambda heads: MEASURED.start() or {"heads": heads},
    env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", FAULT_INJECTION_ENV: "1"},  # the fault test below injects one
    warm_up_s=0,
    max_hidden_states_bytes=BOUND,
    errors=MEASURED,
    **PP_ARGS,
)
sp = sampling(max_tokens=10)
EVERY = [*range(LAYERS), -1]


def check(case: str, got, want) -> None:
    diff, scale = float(np.abs(np.asarray(got, np.float32) - want).max()), float(np.abs(want).max())
    assert diff <= 1e-5 * scale, f"{case}: max abs error {diff:.3g} (max |reference| {scale:.3g})"
    ERRORS.append((case, diff, scale))


def test_three_stages_split_1_2_1_and_every_layer_exact_by_tail_and_extraction(engine, loop_thread, reference):
    cfg = engine.llm.vllm_config.parallel_config
    assert cfg.pipeline_parallel_size == 3 and cfg.world_size == 3 and cfg.distributed_executor_backend == "mp"
    workers = loop_thread.run(engine.stats())["workers"]
    # each stage hooks the layers it runs: layer 0; layers 1 (its input) and 2; layer 3 (its input)
    assert [w["layer_hooks"] for w in workers] == [len(s) for s in STAGES], workers
    assert engine.layer_capture["stage_layers"] == [3, 4], engine.layer_capture  # the sending stage's, and -1
    prompts = PROMPTS + [long_text(300, seed=43)]  # one over the 256-token prefill chunk

    async def run():
        tails = [
            engine.complete(p, sp(max_tokens=8 + 3 * i), layers=EVERY, position="all") for i, p in enumerate(prompts)
        ]
        stops = [engine.complete(p, sp(max_tokens=24, stop=["e"]), layers=EVERY) for p in prompts[:3]]
        return await asyncio.gather(*tails), await asyncio.gather(*stops)

    tails, stops = loop_thread.run(run(), timeout=300)
    for c in tails:
        ch = c.choices[0]
        ids = list(c.prompt_token_ids) + list(ch.token_ids)
        assert ch.extraction.via == "tail" and ch.extraction.computed_tokens == 1, ch.extraction
        for layer in EVERY:  # every position, prompt and completion, at every layer of every stage
            want = reference_states(reference, ids, layer)
            check(f"tail, layer {layer}, {len(ids)} tokens", ch.hidden_states_by_layer[layer], want)
    for c in stops:
        ch = c.choices[0]
        assert ch.finish_reason == "stop" and ch.extraction.via == "extraction", ch.extraction
        ids = list(c.prompt_token_ids) + list(ch.token_ids)
        for layer in EVERY:
            err, scale = reference.assert_matches(ids, ch.hidden_states_by_layer[layer], layer=layer)
            ERRORS.append((f"extraction, layer {layer}", err, scale))


ASKED = {"sae-gated": 32, "sae-std": 32, "mid": 0, "sae-l2": 32, "lin-l3": 0, "sae-topk": 16, "probe": 0}


def test_heads_at_a_layer_of_every_stage(engine, loop_thread, reference, heads):
    """SAEs (SAELens) and linear heads at layer 0 (stage 0), 1 and 2 (the middle stage's two), 3 and -1 (the last
    stage's), at every completion position, and by the extraction step: each computed on the last stage from the
    rows the stages before sent on."""
    ask = [{"name": n, "topk": k} if k else n for n, k in ASKED.items()]

    async def run():
        return await asyncio.gather(
            engine.complete(PROMPTS[1], sp(), heads=ask, position="completion", return_hidden_states=False),
            engine.complete(PROMPTS[0], sp(stop=["zzzz"]), heads=ask, return_hidden_states=False),
        )

    out, ext = loop_thread.run(run())
    for c, case in ((out, "completion"), (ext, "extraction step")):
        ch = c.choices[0]
        ids = list(c.prompt_token_ids) + list(ch.token_ids)
        positions = list(range(len(c.prompt_token_ids), len(ids))) if case == "completion" else [len(ids) - 1]
        assert ch.extraction.via == ("tail" if case == "completion" else "extraction")
        states = [reference_states(reference, ids, layer) for layer in range(LAYERS + 1)]
        check_heads(case, ch.heads, states, positions, heads, ASKED, ERRORS)


# Steering at layers of every stage (test_steering's tests, which read every layer of the reference's model).
test_steering.CASES.setdefault(
    "stage 0 and both of the middle stage's layers",
    [
        {"layer": 0, "vector": test_steering.b64(unit_vector(61, 2.0)), "positions": "completion"},
        {"layer": 1, "vector": test_steering.b64(unit_vector(62, 3.0))},
        {"layer": 2, "vector": test_steering.b64(unit_vector(63, 3.0)), "scale": -1.5},
    ],
)
test_steering.CASES.setdefault(
    "the middle stage's second layer, then the last stage's",
    [
        {"layer": 2, "vector": test_steering.b64(unit_vector(64, 4.0))},
        {"layer": 2, "vector": test_steering.b64(unit_vector(65)), "op": "ablate"},
        {"layer": -2, "vector": test_steering.b64(unit_vector(66, 3.0))},
    ],
)
STEER_CASES = [
    "stage 0 and both of the middle stage's layers",
    "the middle stage's second layer, then the last stage's",
]


@pytest.mark.parametrize("case", STEER_CASES)
def test_steering_at_the_layers_of_every_stage(engine, loop_thread, reference, case):
    test_steering.test_steered_tokens_and_rows_are_transformers_with_the_same_hook(engine, loop_thread, reference, case)


@pytest.mark.parametrize("case", STEER_CASES[:1])
def test_the_extraction_step_is_steered_on_every_stage(engine, loop_thread, reference, case):
    test_steering.test_the_extraction_step_is_steered_the_same(engine, loop_thread, reference, case)


# Conditional entries: at stage 0's layer with its condition (an SAE feature) on the middle stage's first layer, and
# at the middle stage's second layer with its condition (a linear head) on the middle stage's first. (test_steering's
# "add at 0 when an SAE feature at 1 is low" finds no threshold clear of the band on this model.)
test_steering.WHEN_CASES.setdefault(
    "add at 0 when an SAE feature at 1 is high",
    ({"layer": 0, "vector": test_steering.b64(unit_vector(42, 3.0))}, "sae-std", None, True, 1),
)
test_steering.WHEN_CASES.setdefault(
    "add at 2 when the linear head at 1 is high",
    ({"layer": 2, "vector": test_steering.b64(unit_vector(67, 4.0)), "scale": 1.5}, "mid", 0, True, 1),
)
WHEN_CASES = ["add at 0 when an SAE feature at 1 is high", "add at 2 when the linear head at 1 is high"]


@pytest.mark.parametrize("case", WHEN_CASES)
def test_a_conditional_entry_at_stage_0_and_at_the_middle_stage(engine, loop_thread, reference, case):
    test_steering.test_a_conditional_entry_applies_where_its_condition_held_on_the_row_before(
        engine, loop_thread, reference, case
    )


# Stop conditions from heads at the middle stage's first layer (test_heads' own case) and at its second.
test_heads.STOP_CASES.setdefault(
    "sae feature at layer 2 above, the middle stage", ("sae-l2", {"feature": None}, None, True)
)


@pytest.mark.parametrize("case", ["mid below", "sae feature at layer 2 above, the middle stage"])
def test_a_stop_condition_from_a_head_of_the_middle_stage(engine, loop_thread, reference, heads, case):
    test_heads.test_a_stop_condition_finishes_at_the_first_position_the_reference_crosses(
        engine, loop_thread, reference, heads, case
    )


def test_each_stage_gathers_receives_and_sends_on_its_rows_and_steers_its_own(engine, loop_thread):
    """Rows at every layer of every position, steered at every layer: stage 0 gathers layer 0's rows and sends
    them; the middle stage receives them and sends them on with its layers 1 and 2; the last stage receives all
    three and copies them to the host with its own (3 and -1). Each stage steers the rows of its own layers."""
    keys = ("captured", "host_copies", "bytes_copied", "steered_rows", "forwarded_rows", "received_rows")
    keys += ("forwarded_bytes",)
    before = loop_thread.run(engine.stats())["workers"]
    steering = [
        {"layer": layer, "vector": base64.b64encode(unit_vector(70 + layer, 1.0).tobytes()).decode()}
        for layer in range(LAYERS)
    ]
    out = loop_thread.run(
        engine.complete(PROMPTS[0], sp(max_tokens=6), steering=steering, layers=EVERY, position="all")
    )
    after = loop_thread.run(engine.stats())["workers"]
    stage = [{k: a[k] - b[k] for k in keys} for a, b in zip(after, before, strict=True)]
    total = len(out.prompt_token_ids) + len(out.choices[0].token_ids)  # each position computed once per stage
    for s in stage[:2]:
        assert s["captured"] == s["host_copies"] == s["bytes_copied"] == 0, stage
    assert stage[0]["received_rows"] == 0 and stage[0]["forwarded_rows"] == total, stage
    assert stage[1]["received_rows"] == total and stage[1]["forwarded_rows"] == 3 * total, stage
    assert stage[2]["received_rows"] == 3 * total and stage[2]["forwarded_rows"] == 0, stage
    assert stage[1]["forwarded_bytes"] > 3 * total * TINY_D * 4, stage  # float32 rows, and each step's index
    assert stage[2]["bytes_copied"] >= 5 * total * TINY_D * 4, stage  # every layer's rows, one copy a step
    assert [s["steered_rows"] for s in stage] == [len(layers) * total for layers in STAGES], stage


def test_a_steering_fault_on_the_middle_stage_fails_its_request_alone(engine, loop_thread, reference):
    """The middle stage's steering (layer 2) raising for one request of four: the middle stage leaves it out and sends
    the fault on with the rows, the last stage reports it, the others are as they are alone (test_steering's check)."""
    before = loop_thread.run(engine.stats())["workers"]
    test_steering.test_a_worker_hook_that_raises_fails_its_request_alone(engine, loop_thread, reference, "steering", 2)
    after = loop_thread.run(engine.stats())["workers"]
    assert [a["hook_faults"] - b["hook_faults"] for a, b in zip(after, before)] == [0, 1, 0]
    assert after[1]["forwarded_faults"] > before[1]["forwarded_faults"]
