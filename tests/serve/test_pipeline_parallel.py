"""The real app with a pipeline-parallel engine: `engine: {pipeline_parallel_size: 2}`, one replica of two stages,
compiled (`enforce_eager: false`, `capture_layers: [0, 1]`: each stage traces its own layer).

Over HTTP with the openai client (completions streamed and not, n = 2, base64; a chat with a stop string: the
extraction step; rows of layer 0 (stage 0's), layer 1 and the final norm at every position; SAE and linear heads
at layers of both stages) and through a Python deployment handle, each vector checked against transformers on its
own choice's tokens; the replica asks for a CPU per stage, and its last stage alone copied and sent.
(tests/engine/test_pipeline_capture.py checks the engine.)
"""

from __future__ import annotations

import openai
import pytest

from tests.conftest import cpu_only
from tests.engine.test_positions import reference_states
from tests.serve.conftest import APPS, decode_vector, parallel_choices_exact, replica_stats, stopped_by_a_string

pytestmark = cpu_only  # two CPU stages; on GPUs the app would need a GPU per stage

MODEL = "tiny-llama"
HS = {"return_hidden_states": True, "return_token_ids": True}


def test_the_replica_asks_for_a_cpu_per_stage():
    from deployments.config import AppArgs

    args = AppArgs(**APPS["hs-pp2"][1](), accelerator="cpu")
    assert args.replica_options()["ray_actor_options"]["num_cpus"] == 2


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_vectors_exact_over_http_on_two_stages(pp2_app, reference, stream):
    client = openai.OpenAI(base_url=f"{pp2_app}/v1", api_key="unused", timeout=120, max_retries=0)
    before = replica_stats(pp2_app)["replica"]
    parallel_choices_exact(client, reference, ["The last stage sends the rows", "Two stages, one replica"], 5, stream)

    # a stop string: the extraction step; layers 0 (stage 0's), 1 (stage 1's first) and -1 at every position
    extra = {**HS, "hidden_states_layers": [0, 1, -1], "hidden_states_position": "all"}
    chat = stopped_by_a_string(client, [{"role": "user", "content": "Tell me about the stages."}], extra)
    c = chat.choices[0]
    ids = chat.prompt_token_ids + c.token_ids
    for layer in ("0", "1", "-1"):
        got = decode_vector(c.hidden_states_by_layer[layer])
        want = reference_states(reference, ids, int(layer) % 3)
        assert got.shape == want.shape and abs(got - want).max() <= 1e-5 * abs(want).max(), layer

    after = replica_stats(pp2_app)["replica"]
    workers, old = after["workers"], before["workers"]
    assert len(workers) == 2 and all(w["installed"] for w in workers), workers
    assert workers[0]["captured"] == old[0]["captured"] and workers[0]["bytes_copied"] == old[0]["bytes_copied"]
    assert workers[1]["captured"] - old[1]["captured"] >= 5, (workers[1], old[1])
    # layer 0's rows (the completions' and the chats' generation steps, the extraction step's), all arrived
    sent = workers[0]["forwarded_rows"] - old[0]["forwarded_rows"]
    assert sent == workers[1]["received_rows"] - old[1]["received_rows"] >= len(ids), (workers, old)
    assert after["pending"] == 0 and after["missing_vectors"] == 0
    assert after["startup"]["enforce_eager"] is False  # compiled: each stage traced its own layer
    assert [w["capture_layers"] for w in workers] == [[0], [1]], workers


def test_a_handle_on_two_stages_is_the_reference(pp2_app, reference):
    from ray import serve

    from deployments.client import complete

    handle = serve.get_app_handle("hs-pp2")
    c = complete(handle, "A handle from another Ray job", max_tokens=8)
    (ch,) = c.choices
    reference.assert_matches(list(c.prompt_token_ids) + list(ch.token_ids), ch.hidden_states)


def test_heads_of_both_stages_over_http(pp2_app, reference):
    """SAE (standard, top-k, JumpReLU, gated) and linear heads at layers 0 (stage 0's rows, sent on), 1 and -1 run
    on the last stage: SAELens's and numpy's outputs on transformers' rows."""
    from tests.heads_ref import TINY_TOPK_K, build_test_heads, check_heads
    from tests.serve.test_heads import states

    client = openai.OpenAI(base_url=f"{pp2_app}/v1", api_key="unused", timeout=120, max_retries=0)
    ask = [{"name": n, "topk": 24} for n in ("sae-std", "sae-jump", "sae-gated")] + ["sae-topk", "probe", "mid"]
    asked = {"sae-std": 24, "sae-jump": 24, "sae-gated": 24, "sae-topk": TINY_TOPK_K, "probe": 0, "mid": 0}
    r = client.completions.create(
        model=MODEL,
        prompt="The heads read the last stage's rows",
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "hidden_states_heads": ask, "hidden_states_position": "completion"},
    )
    (b,) = r.choices
    ids = b.prompt_token_ids + b.token_ids
    positions = b.hidden_states_meta["positions"]
    assert positions == list(range(len(b.prompt_token_ids), len(ids)))
    check_heads("two stages", b.hidden_states_heads, states(reference, ids), positions, build_test_heads(), asked)
