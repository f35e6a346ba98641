"""The real app with a tensor-parallel engine: `engine: {tensor_parallel_size: 2}`, one replica.

Over HTTP with the openai client: completions and chat, streamed and not, n = 2, a stop
string (the extraction step), float and base64, each vector checked against transformers
on its own choice's tokens; the replica's engine reports two workers, of which rank 0
alone captured and sent the vectors. (tests/engine/test_parallel.py checks the engine.)
"""

from __future__ import annotations

import openai
import pytest

from tests.conftest import cpu_only
from tests.serve.conftest import APPS, decode_vector, parallel_choices_exact, replica_stats, stopped_by_a_string

pytestmark = cpu_only  # two CPU ranks; on GPUs the app would need two GPUs per replica

HS = {"return_hidden_states": True, "return_token_ids": True}


@pytest.fixture
def tp2_client(tp2_app):
    return openai.OpenAI(base_url=f"{tp2_app}/v1", api_key="unused", timeout=120, max_retries=0)


def test_the_replica_asks_for_a_cpu_per_rank():
    from deployments.config import AppArgs

    args = AppArgs(**APPS["hs-tp2"][1](), accelerator="cpu")
    opts = args.replica_options()
    assert opts["ray_actor_options"]["num_cpus"] == 2
    assert opts["ray_actor_options"]["runtime_env"]["env_vars"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_vectors_exact_over_http_on_two_ranks(tp2_app, tp2_client, reference, stream):
    before = replica_stats(tp2_app)["replica"]
    prompts = ["The replica computes the hidden state", "Two ranks hold the same rows"]
    parallel_choices_exact(tp2_client, reference, prompts, 3, stream)

    # a stop string (cut from the middle of the greedy answer): the extraction step, on the same two ranks
    chat = stopped_by_a_string(tp2_client, [{"role": "user", "content": "Tell me about the cache."}], HS)
    c = chat.choices[0]
    reference.assert_matches(chat.prompt_token_ids + c.token_ids, decode_vector(c.hidden_states))

    after = replica_stats(tp2_app)["replica"]
    workers, old = after["workers"], before["workers"]
    assert len(workers) == 2 and all(w["installed"] for w in workers), workers
    assert workers[0]["captured"] - old[0]["captured"] == 5  # four tail rows and one extraction row, each once
    assert workers[1]["captured"] == workers[1]["steps_with_capture"] == 0, workers[1]
    assert after["pending"] == 0 and after["missing_vectors"] == 0
    assert after["startup"]["enforce_eager"] is False  # the app runs compiled (tests/serve/test_compiled.py)
