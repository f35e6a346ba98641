"""The vLLM seam: every point where this project patches, extends or reads vLLM's internals (and Ray's private
ones), as vllm-ascend keeps its own (`vllm_ascend/patch/`). One registry, `POINTS`; one module per point that
patches, wraps or replaces something of vLLM, its docstring saying why, how, what it relies on, the upstream
report where there is one, and when it can go; the others (a public extension point, internals read, vLLM's
own paths) are listed here with what they are.

Installing: each process calls `install(process, stage, **context)` at the moment the stage names, and the
registry runs that stage's points in order (`STAGES`), each module's function named as the stage:

    frontend     "start"     HiddenStatesEngine.start, before vLLM's config is built    points 3, 17
                 "config"    after `create_engine_config`, before the engine core starts  points 12, 18, 23
                 "scheduler" hidden states on: the engine core's scheduler class        point 9
                 "async_llm" ExtractingAsyncLLM.__init__, on its output processor       point 10
                 "serving"   frontend/openai.py, on vLLM's completion and chat serving objects   point 21
    engine core  "executor"  the Ray executor of point 23, before it places its workers  point 24
                 (and the scheduler class point 9 names)
    worker       "imported"  the worker extension's import, before the model loads      points 16, 12, 22
                 "runner"    hidden_states_install, on the model runner instance       points 2, 16, 14, 5
                 "lora" / "spec_sampling" / "mm_prefix": CPU start-up steps (collective_rpc)   11 / 13 / 18

The drift check: every symbol these points rely on (`relied()`: each point module's `RELIED`, the others'
in `unpatched.py`, Ray's in `ray_internals.py`) against what is installed; the machinery is `drift.py`.

    python -m hidden_states.vllm.patches            # the table: symbol, kind, ledger point, what is expected
    python -m hidden_states.vllm.patches --check    # each drifted symbol on a line, exit 1; else one line, exit 0

Every engine start runs it (`hidden_states.vllm.check_vllm_version(drift=True)`), and refuses to start on a
drifted symbol, naming it. No module outside this folder patches vLLM (tests/unit/test_patch_sites.py).
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple


class Point(NamedTuple):
    number: int  # the ledger point (docs/how-it-works.md, "The ledger, in short"); 0: Ray's internals
    name: str
    kind: str  # "patch" | "patch, tests only" | "config" | "extension point" | "internals read" | "own path"
    processes: tuple[str, ...]  # where it acts: frontend, engine_core, worker, replica
    module: str | None  # hidden_states.vllm.patches.<module>: the patch and its docstring; None: not a patch
    what: str


POINTS: tuple[Point, ...] = (
    Point(
        1,
        "worker_extension",
        "extension point",
        ("worker",),
        None,
        "the worker gains `hidden_states_install`/`hidden_states_stats` through the public `worker_extension_cls` "
        "engine argument (worker/extension.py). Remove: never; it is the supported extension point.",
    ),
    Point(
        2,
        "runner_step",
        "patch",
        ("worker",),
        "runner_step",
        "`GPUModelRunner.execute_model`/`sample_tokens` wrapped on the runner instance; the step's rows hung on "
        "its ModelRunnerOutput (`AsyncModelRunnerOutput.get_output` wrapped on the instance under async).",
    ),
    Point(3, "v2_runner_off", "config", ("frontend",), "v2_runner_off", "Model Runner V2 turned off by env."),
    Point(
        4,
        "refused_shapes",
        "internals read",
        ("frontend", "worker"),
        None,
        "data parallelism, KV connectors, spec decoding under async scheduling and the rest of "
        "engine_args.REFUSED, and what pipeline parallelism does not serve yet (PIPELINE_REFUSED), refused by name "
        "(engine_args.refuse, at start and in each worker's install); under pipeline parallelism the rank that "
        "sends is the executor's output rank (the last stage's first tensor-parallel rank) and a stage hooks the "
        "layers it runs (not vLLM's `PPMissingLayer`). Remove when the capture serves them.",
    ),
    Point(5, "generator_rewind", "patch", ("worker",), "generator_rewind", "CPU: seeded generators rewound."),
    Point(
        6,
        "kv_prefault",
        "internals read",
        ("worker",),
        None,
        "CPU, optional: `GPUModelRunner.kv_caches` written once at start-up (cpu.CPUWorkerSteps). "
        "Remove when vLLM's CPU worker pre-faults its KV cache.",
    ),
    Point(
        7,
        "warm_up",
        "internals read",
        ("worker",),
        None,
        "CPU, optional: `GPUModelRunner._dummy_run(n, force_attention=True)` per batch size at start-up "
        "(cpu.CPUWorkerSteps). Remove when vLLM's CPU worker warms up per batch size.",
    ),
    Point(
        8,
        "layer_sites",
        "internals read",
        ("worker",),
        None,
        "layer L read at the output of decoder layer L - 1 (a pre-hook on layer 0 for L = 0): torch forward hooks "
        "(worker/layers.py, capture.py), vLLM's decoder-layer convention checked per layer class. "
        "Remove when vLLM returns chosen layers itself (RFC #48743).",
    ),
    Point(
        9,
        "scheduler_cls",
        "config",
        ("frontend", "engine_core"),
        "scheduler_cls",
        "the engine core's scheduler is ours (core/scheduler.py) through the public `scheduler_cls`.",
    ),
    Point(10, "output_rows", "patch", ("frontend",), "output_rows", "the rows taken off each EngineCoreOutput."),
    Point(11, "lora_ops", "patch", ("worker",), "lora_ops", "CPU, LoRA: rows without an adapter get none."),
    Point(12, "cpu_async_shim", "patch, tests only", ("frontend", "worker"), "cpu_async_shim", "vLLM's async on CPU."),
    Point(13, "spec_expand_kernel", "patch", ("worker",), "spec_expand_kernel", "CPU, spec decoding: expand."),
    Point(14, "encoder_items", "patch", ("worker",), "encoder_items", "a model's encoder items counted."),
    Point(
        15,
        "heads_and_steering",
        "internals read",
        ("worker",),
        None,
        "heads' specs reach the workers through `collective_rpc`; steering reads each request's `extra_args` off "
        "the runner's `requests` and its rows from the input batch (worker/steering.py). "
        "Remove: never; re-check when the runner's batch state changes.",
    ),
    Point(16, "traced_forward", "patch", ("worker",), "traced_forward", "the static layer set, traced."),
    Point(17, "audio_resampler", "patch", ("frontend",), "audio_resampler", "audio at any rate, by soxr."),
    Point(18, "mm_prefix_attention", "patch", ("frontend", "worker"), "mm_prefix_attention", "CPU: image spans."),
    Point(
        19,
        "faults",
        "own path",
        ("engine_core", "worker", "frontend"),
        None,
        "a hook of ours that raises fails its request alone, through vLLM's own `finish_requests` and "
        "`FinishReason.ERROR`; tests inject faults with HIDDEN_STATES_FAULT_INJECTION=1, through the twins of "
        "the scheduler (core/fault_injection.py) and of the worker's hook (worker/fault_injection.py). "
        "Remove: never; it is how our code fails safe.",
    ),
    Point(
        20,
        "stop_conditions",
        "own path",
        ("engine_core", "worker"),
        None,
        "stop conditions end a request through vLLM's own stop path (`_update_request_with_output`, "
        "`check_stop`, `FINISHED_STOPPED`, `stop_reason`). Remove: never; vLLM has no per-request hook on a "
        "step's hidden states.",
    ),
    Point(21, "beam_search", "patch", ("frontend",), "beam_search", "beam search's final beams extracted."),
    Point(
        22,
        "pp_buffers",
        "patch",
        ("worker",),
        "pp_buffers",
        "CPU, pipeline parallelism: the later stages' intermediate-tensor buffers allocated when the model loads.",
    ),
    Point(
        23,
        "ray_executor",
        "patch",
        ("frontend", "engine_core"),
        "ray_executor",
        "`distributed_executor_backend: ray`: vLLM's RayExecutorV2 subclassed, in the replica's placement group, its "
        "waits on the workers ended as soon as one dies (a replica across Ray nodes).",
    ),
    Point(
        24,
        "ray_cpu_device",
        "patch, tests only",
        ("engine_core", "worker"),
        "ray_cpu_device",
        "CPU: vLLM's Ray executor with a custom Ray resource as each worker's device (multi-node tests).",
    ),
    Point(
        0,
        "ray_internals",
        "internals read",
        ("replica",),
        "ray_internals",
        "private Ray Serve internals the deployments use (routing.py's PrefixRouter, Serve's switches).",
    ),
)

# (process, stage) -> the points it installs, in order
STAGES: dict[tuple[str, str], tuple[int, ...]] = {
    ("frontend", "start"): (3, 17),
    ("frontend", "config"): (12, 18, 23),
    ("engine_core", "executor"): (24,),
    ("frontend", "scheduler"): (9,),
    ("frontend", "async_llm"): (10,),
    ("frontend", "serving"): (21,),
    ("worker", "imported"): (16, 12, 22),
    ("worker", "runner"): (2, 16, 14, 5),
    ("worker", "lora"): (11,),
    ("worker", "spec_sampling"): (13,),
    ("worker", "mm_prefix"): (18,),
}

BY_NUMBER = {p.number: p for p in POINTS}


def module_of(point: int | Point) -> Any:
    """A point's module (imported on first use: a process imports only the patches it installs)."""
    p = BY_NUMBER[point] if isinstance(point, int) else point
    if p.module is None:
        raise KeyError(f"ledger point {p.number} ({p.name}) is not a patch: it has no module")
    return importlib.import_module(f"{__name__}.{p.module}")


def install(process: str, stage: str, **context: Any) -> dict[str, Any]:
    """Installs the points of `process` at `stage` (`STAGES`), in order: each module's function named `stage`,
    with `context`. Returns {point name: what its install returned}."""
    if (process, stage) not in STAGES:
        raise KeyError(f"no stage {stage!r} in process {process!r}: {sorted(STAGES)}")
    out = {}
    for n in STAGES[(process, stage)]:
        out[BY_NUMBER[n].name] = getattr(module_of(n), stage)(**context)
    return out


def relied() -> tuple:
    """Every symbol the points rely on (drift.Symbol): each point module's `RELIED`, then unpatched.py's."""
    from hidden_states.vllm.patches import unpatched

    symbols = []
    for p in POINTS:
        if p.module is not None:
            symbols.extend(getattr(module_of(p), "RELIED", ()))
    return (*symbols, *unpatched.RELIED)
