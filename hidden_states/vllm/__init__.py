"""Everything that touches vLLM lives in this package; nothing else imports vllm.

- `engine.py`  the vLLM implementation of the engine interface (hidden_states/engine.py):
               AsyncLLM plus the extraction step;
- `openai.py`  vLLM's own OpenAI serving classes, plus the vectors;
- `worker.py`  the model-runner hook in every worker;
- `cpu.py`     CPU engines' start-up steps (pre-faulted KV cache, warm-up, malloc_trim)
               and the CPU generator fix.

Ledger of patched points (supported: vLLM {SUPPORTED}):

1. `Worker` gains `hidden_states_install/hidden_states_stats` through the public
   `worker_extension_cls` engine argument (not a patch).
   Remove: never; it is the supported extension point.
2. `GPUModelRunner.execute_model` is wrapped *on the runner instance* (CPU and
   XPU runners subclass GPUModelRunner, so one wrapper serves all V1 runners).
   Why: after it returns, `runner.execute_model_state` holds the step's
   `scheduler_output` and `sample_hidden_states` (one row per scheduled request
   in `input_batch.req_ids` order) until `sample_tokens()` runs.
   How: read both after the original call; no vLLM code is modified. The
   step's capture plan is dropped when the call returns or raises, so forwards
   outside a step (dummy batches) see none.
   Remove when: vLLM returns last-token hidden states inline (RFC #48743).
   Under async scheduling (vLLM's GPU default; untested here, no GPU), read
   from vLLM 0.32's sources: the engine core still calls execute_model then
   sample_tokens for every step, in the plain loop and the batch queue, so the
   rows are in execute_model_state when the wrapper returns; the scheduler's
   placeholders live in num_output_placeholders, apart from
   num_computed_tokens, which the runner receives as of before the step, so
   "this step reaches the last prompt token" still holds; and a full prefix
   hit still recomputes the last token. The capture's `.to("cpu")` is a
   synchronous copy inside the engine loop there (shared/GPU-REVIEW.md item 1).
3. Model Runner V2 (`vllm/v1/worker/gpu/`) is turned off with
   `VLLM_USE_V2_MODEL_RUNNER=0` (engine.py sets it): it has no
   `execute_model_state`. Remove when point 2 is ported to V2.
4. Speculative decoding and pipeline parallelism are refused at install: rows
   no longer map one per request, or the last rank holds them.
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
   Remove when vLLM returns chosen layers itself (RFC #48743).
9. The tail step (scheduler.py): the public `scheduler_cls` engine argument
   names `TailScheduler`, a subclass of v1 `Scheduler` that overrides
   `add_request` (notes requests flagged `tail=True`), `schedule` (adds the
   attribute `hidden_states_tails` to the SchedulerOutput: the held requests
   scheduled in this step), `_update_request_with_output` (holds a flagged
   request's stop for one step, then drops the token sampled in it and finishes
   with the held status and stop reason) and `_free_request` (forgets held
   requests however they end). The worker reads the attribute (worker.py); it
   reaches the workers because the SchedulerOutput dataclass instance travels
   whole (in-process, or pickled by the multiprocess executor, the CPU
   default; tested by every tail-step test, which would time out without it).
   Why: the final token's hidden state then costs one decode row in a batch
   that runs anyway, instead of a second request through the frontend.
   Async scheduling (vLLM's GPU default, never used on CPU): when a stop is
   seen, the step with the final token as input is usually already in flight,
   unmarked, so the tail row would be computed but not captured. The engine
   therefore uses the tail only on synchronous schedulers (CPU, or GPU with
   `async_scheduling: false`) and keeps the extraction step otherwise. The
   design for async: mark every flagged running request whose next token may
   be its last (max_tokens reached next step, or always when EOS/stop ids
   apply) so the runner keeps that row on the device, and send it once the
   scheduler confirms the stop; free otherwise. Not built, not tested: no GPU.
   Remove when vLLM returns the final token's hidden state itself.
"""

from __future__ import annotations

SUPPORTED_VLLM = ("0.32.",)
__doc__ = __doc__.replace("{SUPPORTED}", ", ".join(v + "x" for v in SUPPORTED_VLLM))
# Architectures whose intermediate layers are checked against transformers (the test
# suite; Mistral's decoder layer is Llama's). Support itself is detected per model at
# install (`layer_capture_support`); these name the families in the engine's refusals.
SUPPORTED_LAYER_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
                         "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM")
WORKER_EXTENSION = "hidden_states.vllm.worker.HiddenStatesWorkerExtension"
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
