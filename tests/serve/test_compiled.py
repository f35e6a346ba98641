"""The compiled apps through Serve: TP = 2, n-gram speculative decoding and a LoRA adapter, each started
`enforce_eager: false` with the app arg `capture_layers: [0, 1]` (tests/serve/conftest.py COMPILED).

For each: /v1/models lists the static set; the replica's engine is compiled (on the CPU, vLLM runs a
LoRA engine's forward uncompiled: there the traced entries run eagerly, and that is asserted, not
hidden) with the set traced and no layer hook; rows at layers 0, 1 and -1 at every position of
prompt + completion, by the tail step and by the extraction step (a stop string), streamed and not,
equal transformers' (transformers + peft for the adapter) at relative 1e-5; and vLLM's and dynamo's
compile counts are the same after those requests as before. The same apps' heads and steering
tests (tests/serve/test_heads.py, test_steering.py) run on these compiled engines too.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai

from tests.conftest import Reference, cpu_only
from tests.serve.conftest import COMPILED, replica_stats, tiny_lora_modules

pytestmark = cpu_only  # the apps' shapes (two CPU ranks) are the CPU suite's; a GPU's: scripts/gpu-check.sh

LAYERS = [0, 1, -1]
HS = {
    "return_hidden_states": True,
    "return_token_ids": True,
    "hidden_states_layers": LAYERS,
    "hidden_states_position": "all",
    "hidden_states_encoding": "base64",
}


def _rows(reference, ids) -> dict[int, np.ndarray]:
    with reference.torch.no_grad():
        out = reference.model(reference.torch.tensor([list(ids)]), output_hidden_states=True)
    return {layer: out.hidden_states[layer][0].float().numpy() for layer in LAYERS}


def _assert_rows(choice: dict, reference, where: str) -> None:
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    refs = _rows(reference, ids)
    by_layer = choice["hidden_states_by_layer"]
    assert sorted(by_layer, key=int) == sorted(str(l) for l in LAYERS), (where, sorted(by_layer))
    for layer in LAYERS:
        got = np.frombuffer(base64.b64decode(by_layer[str(layer)]), "<f4").reshape(len(ids), -1)
        ref = refs[layer]
        diff, scale = float(np.abs(got - ref).max()), float(np.abs(ref).max())
        assert diff <= 1e-5 * scale, f"{where} layer {layer}: max abs error {diff:.3g} > 1e-5 x {scale:.3g}"


def _workers(base: str) -> list[dict]:
    return replica_stats(base)["replica"]["workers"]


def _check(base: str, reference, model: str = "tiny-llama", n: int = 1) -> None:
    card = httpx.get(f"{base}/v1/models", timeout=30).json()["data"]
    assert all(m["capture_layers"] == COMPILED["capture_layers"] for m in card), card
    stats = replica_stats(base)["replica"]
    assert stats["startup"]["enforce_eager"] is False, stats["startup"]
    workers = stats["workers"]
    assert all(w["capture_layers"] == [0, 1] for w in workers), workers
    before = [w["compilations"] for w in workers]

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
    prompt = "a b a b a b a b the compiled replica"
    whole = client.completions.create(
        model=model, prompt=prompt, max_tokens=10, n=n, temperature=0.8 if n > 1 else 0, seed=4, extra_body=HS
    )
    for ch in whole.choices:
        assert ch.model_extra["hidden_states_meta"]["via"] == "tail", ch.model_extra["hidden_states_meta"]
        _assert_rows(
            {"prompt_token_ids": whole.choices[0].prompt_token_ids, **ch.model_extra},
            reference,
            f"{base} choice {ch.index}",
        )

    # streamed: the rows of each chunk, concatenated, are the whole response's (greedy: the same tokens)
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=10, temperature=0, stream=True, extra_body=HS
    )
    got: dict = {"token_ids": [], "rows": {str(l): b"" for l in LAYERS}}
    for chunk in stream:
        for ch in chunk.choices:
            extra = ch.model_extra or {}
            got["token_ids"] += extra.get("token_ids") or []
            got.setdefault("prompt_token_ids", extra.get("prompt_token_ids"))
            for layer, value in (extra.get("hidden_states_by_layer") or {}).items():
                got["rows"][layer] += base64.b64decode(value)
    got["hidden_states_by_layer"] = {k: base64.b64encode(v).decode() for k, v in got["rows"].items()}
    _assert_rows(got, reference, f"{base} streamed")

    # a stop string: the final rows come from the extraction step (a prefill of prompt + completion)
    free = client.completions.create(model=model, prompt="Tell me about the cache", max_tokens=16, temperature=0)
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    cut = client.completions.create(
        model=model, prompt="Tell me about the cache", max_tokens=16, temperature=0, stop=[stop], extra_body=HS
    )
    (c,) = cut.choices
    assert c.finish_reason == "stop" and c.model_extra["hidden_states_meta"]["via"] == "extraction", c.model_extra
    _assert_rows({"prompt_token_ids": c.prompt_token_ids, **c.model_extra}, reference, f"{base} extraction")

    after = [w["compilations"] for w in _workers(base)]
    assert after == before, [{k: (b[k], a[k]) for k in b if b[k] != a.get(k)} for b, a in zip(before, after)]


def test_tensor_parallelism_compiled(tp2_app, reference):
    _check(tp2_app, reference, n=2)
    stats = replica_stats(tp2_app)["replica"]
    assert stats["startup"]["compilation_mode"] not in ("0", "None", "CompilationMode.NONE"), stats["startup"]
    # both ranks compiled their forward at start
    assert all(
        sum(
            w["compilations"].get(k, 0)
            for k in (
                "num_backend_compilations",
                "num_compiled_artifacts_loaded",
                "num_aot_compiles",
                "num_aot_artifacts_loaded",
            )
        )
        >= 1
        for w in stats["workers"]
    ), stats["workers"]


def test_speculative_decoding_compiled(spec_app, reference):
    _check(spec_app, reference)
    stats = replica_stats(spec_app)["replica"]
    assert stats["startup"]["compilation_mode"] not in ("0", "None", "CompilationMode.NONE"), stats["startup"]


def test_lora_adapter_on_the_compiled_app(lora_app, model_dir):
    adapter = tiny_lora_modules()[1]
    _check(lora_app, Reference(model_dir, adapter["path"]), model=adapter["name"])
    # vLLM's CPU platform turns compilation off for LoRA (platforms/cpu.py): the traced entries ran eagerly
    stats = replica_stats(lora_app)["replica"]
    assert stats["startup"]["compilation_mode"] in ("0", "None", "CompilationMode.NONE"), stats["startup"]
