"""The product as users meet it: real Ray Serve, real HTTP, the real openai client.

Every vector is checked against transformers on that choice's
prompt_token_ids + token_ids, which the server returns with return_token_ids.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import eager_only, long_text
from tests.serve.conftest import APP, decode_vector, replica_stats, router_ports

HS = {"return_hidden_states": True, "return_token_ids": True}


def test_completion_n2_float(client, reference):
    r = client.completions.create(
        model="tiny-llama",
        prompt="Hello! How are you today?",
        max_tokens=12,
        n=2,
        temperature=1.0,
        seed=11,
        extra_body=HS,
    )
    assert len(r.choices) == 2
    prompt_ids = r.choices[0].prompt_token_ids
    for ch in r.choices:
        assert isinstance(ch.hidden_states, list) and len(ch.hidden_states) == 128
        reference.assert_matches(prompt_ids + ch.token_ids, decode_vector(ch.hidden_states))


def test_completion_stream_base64_n2(client, reference):
    stream = client.completions.create(
        model="tiny-llama",
        prompt="The router sends every completion",
        max_tokens=10,
        n=2,
        temperature=1.0,
        seed=3,
        stream=True,
        extra_body={**HS, "hidden_states_encoding": "base64"},
    )
    tokens, vectors, prompt_ids = {0: [], 1: []}, {}, None
    for chunk in stream:
        for ch in chunk.choices:
            extra = ch.model_extra or {}
            if extra.get("prompt_token_ids"):
                prompt_ids = extra["prompt_token_ids"]
            tokens[ch.index] += extra.get("token_ids") or []
            if ch.finish_reason is not None:
                vectors[ch.index] = extra["hidden_states"]
            else:
                assert "hidden_states" not in extra
    assert set(vectors) == {0, 1} and prompt_ids
    for i, v in vectors.items():
        assert isinstance(v, str)
        reference.assert_matches(prompt_ids + tokens[i], decode_vector(v))


def test_chat_n2_and_base64_equals_float(client, reference):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    f = client.chat.completions.create(
        model="tiny-llama", messages=msgs, max_tokens=8, n=2, temperature=1.0, seed=9, extra_body=HS
    )
    b = client.chat.completions.create(
        model="tiny-llama",
        messages=msgs,
        max_tokens=8,
        n=2,
        temperature=1.0,
        seed=9,
        extra_body={**HS, "hidden_states_encoding": "base64"},
    )
    prompt_ids = f.prompt_token_ids
    for fc, bc in zip(f.choices, b.choices):
        fv, bv = decode_vector(fc.hidden_states), decode_vector(bc.hidden_states)
        assert np.array_equal(fv, bv)  # the same float32 bits either way
        reference.assert_matches(prompt_ids + fc.token_ids, fv)


def test_chat_stream(client, reference):
    stream = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=10,
        stream=True,
        extra_body=HS,
    )
    tokens, vector, prompt_ids, finals = [], None, None, 0
    for chunk in stream:
        extra = chunk.model_extra or {}
        if extra.get("prompt_token_ids"):
            prompt_ids = extra["prompt_token_ids"]
        for ch in chunk.choices:
            tokens += (ch.model_extra or {}).get("token_ids") or []
            if ch.finish_reason is not None:
                finals += 1
                vector = ch.model_extra["hidden_states"]
    assert finals == 1 and prompt_ids
    reference.assert_matches(prompt_ids + tokens, decode_vector(vector))


def test_prompt_list_token_ids_stop_seed_logprobs(client, reference):
    ids = reference.tokenizer("Numbers: 0 1 2 3")["input_ids"]
    r = client.completions.create(
        model="tiny-llama",
        prompt=["The cache", "A user reads"],
        max_tokens=10,
        n=2,
        temperature=0.8,
        seed=5,
        logprobs=2,
        extra_body=HS,
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.logprobs is not None for c in r.choices)
    by_prompt = {}
    for c in r.choices:
        by_prompt.setdefault(c.index // 2, c.prompt_token_ids)
        reference.assert_matches(c.prompt_token_ids + c.token_ids, decode_vector(c.hidden_states))
    assert by_prompt[0] != by_prompt[1]
    r2 = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=16, stop=["e"], extra_body=HS)
    (c,) = r2.choices
    assert c.prompt_token_ids == ids
    reference.assert_matches(ids + c.token_ids, decode_vector(c.hidden_states))


def test_without_the_flag_no_vectors(client):
    r = client.completions.create(model="tiny-llama", prompt="Hello!", max_tokens=4)
    assert "hidden_states" not in (r.choices[0].model_extra or {})


def test_switch_off_is_400_and_no_engine_work(off_app):
    off = openai.OpenAI(base_url=f"{off_app}/v1", api_key="unused", timeout=60, max_retries=0)
    before = replica_stats(off_app)["replica"]["requests"]
    with pytest.raises(openai.BadRequestError) as e:
        off.completions.create(
            model="tiny-llama", prompt="Hello!", max_tokens=4, extra_body={"return_hidden_states": True}
        )
    assert e.value.status_code == 400
    body = e.value.response.json()
    assert (
        "enable_return_hidden_states" in body["error"]["message"] and body["error"]["param"] == "return_hidden_states"
    )
    assert replica_stats(off_app)["replica"]["requests"] == before
    # The same server still serves plain completions.
    assert off.completions.create(model="tiny-llama", prompt="Hello!", max_tokens=4).choices[0].text is not None


def test_two_replicas_vectors_are_local_and_one_token(serve_app, reference):
    def one(i: int):
        r = httpx.post(
            f"{serve_app}/v1/completions",
            timeout=300,
            json={
                "model": "tiny-llama",
                "prompt": long_text(250, seed=100 + i),
                "max_tokens": 16,
                **HS,
            },
        )
        assert r.status_code == 200, r.text
        return r.headers["x-replica-id"], r.json()

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    replicas = set()
    for replica, body in results:
        (c,) = body["choices"]
        meta = c["hidden_states_meta"]
        total = len(c["prompt_token_ids"]) + len(c["token_ids"])
        assert meta["replica"] == replica  # extraction ran where the choice was generated
        assert meta["tokens"] == total
        # the tail step on that replica's engine: one position computed, the final token
        assert meta["via"] == "tail" and meta["computed_tokens"] == 1 and meta["cached_tokens"] == total - 1, meta
        assert 0 <= meta["extraction_seconds"] < 60, meta
        replicas.add(replica)
        reference.assert_matches(c["prompt_token_ids"] + c["token_ids"], decode_vector(c["hidden_states"]))
    assert len(replicas) == 2, f"expected both replicas to serve, saw {replicas}"


@eager_only  # it asks for layer 1 too
def test_handle_from_second_driver_matches_http(serve_app, ray_cluster, reference):
    prompt = "A verifier reads the hidden state"
    messages = [{"role": "user", "content": "Which vector does a verifier read?"}]
    http = httpx.post(
        f"{serve_app}/v1/completions",
        timeout=120,
        json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 10, "temperature": 0, **HS},
    ).json()["choices"][0]
    chat = httpx.post(
        f"{serve_app}/v1/chat/completions",
        timeout=120,
        json={"model": "tiny-llama", "messages": messages, "max_tokens": 10, "temperature": 0, **HS},
    ).json()
    script = textwrap.dedent(f"""
        import json, ray
        from ray import serve
        from deployments.client import complete
        ray.init(address={ray_cluster!r}, namespace="serve", logging_level="ERROR")
        handle = serve.get_app_handle({APP!r})
        result = complete(handle, {prompt!r}, max_tokens=10, temperature=0.0)
        ch = result.choices[0]
        layered = complete(handle, {prompt!r}, max_tokens=10, temperature=0.0, hidden_states_layers=[1, -1])
        chat = complete(handle, messages={messages!r}, max_tokens=10)  # greedy: the handle's default
        print("RESULT" + json.dumps({{"token_ids": list(ch.token_ids), "prompt": list(result.prompt_token_ids),
              "vector": ch.hidden_states.tolist(), "dtype": str(ch.hidden_states.dtype),
              "layer1": layered.choices[0].hidden_states_by_layer[1].tolist(),
              "chat_prompt": list(chat.prompt_token_ids), "chat_ids": list(chat.choices[0].token_ids),
              "chat_text": chat.choices[0].text, "chat_vector": chat.choices[0].hidden_states.tolist()}}))
    """)
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, out.stdout[-2000:] + out.stderr[-3000:]
    got = json.loads(line[0][6:])
    assert got["dtype"] == "float32"
    assert got["token_ids"] == http["token_ids"] and got["prompt"] == http["prompt_token_ids"]
    assert np.array_equal(np.asarray(got["vector"], np.float32), decode_vector(http["hidden_states"]))
    reference.assert_matches(got["prompt"] + got["token_ids"], got["vector"])
    reference.assert_matches(got["prompt"] + got["token_ids"], got["layer1"], layer=1)
    # chat messages over the handle: the chat template as over HTTP, the same answer and vector
    (c,) = chat["choices"]
    assert got["chat_prompt"] == chat["prompt_token_ids"] and got["chat_ids"] == c["token_ids"]
    assert got["chat_text"] == c["message"]["content"]
    assert np.array_equal(np.asarray(got["chat_vector"], np.float32), decode_vector(c["hidden_states"]))
    reference.assert_matches(got["chat_prompt"] + got["chat_ids"], got["chat_vector"])


def test_each_request_s_fields_are_parsed_once_where_it_is_first_read(serve_app, client):
    """The Router parses a request's hidden-states fields (params.parse_fields) and the engine
    replicas take that spec as it was parsed: over HTTP, streamed or not, with or without
    hidden states, refused, and from a Python handle, each request is parsed exactly once, in a
    Router, and never in a replica (counted in each process: /debug/stats' `specs_parsed`)."""
    from ray import serve

    from deployments.client import complete
    from tests.serve.test_lifecycle import engine_replicas

    def counts():
        routers = sum(replica_stats(f"http://127.0.0.1:{p}")["ingress"]["specs_parsed"] for p in router_ports())
        return routers, {rid: s["specs_parsed"] for rid, s in engine_replicas().items()}

    routers, replicas = counts()
    client.completions.create(model="tiny-llama", prompt="one", max_tokens=3, extra_body={**HS, "n": 2})
    list(
        client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "two"}], max_tokens=3, stream=True, extra_body=HS
        )
    )
    client.completions.create(model="tiny-llama", prompt="three", max_tokens=3)
    bad = httpx.post(
        f"{serve_app}/v1/completions",
        timeout=60,
        json={"model": "tiny-llama", "prompt": "four", **HS, "hidden_states_position": "middle"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "hidden_states_position"
    assert complete(serve.get_app_handle(APP), "five", max_tokens=3).choices[0].hidden_states is not None
    routers_after, replicas_after = counts()
    assert routers_after - routers == 5, (routers, routers_after)
    assert replicas_after == replicas, (replicas, replicas_after)


def test_router_own_port_serves_the_same_api(serve_app, reference):
    """Direct ingress (on, as `make serve` runs): the Router replica's own port takes the same
    requests as Serve's proxy, vectors included, with no proxy hop."""
    ports = router_ports()
    assert ports, "no Router replica answers on its own port"
    own = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[0]}/v1", api_key="unused", timeout=120, max_retries=0)
    r = own.completions.create(model="tiny-llama", prompt=long_text(30, seed=21), max_tokens=9, extra_body=HS)
    (c,) = r.choices
    reference.assert_matches(c.prompt_token_ids + c.token_ids, c.hidden_states)
    assert c.hidden_states_meta["via"] == "tail" and c.hidden_states_meta["computed_tokens"] == 1
    models = httpx.get(f"http://127.0.0.1:{ports[0]}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]


def test_conventions_users_bring(serve_app, client, reference):
    """OpenAI's encoding_format, vLLM's /tokenize and /detokenize, and max_model_len on /v1/models."""
    r = client.completions.create(
        model="tiny-llama", prompt="The alias", max_tokens=4, extra_body={**HS, "encoding_format": "base64"}
    )
    (c,) = r.choices
    assert isinstance(c.hidden_states, str)  # base64, as hidden_states_encoding would give
    reference.assert_matches(c.prompt_token_ids + c.token_ids, decode_vector(c.hidden_states))
    tok = httpx.post(f"{serve_app}/tokenize", timeout=60, json={"model": "tiny-llama", "prompt": "The alias"}).json()
    assert tok["tokens"] == c.prompt_token_ids and tok["count"] == len(c.prompt_token_ids), tok
    assert tok["max_model_len"] == 4096
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=2, extra_body=HS)
    tok = httpx.post(f"{serve_app}/tokenize", timeout=60, json={"model": "tiny-llama", "messages": messages}).json()
    assert tok["tokens"] == chat.prompt_token_ids, tok
    text = httpx.post(f"{serve_app}/detokenize", timeout=60, json={"model": "tiny-llama", "tokens": c.prompt_token_ids})
    assert text.status_code == 200 and text.json()["prompt"].endswith("The alias"), text.text
    bad = httpx.post(f"{serve_app}/detokenize", timeout=60, json={"model": "tiny-llama", "tokens": "nope"})
    assert bad.status_code == 400, bad.text
    models = httpx.get(f"{serve_app}/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny-llama", 4096)]


def test_router_left_nothing_pending(serve_app, client):
    client.completions.create(model="tiny-llama", prompt="flush", max_tokens=2)
    stats = replica_stats(serve_app)
    assert stats["ingress"]["pending"] == 0 and stats["ingress"]["failed"] == 0, stats
    assert stats["replica"]["pending"] == 0 and stats["replica"]["malformed_vectors"] == 0


@eager_only
def test_layers_over_http(client, reference):
    r = client.completions.create(
        model="tiny-llama",
        prompt="The probe reads a layer",
        max_tokens=6,
        extra_body={**HS, "hidden_states_layers": [0, 1, -1], "hidden_states_encoding": "base64"},
    )
    c = r.choices[0]
    by_layer = c.model_extra["hidden_states_by_layer"]
    assert sorted(by_layer) == ["-1", "0", "1"] and "hidden_states" not in c.model_extra
    for layer, vec in by_layer.items():
        reference.assert_matches(c.prompt_token_ids + c.token_ids, decode_vector(vec), layer=int(layer))


def test_prompt_end_over_http_runs_no_extraction(client, reference):
    r = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=6,
        extra_body={**HS, "hidden_states_position": "prompt_end"},
    )
    c = r.choices[0]
    meta = c.model_extra["hidden_states_meta"]
    assert meta["position"] == "prompt_end" and "cached_tokens" not in meta  # no extraction step ran
    reference.assert_matches(r.prompt_token_ids, decode_vector(c.hidden_states))


def test_bad_layer_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model="tiny-llama", prompt="x", max_tokens=2, extra_body={**HS, "hidden_states_layers": [99]}
        )
    assert "out of range" in e.value.response.json()["error"]["message"]
