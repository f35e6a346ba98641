"""A replica across Ray nodes (issue 65, item 3): the placement the app's config builds for vLLM's Ray executor
(one bundle per worker beside the replica's own, PACK when the stages may span nodes), and what is refused by name:
vLLM's legacy Ray executor, other executors under pipeline parallelism, the Ray executor on CPUs outside the tests.
Reads the config and engine_args only; no vLLM, no Ray. (tests/cluster/test_multinode_pp.py runs it on two nodes.)"""

from __future__ import annotations

import pytest

from deployments.config import RAY_CPU_DEVICE_ENV, AppArgs
from hidden_states.preflight import EngineStartupError
from hidden_states.vllm.engine_args import PIPELINE_REFUSED, pipeline_refusal, refuse


def gpu_args(tp: int, pp: int, **engine) -> AppArgs:
    return AppArgs(accelerator="gpu", engine={"tensor_parallel_size": tp, "pipeline_parallel_size": pp, **engine})


@pytest.mark.parametrize("tp, pp", [(8, 2), (1, 2), (2, 4)])
def test_a_pipeline_parallel_gpu_replica_is_one_gpu_bundle_per_worker_packed_across_nodes(tp, pp):
    opts = gpu_args(tp, pp, distributed_executor_backend="ray").replica_options()
    assert opts["placement_group_bundles"] == [{"CPU": 1}] + [{"GPU": 1}] * (tp * pp)
    assert opts["placement_group_strategy"] == "PACK"  # STRICT_PACK would forbid spanning nodes
    actor = opts["ray_actor_options"]
    assert actor["num_cpus"] == 1 and "num_gpus" not in actor  # the replica itself: its CPU bundle
    assert actor["runtime_env"]["env_vars"]["VLLM_RAY_PER_WORKER_GPUS"] == "1"


def test_tensor_parallelism_alone_stays_on_one_node():
    opts = gpu_args(4, 1).replica_options()
    assert opts["placement_group_bundles"] == [{"CPU": 1}] + [{"GPU": 1}] * 4
    assert opts["placement_group_strategy"] == "STRICT_PACK"


def test_the_ray_executor_on_cpus_takes_the_tests_resource_as_each_workers_device(monkeypatch):
    monkeypatch.setenv(RAY_CPU_DEVICE_ENV, "hs_rank")
    args = AppArgs(
        accelerator="cpu",
        engine={"pipeline_parallel_size": 2, "distributed_executor_backend": "ray"},
        replica_resources={"hs_head": 1},
    )
    opts = args.replica_options()
    assert opts["placement_group_bundles"] == [{"CPU": 1}, {"CPU": 1, "hs_rank": 1}, {"CPU": 1, "hs_rank": 1}]
    assert opts["placement_group_strategy"] == "PACK"
    actor = opts["ray_actor_options"]
    assert actor["num_cpus"] == 1 and actor["resources"] == {"hs_head": 1}
    env = actor["runtime_env"]["env_vars"]
    assert env[RAY_CPU_DEVICE_ENV] == "hs_rank" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_the_ray_executor_on_cpus_is_refused_outside_the_tests_naming_the_argument(monkeypatch):
    monkeypatch.delenv(RAY_CPU_DEVICE_ENV, raising=False)
    args = AppArgs(accelerator="cpu", engine={"pipeline_parallel_size": 2, "distributed_executor_backend": "ray"})
    with pytest.raises(ValueError, match=r"engine.distributed_executor_backend: ray on CPUs: .*no Ray device"):
        args.replica_options()
    # the one-machine default is unchanged: the workers are processes of the replica's, a CPU each
    mp = AppArgs(accelerator="cpu", engine={"pipeline_parallel_size": 2}).replica_options()
    assert mp["ray_actor_options"]["num_cpus"] == 2 and "placement_group_bundles" not in mp


def test_a_placement_group_replica_refuses_replica_max_per_node():
    with pytest.raises(ValueError, match="replica_max_per_node cannot be combined"):
        AppArgs(
            accelerator="gpu",
            engine={"tensor_parallel_size": 8, "pipeline_parallel_size": 2},
            replica_max_per_node=1,
        ).replica_options()


def test_the_ray_executor_is_served_under_pipeline_parallelism(monkeypatch):
    monkeypatch.delenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", raising=False)
    refuse({"pipeline_parallel_size": 2, "distributed_executor_backend": "ray"})  # RayExecutorV2: vLLM's default
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "1")
    refuse({"pipeline_parallel_size": 2, "distributed_executor_backend": "ray"})
    assert pipeline_refusal(2, 2, {"distributed_executor_backend": "ray"}) is None


def test_the_legacy_ray_executor_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")
    with pytest.raises(
        EngineStartupError,
        match=r"environment variable VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0 with distributed_executor_backend='ray' "
        r"cannot be combined with pipeline_parallel_size=2",
    ) as e:
        refuse({"pipeline_parallel_size": 2, "distributed_executor_backend": "ray"})
    assert PIPELINE_REFUSED["VLLM_USE_RAY_V2_EXECUTOR_BACKEND"] in str(e.value)
    refuse({"pipeline_parallel_size": 1, "distributed_executor_backend": "ray"})  # one stage: not this check's


@pytest.mark.parametrize("backend", ["external_launcher", "my.module.Executor"])
def test_other_executors_under_pipeline_parallelism_are_refused_by_name(backend):
    with pytest.raises(EngineStartupError, match=rf"engine argument distributed_executor_backend='{backend}'") as e:
        refuse({"pipeline_parallel_size": 2, "distributed_executor_backend": backend})
    assert PIPELINE_REFUSED["distributed_executor_backend"] in str(e.value)


def test_the_resolved_executor_is_checked_too(monkeypatch):
    """The engine start resolves `ray` to ledger point 23's executor class: the resolved check accepts it, and
    refuses it when the legacy executor is asked for."""

    class HiddenStatesRayExecutor:  # named as refuse() knows it; vLLM is not imported here
        pass

    HiddenStatesRayExecutor.__module__ = "hidden_states.vllm.patches.ray_executor"
    HiddenStatesRayExecutor.__qualname__ = "HiddenStatesRayExecutor"

    class PC:
        pipeline_parallel_size, tensor_parallel_size = 2, 1
        distributed_executor_backend = HiddenStatesRayExecutor

    class MC:
        enforce_eager, runner_type, is_multimodal_model = True, "generate", False

        class hf_text_config:
            num_hidden_layers = 2

    class Config:
        parallel_config, model_config = PC, MC
        speculative_config = lora_config = kv_transfer_config = None

    monkeypatch.delenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", raising=False)
    refuse({}, Config)
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")
    with pytest.raises(EngineStartupError, match="VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0"):
        refuse({}, Config)
