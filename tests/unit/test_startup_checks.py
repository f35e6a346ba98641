"""Start-up failures that say why: the pre-flight checks and the Router's readiness logic (no vLLM, no Ray)."""

from __future__ import annotations

import json
import types

import pytest

from deployments.config import AppArgs
from deployments.readiness import startup_cause, why_not_ready
from hidden_states.preflight import EngineStartupError, GiB, check_architecture, check_cpu_memory, check_model_folder


def test_missing_folder_names_the_path(tmp_path):
    with pytest.raises(EngineStartupError, match="does not exist"):
        check_model_folder(str(tmp_path / "nope"))
    assert check_model_folder("HuggingFaceTB/SmolLM2-135M-Instruct") is None  # a hub id: vLLM's to resolve


def test_folder_without_config_or_weights(tmp_path):
    with pytest.raises(EngineStartupError, match="no config.json"):
        check_model_folder(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(EngineStartupError, match="no weights"):
        check_model_folder(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    assert check_model_folder(str(tmp_path))["architectures"] == ["LlamaForCausalLM"]


def test_unsupported_architecture():
    check_architecture({"architectures": ["LlamaForCausalLM"]}, "m", {"LlamaForCausalLM"})
    with pytest.raises(EngineStartupError, match="NoSuchForCausalLM, an architecture"):
        check_architecture({"architectures": ["NoSuchForCausalLM"]}, "m", {"LlamaForCausalLM"})


def test_memory_check_names_the_setting_and_the_sizes(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * (GiB // 4))
    check_cpu_memory(str(tmp_path), GiB, available=2 * GiB)  # 1.25 GiB fits in 2
    with pytest.raises(EngineStartupError) as e:
        check_cpu_memory(str(tmp_path), 4 * GiB, available=2 * GiB)
    msg = str(e.value)
    assert "kv_cache_memory_bytes = 4.00 GiB" in msg and "weights (0.25 GiB)" in msg and "2.00 GiB available" in msg
    check_cpu_memory(str(tmp_path), None, available=1)  # no byte size asked: vLLM sizes by its own share


def test_cpu_kv_cache_default_is_bytes_not_a_share():
    args = AppArgs(accelerator="cpu").engine_args()
    assert args["kv_cache_memory_bytes"] == 2**30 and "gpu_memory_utilization" not in args
    shared = AppArgs(accelerator="cpu", engine={"gpu_memory_utilization": 0.3}).engine_args()
    assert "kv_cache_memory_bytes" not in shared and shared["gpu_memory_utilization"] == 0.3
    assert "kv_cache_memory_bytes" not in AppArgs(accelerator="gpu").engine_args()  # vLLM's own on GPUs


def test_a_multi_gpu_replica_with_a_per_node_cap_is_refused_naming_both():
    """Serve refuses max_replicas_per_node beside placement_group_bundles (a replica of several GPUs): the app says
    so with its own arguments' names, before Serve would."""

    one = AppArgs(accelerator="gpu", replica_max_per_node=2).replica_options()
    assert one["max_replicas_per_node"] == 2 and "placement_group_bundles" not in one
    for engine in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        args = AppArgs(accelerator="gpu", engine=engine, replica_max_per_node=2)
        with pytest.raises(ValueError, match="replica_max_per_node cannot be combined with a replica of 2 GPUs"):
            args.replica_options()
        assert "max_replicas_per_node" not in AppArgs(accelerator="gpu", engine=engine).replica_options()


TRACEBACK = """The deployment failed to start 3 times in a row. This may be due to a problem with its constructor.
Error:
Traceback (most recent call last):
  File "replica.py", line 40, in __init__
hidden_states.preflight.EngineStartupError: not enough memory: the KV cache (engine.kv_cache_memory_bytes = 4.00 GiB)
"""


def deployment(status, message="", **states):
    return types.SimpleNamespace(status=status, message=message, replica_states=states)


def test_readiness_reasons():
    assert why_not_ready(deployment("HEALTHY", RUNNING=1)) is None
    assert why_not_ready(deployment("UPDATING", RUNNING=1, STARTING=1)) is None  # one is enough
    starting = why_not_ready(deployment("UPDATING", STARTING=2))
    assert "is ready yet (2 starting" in starting
    failed = why_not_ready(deployment("DEPLOY_FAILED", TRACEBACK))
    assert failed.endswith("not enough memory: the KV cache (engine.kv_cache_memory_bytes = 4.00 GiB)")
    assert why_not_ready(None) is not None


def test_startup_cause_falls_back_to_the_last_line():
    assert startup_cause("Traceback\n  x\nRuntimeError: boom\n") == "RuntimeError: boom"
    assert startup_cause("") == "unknown"


def test_readiness_asks_the_controller_rarely_while_ready_often_while_not():
    import asyncio

    from deployments.readiness import Readiness

    answers, calls = ["starting", None, None], []

    async def go():
        r = Readiness("app", ready_ttl_s=60, not_ready_ttl_s=0.05)

        async def check():
            calls.append(1)
            return answers[min(len(calls), len(answers)) - 1]

        r._check = check
        assert await r.why_not() == "starting"
        assert await r.why_not() == "starting" and len(calls) == 1  # cached within the short TTL
        await asyncio.sleep(0.1)
        assert await r.why_not() is None and len(calls) == 2  # rechecked: now ready
        for _ in range(5):
            assert await r.why_not() is None
        assert len(calls) == 2  # ready: no controller call within the long TTL

    asyncio.run(go())
