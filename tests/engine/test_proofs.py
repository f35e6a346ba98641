"""TOPLOC proofs from a real model (SmolLM2-135M-Instruct) on engines in float32 and bfloat16,
checked against the real toploc library on transformers' float32 activations cast to bfloat16
(TOPLOC's cross-precision case), and validated by the server (POST /v1/hidden_states through the
engine's own OpenAI routes), which agrees with the library on honest and tampered cases: another
prompt, another completion, another model (proofs the library builds from a perturbed model's rows,
sent to the server), a well-formed proof with a coefficient altered. The float32 engine's validation
recomputes the rows transformers does, so its verdicts are the library's proof by proof; the
bfloat16 engine's recomputes them in bfloat16, and a borderline proof (another prompt's prefill:
39-42 exponent mismatches against a threshold of 38) can fall either side, so there the request's
verdict is compared. Each tampered case is a check (`REJECTIONS`), and each fails with the server's
validation broken (tests/unit/test_proofs.py BROKEN_VALIDATION, monkeypatched into this process,
where the routes run)."""

from __future__ import annotations

import asyncio
import json

import pytest

from hidden_states.proofs import toploc as ours
from tests.conftest import sampling
from tests.toploc_ref import (
    ProofChoice,
    altered_proof,
    another_completion,
    another_model,
    another_prompt,
    fed_rows,
    library_ok,
    load_toploc,
    perturbed,
)
from tests.unit.test_proofs import BROKEN_VALIDATION

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three colours, then count to five.",
    "Explain in two sentences why the sky is blue.",
]
PROOF = {"scheme": "toploc", "topk": 128, "decode_batching_size": 32}
sp = sampling()  # greedy SamplingParams; keywords override


@pytest.fixture(scope="module")
def tl():
    return load_toploc()


@pytest.fixture(scope="module")
def proof_ref():
    from hidden_states.models.builtin import resolve_model
    from tests.conftest import Reference
    from tests.engine.test_smollm2 import MODEL

    return Reference(resolve_model(MODEL))


@pytest.fixture(scope="module")
def other_model(proof_ref):
    """Another model: SmolLM2's weights, each perturbed by 5% noise (2% sits at TOPLOC's thresholds)."""
    return perturbed(proof_ref.model, 0.05)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def proof_engine(request, loop_thread):
    from hidden_states.vllm.engine import HiddenStatesEngine
    from tests.engine.test_smollm2 import ENGINE_ARGS, MODEL

    eng = loop_thread.run(HiddenStatesEngine.start(MODEL, **{**ENGINE_ARGS, "dtype": request.param}), timeout=600)
    eng.dtype = request.param
    routes = loop_thread.run(eng.openai("smollm2", "r0"))
    yield eng, routes
    eng.shutdown()


def activations(model, ids: list[int], prompt_len: int):
    return fed_rows(model, ids, prompt_len)


def _ok(tl, acts, proofs) -> list[bool]:
    return library_ok(tl, acts, proofs, PROOF["decode_batching_size"], PROOF["topk"])


def validator(loop_thread, routes):
    """The engine's own POST /v1/hidden_states (its OpenAI routes, in this process): a body's `comparison`."""

    def validate(body: dict) -> dict:
        async def go():
            async for part in routes.handle("hidden_states", json.dumps(body).encode()):
                return part

        status, raw = loop_thread.run(go(), timeout=300)
        assert status == 200, raw
        return json.loads(raw)["comparison"]

    return validate


def choice(
    loop_thread, routes, eng, tl, proof_ref, other_model, prompts, prompt, completion, proofs, proof=PROOF, every=False
) -> ProofChoice:
    """One choice to check. The float32 engine's validation recomputes the rows transformers does, so its verdicts
    are the library's proof by proof (`exact`); another prompt is another question's; each proof altered (the
    prefill's and the last, each way) is far past the exponent threshold; with `every`, another model fails every
    proof (not only one)."""
    return ProofChoice(
        validate=validator(loop_thread, routes),
        tl=tl,
        proof=proof,
        model=proof_ref.model,
        other_model=other_model,
        prompt=prompt,
        completion=completion,
        proofs=proofs,
        label=eng.dtype,
        exact=eng.dtype == "float32",
        other_prompt=next(p for p in prompts if p != list(prompt)),
        every_proof_of_another_model_fails=every,
        alterations=[(how, i) for how in ("linear", "exponent") for i in (0, -1)],
        min_exp_mismatches=64,
    )


REJECTIONS = [another_prompt, another_completion, another_model, altered_proof]


def test_proofs_pass_the_library_on_transformers_rows_and_the_server_agrees(
    proof_engine, loop_thread, proof_ref, tl, other_model
):
    eng, routes = proof_engine
    tok = proof_ref.tokenizer
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        )
        for q in QUESTIONS
    ]

    async def run():
        return await asyncio.gather(
            *(eng.complete(p, sp(max_tokens=70), proof=PROOF) for p in prompts),
            eng.complete(prompts[1], sp(max_tokens=70, n=2, temperature=0.8, seed=9), proof=PROOF),
        )

    outs = loop_thread.run(run(), timeout=900)
    assert "Paris" in outs[0].choices[0].text
    counted, one_token = 0, []
    for out in outs:
        prompt = list(out.prompt_token_ids)
        P = len(prompt)
        for ch in out.choices:
            completion, proofs = list(ch.token_ids), list(ch.proofs)
            ids = prompt + completion
            assert ch.hidden_states is None and len(proofs) == len(ours.chunk_bounds(P, len(ids), 32)) >= 2
            honest = _ok(tl, activations(proof_ref.model, ids, P), proofs)
            assert all(honest), (eng.dtype, ch.text[:30], honest)
            c = choice(loop_thread, routes, eng, tl, proof_ref, other_model, prompts, prompt, completion, proofs)
            server = c.server(prompt, completion, proofs)
            assert server["ok"] is True and [p["ok"] for p in server["proofs"]] == honest, server
            # Tampered: rejected by the library, and the server says the same.
            for check in REJECTIONS:
                check(c)
            assert not all(_ok(tl, activations(other_model, ids, P), proofs)), "another model, by the library"
            # TOPLOC's top-k sits on massive activations: one mid-prompt token changed is often accepted
            p2 = prompt[: P // 2] + [(prompt[P // 2] + 7) % tok.vocab_size] + prompt[P // 2 + 1 :]
            lib = c.library(proof_ref.model, p2, completion, proofs)
            if eng.dtype == "float32":
                assert [p["ok"] for p in c.server(p2, completion, proofs)["proofs"]] == lib, ("one token", lib)
            one_token.append(all(lib))
            counted += 1
    assert counted == 5
    print(
        f"\n{eng.dtype}: one mid-prompt token changed was accepted by TOPLOC for {sum(one_token)} of "
        f"{len(one_token)} choices"
    )


def test_each_rejection_fails_when_the_server_s_validation_is_broken(
    proof_engine, loop_thread, proof_ref, tl, other_model, monkeypatch
):
    """The breaking variants of each tampered case above: the server's validation (the routes run in this
    process) accepting every proof, never looking at the rows, or ignoring the thresholds; each check then
    fails. Unbroken, the same checks pass on the same choice."""
    eng, routes = proof_engine
    tok = proof_ref.tokenizer
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        )
        for q in QUESTIONS[:2]
    ]
    out = loop_thread.run(eng.complete(prompts[0], sp(max_tokens=40), proof=PROOF), timeout=300)
    (ch,) = out.choices
    c = choice(
        loop_thread, routes, eng, tl, proof_ref, other_model, prompts, out.prompt_token_ids, ch.token_ids, ch.proofs
    )
    for check in REJECTIONS:
        check(c)
    for broken, breaks in sorted(BROKEN_VALIDATION.items()):
        with monkeypatch.context() as m:
            breaks(m)
            for check in REJECTIONS:
                with pytest.raises(AssertionError):
                    check(c)
                print(f"{eng.dtype}: {broken}: {check.__name__} fails")
