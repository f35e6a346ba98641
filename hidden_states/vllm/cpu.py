"""CPU engines: start-up steps before a replica takes traffic, and CPU fixes (ledger points 5-7,
11, 13, 18 in __init__.py). `cpu_start_up()` runs them from the engine through `collective_rpc`;
`CPUWorkerSteps` (mixed into the worker extension) does them in each worker.
"""

from __future__ import annotations

import logging
from typing import Any

from hidden_states.vllm import _require

logger = logging.getLogger(__name__)


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def warm_up_sizes(max_tokens: int) -> list[int]:
    """Batch sizes 1..`max_tokens`, most useful first: every size to 64, every 8th to 512, every
    64th beyond, then the rest."""
    first = [*range(1, 65), *range(72, 513, 8), *range(576, max_tokens + 1, 64)]
    first = [n for n in first if n <= max_tokens]
    seen = set(first)
    return first + [n for n in range(1, max_tokens + 1) if n not in seen]


async def cpu_start_up(
    llm: Any, prefault_kv_cache: bool, warm_up_s: float, malloc_trim_interval_s: float, timeout_s: float
) -> dict[str, Any]:
    """A CPU engine's start-up steps, before it takes requests; returns what they did."""
    out: dict[str, Any] = {}
    if llm.vllm_config.lora_config is not None:  # base rows next to adapter rows stay base rows (point 11)
        out["cpu_lora_fix"] = all(await llm.collective_rpc("hidden_states_fix_cpu_lora", timeout=timeout_s))
    if llm.vllm_config.speculative_config is not None:  # greedy rows stay greedy beside sampled ones (point 13)
        out["cpu_spec_sampling_fix"] = all(
            await llm.collective_rpc("hidden_states_fix_cpu_spec_sampling", timeout=timeout_s)
        )
    if mm_prefix_model(llm.vllm_config):  # Gemma 3's images attend both ways, as in transformers (point 18)
        out["cpu_mm_prefix_fix"] = all(await llm.collective_rpc("hidden_states_fix_cpu_mm_prefix", timeout=timeout_s))
    if prefault_kv_cache:  # resident memory flat from the start (ledger point 6)
        touched = await llm.collective_rpc("hidden_states_prefault_kv_cache", timeout=timeout_s)
        out["kv_cache_prefaulted_bytes"] = sum(touched)
    if warm_up_s > 0:  # kernel caches at their working size before the first request (point 7)
        sizes = warm_up_sizes(llm.vllm_config.scheduler_config.max_num_batched_tokens)
        done = await llm.collective_rpc("hidden_states_warm_up", timeout=timeout_s + warm_up_s, args=(sizes, warm_up_s))
        out.update(
            warm_up_batch_sizes=min(n for n, _ in done),
            warm_up_of=len(sizes),
            warm_up_seconds=round(max(t for _, t in done), 3),
        )
    if malloc_trim_interval_s > 0:  # free heap pages back to the OS when idle (malloc_trim.py)
        started = await llm.collective_rpc(
            "hidden_states_start_trimmer", timeout=timeout_s, args=(malloc_trim_interval_s,)
        )
        out["malloc_trim_interval_s"] = malloc_trim_interval_s if all(started) else None
    return out


class CPUWorkerSteps:
    """Worker-side start-up steps of a CPU engine (no-ops on other devices)."""

    def hidden_states_prefault_kv_cache(self) -> int:
        """Ledger point 6: write every KV-cache page once; returns the bytes touched."""
        runner = getattr(self, "model_runner", None)
        _require(runner is not None and hasattr(runner, "kv_caches"), "GPUModelRunner.kv_caches")
        if getattr(runner, "device", None) is None or runner.device.type != "cpu":
            return 0
        touched, seen = 0, set()
        stack = list(runner.kv_caches)
        while stack:
            t = stack.pop()
            if isinstance(t, (list, tuple)):
                stack.extend(t)
                continue
            if t is None or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            t.zero_()  # the cache holds nothing yet: zeroing only maps the pages
            touched += t.numel() * t.element_size()
        logger.info("KV cache pre-faulted: %.1f MiB", touched / 2**20)
        return touched

    def hidden_states_warm_up(self, sizes: list[int], budget_s: float) -> tuple[int, float]:
        """Ledger point 7: one dummy forward per batch size in `sizes`, in order, until
        `budget_s` seconds have passed; returns (sizes run, seconds taken)."""
        import time

        runner = getattr(self, "model_runner", None)
        _require(runner is not None and hasattr(runner, "_dummy_run"), "GPUModelRunner._dummy_run")
        if getattr(runner, "device", None) is None or runner.device.type != "cpu":
            return 0, 0.0
        t0, done = time.perf_counter(), 0
        for n in sizes:
            if time.perf_counter() - t0 >= budget_s:
                break
            runner._dummy_run(int(n), force_attention=True)
            done += 1
        took = time.perf_counter() - t0
        logger.info("warmed up %d of %d batch sizes in %.1f s", done, len(sizes), took)
        return done, took

    def hidden_states_fix_cpu_lora(self) -> bool:
        """Ledger point 11 in this worker process."""
        patch_cpu_lora_ops()
        return True

    def hidden_states_fix_cpu_spec_sampling(self, fixed: bool = True) -> bool:
        """Ledger point 13 in this worker process; `fixed=False` puts vLLM's own kernel back
        (the tests show the bug with it)."""
        return fix_cpu_spec_sampling(fixed)

    def hidden_states_fix_cpu_mm_prefix(self, fixed: bool = True) -> bool:
        """Ledger point 18 in this worker process; `fixed=False` puts vLLM's causal kernel back (the
        tests show the difference with it)."""
        return fix_cpu_mm_prefix_attention(fixed)

    def hidden_states_start_trimmer(self, interval_s: float) -> bool:
        """Starts the worker's malloc_trim thread (hidden_states/malloc_trim.py; not a patch)."""
        from hidden_states.malloc_trim import MallocTrimmer

        if getattr(self, "_hidden_states_trimmer", None) is not None:
            return False
        self._hidden_states_trimmer = MallocTrimmer(interval_s).start()
        return self._hidden_states_trimmer.available


def patch_cpu_generator_rewind(runner: Any) -> None:
    """Ledger point 5: rewind discarded seeded samples by state, not offset, on CPU."""
    _require(
        hasattr(runner, "_bookkeeping_sync") and hasattr(runner, "discard_request_mask"),
        "GPUModelRunner._bookkeeping_sync / discard_request_mask",
    )
    execute, bookkeeping = runner.execute_model, runner._bookkeeping_sync
    saved: dict[int, Any] = {}

    def discarded_with_generator():
        n = runner.input_batch.num_reqs
        for i in runner.discard_request_mask.np[:n].nonzero()[0]:
            gen = runner.input_batch.generators.get(int(i))
            if gen is not None:
                yield int(i), gen

    def execute_model(*args, **kwargs):
        out = execute(*args, **kwargs)
        saved.clear()
        if out is None:  # sampling follows in sample_tokens(): keep the states it will advance
            saved.update({i: gen.get_state() for i, gen in discarded_with_generator()})
        return out

    def bookkeeping_sync(*args, **kwargs):
        gens = runner.input_batch.generators
        hidden = {i: gens.pop(i) for i in list(saved) if i in gens}
        for i, gen in hidden.items():
            gen.set_state(saved[i])
        try:
            return bookkeeping(*args, **kwargs)
        finally:
            gens.update(hidden)
            saved.clear()

    runner.execute_model = execute_model
    runner._bookkeeping_sync = bookkeeping_sync


def expand_batch_to_tokens(output, input, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:
    """vLLM's `expand_kernel` (Triton) in torch: `output[cu[i-1]:cu[i]] = input[i]`, with
    `replace_from` read as `replace_to`, written in place at `output`'s own dtype."""
    import torch

    if cu_num_tokens.numel() == 0:
        return
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input == replace_from, torch.full_like(input, replace_to), input)
    n = int(cu_num_tokens[-1])
    output[:n].copy_(torch.repeat_interleave(values, counts, output_size=n))


def fix_cpu_spec_sampling(fixed: bool = True) -> bool:
    """Ledger point 13: swaps the shared `KernelOverride`'s implementation for `expand_batch_to_tokens`
    (`fixed=False`: vLLM's back); re-registering would rescan modules and fail in the worker.
    Returns whether the fix is in place (False where vLLM runs Triton itself)."""
    import inspect

    import vllm.v1.sample.rejection_sampler as rejection_sampler
    from vllm.triton_utils.dispatcher import KernelOverride
    from vllm.utils import cpu_triton_utils

    wrapper = getattr(rejection_sampler, "expand_kernel", None)
    if not isinstance(wrapper, KernelOverride):
        return False
    _require(
        hasattr(wrapper, "_impl") and hasattr(cpu_triton_utils, "_expand_kernel_impl"),
        "KernelOverride._impl / cpu_triton_utils._expand_kernel_impl",
    )
    impl = expand_batch_to_tokens if fixed else cpu_triton_utils._expand_kernel_impl
    wrapper._impl = wrapper.func = impl
    wrapper._forward_by_name = tuple(inspect.signature(impl).parameters) == wrapper.arg_names
    return fixed


def mm_prefix_model(vcfg: Any) -> bool:
    """Whether the model attends bidirectionally within each image's tokens (vLLM's "mm prefix LM":
    Gemma 3, PaliGemma, ...) and takes images here."""
    model = vcfg.model_config
    return bool(getattr(model, "is_multimodal_model", False) and getattr(model, "is_mm_prefix_lm", False))


def force_atomic_image_spans(vcfg: Any) -> bool:
    """Point 18's precondition, set before the engine core starts: an image's tokens are prefilled in
    one step (vLLM's GPU platforms force `disable_chunked_mm_input` for these models; its CPU
    platform does not). Returns whether it changed the config."""
    sched = vcfg.scheduler_config
    if not mm_prefix_model(vcfg) or sched.disable_chunked_mm_input:
        return False
    sched.disable_chunked_mm_input = True
    return True


# point 18's work in this worker process: query rows recomputed over their image span, summed over layers
MM_PREFIX_ROWS = [0]


def image_span_refusal(vcfg: Any) -> str | None:
    """Why point 18 cannot serve this model as its authors define it, or None: an image longer than the
    sliding window (transformers then lets its tokens see the whole image on windowed layers; vLLM's
    runner drops such spans). No released Gemma 3 has one (256 image tokens, a 1024-token window)."""
    if not mm_prefix_model(vcfg):
        return None
    tokens = getattr(vcfg.model_config.hf_config, "mm_tokens_per_image", None)
    window = getattr(vcfg.model_config.hf_text_config, "sliding_window", None)
    if tokens and window and tokens > window:
        return (
            f"an image is {tokens} tokens, longer than the model's sliding window ({window}): the CPU engine "
            "cannot attend them as the model does"
        )
    return None


def fix_cpu_mm_prefix_attention(fixed: bool = True) -> bool:
    """Ledger point 18: vLLM 0.32's CPU attention ignores the image spans the runner computes
    (`CommonAttentionMetadata.mm_req_doc_ranges`) and attends causally. Wrapped at class level: the
    metadata builder adds, for a step that prefills image tokens, a second batch with one entry per
    span (its query rows, keys 0..span end, non-causal); the backend, after vLLM's kernel has
    computed every row, recomputes those rows with the same kernel on that batch. Non-causal with a
    window is |i - j| < w, which equals transformers' "causal window OR same image" for spans no
    longer than the window (vLLM's runner drops longer spans). Idempotent; returns `fixed`."""
    from vllm.v1.attention.backends import cpu_attn

    builder, impl = cpu_attn.CPUAttentionMetadataBuilder, cpu_attn.CPUAttentionBackendImpl
    _require(
        hasattr(builder, "build")
        and hasattr(impl, "forward")
        and hasattr(cpu_attn.ops, "cpu_attention_with_kv_cache")
        and hasattr(cpu_attn.ops, "cpu_attn_get_scheduler_metadata"),
        "cpu_attn.CPUAttentionMetadataBuilder.build / CPUAttentionBackendImpl.forward",
    )
    if fixed and not hasattr(builder, "_hidden_states_build"):
        builder._hidden_states_build, builder.build = builder.build, _build_with_image_spans
        impl._hidden_states_forward, impl.forward = impl.forward, _forward_with_image_spans
    elif not fixed and hasattr(builder, "_hidden_states_build"):
        builder.build, impl.forward = builder._hidden_states_build, impl._hidden_states_forward
        del builder._hidden_states_build, impl._hidden_states_forward
    return fixed


def _build_with_image_spans(self, common_prefix_len, common_attn_metadata, fast_build=False):
    md = type(self)._hidden_states_build(self, common_prefix_len, common_attn_metadata, fast_build)
    ranges = getattr(common_attn_metadata, "mm_req_doc_ranges", None)
    md.hidden_states_spans = None
    # a decode-only step (one row per request) prefills no image: nothing to look at
    if (
        ranges
        and common_attn_metadata.max_query_len > 1
        and not self.is_cross_attention
        and not self.is_encoder_only_attention
    ):
        md.hidden_states_spans = _image_span_batch(self, common_attn_metadata, ranges)
    return md


def _image_span_batch(builder: Any, cm: Any, ranges: dict) -> dict | None:
    """The step's image spans as a batch for the CPU kernel: `rows` (token indices of the step),
    `query_start_loc`, `seq_lens` (span end + 1), `block_table` (the span's request's row) and its
    scheduler metadata; None when no span has rows in this step."""
    import torch
    from vllm import _custom_ops as ops

    qsl = cm.query_start_loc_cpu.tolist()
    seq_lens = cm.seq_lens.cpu().tolist()
    rows, starts, ends, reqs = [], [0], [], []
    for r, spans in ranges.items():
        if r >= cm.num_reqs:
            continue
        q_len = qsl[r + 1] - qsl[r]
        ctx = seq_lens[r] - q_len  # position of the request's first row in this step
        for start, end in spans:  # inclusive positions
            if start >= end or end < ctx or q_len <= 0:
                continue  # one token, or computed in an earlier step
            if end >= ctx + q_len:
                raise RuntimeError(
                    f"an image span ({start}..{end}) is split across prefill steps; "
                    "disable_chunked_mm_input must be on for this model (ledger point 18)"
                )
            first = max(start, ctx)
            rows.extend(range(qsl[r] + first - ctx, qsl[r] + end - ctx + 1))
            starts.append(len(rows))
            ends.append(end + 1)
            reqs.append(r)
    if not reqs:
        return None
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    seq_lens_t = torch.tensor(ends, dtype=torch.int32)
    return {
        "rows": torch.tensor(rows, dtype=torch.long),
        "query_start_loc": query_start_loc,
        "seq_lens": seq_lens_t,
        "block_table": cm.block_table_tensor[torch.tensor(reqs, dtype=torch.long)],
        "scheduler_metadata": ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(reqs),
            num_heads=builder.num_heads,
            num_kv_heads=builder.num_kv_heads,
            head_dim=builder.head_dim,
            seq_lens=seq_lens_t,
            dtype=builder.dtype,
            query_start_loc=query_start_loc,
            causal=False,
            sliding_window_size=builder.window_size,
            isa=builder.isa,
            enable_kv_split=False,
            kv_cache_dtype=builder.kv_cache_dtype,
        ),
    }


def _forward_with_image_spans(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
    out = type(self)._hidden_states_forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs
    )
    spans = getattr(attn_metadata, "hidden_states_spans", None)
    if spans is None:
        return out
    from vllm import _custom_ops as ops

    num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
    key_cache, value_cache = kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1)).chunk(2, dim=2)
    rows = spans["rows"]
    span_out = output.new_empty((len(rows), *output.shape[1:]))
    ops.cpu_attention_with_kv_cache(
        query=query.index_select(0, rows),
        key_cache=key_cache,
        value_cache=value_cache,
        output=span_out,
        query_start_loc=spans["query_start_loc"],
        seq_lens=spans["seq_lens"],
        scale=self.scale,
        causal=False,
        alibi_slopes=self.alibi_slopes,
        sliding_window=self.sliding_window,
        block_table=spans["block_table"],
        softcap=self.logits_soft_cap,
        scheduler_metadata=spans["scheduler_metadata"],
        s_aux=self.sinks,
        dynamic_causal=None,
        k_scale=layer._k_scale_float,
        v_scale=layer._v_scale_float,
        kv_cache_dtype=self.kv_cache_dtype,
    )
    output.index_copy_(0, rows, span_out)
    MM_PREFIX_ROWS[0] += len(rows)
    return out


_LORA_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def patch_cpu_lora_ops() -> None:
    """Ledger point 11: rows with index -1 get zero input, so a zero LoRA delta, as the Triton kernels
    skip them. Idempotent."""
    import vllm.lora.ops.torch_ops as package
    import vllm.lora.ops.torch_ops.lora_ops as ops
    from vllm.lora.punica_wrapper import punica_cpu

    _require(all(hasattr(ops, name) for name in _LORA_OPS), "vllm.lora.ops.torch_ops.lora_ops.bgmv_*")
    if getattr(ops, "_hidden_states_no_lora_rows", False):
        return
    for name in _LORA_OPS:
        fixed = _skipping_no_lora_rows(getattr(ops, name))
        for module in (ops, package, punica_cpu):  # sgmv_* call ops' bgmv_*; punica_cpu imported its own names
            if hasattr(module, name):
                setattr(module, name, fixed)
    ops._hidden_states_no_lora_rows = True


def _skipping_no_lora_rows(op):
    def op_skipping_no_lora_rows(inputs, weights, output, indices, *args, **kwargs):
        skip = indices < 0
        if skip.shape[:1] == inputs.shape[:1] and bool(skip.any()):
            inputs = inputs.masked_fill(skip.unsqueeze(-1), 0)
            indices = indices.clamp_min(0)
        return op(inputs, weights, output, indices, *args, **kwargs)

    return op_skipping_no_lora_rows


# -- tests only: vLLM's async scheduling path on the CPU engine (ledger point 12) -------------
CPU_ASYNC_ENV = "HIDDEN_STATES_TEST_CPU_ASYNC"  # "1": the engine runs vLLM's async scheduling on CPU


def install_cpu_async_shim() -> None:
    """Ledger point 12 (tests only): CPU stand-ins for Model Runner V1's CUDA stream and event calls.
    CPU ops run in order on the calling thread, so streams are the current thread and events
    no-ops."""
    import contextlib

    import torch

    class _Stream:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            pass

        def synchronize(self):
            pass

        def record_event(self, event=None):
            return event or _Event()

    class _Event:
        def __init__(self, *a, **k):
            pass

        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

        def wait(self, stream=None):
            pass

        def query(self):
            return True

    torch.cuda.Stream, torch.cuda.Event, torch.Event = _Stream, _Event, _Event
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
