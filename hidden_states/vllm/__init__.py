"""Everything that touches vLLM lives in this package; nothing else imports vllm.

- `engine.py`       HiddenStatesEngine: the vLLM implementation of hidden_states/interface.py;
- `engine_args.py`  every vLLM engine argument: exercised, refused at start, or irrelevant;
- `cpu.py`          CPU engines' start-up steps and CPU fixes (generator, LoRA ops, expand kernel, image attention);
- `frontend/`       the AsyncLLM's process: `extraction.py`, `openai.py`;
- `core/`           the engine-core process: `scheduler.py`;
- `worker/`         the worker processes: `extension.py`, `capture.py`, `layers.py`.

The three processes import none of each other; what crosses between them is hidden_states/protocol.py.

Ledger of patched points (supported: vLLM {SUPPORTED}):

1. `Worker` gains `hidden_states_install/hidden_states_stats` through the public
   `worker_extension_cls` engine argument (not a patch).
   Remove: never; it is the supported extension point.
2. `GPUModelRunner.execute_model` and `sample_tokens` are wrapped *on the runner
   instance* (CPU and XPU runners subclass it). Between the two calls
   `runner.execute_model_state` holds the step's `scheduler_output`,
   `sample_hidden_states` (one row per request, `input_batch.req_ids` order) and
   `hidden_states` (every scheduled token's row after the final norm, at
   `query_start_loc` offsets). The scheduler's plan (point 9, `protocol.PLAN_ATTR`)
   gives offsets into each request's scheduled tokens; the rows are gathered, cast
   and top-k selected on the device, packed into one buffer, and hung on the
   returned ModelRunnerOutput (`hidden_states_step`, a `protocol.StepCapture`):
   one device-to-host copy per step, after sampling (under async scheduling inside
   `get_output`). The plan is dropped when execute_model returns or raises, so
   dummy batches see none. Async scheduling (untested, no GPU) relies on vLLM
   0.32 calling execute_model then sample_tokens every step and passing
   num_computed_tokens as of before the step.
   Remove when: vLLM returns last-token hidden states inline (RFC #48743).
3. Model Runner V2 (`vllm/v1/worker/gpu/`) is turned off with
   `VLLM_USE_V2_MODEL_RUNNER=0` (engine.py sets it): it has no
   `execute_model_state`. Remove when point 2 is ported to V2.
4. Pipeline and data parallelism, KV connectors, speculative decoding under
   async scheduling and the rest of engine_args.REFUSED are refused by name
   (engine_args.refuse: in HiddenStatesEngine.start, and on the resolved config
   in each worker's install): with them rows do not map one per request, or the
   step that computes them is skipped. Tensor parallelism needs nothing: every
   rank holds whole rows after each all-reduce; rank 0 sends them.
5. CPU only: `GPUModelRunner._bookkeeping_sync` rewinds a seeded request's
   generator with `gen.set_offset(...)`, which CPU generators refuse, killing the
   engine on seeded prompts longer than one prefill chunk. How: wrapped on the
   runner instance; the generator state saved before sampling is restored
   instead. Remove when vLLM's CPU runner rewinds CPU generators itself.
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
9. The scheduler (scheduler.py) is always ours when hidden states are on
   (`scheduler_config.scheduler_cls`, set after `create_engine_config`):
   `TailScheduler` (a v1 `Scheduler`) under synchronous scheduling,
   `AsyncVectorScheduler` (an `AsyncScheduler`) under async. They override
   `add_request`, `schedule` (the step's plan, `PLAN_ATTR`, on the
   SchedulerOutput), `update_from_output` (rows onto each EngineCoreOutput's
   `kv_transfer_params`) and `_free_request`; the TailScheduler also
   `_update_request_with_output` (holds a flagged request's stop for one step)
   and, under speculative decoding, drops rejected drafts' rows and resets a held
   request's `num_computed_tokens` and `spec_token_ids`. Async: the tail row is
   the step in flight's; `max_tokens` reads one more while `schedule()` runs so
   that step is not skipped. The CUDA stream side is untested.
   Remove when vLLM returns the final token's hidden state itself.
10. The rows' way to the frontend: `EngineCoreOutput.kv_transfer_params`
   (a `dict[str, Any]` vLLM's msgpack carries). `ExtractingAsyncLLM` wraps its
   output processor's `process_outputs` on the instance and takes our key
   (`protocol.ROWS_KEY`) off each output before vLLM reads it; KV connectors,
   the field's real users, are refused. vLLM's completions serving names a
   prompt's engine requests `{id}-{i}` (extraction.prompt_ordinal), so a choice's
   vector is `ordinal * n + index`. Remove when vLLM's outputs carry hidden
   states (RFC #48743).
11. CPU only, LoRA engines: `vllm.lora.ops.torch_ops.lora_ops.bgmv_shrink`,
   `bgmv_expand`, `bgmv_expand_slice` (and `punica_cpu`'s imported names) are
   replaced in the worker (cpu.patch_cpu_lora_ops) by wrappers giving rows with
   index -1 zero input: `weights[-1]` otherwise applied the last adapter to
   base-model requests. Remove when vLLM's torch LoRA ops skip -1 (open PRs
   #48421, #49656).
12. Tests only, CPU: with `HIDDEN_STATES_TEST_CPU_ASYNC=1`,
   `HiddenStatesEngine.start` sets `scheduler_config.async_scheduling = True`
   and the worker module replaces `torch.cuda.Stream`, `torch.cuda.Event`,
   `torch.Event`, `torch.cuda.current_stream` and `torch.cuda.stream` with CPU
   stand-ins (cpu.install_cpu_async_shim), so vLLM's async path runs on CPU.
   Never set in production. Remove when vLLM's CPU platform allows async
   scheduling.
13. CPU only, speculative decoding: the CPU stand-in for the rejection sampler's
   `expand_kernel` (`cpu_triton_utils._expand_kernel_impl`, a `KernelOverride`)
   writes to a converted copy and never copies back, so greedy rows in a mixed
   batch take wrong tokens. How: each worker with a drafter
   (cpu.fix_cpu_spec_sampling) swaps in a torch implementation writing in place.
   Remove when vLLM's CPU stand-in writes its output (report text:
   docs/how-it-works.md, "The ledger, in short").
14. Multimodal prompts and prompt embeddings (not patches; internals read):
   the extraction step rebuilds the request's engine input with
   `vllm.inputs.engine.mm_input` (the processed items, hashes and placeholders of
   the `MultiModalInput` `AsyncLLM.generate` received) or `embeds_input` (the
   embeddings, then the completion's ids with `is_token_ids`); a VLM's text stack
   is `get_language_model()` and its depth `hf_text_config`; handle and verifier
   `messages` with media are rendered by `AsyncLLM.renderer.render_chat_async`;
   each worker counts `embed_multimodal`'s items (`encoder_items`, wrapped on the
   model instance). Remove: never; re-check when vLLM's input types change.
15. Heads and steering (not patches; internals read): heads' specs reach the
   workers as `collective_rpc("hidden_states_install", args=...)`; steering reads
   each request's `SamplingParams.extra_args` off the runner's `requests[rid]`
   (`CachedRequestState.num_prompt_tokens`), its rows from
   `input_batch.num_computed_tokens_cpu` and `query_start_loc`, and changes the
   stream at each layer's site (point 8: hooks returning new args or output), on every
   tensor-parallel rank. Remove: never; re-check when the runner's batch state changes.
16. The static layer set (`capture_layers`, worker/traced.py): compiled engines,
   and eager ones started with it. The set travels in
   `VllmConfig.additional_config["hidden_states"]` (hashed into vLLM's
   compile-cache key). `gpu_worker.Worker.load_model` (CPU and XPU workers
   inherit it) is wrapped at class level when the worker extension is imported,
   before the model loads; after it loads, each layer L of the set gets its
   steering and capture in the instance `forward` of decoder layer L - 1 (after it;
   layer 0: before decoder layer 0), on buffers registered on that module
   (`register_buffer(persistent=False)`, [max tokens, D], allocated
   once), traced by torch.compile with the model and replayed by CUDA graphs.
   `GPUModelRunner._model_forward` is wrapped on the runner instance to write a
   step's steering into those buffers before the forward and clear them after
   (dummy runs call the model directly and see them cleared). Relies on
   `runner.max_num_tokens` bounding a forward's tokens (and the largest CUDA-graph
   size). Counts: `vllm.compilation.counter.compilation_counter` and dynamo's
   `counters`. Remove when vLLM returns chosen layers from the compiled forward
   (RFC #48743).
17. Audio at any rate: `vllm.multimodal.audio.AudioResampler.__init__` is wrapped
   at class level in the frontend process (frontend/audio.py, from
   `HiddenStatesEngine.start`) so that vLLM's default method, torchaudio's (not
   installed on the CPU engine), becomes soxr's (`resample_audio_soxr`, vLLM's own)
   on every machine; a method a model's processor names stays. Remove when vLLM's
   default resampler needs no optional package, or keep for one resampler on every
   machine.
18. CPU only, models vLLM marks `is_mm_prefix_lm` (Gemma 3): an image's tokens
   attend to the whole image. vLLM 0.32's CPU attention ignores the runner's
   `CommonAttentionMetadata.mm_req_doc_ranges` and runs them causally. How:
   `cpu_attn.CPUAttentionMetadataBuilder.build` and
   `CPUAttentionBackendImpl.forward` wrapped at class level in each worker
   (cpu.py, from `cpu_start_up`): a second, non-causal batch of the step's
   image spans for `ops.cpu_attention_with_kv_cache`, whose rows overwrite the
   causal kernel's; `scheduler_config.disable_chunked_mm_input` set before the
   engine core starts, as vLLM's GPU platforms do; an image longer than the
   sliding window refused at start. Remove when the CPU backend supports
   mm_prefix (report in docs/how-it-works.md).
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
   (`FAULT_INJECT_KEY` in `extra_args`, honoured only with
   `HIDDEN_STATES_FAULT_INJECTION=1` in the engine's environment): the
   engine core then runs the fault-injecting twin of its scheduler
   (core/fault_injection.py), so the production scheduler carries no test
   code; the worker still checks for an injected fault inside its hooks.
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

SUPPORTED_VLLM = ("0.32.",)
__doc__ = __doc__.replace("{SUPPORTED}", ", ".join(v + "x" for v in SUPPORTED_VLLM))
# The architectures whose intermediate layers (rows, heads, steering, stop and `when` conditions at
# layers 0..n-1) are served: each name -> the built-in model whose test checks every layer of it
# against transformers' own class (the tests read this table, so a family added here is tested:
# text stacks in tests/engine/test_layers.py, multimodal ones in tests/engine/test_multimodal.py,
# MiMo in tests/engine/test_spec_decode.py). Any other architecture serves the last layer (-1) only,
# and a request for more gets a 400 naming these families. The structural check
# (worker/layers.layer_capture_support) can only refuse one of them, never admit another.
VERIFIED_LAYER_ARCHS = {
    "LlamaForCausalLM": "tiny-llama",
    "Qwen2ForCausalLM": "tiny-qwen2",
    "Qwen3ForCausalLM": "tiny-qwen3",
    "Gemma2ForCausalLM": "tiny-gemma2",
    "Gemma3ForCausalLM": "tiny-gemma3",
    "GemmaForCausalLM": "tiny-gemma",  # make test-long
    "Phi3ForCausalLM": "tiny-phi3",  # make test-long
    "MiMoForCausalLM": "mimo (tests/engine/draft_heads.py, on tiny-qwen2)",
    # vision-language models' text stacks
    "Gemma3ForConditionalGeneration": "tiny-gemma3-vlm",
    "LlavaForConditionalGeneration": "tiny-llava",
    "Qwen2_5_VLForConditionalGeneration": "tiny-qwen2.5-vl",
    "Qwen3VLForConditionalGeneration": "tiny-qwen3-vl",  # DeepStack: rows before its additions
}
LONG_TESTED = ("GemmaForCausalLM", "Phi3ForCausalLM")  # verified by `make test-long` only


def verified_families() -> str:
    """The verified architectures, short: "Llama, Qwen2, ..., Qwen3VL"."""
    return ", ".join(
        a.removesuffix("ForCausalLM").removesuffix("ForConditionalGeneration") for a in VERIFIED_LAYER_ARCHS
    )


def unverified_reason(arch: str) -> str:
    return (
        f"intermediate layers of {arch} are not verified against transformers; they are served on {verified_families()}"
    )


WORKER_EXTENSION = "hidden_states.vllm.worker.extension.HiddenStatesWorkerExtension"
ENGINE_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}


class VLLMIncompatibleError(RuntimeError):
    pass


def _require(cond: bool, what: str) -> None:
    if not cond:
        import vllm

        raise VLLMIncompatibleError(
            f"hidden-states hook: {what} is missing in vLLM {vllm.__version__}; "
            f"this project supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)} "
            "(see the ledger in hidden_states/vllm/__init__.py)"
        )


def check_vllm_version(*, drift: bool = False) -> None:
    """Refuses a vLLM outside the tested range. With `drift` (an engine's start), also runs the drift check
    (hidden_states/vllm/drift.py; its result cached per installed vLLM, Ray and table): a drifted symbol
    refuses the start, naming it, and a refused version says what the check found."""
    import vllm

    found = []
    if drift:
        from hidden_states.vllm.drift import cached_check

        found = cached_check()
    tested = ", ".join(v + "x" for v in SUPPORTED_VLLM)
    shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        what = (
            f"; the drift check found {len(found)} drifted symbol(s): {shown}"
            if found
            else "; the drift check found none drifted"
            if drift
            else ""
        )
        raise VLLMIncompatibleError(
            f"vLLM {vllm.__version__} is not supported; install one of {tested} (scripts/setup.sh does){what}"
        )
    if found:
        raise VLLMIncompatibleError(
            f"vLLM {vllm.__version__}: {len(found)} symbol(s) this project relies on drifted "
            f"(python -m hidden_states.vllm.drift --check lists them): {shown}"
        )
