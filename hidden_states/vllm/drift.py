"""The drift check: every vLLM internal (and private Ray one) the project relies on, against what is installed.

The ledger in `hidden_states/vllm/__init__.py` says what each patch of vLLM relies on; `RELIED` is the same, as
data: one `Symbol` per module, class, method, field or attribute the product code imports, overrides, wraps,
replaces, calls or reads (hidden_states/vllm/, hidden_states/protocol.py, deployments/; not tests/ or bench/),
with the ledger point(s) it serves ("import" where none, "ray" for Ray's internals). Nothing starts: modules are
imported and classes read, so a new vLLM or Ray is checked in seconds, before any engine or cluster runs.

    python -m hidden_states.vllm.drift            # the table: symbol, kind, ledger point, what is expected
    python -m hidden_states.vllm.drift --check    # each drifted symbol on a line, exit 1; else one line, exit 0

An entry's `path` is "module:Qualname.attr" ("module" for a module). `params`, where given, are the parameter
names relied on (`self` skipped), a prefix of the signature in order; names after "*" are passed by keyword, so
they need only exist; "name=<repr>" also checks the default; `exact=True`: the whole list, in order. `mentions`:
text the object's source must contain (whitespace ignored), for behaviour a name cannot show (which method calls
which, with what). `defined_in`: the class the attribute must come from (no subclass in between overrides it).
`kind` says how the project uses the name, and how the last name is checked:

- "field": a dataclass, msgspec, pydantic, NamedTuple or TypedDict field (or anything on the class);
- "init attr" / "load_model attr": an instance attribute, found as an assignment to `self.<name>` in the source
  of `__init__`/`__post_init__` (or `load_model`) of the class or a base, or anything on the class: the object
  itself is never built, so these are checked by their source text;
- "called" and "class": the project calls (constructs) it with `params` only, so any other parameter must have
  a default; "override": vLLM calls our subclass's method; "wrapped" / "replaced": ours stands in for it at run
  time (where this process already runs a patch of ours, the original it keeps is checked);
- "open instances": the class's instances take new attributes (no `__slots__`): the project hangs its own on them;
- "decoder layer": the layer's `forward` also passes the install-time convention check each worker runs
  (worker/layers._residual_norm_of: a fused residual norm at its entry);
- any other kind (module, class, function, method, property, constant, ...): the name resolves.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import re
import sys
import textwrap
from typing import Any, NamedTuple


class Symbol(NamedTuple):
    path: str  # "module:Qualname.attr", or "module"
    point: str  # the ledger point(s) it serves: "9", "9, 20"; "import" or "ray" where none
    params: tuple[str, ...] | None = None  # parameter names relied on (see the module docstring)
    kind: str = "attr"  # how the project uses it, which decides how it is checked (see the module docstring)
    exact: bool = False  # params: the whole list, not a prefix
    mentions: tuple[str, ...] = ()  # strings the source must contain (whitespace ignored)
    defined_in: str = ""  # the class (qualname) the attribute must be defined by


# -- the table, by ledger point ---------------------------------------------------------------------------------

_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
_ASYNC_SCHED = "vllm.v1.core.sched.async_scheduler:AsyncScheduler"
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_CPU_RUNNER = "vllm.v1.worker.cpu_model_runner:CPUModelRunner"
_XPU_RUNNER = "vllm.v1.worker.xpu_model_runner:XPUModelRunner"
_BATCH = "vllm.v1.worker.gpu_input_batch:InputBatch"
_WORKER = "vllm.v1.worker.gpu_worker:Worker"
_ASYNC_LLM = "vllm.v1.engine.async_llm:AsyncLLM"
_REQUEST = "vllm.v1.request:Request"
_STATUS = "vllm.v1.request:RequestStatus"
_SO = "vllm.v1.core.sched.output:SchedulerOutput"
_MRO = "vllm.v1.outputs:ModelRunnerOutput"
_ECO = "vllm.v1.engine:EngineCoreOutput"
_SP = "vllm.sampling_params:SamplingParams"
_VCFG = "vllm.config:VllmConfig"
_MCFG = "vllm.config:ModelConfig"
_SCFG = "vllm.config:SchedulerConfig"
_PCFG = "vllm.config:ParallelConfig"
_ARGS = "vllm.engine.arg_utils:AsyncEngineArgs"
_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
_CM = "vllm.v1.attention.backend:CommonAttentionMetadata"
_LORA_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
_LORA_PARAMS = ("inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor")
_MODELS = "vllm.model_executor.models"
_SERVING_CMPL = "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion"
_SERVING_CHAT = "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat"
_PREFIX = "ray.llm._internal.serve.routing_policies.prefix_aware"
_RR = "ray.serve._private.request_router.request_router:RequestRouter"
_LAYER_PARAMS = ("positions", "hidden_states", "residual")
_VLMS = (  # the verified vision-language models (VERIFIED_LAYER_ARCHS): their text stacks and encoders
    "gemma3_mm:Gemma3ForConditionalGeneration",
    "llava:LlavaForConditionalGeneration",
    "qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl:Qwen3VLForConditionalGeneration",
)


def _refused_args() -> tuple[Symbol, ...]:
    """Point 4: each engine argument refused by name is still vLLM's name for that feature."""
    from hidden_states.vllm.engine_args import REFUSED

    return tuple(Symbol(f"{_ARGS}.{name}", "4", kind="field") for name in REFUSED if name != "worker_extension_cls")


RELIED: tuple[Symbol, ...] = (
    # Point 1: the worker extension, mixed into vLLM's Worker by `worker_extension_cls`.
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
    # Point 2: execute_model / sample_tokens wrapped on the runner; rows from execute_model_state.
    Symbol(
        f"{_RUNNER}.execute_model",
        "2, 16",
        ("scheduler_output",),
        "wrapped",
        mentions=("self._model_forward(input_ids=input_ids", "inputs_embeds=inputs_embeds"),
    ),
    Symbol(f"{_RUNNER}.sample_tokens", "2", kind="wrapped"),
    Symbol(_RUNNER, "2, 16", kind="open instances"),  # execute_model, sample_tokens, _model_forward set on it
    Symbol(f"{_CPU_RUNNER}.execute_model", "2, 5", ("scheduler_output",), "inherited", defined_in="GPUModelRunner"),
    Symbol(f"{_CPU_RUNNER}.sample_tokens", "2", kind="inherited", defined_in="GPUModelRunner"),
    Symbol(f"{_XPU_RUNNER}.execute_model", "2", kind="inherited", defined_in="GPUModelRunner"),
    Symbol(f"{_XPU_RUNNER}.sample_tokens", "2", kind="inherited", defined_in="GPUModelRunner"),
    Symbol(f"{_RUNNER}.execute_model_state", "2", kind="init attr"),
    Symbol("vllm.v1.worker.gpu_model_runner:ExecuteModelState.scheduler_output", "2", kind="field"),
    Symbol("vllm.v1.worker.gpu_model_runner:ExecuteModelState.hidden_states", "2", kind="field"),
    Symbol("vllm.v1.worker.gpu_model_runner:ExecuteModelState.sample_hidden_states", "2", kind="field"),
    Symbol(f"{_RUNNER}.input_batch", "2", kind="init attr"),
    Symbol(f"{_RUNNER}.query_start_loc", "2, 15", kind="init attr"),
    Symbol(f"{_RUNNER}.vllm_config", "2", kind="init attr"),
    Symbol(f"{_RUNNER}.device", "2, 6", kind="init attr"),
    Symbol(f"{_BATCH}.req_id_to_index", "2", kind="init attr"),
    Symbol(f"{_BATCH}.req_ids", "2", kind="property"),
    Symbol("vllm.v1.utils:CpuGpuBuffer.np", "2, 5, 15", kind="init attr"),
    Symbol(f"{_MRO}.req_id_to_index", "2, 9", kind="field"),
    Symbol(_MRO, "2, 9", kind="open instances"),  # the step's rows hang on it (protocol.STEP_ATTR)
    Symbol("vllm.v1.outputs:AsyncModelRunnerOutput", "2", kind="open instances"),  # get_output replaced on it
    Symbol("vllm.v1.outputs:AsyncModelRunnerOutput.get_output", "2", (), "replaced", exact=True),
    Symbol(_SO, "2, 9", kind="open instances"),  # the scheduler's plan rides it to the workers (PLAN_ATTR)
    Symbol(f"{_SO}.num_scheduled_tokens", "2, 9, 15", kind="field"),
    Symbol(f"{_SO}.total_num_scheduled_tokens", "2", kind="field"),
    Symbol(f"{_SO}.finished_req_ids", "2, 15", kind="field"),
    # Point 3: Model Runner V2 turned off by its environment variable.
    Symbol("vllm.envs:VLLM_USE_V2_MODEL_RUNNER", "3", kind="environment variable"),
    # Point 4: refused engine shapes, by argument name and on the resolved configuration (engine_args.refuse).
    *_refused_args(),
    Symbol(f"{_PCFG}.pipeline_parallel_size", "4", kind="field"),
    Symbol(f"{_PCFG}.data_parallel_size", "4", kind="field"),
    Symbol(f"{_PCFG}.prefill_context_parallel_size", "4", kind="field"),
    Symbol(f"{_PCFG}.decode_context_parallel_size", "4", kind="field"),
    Symbol(f"{_PCFG}.world_size", "4", kind="field"),
    Symbol(f"{_VCFG}.kv_transfer_config", "4", kind="field"),
    Symbol(f"{_VCFG}.speculative_config", "4, 13", kind="field"),
    Symbol(f"{_MCFG}.runner_type", "4", kind="init attr"),
    Symbol(f"{_MCFG}.is_diffusion", "4", kind="property"),
    Symbol(f"{_SCFG}.async_scheduling", "4, 9, 12", kind="field"),
    # Point 5: CPU only, the seeded generators' rewind in _bookkeeping_sync (wrapped on the runner).
    Symbol(f"{_CPU_RUNNER}._bookkeeping_sync", "5", kind="wrapped"),
    Symbol(f"{_CPU_RUNNER}.discard_request_mask", "5", kind="init attr"),
    Symbol(f"{_BATCH}.generators", "5", kind="init attr"),
    Symbol(f"{_BATCH}.num_reqs", "5", kind="property"),
    # Point 6: CPU only, the KV cache written once at start-up.
    Symbol(f"{_CPU_RUNNER}.kv_caches", "6", kind="init attr"),
    # Point 7: CPU only, one dummy forward per batch size at start-up.
    Symbol(f"{_CPU_RUNNER}._dummy_run", "7", ("num_tokens", "*", "force_attention"), "called"),
    # Point 8: decoder layers' convention (hooks at entry_site), text stacks, the final-norm probe.
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
    Symbol(f"{_RUNNER}.model", "8, 14", kind="load_model attr"),
    Symbol(f"{_MCFG}.hf_config", "8", kind="field"),
    Symbol(f"{_MCFG}.hf_text_config", "8, 14", kind="field"),
    Symbol(f"{_MCFG}.get_hidden_size", "8", (), "called"),
    Symbol(f"{_MCFG}.enforce_eager", "8, 16", kind="field"),
    # Point 9: our Scheduler subclasses (TailScheduler, VectorScheduler; AsyncVectorScheduler) and what they read.
    Symbol(f"{_SCFG}.scheduler_cls", "9", kind="field"),
    Symbol(f"{_SCHED}.add_request", "9", ("request",), "override", exact=True),
    Symbol(f"{_SCHED}.schedule", "9", kind="override", mentions=("self._update_after_schedule(",)),
    Symbol(f"{_SCHED}._update_after_schedule", "9", ("scheduler_output",), "method"),
    Symbol(
        f"{_SCHED}.update_from_output",
        "9, 20",
        ("scheduler_output", "model_runner_output"),
        "override",
        exact=True,
        mentions=(
            "self._update_request_with_output(",
            "logprobs.slice_request(req_index, len(new_token_ids))",
            "self._free_request(",
        ),
    ),
    Symbol(
        f"{_SCHED}._update_request_with_output",
        "9, 20",
        ("request", "new_token_ids"),
        "override",
        mentions=("check_stop(", "return new_token_ids, stopped"),
    ),
    Symbol(f"{_SCHED}._free_request", "9", ("request",), "override"),
    Symbol(f"{_ASYNC_SCHED}.add_request", "9", ("request",), "override", exact=True),
    Symbol(f"{_ASYNC_SCHED}.schedule", "9", kind="override"),
    Symbol(
        f"{_ASYNC_SCHED}.update_from_output", "9", ("scheduler_output", "model_runner_output"), "override", exact=True
    ),
    Symbol(f"{_ASYNC_SCHED}._update_request_with_output", "9, 20", ("request", "new_token_ids"), "override"),
    Symbol(f"{_ASYNC_SCHED}._free_request", "9", ("request",), "override"),
    Symbol(f"{_SCHED}.requests", "9", kind="init attr"),
    Symbol(f"{_SCHED}.vllm_config", "9", kind="init attr"),
    Symbol(f"{_SCHED}.max_model_len", "9", kind="init attr"),
    Symbol(f"{_SCHED}.return_sampling_mask", "9", kind="init attr"),
    Symbol(f"{_REQUEST}.request_id", "9", kind="init attr"),
    Symbol(f"{_REQUEST}.sampling_params", "9", kind="init attr"),
    Symbol(f"{_REQUEST}.num_prompt_tokens", "9", kind="init attr"),
    Symbol(f"{_REQUEST}.num_tokens", "9, 20", kind="property"),
    Symbol(f"{_REQUEST}.num_computed_tokens", "9", kind="init attr"),
    Symbol(f"{_REQUEST}.spec_token_ids", "9", kind="init attr"),
    Symbol(f"{_REQUEST}.num_output_placeholders", "9", kind="init attr"),
    Symbol(f"{_REQUEST}.max_tokens", "9", kind="init attr"),
    Symbol(f"{_REQUEST}.status", "9, 20", kind="init attr"),
    Symbol(f"{_REQUEST}.structured_output_request", "9", kind="init attr"),
    Symbol(f"{_STATUS}.RUNNING", "9", kind="enum member"),
    Symbol(f"{_STATUS}.FINISHED_LENGTH_CAPPED", "9", kind="enum member"),
    Symbol(f"{_STATUS}.FINISHED_REPETITION", "9", kind="enum member"),
    Symbol(f"{_STATUS}.FINISHED_ABORTED", "9", kind="enum member"),
    Symbol(f"{_SO}.scheduled_spec_decode_tokens", "9", kind="field"),
    Symbol(f"{_MRO}.sampled_token_ids", "9", kind="field"),
    Symbol(f"{_MRO}.logprobs", "9", kind="field"),
    Symbol(f"{_MRO}.sampling_masks", "9", kind="field"),
    Symbol("vllm.v1.outputs:LogprobsLists.slice_request", "9", ("req_idx", "num_positions"), "called"),
    Symbol("vllm.v1.outputs:SamplingMaskLists.slice_request", "9", ("req_idx", "num_positions"), "called"),
    Symbol(f"{_ECO}.new_logprobs", "9", kind="field"),
    Symbol(f"{_ECO}.new_sampling_mask", "9", kind="field"),
    Symbol(f"{_SP}.num_logprobs", "9", kind="property"),
    Symbol(f"{_SP}.stop", "9", kind="field"),
    Symbol(f"{_SP}.structured_outputs", "9", kind="field"),
    # Point 10: rows ride EngineCoreOutput.kv_transfer_params; the output processor's process_outputs is wrapped.
    Symbol(f"{_ECO}.kv_transfer_params", "10, 19", kind="field"),
    Symbol(_ASYNC_LLM, "10", kind="open instances"),  # ExtractingAsyncLLM; llm.extraction set on it
    Symbol(f"{_ASYNC_LLM}.__init__", "10", kind="override"),
    Symbol(
        f"{_ASYNC_LLM}.generate",
        "10",
        ("prompt", "sampling_params", "request_id", "*", "lora_request", "priority"),
        "override",
    ),
    Symbol(f"{_ASYNC_LLM}.from_vllm_config", "10", ("vllm_config", "*", "stat_loggers"), "called"),
    Symbol(f"{_ASYNC_LLM}.output_processor", "10", kind="init attr"),
    Symbol(
        "vllm.v1.engine.output_processor:OutputProcessor.process_outputs", "10", ("engine_core_outputs",), "wrapped"
    ),
    Symbol("vllm.v1.engine.output_processor:OutputProcessor", "10", kind="open instances"),  # process_outputs set
    Symbol("vllm.v1.engine.output_processor:OutputProcessor.request_states", "10", kind="init attr"),
    Symbol("vllm.v1.engine.output_processor:RequestState.parent_req", "10", kind="init attr"),
    Symbol("vllm.v1.engine.output_processor:RequestState.external_req_id", "10", kind="init attr"),
    Symbol("vllm.v1.engine.output_processor:RequestState.request_index", "10", kind="init attr"),
    Symbol(
        f"{_SERVING_CMPL}.create_completion",
        "10",
        ("request", "raw_request"),
        "called",
        mentions=("self._create_completion(request, raw_request)",),
    ),
    Symbol(
        f"{_SERVING_CMPL}._create_completion",
        "10",
        kind="method",
        mentions=('request_id_item = f"{request_id}-{i}"', "self.beam_search("),
    ),
    # Point 11: CPU only, LoRA ops replaced by wrappers that zero the input of rows with index -1.
    Symbol("vllm.lora.ops.torch_ops", "11", kind="module"),
    *(Symbol(f"vllm.lora.ops.torch_ops.lora_ops:{op}", "11", _LORA_PARAMS, "replaced") for op in _LORA_OPS),
    *(Symbol(f"vllm.lora.ops.torch_ops:{op}", "11", _LORA_PARAMS, "replaced") for op in _LORA_OPS),
    *(Symbol(f"vllm.lora.punica_wrapper.punica_cpu:{op}", "11", _LORA_PARAMS, "replaced") for op in _LORA_OPS),
    Symbol(f"{_VCFG}.lora_config", "11", kind="field"),
    # Point 12 (tests only): async scheduling forced on a CPU engine; SchedulerConfig.async_scheduling, above.
    # Point 13: CPU only, the rejection sampler's expand_kernel stand-in swapped for one writing in place.
    Symbol(
        "vllm.v1.sample.rejection_sampler:expand_kernel",
        "13",
        ("output_ptr", "input_ptr", "cu_num_tokens_ptr", "replace_from", "replace_to", "MAX_NUM_TOKENS"),
        "replaced",
        exact=True,
    ),
    Symbol("vllm.triton_utils.dispatcher:KernelOverride", "13", kind="class"),
    Symbol("vllm.triton_utils.dispatcher:KernelOverride._impl", "13", kind="init attr"),
    Symbol("vllm.triton_utils.dispatcher:KernelOverride.func", "13", kind="init attr"),
    Symbol("vllm.triton_utils.dispatcher:KernelOverride.arg_names", "13", kind="init attr"),
    Symbol("vllm.triton_utils.dispatcher:KernelOverride._forward_by_name", "13", kind="init attr"),
    Symbol(
        "vllm.utils.cpu_triton_utils:_expand_kernel_impl",
        "13",
        ("output", "input_val", "cu_num_tokens", "replace_from", "replace_to", "MAX_NUM_TOKENS"),
        "function",
        exact=True,
    ),
    # Point 14: multimodal and embeddings inputs rebuilt for the extraction step; messages rendered by vLLM.
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
    *(Symbol(f"{_MODELS}.{cls}.embed_multimodal", "14", ("**kwargs",), "wrapped", exact=True) for cls in _VLMS),
    # Point 15: heads and steering read each request's extra_args and the runner's batch state.
    Symbol(f"{_RUNNER}.requests", "15", kind="init attr"),
    Symbol("vllm.v1.worker.gpu_input_batch:CachedRequestState.sampling_params", "15", kind="field"),
    # (named by the ledger; the steering code reads only the request state's sampling_params)
    Symbol("vllm.v1.worker.gpu_input_batch:CachedRequestState.num_prompt_tokens", "15", kind="init attr"),
    Symbol(f"{_BATCH}.num_computed_tokens_cpu", "15", kind="init attr"),
    Symbol(f"{_RUNNER}.model_config", "15", kind="init attr"),
    Symbol(f"{_MCFG}.dtype", "15, 16", kind="field"),
    Symbol(f"{_SP}.extra_args", "15", kind="field"),
    # Point 16: the static layer set traced into the compiled forward; Worker.load_model wrapped at class level.
    Symbol(f"{_WORKER}.load_model", "16", kind="wrapped"),
    Symbol("vllm.v1.worker.cpu_worker:CPUWorker.load_model", "16", kind="inherited", defined_in="Worker"),
    Symbol("vllm.v1.worker.xpu_worker:XPUWorker.load_model", "16", kind="inherited", defined_in="Worker"),
    Symbol(f"{_VCFG}.additional_config", "16", kind="field"),
    Symbol(f"{_VCFG}.compute_hash", "16", kind="method", mentions=("self.additional_config",)),
    Symbol(f"{_RUNNER}._model_forward", "16", ("*", "input_ids", "inputs_embeds"), "wrapped"),
    Symbol(f"{_RUNNER}.get_model", "16", (), "called"),
    Symbol(f"{_RUNNER}.max_num_tokens", "15, 16", kind="init attr"),
    Symbol("vllm.config:CompilationConfig.max_cudagraph_capture_size", "16", kind="field"),
    Symbol("vllm.compilation.counter:compilation_counter", "16", kind="dataclass instance"),
    # Point 17: AudioResampler.__init__ wrapped at class level: vLLM's default method becomes soxr.
    Symbol(
        "vllm.multimodal.audio:AudioResampler.__init__",
        "17",
        ("target_sr", "method='torchaudio'"),
        "wrapped",
        exact=True,
    ),
    Symbol("vllm.multimodal.audio:AudioResampler.resample", "17", kind="method", mentions=("resample_audio_soxr(",)),
    Symbol("vllm.multimodal.audio:resample_audio_soxr", "17", ("audio", "*", "orig_sr", "target_sr"), "function"),
    # Point 18: CPU only, image spans attended both ways: the CPU attention builder and backend wrapped.
    Symbol(
        f"{_CPU_ATTN}:CPUAttentionMetadataBuilder.build",
        "18",
        ("common_prefix_len", "common_attn_metadata", "fast_build=False"),
        "wrapped",
        exact=True,
    ),
    Symbol(
        f"{_CPU_ATTN}:CPUAttentionBackendImpl.forward",
        "18",
        ("layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"),
        "wrapped",
    ),
    *(
        Symbol(f"{_CPU_ATTN}:CPUAttentionMetadataBuilder.{name}", "18", kind="init attr")
        for name in (
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "dtype",
            "window_size",
            "isa",
            "kv_cache_dtype",
            "is_cross_attention",
            "is_encoder_only_attention",
        )
    ),
    *(
        Symbol(f"{_CPU_ATTN}:CPUAttentionBackendImpl.{name}", "18", kind="init attr")
        for name in ("scale", "alibi_slopes", "sliding_window", "logits_soft_cap", "sinks", "kv_cache_dtype")
    ),
    Symbol(f"{_CPU_ATTN}:CPUAttentionMetadata", "18", kind="open instances"),  # build() hangs the spans on it
    Symbol(f"{_CPU_ATTN}:ops", "18", kind="module"),
    Symbol(
        f"{_CPU_ATTN}:ops.cpu_attention_with_kv_cache",
        "18",
        (
            "*",
            "query",
            "key_cache",
            "value_cache",
            "output",
            "query_start_loc",
            "seq_lens",
            "scale",
            "causal",
            "alibi_slopes",
            "sliding_window",
            "block_table",
            "softcap",
            "scheduler_metadata",
            "s_aux",
            "dynamic_causal",
            "k_scale",
            "v_scale",
            "kv_cache_dtype",
        ),
        "called",
    ),
    Symbol(
        f"{_CPU_ATTN}:ops.cpu_attn_get_scheduler_metadata",
        "18",
        (
            "*",
            "num_reqs",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "seq_lens",
            "dtype",
            "query_start_loc",
            "causal",
            "sliding_window_size",
            "isa",
            "enable_kv_split",
            "kv_cache_dtype",
        ),
        "called",
    ),
    *(
        Symbol(f"{_CM}.{name}", "18", kind="field")
        for name in (
            "mm_req_doc_ranges",
            "max_query_len",
            "query_start_loc_cpu",
            "seq_lens",
            "num_reqs",
            "block_table_tensor",
        )
    ),
    Symbol("vllm.v1.attention.backend:AttentionLayer._k_scale_float", "18", kind="field"),
    Symbol("vllm.v1.attention.backend:AttentionLayer._v_scale_float", "18", kind="field"),
    Symbol(f"{_SCFG}.disable_chunked_mm_input", "18", kind="field"),
    Symbol(f"{_MCFG}.is_multimodal_model", "18", kind="property"),
    Symbol(f"{_MCFG}.is_mm_prefix_lm", "18", kind="property"),
    # Point 19: a hook's fault fails its request alone, through vLLM's own error path.
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
    # Point 20: stop conditions: _update_request_with_output (above) keeps the tokens up to the trigger.
    Symbol(f"{_STATUS}.FINISHED_STOPPED", "20", kind="enum member"),
    Symbol(f"{_REQUEST}.stop_reason", "20", kind="init attr"),
    Symbol("vllm.v1.core.sched.utils:check_stop", "20", ("request", "max_model_len"), "function"),
    # No ledger point: the rest of what the product code imports from vLLM and reads off its objects.
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
    Symbol(_SERVING_CMPL, "import", kind="open instances"),  # beam_search set on the instance
    Symbol(_SERVING_CHAT, "import", kind="open instances"),
    Symbol(f"{_SERVING_CMPL}.beam_search", "import", ("prompt", "request_id", "params", "lora_request"), "wrapped"),
    Symbol(f"{_SERVING_CHAT}.beam_search", "import", ("prompt", "request_id", "params", "lora_request"), "wrapped"),
    Symbol(
        f"{_SERVING_CHAT}.create_chat_completion",
        "import",
        ("request", "raw_request"),
        "called",
        mentions=("self._create_chat_completion(request, raw_request)",),
    ),
    Symbol(f"{_SERVING_CHAT}._create_chat_completion", "import", kind="method", mentions=("self.beam_search(",)),
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
    # Ray's internals (deployments/routing.py: PrefixRouter; deployments/replica.py, serve_env.py: Serve's switches).
    Symbol(f"{_PREFIX}.prefix_aware_router:PrefixCacheAffinityRouter", "ray", kind="class"),
    Symbol(f"{_PREFIX}.prefix_aware_router:PrefixCacheAffinityRouter.initialize_state", "ray", kind="override"),
    Symbol(
        f"{_PREFIX}.prefix_aware_router:PrefixCacheAffinityRouter._extract_text_from_request",
        "ray",
        ("pending_request",),
        "override",
        exact=True,
    ),
    Symbol(
        f"{_PREFIX}.prefix_aware_router:PrefixCacheAffinityRouter._prefix_match_best_replicas",
        "ray",
        ("pending_request", "candidate_replicas"),
        "override",
        exact=True,
    ),
    Symbol(
        f"{_PREFIX}.prefix_aware_router:PrefixCacheAffinityRouter.on_request_routed",
        "ray",
        ("pending_request", "replica_id", "result"),
        "override",
        exact=True,
    ),
    Symbol(
        f"{_PREFIX}.prefix_aware_router:PrefixCacheAffinityRouter.update_replicas",
        "ray",
        ("replicas",),
        "override",
        exact=True,
    ),
    Symbol(
        f"{_PREFIX}.prefix_aware_router:PrefixCacheAffinityRouter.on_replica_actor_died",
        "ray",
        ("replica_id",),
        "override",
        exact=True,
    ),
    Symbol(
        f"{_PREFIX}.prefix_aware_router:PrefixCacheAffinityRouter.choose_replicas",
        "ray",
        ("candidate_replicas", "pending_request"),
        "method",
        mentions=("self._prefix_match_best_replicas(pending_request, candidate_replicas)",),
    ),
    Symbol(f"{_RR}.initialize_state", "ray", kind="method"),
    Symbol(f"{_RR}.update_replicas", "ray", ("replicas",), "called"),
    Symbol(f"{_RR}.on_replica_actor_died", "ray", ("replica_id",), "called"),
    Symbol(f"{_RR}._probe_queue_lens", "ray", ("replicas", "backoff_index"), "called"),
    Symbol(f"{_RR}._replica_queue_len_cache", "ray", kind="init attr"),
    Symbol(f"{_RR}._use_replica_queue_len_cache", "ray", kind="init attr"),
    Symbol(f"{_RR}._replica_id_set", "ray", kind="init attr"),
    Symbol(
        "ray.serve._private.router:AsyncioRouter.request_router",
        "ray",
        kind="property",
        mentions=("request_router.initialize_state(**(self._request_router_kwargs))",),
    ),
    Symbol("ray.serve._private.request_router.common:ReplicaQueueLengthCache.get", "ray", ("replica_id",), "called"),
    Symbol("ray.serve._private.request_router.common:PendingRequest", "ray", kind="class"),
    Symbol("ray.serve._private.request_router.common:PendingRequest.kwargs", "ray", kind="field"),
    Symbol("ray.serve._private.request_router.replica_wrapper:RunningReplica.replica_id", "ray", kind="property"),
    Symbol(
        "ray.serve._private.request_router.replica_wrapper:RunningReplica.max_ongoing_requests", "ray", kind="property"
    ),
    Symbol("ray.serve._private.common:ReplicaID.unique_id", "ray", kind="field"),
    Symbol(f"{_PREFIX}.prefix_tree:PrefixTree", "ray", (), "class"),
    Symbol(f"{_PREFIX}.prefix_tree:PrefixTree.prefix_match", "ray", ("text", "available_tenants"), "called"),
    Symbol(f"{_PREFIX}.prefix_tree:PrefixTree.insert", "ray", ("text", "tenant", "time_s"), "called"),
    Symbol(f"{_PREFIX}.prefix_tree:PrefixTree.evict_tenant_by_lru", "ray", ("tenant", "min_remove_size"), "called"),
    Symbol(f"{_PREFIX}.prefix_tree:PrefixTree.add_tenants", "ray", ("tenants", "time_s"), "called"),
    Symbol(f"{_PREFIX}.prefix_tree:PrefixTree.remove_tenants", "ray", ("tenants",), "called"),
    Symbol(f"{_PREFIX}.prefix_tree:PrefixTree.tenant_to_char_count", "ray", kind="init attr"),
    *(
        Symbol(f"ray.serve._private.constants:{name}", "ray", kind="environment variable")
        for name in (
            "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD",
            "RAY_SERVE_ENABLE_DIRECT_INGRESS",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT",
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S",
        )
    ),
)


# -- resolution: never raises; a problem is a string ---------------------------------------------------------------


_CALLED = ("called", "class")  # the project calls (constructs) these with the names in `params` and no others


class _Drift(Exception):
    """What was found instead of what was expected."""


def _walk(module: str, names: list[str]) -> Any:
    """`module`'s attribute `names[0]`, then its `names[1]`, ...; a submodule is imported where a module lacks it."""
    obj = importlib.import_module(module)
    for i, name in enumerate(names):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            if not inspect.ismodule(obj):
                raise _Drift(f"no attribute {name!r} on {'.'.join([module, *names[:i]])}") from None
            try:
                obj = importlib.import_module(f"{obj.__name__}.{name}")
            except ImportError:
                raise _Drift(f"no attribute {name!r} on module {obj.__name__}") from None
    return obj


def _sources(obj: Any) -> str:
    if isinstance(obj, property):
        obj = obj.fget
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError) as e:
        raise _Drift(f"no source to read ({type(e).__name__})") from None


def _assigned_in(func: Any, name: str) -> bool:
    """Whether `func`'s source assigns `self.<name>` (plain, annotated, augmented, or in a tuple)."""
    tree = ast.parse(textwrap.dedent(_sources(func)))
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for t in ast.walk(target):
                if (
                    isinstance(t, ast.Attribute)
                    and t.attr == name
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                ):
                    return True
    return False


def _field_names(cls: Any) -> set[str]:
    names: set[str] = set()
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    names |= set(getattr(cls, "__struct_fields__", ()))  # msgspec
    model_fields = getattr(cls, "model_fields", None)  # pydantic
    if isinstance(model_fields, dict):
        names |= set(model_fields)
    names |= set(getattr(cls, "_fields", ()))  # NamedTuple
    for klass in getattr(cls, "__mro__", (cls,)):  # annotations: TypedDict, Protocol, plain classes
        annotations = vars(klass).get("__annotations__", {})
        if isinstance(annotations, dict):
            names |= set(annotations)
    return names


def _check_field(owner: Any, name: str) -> str:
    if name in _field_names(owner) or hasattr(owner, name):
        return "present"
    raise _Drift(f"no field or attribute {name!r}")


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


# Where each kind of instance attribute is assigned (in the class or any base).
_SETTERS = {"init attr": ("__init__", "__post_init__"), "load_model attr": ("load_model",)}


def _check_set_attr(owner: Any, name: str, kind: str) -> str:
    if hasattr(owner, name) or name in _field_names(owner):
        return "present"
    for klass in getattr(owner, "__mro__", ()):
        for method in _SETTERS[kind]:
            func = vars(klass).get(method)
            if not inspect.isfunction(func):
                continue
            # A decorator's wrapper: also the function it wraps or closes over (vLLM's support_torch_compile
            # keeps the original __init__ in a closure); a generated dataclass __init__ has no source.
            cells = [f for f in map(_cell, func.__closure__ or ()) if inspect.isfunction(f)]
            for candidate in (inspect.unwrap(func), *cells):
                try:
                    if _assigned_in(candidate, name):
                        return f"set in {klass.__qualname__}.{method}"
                except _Drift:
                    continue
    where = "/".join(_SETTERS[kind])
    raise _Drift(f"self.{name} is assigned in no {where} of {getattr(owner, '__qualname__', owner)} or its bases")


def _found_params(obj: Any) -> tuple[list[str], dict[str, inspect.Parameter]]:
    """The callable's parameter names, `self` skipped ("*args", "**kwargs" as such), and its parameters."""
    names = getattr(obj, "arg_names", None)  # a Triton kernel, or vLLM's KernelOverride standing in for one
    if isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names) and not inspect.isclass(obj):
        return list(names), {}
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError) as e:
        raise _Drift(f"no signature ({e})") from None
    shown, params = [], {}
    for p in signature.parameters.values():
        if not shown and not params and p.name in ("self", "cls") and not inspect.isclass(obj):
            continue
        shown.append({p.VAR_POSITIONAL: f"*{p.name}", p.VAR_KEYWORD: f"**{p.name}"}.get(p.kind, p.name))
        params[p.name] = p
    return shown, params


def _check_params(sym: Symbol, obj: Any) -> str:
    shown, params = _found_params(obj)
    expected = [p for p in sym.params if p != "*"]
    cut = sym.params.index("*") if "*" in sym.params else len(sym.params)
    positional = [p.partition("=")[0] for p in sym.params[:cut]]
    keywords = [p.partition("=")[0] for p in sym.params[cut + 1 :]]
    found = f"({', '.join(shown)})"
    if sym.exact and shown != [p.partition("=")[0] for p in expected]:
        raise _Drift(found)
    if shown[: len(positional)] != positional:
        raise _Drift(found)
    by_keyword = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [k for k in keywords if k not in by_keyword]
    if params and missing:
        raise _Drift(f"{found}: no parameter {', '.join(missing)}")
    if sym.kind in _CALLED:  # the project's call passes these names only: any other must have a default
        required = [
            n
            for n, p in params.items()
            if p.default is p.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            and n not in positional
            and n not in keywords
        ]
        if required:
            raise _Drift(f"{found}: {', '.join(required)} required")
    for p in expected:
        name, eq, default = p.partition("=")
        if eq and name in params and repr(params[name].default) != default:
            raise _Drift(f"{found} with {name}={params[name].default!r}")
    return found


def _check_mentions(sym: Symbol, obj: Any) -> None:
    source = re.sub(r"\s+", "", _sources(obj))
    missing = [m for m in sym.mentions if re.sub(r"\s+", "", m) not in source]
    if missing:
        raise _Drift(f"source without {' / '.join(repr(m) for m in missing)}")


def _check_defined_in(sym: Symbol, owner: Any, name: str) -> None:
    definer = next((k for k in getattr(owner, "__mro__", ()) if name in vars(k)), None)
    if definer is None or definer.__qualname__ != sym.defined_in:
        raise _Drift(f"defined in {getattr(definer, '__qualname__', None)}")


def _check_open(cls: Any) -> None:
    if not inspect.isclass(cls) or not cls.__dictoffset__:
        raise _Drift("instances without a __dict__ (__slots__): no attribute of ours can be set on them")


def _unpatched(owner: Any, name: str, obj: Any) -> Any:
    """vLLM's own object where this process already runs a patch of ours in its place (a wrapper installed at
    class or module level): the original it keeps, as `_hidden_states_<name>` on the owner or in its closure."""
    if not str(getattr(obj, "__module__", "")).startswith("hidden_states."):
        return obj
    kept = getattr(owner, f"_hidden_states_{name}", None)
    if kept is not None:
        return kept
    inner = [
        f
        for f in map(_cell, getattr(obj, "__closure__", None) or ())
        if callable(f) and not str(getattr(f, "__module__", "")).startswith("hidden_states.")
    ]
    return inner[0] if inner else obj


def _check_decoder_layer(owner: Any) -> None:
    from hidden_states.vllm.worker.layers import _residual_norm_of

    norm, why = _residual_norm_of(owner)
    if norm is None:
        raise _Drift(why)


def _check_one(sym: Symbol) -> str:
    """What was found for `sym` (a short description), or raises _Drift saying what was found instead."""
    module, _, qualname = sym.path.partition(":")
    names = qualname.split(".") if qualname else []
    if sym.kind == "field":
        return _check_field(_walk(module, names[:-1]), names[-1])
    if sym.kind in _SETTERS:
        return _check_set_attr(_walk(module, names[:-1]), names[-1], sym.kind)
    owner = _walk(module, names[:-1]) if names else None
    obj = _walk(module, names)
    if names:
        obj = _unpatched(owner, names[-1], obj)
    if sym.kind == "module" and not inspect.ismodule(obj):
        raise _Drift(f"a {type(obj).__name__}, not a module")
    if sym.kind == "open instances":
        _check_open(obj)
    if sym.kind == "dataclass instance" and not dataclasses.is_dataclass(obj):
        raise _Drift(f"a {type(obj).__name__}, not a dataclass instance")
    found = "present"
    if sym.params is not None:
        found = _check_params(sym, obj)
    if sym.mentions:
        _check_mentions(sym, obj)
    if sym.defined_in:
        _check_defined_in(sym, owner, names[-1])
    if sym.kind == "decoder layer":
        _check_decoder_layer(owner)
    return found


def expected(sym: Symbol) -> str:
    """What the entry expects, as the table and the drift lines show it."""
    if sym.kind == "field":
        what = "a field"
    elif sym.kind in _SETTERS:
        what = f"self.{sym.path.rpartition('.')[2]} set in {'/'.join(_SETTERS[sym.kind])}"
    elif sym.kind == "open instances":
        what = "instances take new attributes"
    elif sym.params is not None:
        what = f"({', '.join(sym.params)}{'' if sym.exact or not sym.params else ', ...'})"
    else:
        what = "present"
    extra = [f"defined in {sym.defined_in}"] if sym.defined_in else []
    extra += [f"source with {m!r}" for m in sym.mentions]
    if sym.kind == "decoder layer":
        extra.append("forward opens with the fused residual norm")
    return " and ".join([what, *extra])


def _point(sym: Symbol) -> str:
    if sym.point in ("import", "ray"):
        return sym.point
    return f"ledger point{'s' if ',' in sym.point else ''} {sym.point}"


def drift_of(sym: Symbol) -> str | None:
    """The drift line of one entry, or None if it holds. Never raises."""
    try:
        _check_one(sym)
        return None
    except _Drift as e:
        found = str(e)
    except (Exception, SystemExit) as e:  # an import that fails, or anything a module raises at import
        found = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return f"{sym.path} ({sym.kind}, {_point(sym)}): expected {expected(sym)}; found: {found}"


def check(relied: tuple[Symbol, ...] = RELIED) -> list[str]:
    """One line per drifted symbol (the symbol, its kind and ledger point, what was expected, what was found);
    [] if none drifted."""
    return [line for sym in relied if (line := drift_of(sym)) is not None]


def cached_check() -> list[str]:
    """`check()`, its result kept on disk per installed vLLM and Ray and this table (the engine's start runs it:
    seconds once per install, a file read after)."""
    import hashlib
    import json
    import os
    from pathlib import Path

    key = hashlib.sha256((_versions() + Path(__file__).read_text()).encode()).hexdigest()[:16]
    root = os.environ.get("HIDDEN_STATES_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hidden-states"
    )
    path = Path(root) / "drift" / f"{key}.json"
    try:
        return list(json.loads(path.read_text()))
    except (OSError, ValueError):
        pass
    lines = check(RELIED)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(lines))
        tmp.replace(path)
    except OSError:  # a read-only cache: checked again next time
        pass
    return lines


def _versions() -> str:
    out = []
    for name in ("vllm", "ray"):
        try:
            out.append(f"{name} {importlib.import_module(name).__version__}")
        except Exception:  # noqa: BLE001 - reported by the check itself
            out.append(f"{name} not importable")
    return ", ".join(out)


def table(relied: tuple[Symbol, ...] = RELIED) -> str:
    """The entries as a table: symbol, kind, ledger point, what is expected."""
    rows = [("symbol", "kind", "ledger point", "expected"), *((s.path, s.kind, s.point, expected(s)) for s in relied)]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(r[:3], widths)), r[3]]).rstrip() for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hidden_states.vllm.drift", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="check the installed vLLM and Ray; exit 1 on drift")
    args = parser.parse_args(argv)
    if not args.check:
        print(table())
        return 0
    lines = check(RELIED)
    if lines:  # the lines alone on stdout; the summary on stderr
        for line in lines:
            print(line)
        print(
            f"{len(lines)} of {len(RELIED)} symbols drifted ({_versions()}): the ledger in "
            "hidden_states/vllm/__init__.py says what each serves",
            file=sys.stderr,
        )
        return 1
    print(f"{len(RELIED)} symbols checked, none drifted ({_versions()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
