"""Ledger point 24, tests only, CPU: vLLM's Ray executor on the CPU engine, a custom Ray resource as each worker's
device.

Why: vLLM's CPU platform has no Ray device (`CpuPlatform.ray_device_key` is empty), so its Ray executor refuses to
start (`initialize_ray_cluster`, `get_bundles_sorted_by_node`: "does not support ray"), and its workers ask Ray for
their accelerator ids (`RayWorkerProc.get_node_and_physical_gpu_ids`), which a CPU has none of. The multi-node
tests (tests/cluster/test_multinode_pp.py) run a replica whose pipeline stages sit on two Ray nodes of one machine.
How: with `HIDDEN_STATES_TEST_RAY_CPU_DEVICE=NAME` (`RAY_CPU_DEVICE_ENV`; the app's config builds each worker's
placement bundle as {CPU: 1, NAME: 1}, deployments/config.py), `executor` (the engine core, as ledger point 23's
executor starts, before it places its workers) sets the platform's `ray_device_key` to NAME, so vLLM places one
worker per NAME bundle and asks each for one NAME, and has it create `CPURayWorkerProc` actors (RayExecutorV2's
`RayWorkerProc`, the module name it creates them from, set to this subclass), which report their node and no
device. Never set in production: a GPU platform has its own device key.
Relies on: `Platform.ray_device_key`; `RayExecutorV2._init_executor` creating `ray.remote(RayWorkerProc)` by the
module's name; `RayWorkerProc.get_node_and_physical_gpu_ids` returning (node id, physical ids), the CPU worker not
reading `assigned_physical_gpu_ids`.
Remove when: vLLM's CPU platform runs under Ray (then the tests keep the custom resource only for placement).
"""

from __future__ import annotations

import os
from typing import Any

from hidden_states.vllm.patches.drift import Symbol

RAY_CPU_DEVICE_ENV = "HIDDEN_STATES_TEST_RAY_CPU_DEVICE"  # tests only: the custom resource a worker's bundle holds


def executor(**_: Any) -> bool:
    """Tests only: in the engine core, before RayExecutorV2 places its workers. Returns whether it patched."""
    device = os.environ.get(RAY_CPU_DEVICE_ENV)
    if not device:
        return False
    from vllm.platforms import current_platform
    from vllm.v1.executor import ray_executor_v2

    if not current_platform.is_cpu():
        return False
    type(current_platform).ray_device_key = device
    ray_executor_v2.RayWorkerProc = _worker_class()
    return True


def _worker_class() -> type:
    if "CPURayWorkerProc" not in globals():  # defined once per process, on first use
        globals()["CPURayWorkerProc"] = _define()
    return globals()["CPURayWorkerProc"]


def _define() -> type:
    import ray
    from vllm.v1.executor.ray_executor_v2 import RayWorkerProc

    class CPURayWorkerProc(RayWorkerProc):
        """RayWorkerProc on a CPU node: its node, and no accelerator ids (tests only, ledger point 24)."""

        def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
            return ray.get_runtime_context().get_node_id(), []

    CPURayWorkerProc.__module__ = __name__
    CPURayWorkerProc.__qualname__ = "CPURayWorkerProc"
    return CPURayWorkerProc


def __getattr__(name: str) -> Any:
    # Defined on first use (no vLLM import before); Ray pickles the class by reference, so each worker actor
    # imports this module and finds it here.
    if name == "CPURayWorkerProc":
        return _worker_class()
    raise AttributeError(name)


RELIED: tuple[Symbol, ...] = (
    Symbol("vllm.platforms.interface:Platform.ray_device_key", "24", kind="field"),
    Symbol(
        "vllm.v1.executor.ray_executor_v2:RayExecutorV2._init_executor",
        "23, 24",
        (),
        "override",
        mentions=(
            "self.response_mqs.append(",
            "ray.remote(RayWorkerProc)",
            "h.actor.get_node_and_physical_gpu_ids.remote()",
        ),
    ),
    Symbol("vllm.v1.executor.ray_executor_v2:RayWorkerProc", "24", kind="class"),
    Symbol("vllm.v1.executor.ray_executor_v2:RayWorkerProc.get_node_and_physical_gpu_ids", "24", (), "override"),
)
