"""LoRA adapters: every vector comes from the adapter the request named, whichever step computed it.

One engine with `enable_lora` and two adapters loaded by vLLM's own OpenAI serving
(`--lora-modules`, as the server does), on the tiny model: "lora-qv" (q_proj,
v_proj) and "lora-all" (every linear layer), random and non-zero (PEFT's
init_lora_weights=False). The oracle is transformers + peft on the same adapter
folder; each vector must also differ from the base model's, so no check passes
by accident. Then SmolLM2-135M with an adapter.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json

import numpy as np
import pytest

from tests.conftest import ON_GPU, TEST_ENGINE_ARGS, TEST_MODEL, Reference, build_lora, long_text, sampling

BASE = "tiny-llama"
PROMPTS = ["Hello! How are you today?", "The router sends every completion to a replica", "Code: def add(a, b):"]
LORA_ARGS = dict(enable_lora=True, max_loras=2, max_lora_rank=8)  # what AppArgs gives two rank-8 adapters
HS = {"return_hidden_states": True, "hidden_states_encoding": "base64", "return_token_ids": True}


@pytest.fixture(scope="module")
def adapters(model_dir) -> dict[str, str]:
    return {"lora-qv": build_lora(model_dir, "qv", seed=1), "lora-all": build_lora(model_dir, "all", seed=2)}


@pytest.fixture(scope="module")
def refs(model_dir, adapters, reference) -> dict[str | None, Reference]:
    """The oracle of each model a request can name (None: the base)."""
    return {None: reference, **{name: Reference(model_dir, path) for name, path in adapters.items()}}


@pytest.fixture(scope="module")
def served(loop_thread, adapters):
    """(engine, its OpenAI frontend): the frontend loads the adapters, as a replica's does."""
    from hidden_states.vllm.engine import HiddenStatesEngine

    eng = loop_thread.run(HiddenStatesEngine.start(TEST_MODEL, **LORA_ARGS, **TEST_ENGINE_ARGS))
    try:
        frontend = loop_thread.run(eng.openai(BASE, "test", [{"name": n, "path": p} for n, p in adapters.items()]))
        yield eng, frontend
        loop_thread.run(eng.complete(PROMPTS[0], sp(max_tokens=2), return_hidden_states=False))  # one more step
        stats = loop_thread.run(eng.stats())
        assert stats["pending"] == 0 and stats["missing_vectors"] == 0, stats
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def engine(served):
    return served[0]


sp = sampling(max_tokens=16)  # greedy SamplingParams; keywords override


def assert_adapters(refs, model: str | None, token_ids, vector) -> tuple[float, float]:
    """Matches `model`'s oracle (transformers + peft), and no other model's. (max abs err, max |ref|)."""
    err, scale = refs[model].assert_matches(list(token_ids), vector)
    for other, ref in refs.items():
        if other != model:
            with pytest.raises(AssertionError):
                ref.assert_matches(list(token_ids), vector)
    print(f"{model or BASE}: {len(token_ids)} tokens, max abs err {err:.3g}, max|ref| {scale:.3g}")
    return err, scale


def openai(frontend, loop_thread, route: str, body: dict) -> tuple[int, dict]:
    async def run():
        async with contextlib.aclosing(frontend.handle(route, json.dumps(body).encode())) as parts:
            status, payload = await anext(parts)
        return status, json.loads(payload)

    return loop_thread.run(run(), timeout=120)


def vector(choice: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(choice["hidden_states"]), "<f4")


def test_tail_step_vector_is_the_adapters(engine, loop_thread, refs):
    """The tail step is one more decode row of the running request: on its adapter. The
    adapter also generated the tokens (transformers + peft's greedy decoding)."""
    c = loop_thread.run(engine.complete(PROMPTS[0], sp(), model="lora-qv"))
    (choice,) = c.choices
    assert choice.extraction.via == "tail" and choice.extraction.computed_tokens == 1, choice.extraction
    assert_adapters(refs, "lora-qv", c.prompt_token_ids + choice.token_ids, choice.hidden_states)
    torch, peft = refs["lora-qv"].torch, refs["lora-qv"].model
    with torch.no_grad():
        hf = peft.generate(
            input_ids=torch.tensor([list(c.prompt_token_ids)]), max_new_tokens=16, do_sample=False, eos_token_id=None
        )
    assert list(choice.token_ids) == hf[0, len(c.prompt_token_ids) :].tolist()


def test_two_adapters_and_the_base_in_one_batch(engine, loop_thread, refs):
    """Base, lora-qv and lora-all requests (n=2 too) running together: each vector its own model's.
    (vLLM's CPU LoRA ops gave base rows the last adapter slot's delta: ledger point 11.)"""
    if not ON_GPU:
        assert engine.startup["cpu_lora_fix"] is True
    cases = [(p, m) for p in PROMPTS[:2] for m in (None, "lora-qv", "lora-all")]

    async def run():
        return await asyncio.gather(
            *(engine.complete(p, sp(max_tokens=10 + i), model=m) for i, (p, m) in enumerate(cases)),
            engine.complete(PROMPTS[2], sp(n=2, temperature=1.0, seed=7, max_tokens=12), model="lora-all"),
        )

    *outs, pair = loop_thread.run(run())
    for (_prompt, model), c in zip(cases, outs):
        ch = c.choices[0]
        assert ch.extraction.via == "tail", ch.extraction
        assert_adapters(refs, model, c.prompt_token_ids + ch.token_ids, ch.hidden_states)
    assert len(pair.choices) == 2
    for ch in pair.choices:
        assert ch.extraction.via == "tail"
        assert_adapters(refs, "lora-all", pair.prompt_token_ids + ch.token_ids, ch.hidden_states)


def test_intermediate_layers_come_from_the_adapter(engine, loop_thread, refs):
    """hidden_states_layers on an adapter: every layer the adapter's; layer 1 and the last differ
    from the base model's (the embeddings, layer 0, are the base's by construction)."""
    c = loop_thread.run(engine.complete(PROMPTS[1], sp(max_tokens=8), model="lora-qv", layers=(0, 1, -1)))
    (choice,) = c.choices
    ids = list(c.prompt_token_ids + choice.token_ids)
    for layer, vec in choice.hidden_states_by_layer.items():
        refs["lora-qv"].assert_matches(ids, vec, layer=layer)
        if layer != 0:
            with pytest.raises(AssertionError):
                refs[None].assert_matches(ids, vec, layer=layer)


def test_stop_string_extraction_on_the_adapters_prefix_cache(engine, loop_thread, refs):
    """A stop string: the extraction step runs on the request's adapter, so on that adapter's
    prefix cache (all but the last block cached); the base model has no cache for it."""
    from hidden_states.vllm.frontend.extraction import Origin

    prompt = long_text(120, seed=23)
    free = loop_thread.run(engine.complete(prompt, sp(max_tokens=24), model="lora-all", return_hidden_states=False))
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    c = loop_thread.run(engine.complete(prompt, sp(max_tokens=24, stop=[stop]), model="lora-all"))
    ch, block = c.choices[0], engine.llm.vllm_config.cache_config.block_size
    ids = c.prompt_token_ids + ch.token_ids
    assert ch.finish_reason == "stop" and ch.extraction.via == "extraction"
    assert len(ids) - block <= ch.extraction.cached_tokens < len(ids), ch.extraction
    assert_adapters(refs, "lora-all", ids, ch.hidden_states)
    # The same tokens on the base model: its own cache, empty for this prompt.
    vec, stats = loop_thread.run(engine.extract_one(ids))
    assert stats.cached_tokens == 0, stats
    assert_adapters(refs, None, ids, vec)
    vec, stats = loop_thread.run(engine.extract_one(ids, Origin(lora_request=engine.lora_request("lora-all"))))
    assert stats.cached_tokens == ch.extraction.cached_tokens, stats  # the adapter's cache, kept
    assert_adapters(refs, "lora-all", ids, vec)


def test_extraction_keeps_the_requests_cache_salt(served, loop_thread, refs):
    """A salted request's extraction step finds its blocks in the salted cache of its adapter
    (without the salt, or on the base model, this fresh prompt would find none)."""
    engine, frontend = served
    body = {
        "model": "lora-all",
        "prompt": long_text(100, seed=31),
        "max_tokens": 20,
        "temperature": 0,
        "cache_salt": "tenant-7",
    }
    status, free = openai(frontend, loop_thread, "completions", body)
    assert status == 200, free
    text = free["choices"][0]["text"]
    status, out = openai(
        frontend, loop_thread, "completions", {**body, "stop": [text[len(text) // 2 : len(text) // 2 + 2]], **HS}
    )
    assert status == 200, out
    (ch,) = out["choices"]
    meta, block = ch["hidden_states_meta"], engine.llm.vllm_config.cache_config.block_size
    assert ch["finish_reason"] == "stop" and meta["via"] == "extraction" and meta["adapter"] == "lora-all", meta
    assert meta["tokens"] - block <= meta["cached_tokens"] < meta["tokens"], meta
    assert_adapters(refs, "lora-all", ch["prompt_token_ids"] + ch["token_ids"], vector(ch))


def test_beam_search_extracts_on_the_adapter(served, loop_thread, refs):
    engine, frontend = served
    status, out = openai(
        frontend,
        loop_thread,
        "completions",
        {"model": "lora-qv", "prompt": PROMPTS[1], "use_beam_search": True, "n": 2, "max_tokens": 8, **HS},
    )
    assert status == 200, out
    assert out["model"] == "lora-qv" and len(out["choices"]) == 2
    for ch in out["choices"]:
        meta = ch["hidden_states_meta"]
        assert meta["adapter"] == "lora-qv" and meta["via"] == "extraction", meta
        assert_adapters(refs, "lora-qv", ch["prompt_token_ids"] + ch["token_ids"], vector(ch))


def test_grammar_chat_extracts_on_the_adapter(served, loop_thread, refs):
    """structured_outputs (a grammar): no tail, the extraction step, on the adapter; a chat request."""
    engine, frontend = served
    status, out = openai(
        frontend,
        loop_thread,
        "chat",
        {
            "model": "lora-all",
            "messages": [{"role": "user", "content": "Pick one."}],
            "max_tokens": 12,
            "structured_outputs": {"choice": ["alpha", "beta", "gamma"]},
            "temperature": 0,
            **HS,
        },
    )
    assert status == 200, out
    (ch,) = out["choices"]
    assert ch["message"]["content"] in ("alpha", "beta", "gamma")
    meta = ch["hidden_states_meta"]
    assert meta["adapter"] == "lora-all" and meta["via"] == "extraction", meta
    assert_adapters(refs, "lora-all", out["prompt_token_ids"] + ch["token_ids"], vector(ch))


def test_base_requests_say_no_adapter_and_unknown_names_are_404(served, loop_thread, refs):
    from hidden_states.params import UnknownModelError

    engine, frontend = served
    status, out = openai(
        frontend, loop_thread, "completions", {"model": BASE, "prompt": PROMPTS[0], "max_tokens": 6, **HS}
    )
    assert status == 200 and out["choices"][0]["hidden_states_meta"]["adapter"] is None
    ch = out["choices"][0]
    assert_adapters(refs, None, ch["prompt_token_ids"] + ch["token_ids"], vector(ch))
    status, out = openai(frontend, loop_thread, "completions", {"model": "lora-nope", "prompt": "x"})
    assert status == 404 and "`tiny-llama`, `lora-qv`, `lora-all`" in out["error"]["message"], out
    with pytest.raises(UnknownModelError, match="lora-nope.*`lora-qv`, `lora-all`"):
        loop_thread.run(engine.complete(PROMPTS[0], sp(), model="lora-nope"))


def test_smollm2_with_an_adapter(loop_thread, record_property):
    """The real model: an adapter on every linear layer; the vector is transformers + peft's."""
    from hidden_states.models.builtin import resolve_model
    from hidden_states.vllm.engine import HiddenStatesEngine
    from tests.engine.test_smollm2 import ENGINE_ARGS, FRANCE, MODEL, chat_ids, check_vector

    path = resolve_model(MODEL)
    adapter = build_lora(path, "all", seed=3)
    eng = loop_thread.run(HiddenStatesEngine.start(MODEL, warm_up_s=0, **LORA_ARGS, **ENGINE_ARGS))
    try:
        loop_thread.run(eng.openai("smollm2", "test", [{"name": "smol-lora", "path": adapter}]))
        prompt = chat_ids(eng.llm.tokenizer, FRANCE)
        c = loop_thread.run(eng.complete(prompt, sp(max_tokens=24), model="smol-lora"))
    finally:
        eng.shutdown()
    (ch,) = c.choices
    ids = c.prompt_token_ids + ch.token_ids
    print("adapter's answer:", repr(ch.text))
    check_vector(Reference(path, adapter), ids, ch.hidden_states, record_property, "smollm2_lora")
    base = Reference(path).last_hidden(ids)
    off = float(np.abs(base - ch.hidden_states).max())
    print(f"smollm2_lora: the base model's vector is {off:.3g} away")
    assert off > 100 * 1e-5 * np.abs(base).max()  # not the base model's
