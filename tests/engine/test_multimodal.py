"""Images and prompt embeddings in, vectors out: real vLLM on the built-in tiny VLMs of three families
(Gemma 3: SigLIP + Gemma 3 text; LLaVA: CLIP + Llama; Qwen2.5-VL: its window-attention ViT + Qwen2
text with M-RoPE, 3-D rotary positions; hidden_states/models/vlm.py), through vLLM's own chat
serving (the replica's frontend), checked against transformers on the same processor outputs and
the returned token ids (tests/vlm_ref.py: each model with the token types its processor makes: Gemma 3's
`token_type_ids`, from which an image's tokens attend to each other both ways, which the CPU engine
computes through ledger point 18; Qwen2.5-VL's `mm_token_type_ids`, from which transformers positions
the image tokens), relative 1e-5 in float32.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import pytest

from hidden_states.vllm import VERIFIED_LAYER_ARCHS
from tests.conftest import TEST_ENGINE_ARGS, TEST_MODEL

# Every verified vision-language architecture (hidden_states.vllm.VERIFIED_LAYER_ARCHS): its built-in model.
FAMILIES = tuple(
    f"builtin:{model}" for arch, model in VERIFIED_LAYER_ARCHS.items() if arch.endswith("ForConditionalGeneration")
)
ENGINE_ARGS = {**TEST_ENGINE_ARGS, "max_model_len": 1024, "limit_mm_per_prompt": {"image": 2}}
VIDEO_FAMILIES = ("builtin:tiny-qwen2.5-vl",)  # the others are served no video (Qwen3-VL: not tested here)
REL_TOL = 1e-5


def image(seed: int, size=(40, 30)):
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype("uint8"))


def data_url(img, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def about(*seeds: int, text: str = "What is in this picture?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(image(s))}} for s in seeds]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    """The engines' allowed_local_media_path: file: URLs under it are read by vLLM."""
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda m: m.split(":")[1])
def vlm(request, loop_thread, media_dir):
    """(model folder, engine, frontend) of one VLM family; one engine per family for the module."""
    from hidden_states.models.builtin import resolve_model
    from hidden_states.vllm.engine import HiddenStatesEngine
    from tests.heads_ref import build_test_heads

    folder = resolve_model(request.param)
    # the test heads (tests/heads_ref.py: D = 128, 2 layers, as every tiny VLM's text stack)
    args = ENGINE_ARGS
    if request.param in VIDEO_FAMILIES:
        args = {**args, "limit_mm_per_prompt": {**args["limit_mm_per_prompt"], "video": 1}}
    eng = loop_thread.run(
        HiddenStatesEngine.start(
            request.param, allowed_local_media_path=str(media_dir), heads=build_test_heads(), **args
        )
    )
    frontend = loop_thread.run(eng.openai("vlm", "r0"))
    yield folder, eng, frontend
    eng.shutdown()


async def chat(frontend, messages, **fields) -> tuple[int, dict]:
    body = {"model": "vlm", "messages": messages, "max_tokens": 6, "temperature": 0, "return_token_ids": True, **fields}
    (status, raw), *_ = [x async for x in frontend.handle("chat/completions", json.dumps(body).encode())]
    return status, json.loads(raw)


def reference(folder, prompt_ids, seeds, completion_ids):
    from tests.vlm_ref import reference_hidden_states

    return reference_hidden_states(folder, prompt_ids, [image(s) for s in seeds], completion_ids)


def assert_close(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    err, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
    assert err <= REL_TOL * scale, f"max abs error {err} > {REL_TOL} x max|reference| {scale}"
    print(f"max abs error {err:.3g}, max|reference| {scale:.3g} (relative {err / scale:.2g})")


def test_a_chat_with_an_image_returns_its_vector_and_rows_exact(vlm, loop_thread):
    """Every layer's rows at every position: transformers' `hidden_states[L]` (Qwen3-VL: before
    DeepStack's additions after layers 0 and 1, which land on the image's positions)."""
    folder, eng, fe = vlm
    status, out = loop_thread.run(
        chat(
            fe,
            about(0),
            return_hidden_states=True,
            hidden_states_position="all",
            hidden_states_layers=[*range(eng.num_layers), -1],
        )
    )
    assert status == 200, out
    ch = out["choices"][0]
    prompt, completion = out["prompt_token_ids"], ch["token_ids"]
    ref = reference(folder, prompt, [0], completion)
    for layer, rows in ch["hidden_states_by_layer"].items():
        assert_close(rows, ref[int(layer)][: len(prompt) + len(completion)])
    # which prompt positions are the image's: its placeholder span holds every image token
    (span,) = ch["hidden_states_meta"]["modalities"]
    from tests.vlm_ref import load

    image_token = load(str(folder))[0].config.image_token_id
    at = [i for i, t in enumerate(prompt) if t == image_token]
    assert span["modality"] == "image" and span["start"] <= at[0] and at[-1] < span["end"] <= len(prompt), span


def test_greedy_tokens_are_transformers_own_with_one_and_two_images(vlm, loop_thread):
    """The tiny VLM as vLLM serves it is the model transformers runs (builder, weight names, processor)."""
    from tests.vlm_ref import reference_greedy

    folder, eng, fe = vlm
    for seeds in ((10,), (10, 11)):
        status, out = loop_thread.run(chat(fe, about(*seeds), max_tokens=8))
        assert status == 200, out
        want = reference_greedy(folder, out["prompt_token_ids"], [image(s) for s in seeds], max_new_tokens=8)
        assert out["choices"][0]["token_ids"] == want


def test_prompt_end_and_a_range_over_the_image_s_positions(vlm, loop_thread):
    folder, eng, fe = vlm
    status, out = loop_thread.run(chat(fe, about(16), return_hidden_states=True, hidden_states_position="prompt_end"))
    assert status == 200, out
    ch = out["choices"][0]
    ref = reference(folder, out["prompt_token_ids"], [16], ch["token_ids"])[-1]
    assert_close(ch["hidden_states"], ref[len(out["prompt_token_ids"]) - 1])
    (span,) = ch["hidden_states_meta"]["modalities"]
    status, out = loop_thread.run(
        chat(
            fe,
            about(16),
            return_hidden_states=True,
            hidden_states_position={"start": span["start"], "end": span["end"]},
        )
    )
    rows = out["choices"][0]
    assert rows["hidden_states_meta"]["positions"] == list(range(span["start"], span["end"]))
    assert_close(rows["hidden_states"], ref[span["start"] : span["end"]])


def test_two_images_and_a_batch_mixing_text_and_image_requests_are_exact(vlm, loop_thread):
    folder, eng, fe = vlm

    async def batch():
        return await asyncio.gather(
            chat(fe, about(1, 2), return_hidden_states=True),
            chat(fe, about(3), return_hidden_states=True),
            chat(fe, [{"role": "user", "content": "No picture today."}], return_hidden_states=True),
        )

    for (status, out), seeds in zip(loop_thread.run(batch()), [(1, 2), (3,), ()]):
        assert status == 200, out
        ch = out["choices"][0]
        assert len(ch["hidden_states_meta"].get("modalities", [])) == len(seeds)
        assert_close(ch["hidden_states"], reference(folder, out["prompt_token_ids"], seeds, ch["token_ids"])[-1][-1])


def test_gemma3_s_image_tokens_attend_both_ways_and_text_stays_on_vllm_s_kernel(vlm, loop_thread):
    """Ledger point 18. Gemma 3 (an "mm prefix" model): the CPU engine recomputes each image token's
    attention over its whole image, counted per row and layer; with vLLM's causal kernel put back the
    rows are not transformers' Gemma 3 (the bug), and a text-only request's rows are the same bits
    either way. The other families are not touched: no fix, no rows."""
    from tests.vlm_ref import load

    folder, eng, fe = vlm
    model = load(str(folder))[0]
    mm_prefix = model.config.model_type == "gemma3"
    assert eng.startup.get("cpu_mm_prefix_fix", False) is mm_prefix, eng.startup
    assert eng.llm.vllm_config.scheduler_config.disable_chunked_mm_input is mm_prefix

    def span_rows():
        return sum(w.get("image_span_rows", 0) for w in loop_thread.run(eng.stats())["workers"])

    text = [{"role": "user", "content": "No picture, only words about the sea and the sky."}]
    before = span_rows()
    status, fixed = loop_thread.run(chat(fe, about(40, 41), return_hidden_states=True, hidden_states_position="all"))
    assert status == 200, fixed
    plain = loop_thread.run(chat(fe, text, return_hidden_states=True))[1]
    image_tokens = fixed["prompt_token_ids"].count(model.config.image_token_id)
    layers = model.config.get_text_config().num_hidden_layers
    assert span_rows() - before == (image_tokens * layers if mm_prefix else 0)
    ch = fixed["choices"][0]
    assert_close(ch["hidden_states"], reference(folder, fixed["prompt_token_ids"], [40, 41], ch["token_ids"])[-1])
    if not mm_prefix:
        return
    try:
        assert not any(loop_thread.run(eng.llm.collective_rpc("hidden_states_fix_cpu_mm_prefix", args=(False,))))
        status, causal = loop_thread.run(
            chat(fe, about(42, 43), return_hidden_states=True, hidden_states_position="all")
        )
        plain_causal = loop_thread.run(chat(fe, text, return_hidden_states=True))[1]
    finally:
        assert all(loop_thread.run(eng.llm.collective_rpc("hidden_states_fix_cpu_mm_prefix")))
    ch = causal["choices"][0]
    ref = reference(folder, causal["prompt_token_ids"], [42, 43], ch["token_ids"])[-1]
    got = np.asarray(ch["hidden_states"], np.float32)[: len(ref)]
    assert np.abs(got - ref[: len(got)]).max() > 1e-3 * np.abs(ref).max()  # vLLM's kernel alone: not Gemma 3
    assert plain_causal["choices"][0]["hidden_states"] == plain["choices"][0]["hidden_states"]
    assert plain_causal["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]


def test_an_extraction_step_sees_the_same_image_and_reuses_its_encoding(vlm, loop_thread):
    """A stop string that never matches: the vector comes from an extraction step, which must be the
    tail step's vector bit for bit (the same image by hash, not the placeholder tokens alone) and
    must not run the vision encoder again (its output is in the encoder cache)."""
    folder, eng, fe = vlm
    messages, layers = about(4), [*range(eng.num_layers), -1]
    status, tail = loop_thread.run(chat(fe, messages, return_hidden_states=True, hidden_states_layers=layers))
    assert status == 200 and tail["choices"][0]["hidden_states_meta"]["via"] == "tail", tail
    before = loop_thread.run(eng.stats())
    status, extracted = loop_thread.run(
        chat(fe, messages, return_hidden_states=True, hidden_states_layers=layers, stop=["never in this text"])
    )
    after = loop_thread.run(eng.stats())
    a, b = tail["choices"][0], extracted["choices"][0]
    assert b["hidden_states_meta"]["via"] == "extraction" and after["extractions"] == before["extractions"] + 1
    # every layer's row of the final token, bit for bit
    assert a["token_ids"] == b["token_ids"] and a["hidden_states_by_layer"] == b["hidden_states_by_layer"]
    # the generation encodes the image once (the encoder cache may even hold it from the first request);
    # the extraction step adds no encoder pass
    encoded = sum(w["encoder_items"] for w in after["workers"]) - sum(w["encoder_items"] for w in before["workers"])
    assert encoded <= 1, encoded


def test_different_images_never_share_vectors_and_the_same_image_hits_the_cache(vlm, loop_thread):
    folder, eng, fe = vlm
    text = "Describe it in detail, please, with every colour and every shape that you can see there."
    first = loop_thread.run(chat(fe, about(5, text=text), return_hidden_states=True))[1]
    other = loop_thread.run(chat(fe, about(6, text=text), return_hidden_states=True))[1]
    again = loop_thread.run(chat(fe, about(5, text=text), return_hidden_states=True))[1]
    for out, seed in ((first, 5), (other, 6)):
        ch = out["choices"][0]
        assert_close(ch["hidden_states"], reference(folder, out["prompt_token_ids"], [seed], ch["token_ids"])[-1][-1])
    assert first["prompt_token_ids"] == other["prompt_token_ids"]  # the same tokens: only the image differs
    assert first["choices"][0]["hidden_states"] != other["choices"][0]["hidden_states"]
    assert again["choices"][0]["hidden_states"] == first["choices"][0]["hidden_states"]
    if "gemma3" not in str(folder):  # Gemma 3's sliding-window layers keep no full blocks to hit
        assert (again["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0) > 0, again["usage"]
    assert (other["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0) < len(other["prompt_token_ids"])


def test_asking_for_vectors_changes_nothing_else(vlm, loop_thread):
    folder, eng, fe = vlm
    # each from an empty prefix cache: usage's cached_tokens are then the same (Qwen-VL's prompt fills a block)
    loop_thread.run(eng.llm.reset_prefix_cache())
    plain = loop_thread.run(chat(fe, about(7), logprobs=True, top_logprobs=2))[1]
    loop_thread.run(eng.llm.reset_prefix_cache())
    withv = loop_thread.run(chat(fe, about(7), logprobs=True, top_logprobs=2, return_hidden_states=True))[1]
    for out in (plain, withv):
        out.pop("id"), out.pop("created")
        for ch in out["choices"]:
            ch.pop("hidden_states", None), ch.pop("hidden_states_meta", None)
    assert plain == withv


def test_a_handle_and_a_verifier_get_the_same_vector(vlm, loop_thread):
    """engine.complete on chat_input (what a Python handle's messages become) and POST
    /v1/hidden_states with the same messages and the completion's ids recompute the chat's vector."""
    from hidden_states.interface import SamplingOptions

    folder, eng, fe = vlm
    messages = about(8)
    out = loop_thread.run(chat(fe, messages, return_hidden_states=True))[1]
    want = out["choices"][0]["hidden_states"]
    c = loop_thread.run(eng.complete(loop_thread.run(eng.chat_input(messages)), SamplingOptions(max_tokens=6)))
    assert list(c.choices[0].token_ids) == out["choices"][0]["token_ids"]
    np.testing.assert_array_equal(c.choices[0].hidden_states, np.asarray(want, np.float32))
    body = {"model": "vlm", "messages": messages, "completion": out["choices"][0]["token_ids"]}

    async def verify():
        return [x async for x in fe.handle("hidden_states", json.dumps(body).encode())][0]

    status, raw = loop_thread.run(verify())
    verified = json.loads(raw)
    assert status == 200 and verified["hidden_states"] == want, verified
    assert verified["hidden_states_meta"]["modalities"] == out["choices"][0]["hidden_states_meta"]["modalities"]


def test_beam_search_with_an_image_extracts_each_beam_on_the_image(vlm, loop_thread):
    """vLLM's beam search over a chat with an image: each returned beam's vector comes from an extraction
    step that sends the same image (by its processed input) with the beam's tokens, equal to
    transformers' on that beam's tokens with the image."""
    folder, eng, fe = vlm
    status, out = loop_thread.run(
        chat(fe, about(9), max_tokens=4, n=2, use_beam_search=True, return_hidden_states=True)
    )
    assert status == 200, out
    assert len(out["choices"]) == 2
    for ch in out["choices"]:
        assert ch["hidden_states_meta"]["via"] == "extraction", ch["hidden_states_meta"]
        assert ch["hidden_states_meta"]["modalities"][0]["modality"] == "image"
        assert_close(ch["hidden_states"], reference(folder, out["prompt_token_ids"], [9], ch["token_ids"])[-1][-1])


def test_heads_and_steering_with_an_image_in_the_prompt(vlm, loop_thread):
    """Heads (SAEs at layers 0, 1 and the last, linear probes) over every position of an image chat, against
    SAELens and numpy on transformers' rows of the same image; and steering (an add at layer 1 over the
    whole sequence, the image's tokens included) against transformers with the same hook: every row,
    and every greedy token the argmax of the steered reference's logits before it."""
    from tests.heads_ref import HEAD_LAYERS, build_test_heads, check_heads
    from tests.vlm_ref import steered_forward

    folder, eng, fe = vlm
    asked = {"sae-std": 16, "sae-topk": 16, "sae-gated": 16, "probe": 0, "mid": 0}
    status, out = loop_thread.run(
        chat(
            fe,
            about(12),
            hidden_states_position="all",
            hidden_states_heads=[{"name": n, "topk": k} if k else n for n, k in asked.items()],
        )
    )
    assert status == 200, out
    ch = out["choices"][0]
    ids = out["prompt_token_ids"] + ch["token_ids"]
    states = reference(folder, out["prompt_token_ids"], [12], ch["token_ids"])
    assert set(HEAD_LAYERS[n] for n in asked) == {0, 1, -1}  # Qwen3-VL: 1 is a DeepStack layer
    check_heads("image chat", ch["hidden_states_heads"], list(states), list(range(len(ids))), build_test_heads(), asked)

    vec = np.random.default_rng(5).normal(size=128).astype("<f4") * 0.5
    steer = [{"layer": 1, "vector": base64.b64encode(vec.tobytes()).decode(), "positions": "all"}]
    plain = loop_thread.run(chat(fe, about(12), max_tokens=6))[1]["choices"][0]["token_ids"]
    status, out = loop_thread.run(
        chat(
            fe,
            about(12),
            max_tokens=6,
            return_hidden_states=True,
            hidden_states_position="all",
            hidden_states_layers=[0, 1, -1],
            hidden_states_steering=steer,
        )
    )
    assert status == 200, out
    ch = out["choices"][0]
    P, ids = len(out["prompt_token_ids"]), out["prompt_token_ids"] + ch["token_ids"]
    ref, logits = steered_forward(folder, ids, [image(12)], [(1, "add", "all", 1.0, vec)], P)
    for layer, rows in ch["hidden_states_by_layer"].items():
        assert_close(rows, ref[int(layer)])
    assert [int(np.argmax(logits[t])) for t in range(P - 1, len(ids) - 1)] == ch["token_ids"]
    assert ch["token_ids"] != plain, "the steering changed nothing"


def test_an_ablation_after_an_add_at_the_injected_layers_is_transformers_with_the_same_hooks(vlm, loop_thread):
    """Steering at layer L acts on transformers' `hidden_states[L]`, the output of decoder layer L - 1, before
    anything the model adds between layers (Qwen3-VL's DeepStack, after layers 0 and 1 at the image's
    positions): an add at layer 1 and an ablation at layer 2, over every position, against transformers with
    the same hooks, every layer's rows and every greedy token (on a 2-layer text stack both at layer 1,
    its last steerable one). An add commutes with DeepStack's: the
    stream entering the next layer is the same whichever comes first (checked in transformers)."""
    from tests.vlm_ref import load, model_inputs, steered_forward

    folder, eng, fe = vlm
    rng = np.random.default_rng(8)
    add, away = (rng.normal(size=128).astype("<f4") * 0.5 for _ in range(2))
    b64 = lambda v: base64.b64encode(v.tobytes()).decode()  # noqa: E731
    last = min(2, eng.num_layers - 1)
    steer = [
        {"layer": 1, "vector": b64(add), "positions": "all"},
        {"layer": last, "vector": b64(away), "op": "ablate", "positions": "all"},
    ]
    status, out = loop_thread.run(
        chat(
            fe,
            about(13),
            max_tokens=6,
            return_hidden_states=True,
            hidden_states_position="all",
            hidden_states_layers=[*range(eng.num_layers), -1],
            hidden_states_steering=steer,
        )
    )
    assert status == 200, out
    ch = out["choices"][0]
    P, ids = len(out["prompt_token_ids"]), out["prompt_token_ids"] + ch["token_ids"]
    entries = [(1, "add", "all", 1.0, add), (last, "ablate", "all", 1.0, away)]
    ref, logits = steered_forward(folder, ids, [image(13)], entries, P)
    for layer, rows in ch["hidden_states_by_layer"].items():
        assert_close(rows, ref[int(layer)])
    assert [int(np.argmax(logits[t])) for t in range(P - 1, len(ids) - 1)] == ch["token_ids"]

    model, _ = load(str(folder))
    if not getattr(model.config.vision_config, "deepstack_visual_indexes", None):
        return
    import torch

    def add_entering(module, args, kwargs):  # the same add at the input of decoder layer 1: after DeepStack's
        hidden = (args[0] if args else kwargs["hidden_states"]) + torch.as_tensor(add)
        return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

    handle = model.model.language_model.layers[1].register_forward_pre_hook(add_entering, with_kwargs=True)
    try:
        with torch.no_grad():
            entering = model(**model_inputs(str(folder), ids, [image(13)]), use_cache=False).logits[0].numpy()
    finally:
        handle.remove()
    _, at_output = steered_forward(folder, ids, [image(13)], [(1, "add", "all", 1.0, add)], P)
    assert_close(entering, at_output)  # the same up to float rounding


def test_a_local_file_under_the_allowed_path_is_the_same_image(vlm, loop_thread, media_dir):
    folder, eng, fe = vlm
    image(12).save(media_dir / "twelve.png")
    local = about(12)
    local[0]["content"][0]["image_url"]["url"] = f"file://{media_dir / 'twelve.png'}"
    a = loop_thread.run(chat(fe, local, return_hidden_states=True))[1]
    b = loop_thread.run(chat(fe, about(12), return_hidden_states=True))[1]
    assert a["choices"][0]["hidden_states"] == b["choices"][0]["hidden_states"], a


def test_dtypes_and_top_k_rows_of_an_image_chat(vlm, loop_thread):
    """float16 rows across the prompt and completion, and their top-8 by magnitude: the float32
    rows' values cast, at transformers' largest entries."""
    import torch

    folder, eng, fe = vlm
    whole = loop_thread.run(chat(fe, about(13), return_hidden_states=True, hidden_states_position="all"))[1]
    ch = whole["choices"][0]
    f32 = np.asarray(ch["hidden_states"], np.float32)
    ref = reference(folder, whole["prompt_token_ids"], [13], ch["token_ids"])[-1]
    assert_close(f32, ref)
    half = loop_thread.run(
        chat(fe, about(13), return_hidden_states=True, hidden_states_position="all", hidden_states_dtype="float16")
    )[1]["choices"][0]
    np.testing.assert_array_equal(
        np.asarray(half["hidden_states"], np.float32), f32.astype(np.float16).astype(np.float32)
    )
    top = loop_thread.run(
        chat(fe, about(13), return_hidden_states=True, hidden_states_position="all", hidden_states_topk=8)
    )[1]["choices"][0]
    indices = np.asarray([row["indices"] for row in top["hidden_states"]])
    np.testing.assert_array_equal(indices, torch.topk(torch.from_numpy(f32).abs(), 8, dim=-1).indices.numpy())
    picked = np.take_along_axis(ref, indices, axis=-1)
    assert_close([row["values"] for row in top["hidden_states"]], picked)


def test_proofs_of_an_image_chat_hold_for_a_verifier_sending_the_same_image(vlm, loop_thread):
    folder, eng, fe = vlm
    messages = about(14)
    out = loop_thread.run(chat(fe, messages, max_tokens=40, hidden_states_proof={"scheme": "toploc"}))[1]
    ch = out["choices"][0]
    proofs = ch["hidden_states_proof"]["proofs"]

    async def verify(messages):
        body = {
            "model": "vlm",
            "messages": messages,
            "completion": ch["token_ids"],
            "compare": {"toploc": {"proofs": proofs}},
        }
        return [x async for x in fe.handle("hidden_states", json.dumps(body).encode())][0]

    status, raw = loop_thread.run(verify(messages))
    assert status == 200 and json.loads(raw)["comparison"]["ok"] is True, raw[:500]
    # (Whether another image's proofs fail is TOPLOC's tolerance on a tiny random model: the tiny Gemma 3's
    # do, the tiny LLaVA's image barely moves the rows its proofs sample. Vectors: the different-images test.)


def test_bad_media_are_refused_and_the_engine_keeps_serving(vlm, loop_thread):
    folder, eng, fe = vlm
    status, out = loop_thread.run(chat(fe, about(1, 2, 3), return_hidden_states=True))  # limit_mm_per_prompt: 2
    assert status == 400 and "At most 2 image" in out["error"]["message"], out
    status, out = loop_thread.run(chat(fe, about(9), return_hidden_states=True))
    assert status == 200 and out["choices"][0]["hidden_states"], out


def video_file(path, seed: int, frames: int = 4, size=(56, 56), fps: float = 2.0):
    """A short mp4 (MPEG-4 part 2, through OpenCV) of random frames."""
    import cv2

    rng = np.random.default_rng(seed)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, size)
    assert writer.isOpened()
    for _ in range(frames):
        writer.write((rng.random((size[1], size[0], 3)) * 255).astype("uint8"))
    writer.release()
    return path


def test_a_video_is_exact_by_tail_and_by_extraction_and_refused_where_the_model_takes_none(vlm, loop_thread, media_dir):
    """Qwen2.5-VL: a video (vLLM's OpenCV loader, every frame of a 4-frame clip) as a data URL and as a
    file URL; rows at layers 0, 1 and -1 at every position against transformers on the same frames,
    with the release's 3-D positions (tests/vlm_ref.py::qwen_vl_positions: text after a video starts
    past the video's last temporal position); the extraction step's vector is the tail's bit for
    bit. A family without video: a 400 naming the limit, and the engine keeps serving."""
    from tests.vlm_ref import reference_video_hidden_states

    folder, eng, fe = vlm
    if "qwen3-vl" in str(folder):
        pytest.skip("Qwen3-VL's videos (timestamps between frames, its own frame sampling) have no reference here yet")
    path = video_file(media_dir / "clip.mp4", seed=3)
    url = "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": url}},
                {"type": "text", "text": "What happens in this clip?"},
            ],
        }
    ]
    status, out = loop_thread.run(
        chat(fe, messages, return_hidden_states=True, hidden_states_position="all", hidden_states_layers=[0, 1, -1])
    )
    from hidden_states.models.builtin import resolve_model

    if all(resolve_model(f) != folder for f in VIDEO_FAMILIES):
        assert status == 400 and "video" in out["error"]["message"], out
        assert loop_thread.run(chat(fe, about(9)))[0] == 200
        return
    assert status == 200, out
    ch = out["choices"][0]
    (span,) = ch["hidden_states_meta"]["modalities"]
    assert span["modality"] == "video" and span["end"] - span["start"] == 8, span  # 2 x 4 x 4 patches / 2 x 2
    ref = reference_video_hidden_states(folder, out["prompt_token_ids"] + ch["token_ids"], path)
    n = len(out["prompt_token_ids"]) + len(ch["token_ids"])
    for layer, rows in ch["hidden_states_by_layer"].items():
        assert_close(rows, ref[int(layer)][:n])
    by_file = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": path.as_uri()}},
                {"type": "text", "text": "What happens in this clip?"},
            ],
        }
    ]
    tail = loop_thread.run(chat(fe, by_file, return_hidden_states=True))[1]["choices"][0]
    status, extracted = loop_thread.run(chat(fe, by_file, return_hidden_states=True, stop=["never in this text"]))
    b = extracted["choices"][0]
    assert b["hidden_states_meta"]["via"] == "extraction" and tail["hidden_states_meta"]["via"] == "tail"
    assert b["token_ids"] == tail["token_ids"] == ch["token_ids"] and b["hidden_states"] == tail["hidden_states"]
    assert_close(tail["hidden_states"], ref[-1][n - 1])
    # transformers 5.19's own get_rope_index agrees up to the video's end and not after it (the release's rule
    # starts the text past the last temporal position, 2, not past the last spatial one, 1)
    import torch

    from tests.vlm_ref import load, qwen_vl_positions, video_frames

    model, processor = load(str(folder))
    grid = processor.video_processor(videos=[video_frames(path)[0]], return_tensors="pt")["video_grid_thw"]
    ids = torch.tensor([out["prompt_token_ids"] + ch["token_ids"]])
    types = processor.create_mm_token_type_ids(ids.tolist())
    theirs, _ = model.model.get_rope_index(
        ids, torch.tensor(types), video_grid_thw=grid, second_per_grid_ts=torch.tensor([1.0])
    )
    ours = qwen_vl_positions(types[0], grid.tolist(), [model.config.vision_config.tokens_per_second * 1.0], 2)
    assert (theirs[:, 0, : span["end"]].numpy() == ours[:, : span["end"]]).all()
    assert (theirs[:, 0, span["end"] :].numpy() == ours[:, span["end"] :] - 1).all()


@pytest.fixture(scope="module")
def embeds_engine(loop_thread):
    from hidden_states.vllm.engine import HiddenStatesEngine

    eng = loop_thread.run(HiddenStatesEngine.start(TEST_MODEL, enable_prompt_embeds=True, **TEST_ENGINE_ARGS))
    yield eng, loop_thread.run(eng.openai("tiny-llama", "r0"))
    eng.shutdown()


def test_prompt_embeds_with_vectors_are_exact_by_tail_and_by_extraction(embeds_engine, loop_thread):
    """transformers given the same inputs_embeds (then the completion's token embeddings) is the
    reference; the extraction step (a stop string) sends the embeddings then the completion's ids."""
    import torch
    from transformers import AutoModelForCausalLM

    from hidden_states.models.builtin import resolve_model

    eng, fe = embeds_engine
    E = torch.randn(9, eng.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.5
    buf = io.BytesIO()
    torch.save(E, buf)
    payload = base64.b64encode(buf.getvalue()).decode()

    async def complete(**fields):
        body = {
            "model": "tiny-llama",
            "prompt_embeds": payload,
            "max_tokens": 6,
            "temperature": 0,
            "return_token_ids": True,
            **fields,
        }
        (status, raw), *_ = [x async for x in fe.handle("completions", json.dumps(body).encode())]
        return status, json.loads(raw)

    outs = {
        name: loop_thread.run(complete(**fields))
        for name, fields in {
            "plain": {},
            "tail": {"return_hidden_states": True},
            "extraction": {"return_hidden_states": True, "stop": ["never in this text"]},
            "all": {"return_hidden_states": True, "hidden_states_position": "all"},
        }.items()
    }
    assert all(status == 200 for status, _ in outs.values()), outs
    tokens = outs["plain"][1]["choices"][0]["token_ids"]
    model = AutoModelForCausalLM.from_pretrained(resolve_model(TEST_MODEL), dtype=torch.float32).eval()
    with torch.no_grad():
        x = torch.cat([E, model.get_input_embeddings()(torch.tensor(tokens))])[None]
        ref = model(inputs_embeds=x, output_hidden_states=True).hidden_states[-1][0].numpy()
    for name in ("tail", "extraction"):
        ch = outs[name][1]["choices"][0]
        assert ch["token_ids"] == tokens and ch["hidden_states_meta"]["via"] == name, ch["hidden_states_meta"]
        assert_close(ch["hidden_states"], ref[-1])
    assert_close(outs["all"][1]["choices"][0]["hidden_states"], ref)


def wav_clip(seconds: float, freq: float, rate: int = 16000) -> tuple[bytes, np.ndarray]:
    """A 16-bit mono WAV tone and its samples as vLLM's decoder reads them (int16 / 32768)."""
    import wave

    t = np.arange(int(rate * seconds)) / rate
    noise = 0.05 * np.random.default_rng(int(freq)).standard_normal(t.size)
    pcm = (np.clip(0.5 * np.sin(2 * np.pi * freq * t) + noise, -1, 1) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue(), pcm.astype(np.float32) / 32768.0


@pytest.fixture(scope="module")
def audio_engine(loop_thread, media_dir):
    """The built-in tiny Qwen2-Audio (hidden_states/models/audio.py): one engine for the module."""
    from hidden_states.models.builtin import resolve_model
    from hidden_states.vllm.engine import HiddenStatesEngine

    folder = resolve_model("builtin:tiny-qwen2-audio")
    # A processor cache that holds one processed 1 s clip: a second clip evicts the first
    eng = loop_thread.run(
        HiddenStatesEngine.start(
            "builtin:tiny-qwen2-audio",
            allowed_local_media_path=str(media_dir),
            mm_processor_cache_gb=ONE_CLIP_GB,
            **{**ENGINE_ARGS, "limit_mm_per_prompt": {"audio": 1}},
        )
    )
    yield folder, eng, loop_thread.run(eng.openai("vlm", "r0"))
    eng.shutdown()


ONE_CLIP_GB = 300 / 1024**2  # 300 KiB: a processed 1 s clip is 204 KB (its features cropped to its length)


def encoded_clip(rate: int, fmt: str, seconds: float = 1.0, freq: float = 440.0) -> bytes:
    """A mono tone with noise, written by soundfile (libsndfile) as `fmt` (wav, flac or mp3) at `rate`."""
    import soundfile

    t = np.arange(int(rate * seconds)) / rate
    x = 0.5 * np.sin(2 * np.pi * freq * t) + 0.05 * np.random.default_rng(rate).standard_normal(t.size)
    buf = io.BytesIO()
    soundfile.write(
        buf,
        np.clip(x, -1, 1).astype(np.float32),
        rate,
        format=fmt.upper(),
        subtype={"wav": "PCM_16", "flac": "PCM_16", "mp3": "MPEG_LAYER_III"}[fmt],
    )
    return buf.getvalue()


def resampled_reference(data: bytes) -> np.ndarray:
    """The clip as the reference hears it: decoded by soundfile (float32, mono), resampled to 16 kHz by
    soxr (libsoxr, its default quality), independent of the server's code."""
    import soundfile
    import soxr

    y, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return soxr.resample(y.mean(axis=1), rate, 16000).astype(np.float32)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3"])
def test_audio_at_any_rate_and_format_is_transformers_on_the_resampled_clip(audio_engine, loop_thread, rate, fmt):
    """input_audio at 8, 22.05, 44.1 and 48 kHz as WAV, FLAC and mp3: the server resamples with soxr
    (ledger point 17) and every row equals transformers' on the same decoded, resampled samples."""
    from tests.vlm_ref import reference_audio_hidden_states

    folder, eng, fe = audio_engine
    data = encoded_clip(rate, fmt)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}},
                {"type": "text", "text": "What is this sound?"},
            ],
        }
    ]
    status, out = loop_thread.run(chat(fe, messages, return_hidden_states=True, hidden_states_position="all"))
    assert status == 200, out
    ch = out["choices"][0]
    (span,) = ch["hidden_states_meta"]["modalities"]
    assert span["modality"] == "audio" and span["end"] - span["start"] == 25, span  # 1 s at 16 kHz: 25 tokens
    ref = reference_audio_hidden_states(folder, out["prompt_token_ids"] + ch["token_ids"], [resampled_reference(data)])[
        -1
    ]
    assert_close(ch["hidden_states"], ref)


def test_audio_url_data_and_file_urls_are_the_same_clip(audio_engine, loop_thread, media_dir):
    """audio_url as a data URL and as a file: URL under allowed_local_media_path: the same rows as the
    same bytes sent as input_audio."""
    folder, eng, fe = audio_engine
    data = encoded_clip(44100, "flac", freq=660.0)
    (media_dir / "clip.flac").write_bytes(data)
    rows = {}
    for name, part in (
        (
            "input_audio",
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "flac"}},
        ),
        (
            "data url",
            {"type": "audio_url", "audio_url": {"url": "data:audio/flac;base64," + base64.b64encode(data).decode()}},
        ),
        ("file url", {"type": "audio_url", "audio_url": {"url": (media_dir / "clip.flac").as_uri()}}),
    ):
        status, out = loop_thread.run(
            chat(fe, [{"role": "user", "content": [part, {"type": "text", "text": "Hi"}]}], return_hidden_states=True)
        )
        assert status == 200, (name, out)
        rows[name] = out["choices"][0]["hidden_states"]
    assert rows["data url"] == rows["input_audio"] and rows["file url"] == rows["input_audio"]


def test_a_chat_with_audio_returns_its_rows_exact_and_the_extraction_step_hears_the_same_clip(
    audio_engine, loop_thread
):
    from tests.vlm_ref import reference_audio_hidden_states

    folder, eng, fe = audio_engine
    data, samples = wav_clip(1.0, 440)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}},
                {"type": "text", "text": "What is this sound?"},
            ],
        }
    ]
    status, out = loop_thread.run(chat(fe, messages, return_hidden_states=True, hidden_states_position="all"))
    assert status == 200, out
    ch = out["choices"][0]
    (span,) = ch["hidden_states_meta"]["modalities"]
    assert span["modality"] == "audio" and span["end"] - span["start"] == 25, span  # 1 s: 25 audio tokens
    ref = reference_audio_hidden_states(folder, out["prompt_token_ids"] + ch["token_ids"], [samples])[-1]
    assert_close(ch["hidden_states"], ref)
    tail = loop_thread.run(chat(fe, messages, return_hidden_states=True))[1]["choices"][0]
    before = loop_thread.run(eng.stats())
    extracted = loop_thread.run(chat(fe, messages, return_hidden_states=True, stop=["never in this text"]))[1]
    after = loop_thread.run(eng.stats())
    b = extracted["choices"][0]
    assert b["hidden_states_meta"]["via"] == "extraction" and b["token_ids"] == tail["token_ids"]
    assert b["hidden_states"] == tail["hidden_states"]
    assert sum(w["encoder_items"] for w in after["workers"]) - sum(w["encoder_items"] for w in before["workers"]) <= 1
    other, _ = wav_clip(1.0, 1234)
    messages[0]["content"][0]["input_audio"]["data"] = base64.b64encode(other).decode()
    assert (
        loop_thread.run(chat(fe, messages, return_hidden_states=True))[1]["choices"][0]["hidden_states"]
        != tail["hidden_states"]
    )


def test_an_item_evicted_from_the_processor_cache_is_sent_again_never_a_500(audio_engine, loop_thread):
    """The engine's processor cache holds one clip. A chat about clip A; the same chat again, whose A now
    travels as its hash alone (vLLM's frontend sent it before), with a stop string, so its final row
    comes from an extraction step; and just before that step, a chat about clip B, which evicts A from
    the engine core's cache (the step is entered through our own method, which runs B's chat first).
    The core refuses the step's hash; the step renders the messages again and sends A with its data:
    a 200, its vector the tail step's bit for bit, counted in `media_resent`."""
    folder, eng, fe = audio_engine

    def about_clip(freq: float) -> list[dict]:
        data = base64.b64encode(encoded_clip(16000, "wav", freq=freq)).decode()
        return [
            {
                "role": "user",
                "content": [
                    {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
                    {"type": "text", "text": "And this one?"},
                ],
            }
        ]

    status, tail = loop_thread.run(chat(fe, about_clip(300.0), return_hidden_states=True))
    assert status == 200 and tail["choices"][0]["hidden_states_meta"]["via"] == "tail", tail
    step = eng.extraction.extract_rows

    async def evict_first(*args, **kwargs):
        status, out = await chat(fe, about_clip(950.0), max_tokens=1)
        assert status == 200, out
        return await step(*args, **kwargs)

    before = loop_thread.run(eng.stats())["media_resent"]
    eng.extraction.extract_rows = evict_first
    try:
        status, out = loop_thread.run(
            chat(fe, about_clip(300.0), return_hidden_states=True, stop=["never in this text"])
        )
    finally:
        del eng.extraction.extract_rows
    assert status == 200, out
    ch = out["choices"][0]
    assert ch["hidden_states_meta"]["via"] == "extraction" and ch["token_ids"] == tail["choices"][0]["token_ids"]
    assert ch["hidden_states"] == tail["choices"][0]["hidden_states"]
    assert loop_thread.run(eng.stats())["media_resent"] == before + 1
