"""Ledger point 18, CPU only, models vLLM marks `is_mm_prefix_lm` (Gemma 3): an image's tokens attend to
the whole image (frontend: the config; worker: the attention backend).

Why: vLLM 0.32's CPU attention ignores the runner's `CommonAttentionMetadata.mm_req_doc_ranges` and runs an
image's tokens causally, unlike the model (and transformers).
How: `cpu_attn.CPUAttentionMetadataBuilder.build` and `CPUAttentionBackendImpl.forward` wrapped at class level
in each worker (`mm_prefix`, the CPU start-up step `hidden_states_fix_cpu_mm_prefix`): a second, non-causal
batch of the step's image spans for `ops.cpu_attention_with_kv_cache`, whose rows overwrite the causal kernel's;
`scheduler_config.disable_chunked_mm_input` set before the engine core starts (`config`), as vLLM's GPU
platforms do; an image longer than the sliding window refused at start (`image_span_refusal`, engine.py).
Relies on: the builder's `build(common_prefix_len, common_attn_metadata, fast_build)` and fields (num_heads,
num_kv_heads, head_dim, dtype, window_size, isa, kv_cache_dtype, is_cross_attention, is_encoder_only_attention),
the backend's `forward(layer, query, key, value, kv_cache, attn_metadata, output, ...)` and fields,
`ops.cpu_attention_with_kv_cache` and `ops.cpu_attn_get_scheduler_metadata`.
Upstream: the report is in docs/how-it-works.md, "The ledger, in short".
Remove when: the CPU backend supports mm_prefix.
"""

from __future__ import annotations

import logging
from typing import Any

from hidden_states.vllm import _require
from hidden_states.vllm.patches.drift import _CM, _CPU_ATTN, _MCFG, _SCFG, Symbol

logger = logging.getLogger(__name__)


def config(vllm_config: Any, model: str = "", **_: Any) -> bool:
    """On a CPU engine: an image prefilled in one step. Returns whether it changed the config."""
    from hidden_states.vllm.cpu import on_cpu

    if on_cpu() and force_atomic_image_spans(vllm_config):
        logger.info("disable_chunked_mm_input: on, as vLLM's GPU platforms set it for %s", model)
        return True
    return False


def mm_prefix(fixed: bool = True, **_: Any) -> bool:
    return fix_cpu_mm_prefix_attention(fixed)


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


RELIED: tuple[Symbol, ...] = (
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
)
