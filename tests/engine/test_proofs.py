"""TOPLOC proofs from a real model (SmolLM2-135M-Instruct) on engines in float32 and bfloat16,
checked against the real toploc library on transformers' float32 activations cast to bfloat16
(TOPLOC's cross-precision case), and validated by the server (POST /v1/hidden_states through the
engine's own OpenAI routes), which agrees with the library on honest and tampered cases: another
prompt, another completion, another model. The float32 engine's validation recomputes the rows
transformers does, so its verdicts are the library's proof by proof; the bfloat16 engine's
recomputes them in bfloat16, and a borderline proof (another prompt's prefill: 39-42 exponent
mismatches against a threshold of 38) can fall either side, so there the request's verdict is
compared."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from hidden_states.proofs import toploc as ours
from tests.toploc_ref import fed_rows, library_ok, load_toploc

QUESTIONS = ["What is the capital of France? Answer in one sentence.", "Name three colours, then count to five.",
             "Explain in two sentences why the sky is blue."]
PROOF = {"scheme": "toploc", "topk": 128, "decode_batching_size": 32}


@pytest.fixture(scope="module")
def tl():
    return load_toploc()


@pytest.fixture(scope="module")
def smol_ref():
    from hidden_states.models.builtin import resolve_model
    from tests.conftest import Reference
    from tests.engine.test_smollm2 import MODEL

    return Reference(resolve_model(MODEL))


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
        body = json.dumps({"prompt": prompt, "completion": completion,
                           "compare": {"toploc": {**PROOF, "proofs": proofs}}}).encode()
        async for part in routes.handle("hidden_states", body):
            return part

    status, raw = loop_thread.run(go(), timeout=300)
    assert status == 200, raw
    return json.loads(raw)["comparison"]


def test_proofs_pass_the_library_on_transformers_rows_and_the_server_agrees(smol, loop_thread, smol_ref, tl):
    from vllm import SamplingParams

    eng, routes = smol
    tok = smol_ref.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False)) for q in QUESTIONS]

    async def run():
        return await asyncio.gather(*(eng.complete(p, SamplingParams(max_tokens=70, temperature=0.0), proof=PROOF)
                                      for p in prompts),
                                    eng.complete(prompts[1], SamplingParams(max_tokens=70, n=2, temperature=0.8,
                                                                            seed=9), proof=PROOF))

    outs = loop_thread.run(run(), timeout=900)
    assert "Paris" in outs[0].choices[0].text
    perturbed = _perturbed(smol_ref.model)
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
            # Tampered: rejected by the library, and the server says the same, proof by proof.
            other_prompt = next(p for p in prompts if p != prompt)
            for what, (p2, c2) in {"another prompt": (other_prompt, completion),
                                   "another completion": (prompt, completion[::-1]),
                                   "one prompt token": (prompt[:P // 2] + [(prompt[P // 2] + 7) % tok.vocab_size]
                                                        + prompt[P // 2 + 1:], completion)}.items():
                lib = _ok(tl, activations(smol_ref.model, p2 + c2, len(p2)), proofs)
                srv = [p["ok"] for p in server_check(loop_thread, routes, p2, c2, proofs)["proofs"]]
                if eng.dtype == "float32":  # the server recomputes the rows transformers does: proof by proof
                    assert srv == lib, (what, lib, srv)
                if what == "one prompt token":  # TOPLOC's top-k sits on massive activations: often accepted
                    one_token.append(all(lib))
                else:  # the request's verdict, whatever the precision the server recomputes in
                    assert not all(lib) and not all(srv), (what, eng.dtype, lib, srv)
            assert not all(_ok(tl, activations(perturbed, ids, P), proofs)), "another model"
            counted += 1
    assert counted == 5
    print(f"\n{eng.dtype}: one mid-prompt token changed was accepted by TOPLOC for {sum(one_token)} of "
          f"{len(one_token)} choices")


def _perturbed(model):
    """Another model: the same weights, each perturbed by 5% noise (2% sits at TOPLOC's thresholds on this model)."""
    import copy

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=g))
    return other
