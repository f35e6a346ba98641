"""Chats with images through the real app (`serve.run` of deployments/app.py, as `serve run` does),
over HTTP with the openai client and over a Python handle, on three built-in VLM families (Gemma 3,
LLaVA, Qwen3-VL with DeepStack; Qwen2.5-VL is served by the same path, tested on the engine): every
vector and row, at every layer, exact against transformers on the same processor outputs and the returned token ids
(tests/vlm_ref.py), streamed with n=2 too; bad media refused by name while the app keeps serving.
And completions with prompt_embeds through the Router, against transformers given the same embeddings."""

from __future__ import annotations

import httpx
import numpy as np

from tests.engine.test_multimodal import REL_TOL, about, image
from tests.serve.conftest import decode_vector

APPS = {
    "gemma3_vlm_app": ("builtin:tiny-gemma3-vlm", "hs-gemma3-vlm"),
    "llava_app": ("builtin:tiny-llava", "hs-llava"),
    "qwen_vl_app": ("builtin:tiny-qwen3-vl", "hs-qwen-vl"),
}


def folder_of(model: str) -> str:
    from hidden_states.models.builtin import resolve_model

    return resolve_model(model)


def check(vector, model: str, prompt_ids, seeds, completion_ids, rows=None, layer: int = -1) -> float:
    """Relative error of `vector` (or `rows` of prompt + completion) at `layer` against transformers'
    `hidden_states[layer]`."""
    from tests.vlm_ref import reference_hidden_states

    ref = reference_hidden_states(folder_of(model), prompt_ids, [image(s) for s in seeds], completion_ids)[layer]
    got, want = (np.asarray(vector, np.float32), ref[-1]) if rows is None else (np.asarray(rows, np.float32), ref)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err <= REL_TOL, err
    return err


def chat_over_http(base: str, model: str, served: str) -> None:
    import openai

    from tests.vlm_ref import load

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
    layers = [*range(load(folder_of(model))[0].config.get_text_config().num_hidden_layers), -1]
    r = client.chat.completions.create(
        model=served,
        messages=about(0),
        max_tokens=6,
        temperature=0,
        extra_body={
            "return_hidden_states": True,
            "return_token_ids": True,
            "hidden_states_position": "all",
            "hidden_states_layers": layers,
        },
    )
    ch = r.choices[0].model_dump()
    meta = ch["hidden_states_meta"]
    assert meta["modalities"][0]["modality"] == "image" and meta["via"] == "tail", meta
    assert sorted(map(int, ch["hidden_states_by_layer"])) == sorted(layers)
    err = max(
        check(None, model, r.prompt_token_ids, [0], ch["token_ids"], rows=rows, layer=int(layer))
        for layer, rows in ch["hidden_states_by_layer"].items()
    )
    # streamed, n=2 (sampled, seeded): each choice's vector on its final chunk, each exact
    stream = client.chat.completions.create(
        model=served,
        messages=about(1, 2),
        max_tokens=5,
        n=2,
        temperature=1.0,
        seed=7,
        stream=True,
        extra_body={"return_hidden_states": True, "return_token_ids": True},
    )
    tokens: dict[int, list[int]] = {}
    vectors, prompt_ids = {}, None
    for chunk in stream:
        data = chunk.model_dump()
        prompt_ids = data.get("prompt_token_ids") or prompt_ids
        for c in data["choices"]:
            tokens.setdefault(c["index"], []).extend(c.get("token_ids") or [])
            if c.get("hidden_states") is not None:
                vectors[c["index"]] = decode_vector(c["hidden_states"])
    assert sorted(vectors) == [0, 1] and prompt_ids, (vectors, prompt_ids)
    errs = [check(vectors[i], model, prompt_ids, [1, 2], tokens[i]) for i in (0, 1)]
    print(f"{served}: rows over HTTP {err:.1e}, streamed n=2 {max(errs):.1e} (relative)")


def chat_over_a_handle(app_name: str, model: str) -> None:
    from ray import serve

    from deployments.client import complete

    handle = serve.get_app_handle(app_name)
    c = complete(handle, messages=about(3), max_tokens=6, timeout_s=120)
    (ch,) = c.choices
    check(ch.hidden_states, model, list(c.prompt_token_ids), [3], list(ch.token_ids))


def refuses_bad_media_and_keeps_serving(base: str, served: str) -> None:
    bad = about(4)
    bad[0]["content"][0]["image_url"]["url"] = "data:image/png;base64,not base64!"
    r = httpx.post(
        f"{base}/v1/chat/completions",
        timeout=60,
        json={"model": served, "messages": bad, "max_tokens": 4, "return_hidden_states": True},
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages[0].content[0].image_url", err
    three = httpx.post(
        f"{base}/v1/chat/completions",
        timeout=60,
        json={"model": served, "messages": about(1, 2, 3), "max_tokens": 4, "return_hidden_states": True},
    )
    assert three.status_code == 400 and "At most 2 image" in three.text, three.text
    ok = httpx.post(
        f"{base}/v1/chat/completions",
        timeout=60,
        json={"model": served, "messages": about(5), "max_tokens": 4, "return_hidden_states": True},
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["hidden_states"], ok.text


def served_name(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]


def test_gemma3_vlm_chats_with_images_over_http_and_a_handle(gemma3_vlm_app):
    model, app = APPS["gemma3_vlm_app"]
    chat_over_http(gemma3_vlm_app, model, served_name(gemma3_vlm_app))
    chat_over_a_handle(app, model)
    refuses_bad_media_and_keeps_serving(gemma3_vlm_app, served_name(gemma3_vlm_app))


def test_llava_chats_with_images_over_http_and_a_handle(llava_app):
    model, app = APPS["llava_app"]
    chat_over_http(llava_app, model, served_name(llava_app))
    chat_over_a_handle(app, model)
    refuses_bad_media_and_keeps_serving(llava_app, served_name(llava_app))


def test_the_same_image_goes_to_the_same_replica_and_hits_its_cache(llava_app):
    """Two LLaVA replicas behind the Router: its routing key holds a digest of each image's data, so a
    chat about one image lands on one replica every time (`x-replica-id`) and, from the second time,
    finds its prefix cached there (`usage.prompt_tokens_details.cached_tokens`); the vectors are exact."""
    from tests.serve.test_prefix_routing import engine_replicas

    model, app = APPS["llava_app"]
    assert len(engine_replicas(app)) == 2
    served = served_name(llava_app)
    text = "Describe it in detail, please, with every colour and every shape that you can see there."  # a full block
    seen: dict[int, list[tuple[str, int]]] = {}
    for round_ in range(3):
        for seed in (20, 21, 22, 23, 24, 25):
            r = httpx.post(
                f"{llava_app}/v1/chat/completions",
                timeout=120,
                json={
                    "model": served,
                    "messages": about(seed, text=text),
                    "max_tokens": 4,
                    "temperature": 0,
                    "return_hidden_states": True,
                    "return_token_ids": True,
                },
            )
            assert r.status_code == 200, r.text[:300]
            body = r.json()
            cached = (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            seen.setdefault(seed, []).append((r.headers["x-replica-id"], cached))
            if round_ == 2:
                ch = body["choices"][0]
                check(ch["hidden_states"], model, body["prompt_token_ids"], [seed], ch["token_ids"])
    for seed, turns in seen.items():
        assert len({replica for replica, _ in turns}) == 1, (seed, turns)  # one replica per image
        assert all(cached > 0 for _, cached in turns[1:]), (seed, turns)  # its cache, from the second time
    print("images by replica:", {seed: turns[0][0][:6] for seed, turns in seen.items()})


def test_qwen_vl_chats_with_images_over_http_and_a_handle(qwen_vl_app):
    """Qwen3-VL: interleaved M-RoPE positions and DeepStack through Serve, every layer's rows, tail and
    streamed, against transformers given the processor's mm_token_type_ids."""
    model, app = APPS["qwen_vl_app"]
    chat_over_http(qwen_vl_app, model, served_name(qwen_vl_app))
    chat_over_a_handle(app, model)
    refuses_bad_media_and_keeps_serving(qwen_vl_app, served_name(qwen_vl_app))


def test_an_image_sent_to_a_text_model_is_refused_by_name(client, serve_app):
    r = httpx.post(
        f"{serve_app}/v1/chat/completions",
        timeout=60,
        json={"model": "tiny-llama", "messages": about(0), "max_tokens": 4, "return_hidden_states": True},
    )
    assert r.status_code == 400 and "not a multimodal model" in r.json()["error"]["message"], r.text
    ok = client.completions.create(model="tiny-llama", prompt="still serving", max_tokens=2)
    assert ok.choices[0].text is not None


def test_prompt_embeds_through_the_router(embeds_app, model_dir):
    """Completions with `prompt_embeds` over HTTP through the Router: the tail step's vector, the
    extraction step's (a stop string: the embeddings then the completion's ids), and rows at every
    position, against transformers given the same inputs_embeds then the completion's embeddings; the
    same tokens as without hidden states."""
    import base64
    import io

    import torch
    from transformers import AutoModelForCausalLM

    E = torch.randn(7, 128, generator=torch.Generator().manual_seed(3)) * 0.5
    buf = io.BytesIO()
    torch.save(E, buf)
    body = {
        "model": served_name(embeds_app),
        "prompt_embeds": base64.b64encode(buf.getvalue()).decode(),
        "max_tokens": 6,
        "temperature": 0,
        "return_token_ids": True,
    }
    outs = {}
    for name, extra in {
        "plain": {},
        "tail": {"return_hidden_states": True},
        "extraction": {"return_hidden_states": True, "stop": ["never in this text"]},
        "all": {"return_hidden_states": True, "hidden_states_position": "all"},
    }.items():
        r = httpx.post(f"{embeds_app}/v1/completions", json={**body, **extra}, timeout=120)
        assert r.status_code == 200, (name, r.text[:500])
        outs[name] = r.json()["choices"][0]
    tokens = outs["plain"]["token_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        x = torch.cat([E, model.get_input_embeddings()(torch.tensor(tokens))])[None]
        ref = model(inputs_embeds=x, output_hidden_states=True).hidden_states[-1][0].numpy()
    for name in ("tail", "extraction"):
        ch = outs[name]
        assert ch["token_ids"] == tokens and ch["hidden_states_meta"]["via"] == name, ch["hidden_states_meta"]
        got = decode_vector(ch["hidden_states"])
        assert np.abs(got - ref[-1]).max() <= REL_TOL * np.abs(ref[-1]).max(), name
    rows = np.asarray(outs["all"]["hidden_states"], np.float32)
    assert rows.shape == ref.shape and np.abs(rows - ref).max() <= REL_TOL * np.abs(ref).max()
