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
from tests.toploc_ref import altered, fed_rows, library_ok, load_toploc, perturbed
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
def smol_ref():
    from hidden_states.models.builtin import resolve_model
    from tests.conftest import Reference
    from tests.engine.test_smollm2 import MODEL

    return Reference(resolve_model(MODEL))


@pytest.fixture(scope="module")
def other_model(smol_ref):
    """Another model: SmolLM2's weights, each perturbed by 5% noise (2% sits at TOPLOC's thresholds)."""
    return perturbed(smol_ref.model, 0.05)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def smol(request, loop_thread):
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


def server_check(loop_thread, routes, prompt: list[int], completion: list[int], proofs: list[str]) -> dict:
    async def go():
        body = json.dumps(
            {"prompt": prompt, "completion": completion, "compare": {"toploc": {**PROOF, "proofs": proofs}}}
        ).encode()
        async for part in routes.handle("hidden_states", body):
            return part

    status, raw = loop_thread.run(go(), timeout=300)
    assert status == 200, raw
    return json.loads(raw)["comparison"]


class Choice:
    """One choice to check: its tokens and proofs, and what the checks need."""

    def __init__(self, loop_thread, routes, eng, tl, smol_ref, other_model, prompts, prompt, completion, proofs):
        self.loop_thread, self.routes, self.dtype, self.tl = loop_thread, routes, eng.dtype, tl
        self.ref, self.other_model, self.tok = smol_ref.model, other_model, smol_ref.tokenizer
        self.prompt, self.completion, self.proofs = list(prompt), list(completion), list(proofs)
        self.other_prompt = next(p for p in prompts if p != self.prompt)

    def server(self, prompt: list[int], completion: list[int], proofs: list[str]) -> dict:
        return server_check(self.loop_thread, self.routes, prompt, completion, proofs)

    def library(self, model, prompt: list[int], completion: list[int], proofs: list[str]) -> list[bool]:
        return _ok(self.tl, activations(model, prompt + completion, len(prompt)), proofs)


def rejected(c: Choice, what: str, prompt: list[int], completion: list[int]) -> None:
    """The choice's proofs on other tokens: the library rejects them on transformers' rows, and so does
    the server (proof by proof from the float32 engine, which recomputes the rows transformers does)."""
    lib = c.library(c.ref, prompt, completion, c.proofs)
    srv = c.server(prompt, completion, c.proofs)
    if c.dtype == "float32":
        assert [p["ok"] for p in srv["proofs"]] == lib, (what, lib, srv)
    assert not all(lib) and srv["ok"] is False, (what, c.dtype, lib, srv)


def another_prompt(c: Choice) -> None:
    rejected(c, "another prompt", c.other_prompt, c.completion)


def another_completion(c: Choice) -> None:
    other = c.completion[::-1]
    assert other != c.completion
    rejected(c, "another completion", c.prompt, other)


def another_model(c: Choice) -> None:
    """Proofs of these tokens from another model (the library's, on the perturbed model's rows) sent to the
    server: rejected, as the library rejects them on this model's rows; the same proofs from this model's
    rows pass (what fails is the model, not the library's proofs)."""
    ids, P = c.prompt + c.completion, len(c.prompt)
    own = c.tl.build_proofs_base64(activations(c.ref, ids, P), PROOF["decode_batching_size"], PROOF["topk"])
    assert c.server(c.prompt, c.completion, own)["ok"] is True, "the library's proofs of this model"
    theirs = c.tl.build_proofs_base64(activations(c.other_model, ids, P), PROOF["decode_batching_size"], PROOF["topk"])
    lib = c.library(c.ref, c.prompt, c.completion, theirs)
    srv = c.server(c.prompt, c.completion, theirs)
    if c.dtype == "float32":
        assert [p["ok"] for p in srv["proofs"]] == lib, ("another model", lib, srv)
    assert not all(lib) and srv["ok"] is False, ("another model", c.dtype, lib, srv)


def altered_proof(c: Choice) -> None:
    """The choice's own tokens, one proof (the prefill's, then the last) altered but well formed: the
    server rejects the request and that proof, and passes the others."""
    for how in ("linear", "exponent"):
        for i in (0, len(c.proofs) - 1):
            proofs = [altered(p, how) if j == i else p for j, p in enumerate(c.proofs)]
            srv = c.server(c.prompt, c.completion, proofs)
            assert [p["ok"] for p in srv["proofs"]] == [j != i for j in range(len(proofs))], (how, i, srv)
            assert srv["ok"] is False and srv["proofs"][i]["exp_mismatches"] > 64, (how, i, srv)


REJECTIONS = [another_prompt, another_completion, another_model, altered_proof]


def test_proofs_pass_the_library_on_transformers_rows_and_the_server_agrees(
    smol, loop_thread, smol_ref, tl, other_model
):
    eng, routes = smol
    tok = smol_ref.tokenizer
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
            honest = _ok(tl, activations(smol_ref.model, ids, P), proofs)
            assert all(honest), (eng.dtype, ch.text[:30], honest)
            server = server_check(loop_thread, routes, prompt, completion, proofs)
            assert server["ok"] is True and [p["ok"] for p in server["proofs"]] == honest, server
            # Tampered: rejected by the library, and the server says the same.
            c = Choice(loop_thread, routes, eng, tl, smol_ref, other_model, prompts, prompt, completion, proofs)
            for check in REJECTIONS:
                check(c)
            assert not all(_ok(tl, activations(other_model, ids, P), proofs)), "another model, by the library"
            # TOPLOC's top-k sits on massive activations: one mid-prompt token changed is often accepted
            p2 = prompt[: P // 2] + [(prompt[P // 2] + 7) % tok.vocab_size] + prompt[P // 2 + 1 :]
            lib = c.library(smol_ref.model, p2, completion, proofs)
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
    smol, loop_thread, smol_ref, tl, other_model, monkeypatch
):
    """The breaking variants of each tampered case above: the server's validation (the routes run in this
    process) accepting every proof, never looking at the rows, or ignoring the thresholds; each check then
    fails. Unbroken, the same checks pass on the same choice."""
    eng, routes = smol
    tok = smol_ref.tokenizer
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        )
        for q in QUESTIONS[:2]
    ]
    out = loop_thread.run(eng.complete(prompts[0], sp(max_tokens=40), proof=PROOF), timeout=300)
    (ch,) = out.choices
    c = Choice(
        loop_thread, routes, eng, tl, smol_ref, other_model, prompts, out.prompt_token_ids, ch.token_ids, ch.proofs
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
