"""Everything that touches vLLM lives in this package; nothing else imports vllm.

- `engine.py`       HiddenStatesEngine: the vLLM implementation of the interface (hidden_states/interface.py);
- `engine_args.py`  every vLLM engine argument: exercised, refused at start, or irrelevant;
- `cpu.py`          CPU engines' start-up steps (pre-faulted KV cache, warm-up, malloc_trim) and the
                    CPU fixes (generator, LoRA ops, the speculative sampler's expand kernel);
- `frontend/`       the AsyncLLM's process: `extraction.py` (rows off vLLM's outputs, the extraction
                    step), `openai.py` (vLLM's OpenAI serving classes, plus the vectors);
- `core/`           the engine-core process: `scheduler.py` (each step's capture plan, rows onto
                    outputs, the tail step and its count);
- `worker/`         the worker processes: `extension.py` (installs the capture, reports its counts),
                    `capture.py` (gathers the plan's rows on the device, one copy to the host),
                    `layers.py` (which models' intermediate layers can be captured).

The three processes import none of each other; what crosses between them is hidden_states/protocol.py.

Ledger of patched points (supported: vLLM {SUPPORTED}):

1. `Worker` gains `hidden_states_install/hidden_states_stats` through the public
   `worker_extension_cls` engine argument (not a patch).
   Remove: never; it is the supported extension point.
2. `GPUModelRunner.execute_model` and `sample_tokens` are wrapped *on the runner
   instance* (CPU and XPU runners subclass GPUModelRunner, so one wrapper
   serves all V1 runners).
   Why: after execute_model returns, `runner.execute_model_state` holds the
   step's `scheduler_output` and `sample_hidden_states` (one row per scheduled
   request in `input_batch.req_ids` order) until `sample_tokens()` runs; the
   rows are sliced on the device then, and hung on the ModelRunnerOutput that
   `sample_tokens` returns (attribute `hidden_states_step`, a
   `protocol.StepCapture`; vLLM's multiprocess executor moves that dataclass
   instance whole, with its own transport). The one device-to-host copy of a
   step happens there, after sampling: under async scheduling (GPU) inside the
   output's `get_output`, where vLLM copies its own results.
   How: no vLLM code is modified. The plan is the scheduler's (point 9): it
   rides the SchedulerOutput (`protocol.PLAN_ATTR`) as offsets into each
   request's scheduled tokens; the worker reads `input_batch.req_id_to_index`
   and `query_start_loc` only to find where a request's tokens start
   (`capture._V1Runner`, the runner adapter). The step's plan is dropped
   when execute_model returns or raises, so forwards outside a step (dummy
   batches) see none.
   Rows of many positions (hidden_states_position "completion", "all", a
   range) come from `execute_model_state.hidden_states` (every scheduled
   token's row after the final norm, in `input_batch` order at
   `runner.query_start_loc` offsets), gathered,
   cast and top-k selected on the device, and packed with every other row of
   the step into one byte buffer: still one copy per step. Under async
   scheduling (untested, no GPU) the positions rely on num_computed_tokens
   meaning the same there.
   Remove when: vLLM returns last-token hidden states inline (RFC #48743).
   Under async scheduling (vLLM's GPU default; untested here, no GPU), read
   from vLLM 0.32's sources: the engine core still calls execute_model then
   sample_tokens for every step, in the plain loop and the batch queue, so the
   rows are in execute_model_state when the wrapper returns; the scheduler's
   placeholders live in num_output_placeholders, apart from
   num_computed_tokens, which the runner receives as of before the step, so
   "this step reaches the last prompt token" still holds; and a full prefix
   hit still recomputes the last token.
3. Model Runner V2 (`vllm/v1/worker/gpu/`) is turned off with
   `VLLM_USE_V2_MODEL_RUNNER=0` (engine.py sets it): it has no
   `execute_model_state`. Remove when point 2 is ported to V2.
4. Pipeline and data parallelism, KV connectors, speculative decoding under
   async scheduling and the other arguments in engine_args.REFUSED are
   refused at start, by name
   (engine_args.refuse, from HiddenStatesEngine.start before vLLM starts, and
   again on the resolved config in each worker's install): rows no longer map
   one per request, the last rank holds them, or a remote prefill skips the
   step that computes them. Tensor parallelism needs nothing: after each
   layer's all-reduce every rank holds whole rows, and only rank 0, whose
   ModelRunnerOutput the executor returns, slices and sends them.
5. CPU only: `GPUModelRunner._bookkeeping_sync` rewinds the generator of a
   seeded request whose sampled token is discarded (a partial prefill chunk)
   with `gen.set_offset(gen.get_offset() - 4)`, which CPU generators refuse
   ("CPU Generator does not use offset"): the engine dies on any seeded request
   with a prompt longer than one prefill chunk. Found by our load test; not a
   hidden-states problem, but it kills our engine. How: wrapped on the runner
   instance; the generator state saved before sampling is restored instead and
   the generator is hidden from the offset rewind. Remove when vLLM's CPU
   runner rewinds CPU generators itself.
6. CPU only, optional (`prefault_kv_cache`): `GPUModelRunner.kv_caches` is
   read to write every KV-cache page once at start-up (read only, not
   patched). Why: the CPU KV cache is allocated zeroed, so the kernel maps its
   pages lazily and a replica's resident memory grows under load until every
   block has been used: a replica that fits at start can be OOM-killed later.
   Remove when vLLM's CPU worker pre-faults its KV cache.
7. CPU only, optional (`warm_up_s`): `GPUModelRunner._dummy_run(n,
   force_attention=True)` is called (not patched) for batch sizes n = 1, 2, ...
   up to max_num_batched_tokens (most common first, within a time budget) at
   start-up, as vLLM's own profiling and graph capture call it. Why: the CPU
   GEMM path (oneDNN) builds and caches a kernel per batch size, so without it
   the worker's memory grows by that cache (about 80 MB on the built-in model)
   over the first few hundred requests, and those requests wait for the
   kernels to be built. Remove when vLLM's CPU worker warms up per batch size.
8. Intermediate layers: `torch.nn.Module.register_forward_pre_hook` on each of
   `runner.model.model.layers` (eager engines only; not a patch of vLLM code).
   Relies on vLLM's decoder-layer convention, checked at install per layer
   class: `forward(positions, hidden_states, residual, ...)` whose source
   begins `if residual is None: residual = hidden_states ... else:
   hidden_states, residual = self.<norm>(hidden_states, residual)`, with a norm
   that returns (norm(h + r), h + r) (probed once on random rows). The stream
   entering layer l is then hidden + residual (hidden alone before layer 0).
   The last layer is the model's forward output, which vLLM's models return
   after the final norm, except where `compute_logits` applies it (MiMo, whose
   MTP layer reads the un-normed stream): a probe at install
   (layers.final_norm_in_logits: `compute_logits(x)` against the LM head on x
   and on `model.model.norm(x)`) finds those, and the capture applies that norm
   to the planned rows (found by `tests/engine/test_spec_decode.py`'s MTP case).
   Remove when vLLM returns chosen layers itself (RFC #48743).
9. The scheduler (scheduler.py): the engine core's scheduler is always ours
   when hidden states are on, chosen from the configuration vLLM resolved
   (`scheduler_config.scheduler_cls` set on the VllmConfig after
   `create_engine_config`). It decides each step's capture plan (`_plan`,
   from `num_computed_tokens` as `_update_after_schedule` advanced it, so the
   step computed positions num_computed - scheduled .. num_computed - 1).
   Speculative decoding (synchronous scheduling): rows at and past
   `num_tokens - rejected` of a step (rejected drafts; `rejected` counted from
   `scheduled_spec_decode_tokens` and the sampled tokens, as vLLM's own
   rollback counts it) are dropped, rows past a stop among accepted drafts are
   trimmed in `_update_request_with_output`, and a held request's
   `num_computed_tokens` is set back to its final token with its
   `spec_token_ids` cleared, so its tail step computes that one token.
   `TailScheduler` (a v1 `Scheduler`) under
   synchronous scheduling, `AsyncVectorScheduler` (an `AsyncScheduler`) under
   async scheduling. Both override `add_request` (note flagged requests),
   `update_from_output` (file the step's captured rows; put the rows decided
   on the request's EngineCoreOutput's `kv_transfer_params`: a stream's on
   each output, the rest on the finishing one), and
   `_free_request` (forget a request however it ends). All override
   `schedule` (adds the step's plan, `PLAN_ATTR`, to the SchedulerOutput; the
   dataclass instance travels whole to the workers). The TailScheduler also
   overrides `_update_request_with_output` (holds a flagged
   request's stop for one step: the final token is appended but not emitted;
   in the next step the token sampled from its row is dropped and the held
   token is emitted with its own logprobs and the original finish).
   Why: the final token's hidden state then costs one decode row in a batch
   that runs anyway, and the frontend sees the outputs it would see without
   hidden states (vLLM's detokenizer leaves a stop token out of the text only
   when it arrives together with its finish).
   Async scheduling (vLLM's GPU default): when a stop is seen, the step
   after it is usually scheduled already, with the final token as its input.
   `AsyncVectorScheduler` plans every decode row of a tail-flagged request
   (one row per request per step), and a stopped request's finishing output
   waits one update for the step in flight (`_async_tails`), whose row is the
   final token's; it leaves then with the vector (`via: tail`, one position).
   vLLM's async scheduler skips the step after one that reaches `max_tokens`;
   for tail-flagged requests their `max_tokens` reads one more while
   `schedule()` runs (restored at once; `check_stop` reads the real one), so
   that step runs. Where the step in flight does not compute the row, the
   frontend's extraction step does. Tested on the CPU engine with vLLM's own
   async path (point 12); the CUDA stream and pinned-copy side is untested.
   Remove when vLLM returns the final token's hidden state itself.
10. The rows' way to the frontend: `EngineCoreOutput.kv_transfer_params`
   (a `dict[str, Any]` that vLLM's msgpack carries; raw bytes stay bytes).
   `ExtractingAsyncLLM` wraps its output processor's `process_outputs` on the
   instance and takes our key off each output before vLLM reads the field,
   finding the choice by `request_states[id].request_index`. KV connectors,
   the field's real users, are refused at start. And vLLM's completions
   serving names the engine requests of a request's prompts `{id}-{i}`
   (extraction.prompt_ordinal), which is how a response choice finds its
   vector: `ordinal * n + index`, as vLLM numbers choices. One key
   (`protocol.ROWS_KEY`) and one type (`protocol.CapturedRows`) for every
   request: a vector is the row of one position.
   Remove when vLLM's outputs carry hidden states (RFC #48743).
11. CPU only, LoRA engines: `vllm.lora.ops.torch_ops.lora_ops.bgmv_shrink`,
   `bgmv_expand` and `bgmv_expand_slice` (also the names `punica_cpu` imported)
   are replaced in the worker process (cpu.patch_cpu_lora_ops) by wrappers that
   give rows without an adapter (index -1) zero input. Why: the PyTorch ops gather
   `weights[indices]`, so -1 picks the last adapter slot: a base-model request in a
   batch with adapter requests was computed (tokens and vectors) with the last-loaded
   adapter (found by tests/engine/test_lora.py; vLLM's Triton kernels skip -1).
   Remove when vLLM's torch LoRA ops skip -1 (open PRs #48421, #49656).
12. Tests only, CPU: vLLM's async scheduling path on the CPU engine. With
   `HIDDEN_STATES_TEST_CPU_ASYNC=1`, `HiddenStatesEngine.start` sets
   `scheduler_config.async_scheduling = True` after vLLM resolved the
   configuration (its CPU platform turns it off: "not required on CPU"), and
   the worker module, imported in the engine-core process before the runner
   is built, replaces `torch.cuda.Stream`, `torch.cuda.Event`, `torch.Event`,
   `torch.cuda.current_stream` and `torch.cuda.stream` with CPU stand-ins
   (cpu.install_cpu_async_shim): CPU ops run in order on one thread, so
   waiting on a stream or an event is a no-op. Then vLLM's AsyncScheduler,
   batch-queue engine loop and the runner's AsyncGPUModelRunnerOutput run as
   on a GPU (tests/engine/test_async_scheduling.py). Never set in production.
   Remove when vLLM's CPU platform allows async scheduling.
13. CPU only, speculative decoding: the CPU platform's stand-in for the rejection
   sampler's `expand_kernel` (`cpu_triton_utils._expand_kernel_impl`, registered as
   a `KernelOverride`) hands the C++ kernel `_ensure_int64(output)`, a new tensor for
   the float32 temperatures and top-p and the int32 top-k, and never copies it back:
   in a batch that is not all greedy, `apply_sampling_constraints` divides every
   draft position's logits, greedy rows' included, by uninitialised memory, and
   greedy requests take wrong tokens (hidden states or not). How: in each worker,
   at start-up when a drafter is configured (cpu.fix_cpu_spec_sampling), the shared
   `KernelOverride`'s implementation becomes a torch one that writes the expansion
   in place at the output's dtype. GPU engines run vLLM's Triton kernel, untouched.
   Remove when vLLM's CPU stand-in writes its output (report text:
   docs/how-it-works.md, "The ledger, in short").
"""

from __future__ import annotations

SUPPORTED_VLLM = ("0.32.",)
__doc__ = __doc__.replace("{SUPPORTED}", ", ".join(v + "x" for v in SUPPORTED_VLLM))
# Architectures whose intermediate layers are checked against transformers (the test
# suite; Mistral's decoder layer is Llama's). Support itself is detected per model at
# install (`layer_capture_support`); these name the families in the engine's refusals.
SUPPORTED_LAYER_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
                         "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM")
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


def check_vllm_version() -> None:
    import vllm

    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise VLLMIncompatibleError(
            f"vLLM {vllm.__version__} is not supported; install one of "
            f"{', '.join(v + 'x' for v in SUPPORTED_VLLM)} (scripts/setup.sh does)"
        )
