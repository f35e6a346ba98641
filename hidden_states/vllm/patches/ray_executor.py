"""Ledger point 23: vLLM's Ray executor for a replica whose workers span Ray nodes (`distributed_executor_backend:
ray`), in the replica's placement group, failing fast when a worker's node dies.

Why: with VLLM_USE_RAY_V2_EXECUTOR_BACKEND on (vLLM 0.32's default), `distributed_executor_backend: ray` runs
`RayExecutorV2`: a MultiprocExecutor whose workers are Ray actors, one per bundle of the placement group it is given
(`ParallelConfig.placement_group`) or runs in. Two things keep it from serving a Serve replica as is:
- AsyncLLM runs the executor in its engine-core process, a new Ray driver outside the replica's placement group and
  unaware of its cluster's address: it would make a placement group of its own, beside the one Serve reserved.
- When the node under a stage dies mid-step, the engine core waits on that step's reply with
  VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s) as its only bound: a worker on another node answers over TCP
  (`MessageQueue.dequeue` polls a socket, which `MessageQueue.shutdown` does not wake). The executor's own monitor
  (`start_worker_monitor`) sees the actor die within seconds and queues EXECUTOR_FAILED to the engine core, but the
  engine core reads its queue only between steps: for 300 s `AsyncLLM.errored` stays False, the replica's
  check_health passes, and the requests in flight hang.
How: `config` (frontend, after `create_engine_config`): a resolved `ray` backend becomes `HiddenStatesRayExecutor`
(below, an Executor subclass: `distributed_executor_backend` takes one), given the placement group of the process
that starts the engine (the Serve replica's, as Ray Serve LLM does) and RAY_ADDRESS (the replica's cluster) for the
engine core. `HiddenStatesRayExecutor` waits on each response queue in slices of at most `POLL_S` (its `dequeue`
wrapped on the instance) and raises once the monitor has marked the executor failed: the step fails, the engine
core dies, AsyncLLM ends its requests with an error and reports `errored`, and the replica's check_health fails, so
Serve replaces the replica. Its workers are `RayExecutorV2`'s; on CPUs (tests only) ledger point 24's.
Relies on: `RayExecutorV2` (its `_init_executor` setting `response_mqs`, `is_failed` set by its monitor, its output
rank being MultiprocExecutor's, which worker/extension.py's `attaches` matches), `MessageQueue.dequeue(timeout)`
raising TimeoutError, `ParallelConfig.placement_group`/`distributed_executor_backend`, `Executor.get_class`.
Upstream: a reader of a dead remote worker's queue should wake when the monitor fails the executor (vLLM 0.32 waits
VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS).
Remove when: RayExecutorV2 fails a step in flight as soon as its monitor sees a worker die, and AsyncLLM passes the
replica's placement group to the engine core itself.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from hidden_states.vllm.patches.drift import _PCFG, Symbol

logger = logging.getLogger(__name__)

POLL_S = 1.0  # how often a wait on a worker's reply checks whether the executor has failed


def config(vllm_config: Any, **_: Any) -> bool:
    """A resolved `ray` backend runs HiddenStatesRayExecutor in this process's placement group and Ray cluster.
    Returns whether it did."""
    pc = vllm_config.parallel_config
    if pc.distributed_executor_backend != "ray":
        return False
    import ray

    pc.distributed_executor_backend = executor_class()
    if ray.is_initialized():
        if pc.placement_group is None:
            pc.placement_group = ray.util.get_current_placement_group()
        # the engine core is a new Ray driver: it joins this process's cluster, whatever else runs on the machine
        os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    logger.info(
        "vLLM's Ray executor (HiddenStatesRayExecutor) in placement group %s",
        getattr(pc.placement_group, "id", None),
    )
    return True


def executor_class() -> type:
    if "HiddenStatesRayExecutor" not in globals():  # defined once per process, on first use
        globals()["HiddenStatesRayExecutor"] = _define()
    return globals()["HiddenStatesRayExecutor"]


def _fail_fast(executor: Any, mq: Any) -> None:
    """`mq.dequeue` waits in slices of at most POLL_S and raises once `executor.is_failed` (its monitor saw a
    worker die), within its own timeout as before."""
    dequeue = mq.dequeue

    def wait(timeout: float | None = None, indefinite: bool = False):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if executor.is_failed:
                raise RuntimeError(
                    "a Ray worker of this engine died (its node was lost?): the step cannot finish "
                    "(hidden_states/vllm/patches/ray_executor.py)"
                )
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            try:
                return dequeue(timeout=max(left, 0.0))
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    mq.dequeue = wait


def _define() -> type:
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    class HiddenStatesRayExecutor(RayExecutorV2):
        """RayExecutorV2 whose waits on the workers end as soon as one of them dies (ledger point 23); on CPUs
        (tests only) with ledger point 24's workers."""

        def _init_executor(self) -> None:
            from hidden_states.vllm.patches import install

            install("engine_core", "executor")  # tests only, CPUs: ledger point 24
            super()._init_executor()
            for mq in self.response_mqs:
                _fail_fast(self, mq)

    HiddenStatesRayExecutor.__module__ = __name__
    HiddenStatesRayExecutor.__qualname__ = "HiddenStatesRayExecutor"
    return HiddenStatesRayExecutor


def __getattr__(name: str) -> Any:
    # The class is defined on first use (this module imports no vLLM until then); pickled by reference to the
    # engine core, which finds it here.
    if name == "HiddenStatesRayExecutor":
        return executor_class()
    raise AttributeError(name)


RELIED: tuple[Symbol, ...] = (
    Symbol("vllm.v1.executor.ray_executor_v2:RayExecutorV2", "23", kind="class"),
    # RayExecutorV2._init_executor (overridden here): ray_cpu_device.py lists it, for both points
    Symbol(
        "vllm.v1.executor.ray_executor_v2:RayExecutorV2.start_worker_monitor",
        "23",
        mentions=("executor.is_failed = True",),
        kind="method",
    ),
    Symbol(
        "vllm.v1.executor.ray_executor_v2:RayExecutorV2._get_output_rank",
        "4, 23",
        kind="method",
        defined_in="MultiprocExecutor",
    ),
    Symbol(
        "vllm.distributed.device_communicators.shm_broadcast:MessageQueue.dequeue",
        "23",
        ("timeout", "indefinite"),
        "wrapped",
        mentions=("MessageQueue.recv(self.remote_socket, timeout)",),
    ),
    Symbol(
        "vllm.distributed.device_communicators.shm_broadcast:MessageQueue.recv",
        "23",
        ("socket", "timeout"),
        mentions=("raise TimeoutError",),
    ),
    Symbol("vllm.v1.executor.abstract:Executor.get_class", "23", mentions=("VLLM_USE_RAY_V2_EXECUTOR_BACKEND",)),
    Symbol(f"{_PCFG}.placement_group", "23", kind="field"),
    Symbol(f"{_PCFG}.distributed_executor_backend", "23", kind="field"),
)
