"""Ledger point 18 at the kernel: vLLM's CPU attention kernel, then our recompute of the image rows,
against transformers' Gemma 3 mask written out in numpy (full layers: causal OR same image; sliding
layers: window AND (causal OR same image)). A batch of a text request and an image request whose
prompt starts in the KV cache (a prefix hit): the image rows equal the mask's, the text rows keep
vLLM's kernel's bits. Also the start-up checks' decisions on stand-in configs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

H, KVH, D, BLOCK = 4, 2, 64, 32


def hf_allowed(q: int, k: int, span: tuple[int, int] | None, window: int) -> bool:
    """transformers' Gemma 3 mask for query position q and key position k (span inclusive)."""
    same = span is not None and span[0] <= q <= span[1] and span[0] <= k <= span[1]
    ok = k <= q or same
    return ok and (window <= 0 or k > q - window)


def reference(Q, K, V, q_pos, seq_len, span, window):
    out = np.zeros((len(q_pos), H, D), np.float64)
    for n, q in enumerate(q_pos):
        keys = [k for k in range(seq_len) if hf_allowed(q, k, span, window)]
        kk = np.repeat(K[keys], H // KVH, axis=1)
        vv = np.repeat(V[keys], H // KVH, axis=1)
        s = np.einsum("hd,nhd->hn", Q[n], kk) / math.sqrt(D)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[n] = np.einsum("hn,nhd->hd", p / p.sum(-1, keepdims=True), vv)
    return out


@pytest.mark.parametrize("window", [-1, 16, 12])
def test_image_rows_are_transformers_mask_and_text_rows_are_the_kernel_s(window):
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from hidden_states.vllm.patches import mm_prefix_attention

    rng = np.random.default_rng(0)
    isa = _get_attn_isa(torch.float32, BLOCK, D)
    # request 0: text, 20 new tokens; request 1: 70 tokens, 0..29 in the cache, image at 40..51 (12 tokens)
    lens, new, span = (20, 70), (20, 40), (40, 51)
    K = [rng.standard_normal((n, KVH, D)).astype(np.float32) for n in lens]
    V = [rng.standard_normal((n, KVH, D)).astype(np.float32) for n in lens]
    Q = [rng.standard_normal((n, H, D)).astype(np.float32) for n in new]
    kv = torch.zeros(8, KVH, BLOCK, 2 * D)  # the layer's cache as vLLM hands it to the backend
    kc, vc = kv.view(8, KVH, BLOCK * 2, D).chunk(2, dim=2)
    table = torch.tensor([[6, 0, 0], [3, 5, 1]], dtype=torch.int32)
    for r in range(2):
        slots = torch.tensor([int(table[r, p // BLOCK]) * BLOCK + p % BLOCK for p in range(lens[r])])
        ops.cpu_attn_reshape_and_cache(torch.from_numpy(K[r]), torch.from_numpy(V[r]), kc, vc, slots, isa)
    qsl = torch.tensor([0, new[0], new[0] + new[1]], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.from_numpy(np.concatenate(Q))

    class Impl:  # vLLM's forward: the causal kernel over the step's batch
        scale, alibi_slopes, sliding_window, logits_soft_cap, sinks, kv_cache_dtype = (
            1 / math.sqrt(D),
            None,
            window,
            0.0,
            None,
            "auto",
        )

        def _hidden_states_forward(self, layer, query, key, value, kv_cache, md, output):
            causal = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=2,
                num_heads=H,
                num_kv_heads=KVH,
                head_dim=D,
                seq_lens=seq_lens,
                dtype=torch.float32,
                query_start_loc=qsl,
                causal=True,
                sliding_window_size=window,
                isa=isa,
                enable_kv_split=False,
            )
            ops.cpu_attention_with_kv_cache(
                query=query,
                key_cache=kc,
                value_cache=vc,
                output=output,
                query_start_loc=qsl,
                seq_lens=seq_lens,
                scale=self.scale,
                causal=True,
                alibi_slopes=None,
                sliding_window=window,
                block_table=table,
                softcap=0.0,
                scheduler_metadata=causal,
                s_aux=None,
            )
            return output

    builder = SimpleNamespace(
        num_heads=H,
        num_kv_heads=KVH,
        head_dim=D,
        dtype=torch.float32,
        window_size=window,
        isa=isa,
        kv_cache_dtype="auto",
    )
    cm = SimpleNamespace(query_start_loc_cpu=qsl, seq_lens=seq_lens, num_reqs=2, block_table_tensor=table)
    md = SimpleNamespace(hidden_states_spans=mm_prefix_attention._image_span_batch(builder, cm, {0: [], 1: [span]}))
    assert md.hidden_states_spans["rows"].tolist() == list(range(new[0] + span[0] - 30, new[0] + span[1] - 30 + 1))
    layer = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)
    causal_only = Impl()._hidden_states_forward(layer, query, None, None, kv, None, torch.empty_like(query)).clone()
    before = mm_prefix_attention.MM_PREFIX_ROWS[0]
    got = mm_prefix_attention._forward_with_image_spans(
        Impl(), layer, query, None, None, kv, md, torch.empty_like(query)
    ).numpy()
    assert mm_prefix_attention.MM_PREFIX_ROWS[0] - before == span[1] - span[0] + 1

    assert np.array_equal(got[: new[0]], causal_only[: new[0]].numpy())  # the text request: vLLM's bits
    want = reference(Q[1], K[1], V[1], range(30, 70), 70, span, window)
    err, scale = float(np.abs(got[new[0] :] - want).max()), float(np.abs(want).max())
    assert err <= 1e-5 * scale, (err, scale)
    # and vLLM's kernel alone is not the model: the image rows differ
    assert float(np.abs(causal_only[new[0] :].numpy() - want).max()) > 1e-3 * scale


def test_a_span_split_across_steps_is_an_error_not_a_silent_causal_row():
    import torch

    from hidden_states.vllm.patches import mm_prefix_attention

    cm = SimpleNamespace(
        query_start_loc_cpu=torch.tensor([0, 10], dtype=torch.int32),
        seq_lens=torch.tensor([10], dtype=torch.int32),
        num_reqs=1,
        block_table_tensor=torch.zeros(1, 1, dtype=torch.int32),
    )
    with pytest.raises(RuntimeError, match="split across prefill steps"):
        mm_prefix_attention._image_span_batch(SimpleNamespace(), cm, {0: [(8, 12)]})
    # a span computed in an earlier step, or a single token, adds nothing
    assert mm_prefix_attention._image_span_batch(SimpleNamespace(), cm, {0: [(0, 0)]}) is None


def test_start_up_decisions():
    from hidden_states.vllm.patches import mm_prefix_attention

    def config(model_type_prefix_lm: bool, tokens=256, window=1024, chunked=False):
        return SimpleNamespace(
            model_config=SimpleNamespace(
                is_multimodal_model=True,
                is_mm_prefix_lm=model_type_prefix_lm,
                hf_config=SimpleNamespace(mm_tokens_per_image=tokens),
                hf_text_config=SimpleNamespace(sliding_window=window),
            ),
            scheduler_config=SimpleNamespace(disable_chunked_mm_input=chunked),
        )

    gemma3 = config(True)
    assert mm_prefix_attention.image_span_refusal(gemma3) is None
    assert mm_prefix_attention.force_atomic_image_spans(gemma3) and gemma3.scheduler_config.disable_chunked_mm_input
    assert not mm_prefix_attention.force_atomic_image_spans(gemma3)  # already on
    other = config(False)
    assert (
        not mm_prefix_attention.force_atomic_image_spans(other) and not other.scheduler_config.disable_chunked_mm_input
    )
    assert "longer than the model's sliding window (16)" in mm_prefix_attention.image_span_refusal(
        config(True, tokens=64, window=16)
    )
    assert mm_prefix_attention.image_span_refusal(config(False, tokens=64, window=16)) is None
