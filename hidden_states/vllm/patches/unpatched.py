"""The ledger's points that patch nothing of vLLM (a public extension point, internals read or called, vLLM's own
paths), as they were specified; their symbols are below (`RELIED`), with the names the product code imports from
vLLM ("import"). Each patch's own symbols sit with its module; `hidden_states.vllm.patches.relied()` is all of
them, and the drift check (drift.py) reads that.

1. `Worker` gains `hidden_states_install/hidden_states_stats` through the public
`worker_extension_cls` engine argument (not a patch).
Remove: never; it is the supported extension point.

4. Pipeline and data parallelism, KV connectors, speculative decoding under
async scheduling and the rest of engine_args.REFUSED are refused by name
(engine_args.refuse: in HiddenStatesEngine.start, and on the resolved config
in each worker's install): with them rows do not map one per request, or the
step that computes them is skipped. Tensor parallelism needs nothing: every
rank holds whole rows after each all-reduce; rank 0 sends them.

6. CPU only, optional (`prefault_kv_cache`): `GPUModelRunner.kv_caches` is
read to write every KV-cache page once at start-up (not patched). Why: the
zeroed CPU KV cache is mapped lazily, so resident memory grows under load
until OOM. Remove when vLLM's CPU worker pre-faults its KV cache.

7. CPU only, optional (`warm_up_s`): `GPUModelRunner._dummy_run(n,
force_attention=True)` is called (not patched) for batch sizes n = 1, 2, ...
within a time budget at start-up. Why: oneDNN builds and caches a kernel per
batch size (about 80 MB on the built-in model), otherwise during the first
requests. Remove when vLLM's CPU worker warms up per batch size.

8. Intermediate layers: layer L is transformers' `hidden_states[L]`, read where
`worker/layers.entry_site` puts it: a forward pre-hook on decoder layer 0 for
L = 0 (the embeddings), a forward hook on the output of decoder layer L-1 for
1 <= L < n (eager engines; not a patch), or the same two sites traced into the
compiled forward (point 16). Not the input of layer L: a model may add to the
stream between layers (Qwen3-VL's DeepStack), and transformers records the
output. Relies on vLLM's decoder-layer convention, checked at install per
layer class: `forward(positions, hidden_states, residual, ...)` returning
(hidden, residual) whose norm returns (norm(h + r), h + r) (probed once), so
the stream is hidden + residual. Served only on `VERIFIED_LAYER_ARCHS`. The
last layer is the model's output after the final norm, except where
`compute_logits` applies it (MiMo): a probe (layers.final_norm_in_logits)
finds those and the capture applies the norm. Remove when vLLM returns
chosen layers itself (RFC #48743).

14. Multimodal prompts and prompt embeddings (not patches; internals read):
the extraction step rebuilds the request's engine input with
`vllm.inputs.engine.mm_input` (the processed items, hashes and placeholders of
the `MultiModalInput` `AsyncLLM.generate` received) or `embeds_input` (the
embeddings, then the completion's ids with `is_token_ids`); a VLM's text stack
is `get_language_model()` and its depth `hf_text_config`; handle and verifier
`messages` with media are rendered by `AsyncLLM.renderer.render_chat_async`;
each worker counts `embed_multimodal`'s items (`encoder_items`, wrapped on the
model instance: the one patch of point 14, encoder_items.py). Remove: never; re-check when vLLM's input types change.

15. Heads and steering (not patches; internals read): heads' specs reach the
workers as `collective_rpc("hidden_states_install", args=...)`; steering reads
each request's `SamplingParams.extra_args` off the runner's `requests[rid]`
(`CachedRequestState.num_prompt_tokens`), its rows from
`input_batch.num_computed_tokens_cpu` and `query_start_loc`, and changes the
stream at each layer's site (point 8: hooks returning new args or output), on every
tensor-parallel rank. Remove: never; re-check when the runner's batch state changes.

19. Faults stay with their request (not a patch of vLLM; its own error path):
a hook of ours that raises for one request, in the scheduler (`plan`,
`file`, `send`, `tail`) or a worker (`capture`, `steering`, `heads`), fails that
request alone. Work done for a whole step (a layer's gather, the step's
pack, a head's product, the traced steering buffers) is redone request by
request when it raises; the worker reports the request on
`StepCapture.faults`; the scheduler finishes it with
`RequestStatus.FINISHED_ERROR` through `Scheduler.finish_requests` and
replaces its output of the step with one `EngineCoreOutput` whose
`finish_reason` is `FinishReason.ERROR` and whose `kv_transfer_params`
carry the `protocol.HookFault` (as vLLM itself fails a request whose
grammar does not compile); the frontend raises `HookFaultError` (a 500
naming the hook). Relies on `finish_requests`, `EngineCoreOutput` and
`FinishReason.ERROR` as in vLLM 0.32. Tests inject faults by request
(`RequestSpec.inject` in `extra_args`, honoured only with
`HIDDEN_STATES_FAULT_INJECTION=1` in the engine's environment): the
engine core then runs the fault-injecting twin of its scheduler
(core/fault_injection.py) and each worker the fault-injecting twin of its
hook (worker/fault_injection.py: `runner_hook_class`), so the production
scheduler and worker carry no test code.
Remove: never; it is how our code fails safe.

20. Stop conditions (`hidden_states_stop`; not a patch of vLLM, its own stop
path): the plan names each monitored request's completion rows not judged
yet (`PlanEntry.watch`); the worker scores them with the registered heads
on the device (`protocol.MONITOR_BLOCK`, float32, in the step's one copy);
`update_from_output` files the scores before vLLM applies the step, and
`_update_request_with_output` keeps the tokens up to the first position
where a condition holds, then sets `RequestStatus.FINISHED_STOPPED` and a
`stop_reason` ("hidden_states_stop[i]") as `check_stop` does for a stop
token. Relies on `_update_request_with_output(request, new_token_ids)`
appending tokens and calling `check_stop` (vLLM 0.32), and on the caller
slicing logprobs by the tokens it returns. Remove: never; vLLM has no
per-request hook on a step's hidden states.
"""

from __future__ import annotations

from hidden_states.vllm.patches.drift import (
    _ARGS,
    _ASYNC_LLM,
    _BATCH,
    _CPU_RUNNER,
    _ECO,
    _LAYER_PARAMS,
    _MCFG,
    _MODELS,
    _PCFG,
    _REQUEST,
    _RUNNER,
    _SCFG,
    _SCHED,
    _SERVING_CHAT,
    _SERVING_CMPL,
    _SP,
    _STATUS,
    _VCFG,
    _VLMS,
    _WORKER,
    Symbol,
    _refused_args,
)

RELIED: tuple[Symbol, ...] = (
    Symbol(f"{_ARGS}.worker_extension_cls", "1, 4", kind="field"),
    Symbol(f"{_PCFG}.worker_extension_cls", "1", kind="field"),
    Symbol(
        "vllm.v1.worker.worker_base:WorkerWrapperBase.init_worker",
        "1",
        kind="method",
        mentions=("worker_extension_cls",),
    ),
    Symbol(f"{_WORKER}.model_runner", "1", kind="init attr"),
    Symbol(f"{_WORKER}.rank", "1", kind="init attr"),
    Symbol(f"{_ASYNC_LLM}.collective_rpc", "1, 15", ("method", "*", "timeout", "args"), "called"),
    *_refused_args(),
    Symbol(f"{_PCFG}.pipeline_parallel_size", "4", kind="field"),
    Symbol(f"{_PCFG}.tensor_parallel_size", "4", kind="field"),
    # the rank whose ModelRunnerOutput the executor returns: the last stage's first tensor-parallel rank, as the
    # worker extension's `attaches` computes it
    Symbol(
        "vllm.v1.executor.multiproc_executor:MultiprocExecutor._get_output_rank",
        "4",
        (),
        "method",
        mentions=("self.world_size", "- self.parallel_config.tensor_parallel_size"),
    ),
    Symbol("vllm.model_executor.models.utils:PPMissingLayer", "4", kind="class"),
    # why speculative decoding is refused under pipeline parallelism (PIPELINE_REFUSED): the runner builds its
    # drafter on the last stage only, and every stage reads it when it allocates its KV cache (a change to either
    # is the moment to try it again)
    Symbol(
        f"{_RUNNER}.__init__",
        "4",
        kind="method",
        mentions=("if self.speculative_config and get_pp_group().is_last_rank:",),
    ),
    Symbol(
        f"{_RUNNER}.initialize_kv_cache_tensors",
        "4",
        kind="method",
        mentions=('if self.speculative_config: attn_groups += getattr(self.drafter, "draft_attn_groups", [])',),
    ),
    Symbol(f"{_PCFG}.data_parallel_size", "4", kind="field"),
    Symbol(f"{_PCFG}.prefill_context_parallel_size", "4", kind="field"),
    Symbol(f"{_PCFG}.decode_context_parallel_size", "4", kind="field"),
    Symbol(f"{_PCFG}.world_size", "4", kind="field"),
    Symbol(f"{_VCFG}.kv_transfer_config", "4", kind="field"),
    Symbol(f"{_VCFG}.speculative_config", "4, 13", kind="field"),
    Symbol(f"{_MCFG}.runner_type", "4", kind="init attr"),
    Symbol(f"{_MCFG}.is_diffusion", "4", kind="property"),
    Symbol(f"{_SCFG}.async_scheduling", "4, 9, 12", kind="field"),
    Symbol(f"{_CPU_RUNNER}.kv_caches", "6", kind="init attr"),
    Symbol(f"{_CPU_RUNNER}._dummy_run", "7", ("num_tokens", "*", "force_attention"), "called"),
    Symbol(f"{_MODELS}.llama:LlamaDecoderLayer.forward", "8", _LAYER_PARAMS, "decoder layer"),
    Symbol(f"{_MODELS}.qwen2:Qwen2DecoderLayer.forward", "8", _LAYER_PARAMS, "decoder layer"),
    Symbol(f"{_MODELS}.qwen3:Qwen3DecoderLayer.forward", "8", _LAYER_PARAMS, "decoder layer"),
    Symbol(f"{_MODELS}.qwen3_vl:Qwen3VLDecoderLayer.forward", "8", _LAYER_PARAMS, "decoder layer"),
    Symbol(f"{_MODELS}.gemma:GemmaDecoderLayer.forward", "8", _LAYER_PARAMS, "decoder layer"),
    Symbol(f"{_MODELS}.gemma2:Gemma2DecoderLayer.forward", "8", _LAYER_PARAMS, "decoder layer"),
    Symbol(f"{_MODELS}.gemma3:Gemma3DecoderLayer.forward", "8", _LAYER_PARAMS, "decoder layer"),
    Symbol(f"{_MODELS}.llama:LlamaModel.layers", "8", kind="init attr"),
    Symbol(f"{_MODELS}.llama:LlamaModel.norm", "8", kind="init attr"),
    Symbol(f"{_MODELS}.llama:LlamaForCausalLM.model", "8", kind="init attr"),
    Symbol(f"{_MODELS}.llama:LlamaForCausalLM.lm_head", "8", kind="init attr"),
    Symbol(f"{_MODELS}.llama:LlamaForCausalLM.logits_processor", "8", kind="init attr"),
    Symbol(f"{_MODELS}.llama:LlamaForCausalLM.compute_logits", "8", ("hidden_states",), "called"),
    Symbol(
        f"{_MODELS}.mimo:MiMoForCausalLM.compute_logits",
        "8",
        ("hidden_states",),
        "called",
        mentions=("self.model.norm(hidden_states)",),
    ),
    Symbol(
        "vllm.model_executor.layers.logits_processor:LogitsProcessor.forward",
        "8",
        ("lm_head", "hidden_states"),
        "called",
    ),
    Symbol(f"{_MODELS}.phi3:Phi3ForCausalLM", "8", kind="class"),
    *(Symbol(f"{_MODELS}.{cls}.get_language_model", "8, 14", (), "called") for cls in _VLMS),
    Symbol(f"{_RUNNER}.model", "8, 14, 22", kind="load_model attr"),
    Symbol(f"{_MCFG}.hf_config", "8", kind="field"),
    Symbol(f"{_MCFG}.hf_text_config", "8, 14", kind="field"),
    Symbol(f"{_MCFG}.get_hidden_size", "8", (), "called"),
    Symbol(f"{_MCFG}.enforce_eager", "8, 16", kind="field"),
    Symbol(
        "vllm.inputs.engine:mm_input",
        "14",
        ("prompt_token_ids", "mm_kwargs", "mm_hashes", "mm_placeholders", "*", "cache_salt"),
        "called",
        mentions=('type="multimodal"',),
    ),
    Symbol(
        "vllm.inputs.engine:embeds_input",
        "14",
        ("prompt_embeds", "*", "cache_salt", "prompt_token_ids", "is_token_ids"),
        "called",
        mentions=('type="embeds"',),
    ),
    Symbol("vllm.inputs.engine:tokens_input", "14", ("prompt_token_ids", "*", "cache_salt"), "called"),
    Symbol("vllm.inputs.engine:MultiModalInput.type", "14", kind="field"),
    Symbol("vllm.inputs.engine:MultiModalInput.prompt_token_ids", "14", kind="field"),
    Symbol("vllm.inputs.engine:MultiModalInput.mm_kwargs", "14", kind="field"),
    Symbol("vllm.inputs.engine:MultiModalInput.mm_hashes", "14", kind="field"),
    Symbol("vllm.inputs.engine:MultiModalInput.mm_placeholders", "14", kind="field"),
    Symbol("vllm.inputs.engine:MultiModalInput.cache_salt", "14", kind="field"),
    Symbol("vllm.inputs.engine:EmbedsInput.prompt_embeds", "14", kind="field"),
    Symbol("vllm.multimodal.inputs:PlaceholderRange.offset", "14", kind="field"),
    Symbol("vllm.multimodal.inputs:PlaceholderRange.length", "14", kind="field"),
    Symbol(f"{_ASYNC_LLM}.renderer", "14", kind="init attr"),
    Symbol("vllm.renderers.base:BaseRenderer.render_chat_async", "14", ("conversations", "chat_params"), "called"),
    Symbol(
        "vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest",
        "14",
        ("*", "model", "messages"),
        "class",
    ),
    Symbol(
        "vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest.build_chat_params",
        "14",
        ("default_template", "default_template_content_format"),
        "called",
    ),
    Symbol(f"{_RUNNER}.requests", "15", kind="init attr"),
    Symbol("vllm.v1.worker.gpu_input_batch:CachedRequestState.sampling_params", "15", kind="field"),
    Symbol("vllm.v1.worker.gpu_input_batch:CachedRequestState.num_prompt_tokens", "15", kind="init attr"),
    Symbol(f"{_BATCH}.num_computed_tokens_cpu", "15", kind="init attr"),
    Symbol(f"{_RUNNER}.model_config", "15, 22", kind="init attr"),
    Symbol(f"{_MCFG}.dtype", "15, 16, 22", kind="field"),
    Symbol(f"{_SP}.extra_args", "15", kind="field"),
    Symbol(f"{_RUNNER}.max_num_tokens", "15, 16, 22", kind="init attr"),
    Symbol(
        f"{_SCHED}.finish_requests",
        "19",
        ("request_ids", "finished_status"),
        "called",
        mentions=("self._free_request(",),
    ),
    Symbol(f"{_STATUS}.FINISHED_ERROR", "19", kind="enum member"),
    Symbol(_ECO, "19", ("request_id", "new_token_ids", "*", "finish_reason", "kv_transfer_params"), "class"),
    Symbol("vllm.v1.engine:EngineCoreOutputs", "19", ("*", "outputs"), "class"),
    Symbol("vllm.v1.engine:FinishReason.ERROR", "19", kind="enum member"),
    Symbol(f"{_REQUEST}.client_index", "19", kind="init attr"),
    Symbol(f"{_STATUS}.FINISHED_STOPPED", "20", kind="enum member"),
    Symbol(f"{_REQUEST}.stop_reason", "20", kind="init attr"),
    Symbol("vllm.v1.core.sched.utils:check_stop", "20", ("request", "max_model_len"), "function"),
    Symbol("vllm:__version__", "import", kind="constant"),
    Symbol("vllm.envs:VLLM_CPU_OMP_THREADS_BIND", "import", kind="environment variable"),  # deployments/config.py
    Symbol("vllm.envs:VLLM_RAY_PER_WORKER_GPUS", "import", kind="environment variable"),
    Symbol("vllm.platforms:current_platform.is_cpu", "import", (), "called"),
    Symbol("vllm.model_executor.models:ModelRegistry.get_supported_archs", "import", (), "called"),
    Symbol(_ARGS, "import", ("*", "model"), "class"),
    Symbol(f"{_ARGS}.create_engine_config", "import", (), "called"),
    *(
        Symbol(f"{_ARGS}.{name}", "import", kind="field")
        for name in ("enable_prefix_caching", "scheduling_policy", "block_size", "kv_cache_memory_bytes")
    ),
    Symbol("vllm.v1.metrics.ray_wrappers:RayPrometheusStatLogger", "import", kind="class"),
    Symbol(f"{_ASYNC_LLM}.vllm_config", "import", kind="init attr"),
    Symbol(f"{_ASYNC_LLM}.model_config", "import", kind="init attr"),
    Symbol(f"{_ASYNC_LLM}.tokenizer", "import", kind="property"),
    Symbol(f"{_ASYNC_LLM}.errored", "import", kind="property"),
    Symbol(f"{_ASYNC_LLM}.output_handler", "import", kind="init attr"),
    Symbol(f"{_ASYNC_LLM}.shutdown", "import", (), "called"),
    Symbol(f"{_ASYNC_LLM}.get_supported_tasks", "import", (), "called"),
    Symbol("vllm.v1.engine.output_processor:OutputProcessor.get_num_unfinished_requests", "import", (), "called"),
    *(
        Symbol(f"{_VCFG}.{name}", "import", kind="field")
        for name in ("model_config", "scheduler_config", "cache_config", "parallel_config", "compilation_config")
    ),
    *(Symbol(f"{_MCFG}.{name}", "import", kind="field") for name in ("model", "max_model_len")),
    Symbol(f"{_MCFG}.get_vocab_size", "import", (), "called"),
    Symbol(f"{_SCFG}.policy", "import", kind="field"),
    Symbol(f"{_SCFG}.max_num_batched_tokens", "import", kind="field"),
    Symbol("vllm.config:CacheConfig.enable_prefix_caching", "import", kind="field"),
    Symbol("vllm.config:CacheConfig.block_size", "import", kind="field"),
    Symbol("vllm.config:CompilationConfig.cudagraph_mode", "import", kind="field"),
    Symbol("vllm.config:CompilationConfig.mode", "import", kind="field"),
    Symbol(
        "vllm:SamplingParams",
        "import",
        ("*", "n", "max_tokens", "temperature", "top_p", "seed", "stop", "detokenize", "output_kind", "extra_args"),
        "class",
    ),
    Symbol(f"{_SP}.clone", "import", (), "called"),
    Symbol("vllm.sampling_params:RequestOutputKind.FINAL_ONLY", "import", kind="enum member"),
    Symbol("vllm.sampling_params:RequestOutputKind.DELTA", "import", kind="enum member"),
    Symbol("vllm.sampling_params:BeamSearchParams.max_tokens", "import", kind="field"),
    Symbol("vllm.sampling_params:BeamSearchParams.beam_width", "import", kind="field"),
    Symbol("vllm.sampling_params:BeamSearchParams.__struct_fields__", "import", kind="msgspec Struct"),
    Symbol("vllm.lora.request:LoRARequest.lora_name", "import", kind="field"),
    *(
        Symbol(f"vllm.outputs:RequestOutput.{name}", "import", kind="init attr")
        for name in ("prompt_token_ids", "outputs", "num_cached_tokens")
    ),
    *(
        Symbol(f"vllm.outputs:CompletionOutput.{name}", "import", kind="field")
        for name in ("index", "text", "token_ids", "finish_reason")
    ),
    Symbol("vllm.entrypoints.openai.completion.protocol:CompletionRequest", "import", kind="class"),
    Symbol("vllm.entrypoints.openai.completion.protocol:CompletionRequest.model", "import", kind="field"),
    Symbol("vllm.entrypoints.openai.completion.protocol:CompletionRequest.vllm_xargs", "import", kind="field"),
    Symbol("vllm.entrypoints.openai.completion.protocol:CompletionRequest.request_id", "import", kind="field"),
    Symbol("vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest.vllm_xargs", "import", kind="field"),
    Symbol("vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest.request_id", "import", kind="field"),
    Symbol(
        "vllm.entrypoints.launchers.api_server.app_state:init_app_state",
        "import",
        ("engine_client", "state", "args", "*", "supported_tasks"),
        "called",
        mentions=("state.openai_serving_models =", "state.serving_tokenization =", "init_generate_state("),
    ),
    Symbol(
        "vllm.entrypoints.generate.api_router:init_generate_state",
        "import",
        kind="function",
        mentions=("state.openai_serving_chat =", "state.openai_serving_completion ="),
    ),
    Symbol("vllm.entrypoints.launchers.cli_args:make_arg_parser", "import", ("parser",), "called"),
    Symbol("vllm.utils.argparse_utils:FlexibleArgumentParser", "import", kind="class"),
    Symbol("vllm.entrypoints.openai.models.serving:OpenAIServingModels.lora_requests", "import", kind="init attr"),
    Symbol("vllm.entrypoints.openai.models.serving:OpenAIServingModels.base_model_paths", "import", kind="init attr"),
    Symbol("vllm.entrypoints.openai.models.protocol:BaseModelPath.name", "import", kind="field"),
    Symbol(
        f"{_SERVING_CHAT}.create_chat_completion",
        "import",
        ("request", "raw_request"),
        "called",
        mentions=("self._create_chat_completion(request, raw_request)",),
    ),
    Symbol(f"{_SERVING_CMPL}.create_error_response", "import", ("message",), "called"),
    Symbol("vllm.entrypoints.serve.engine.protocol:ErrorResponse.error", "import", kind="field"),
    Symbol("vllm.entrypoints.serve.engine.protocol:ErrorInfo.code", "import", kind="field"),
    Symbol("vllm.entrypoints.serve.tokenize.protocol:TokenizeRequest", "import", kind="class"),
    Symbol("vllm.entrypoints.serve.tokenize.protocol:DetokenizeRequest", "import", kind="class"),
    Symbol(
        "vllm.entrypoints.serve.tokenize.serving:ServingTokenization.create_tokenize",
        "import",
        ("request", "raw_request"),
        "called",
    ),
    Symbol(
        "vllm.entrypoints.serve.tokenize.serving:ServingTokenization.create_detokenize",
        "import",
        ("request", "raw_request"),
        "called",
    ),
)
