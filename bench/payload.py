"""Part 3, payload: one choice's vector in a response, float list against base64.

Built as the server builds it (hidden_states.openai_format: `encode_vector`, then
`json.dumps(payload, separators=(",", ":")).encode()`), parsed as a client
would (`json.loads`, then numpy float32). No server needed.
"""

from __future__ import annotations

import base64
import json
import time

import numpy as np

from hidden_states.openai_format import encode_vector


def _response(vec_value, dim: int) -> dict:
    # the shape of vLLM's CompletionResponse.model_dump() with one choice, plus our two fields
    return {
        "id": "cmpl-0123456789abcdef0123456789abcdef",
        "object": "text_completion",
        "created": 1790000000,
        "model": "bench-model",
        "choices": [
            {
                "index": 0,
                "text": " generated text of a typical completion",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "hidden_states": vec_value,
                "hidden_states_meta": {"tokens": 1024, "cached_tokens": 1024 - dim % 97, "replica": "abcd1234"},
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {"prompt_tokens": 900, "total_tokens": 1024, "completion_tokens": 124, "prompt_tokens_details": None},
        "kv_transfer_params": None,
    }


def build(vec: np.ndarray, encoding: str) -> bytes:
    return json.dumps(_response(encode_vector(vec, encoding), vec.shape[0]), separators=(",", ":")).encode()


def parse(raw: bytes) -> np.ndarray:
    value = json.loads(raw)["choices"][0]["hidden_states"]
    if isinstance(value, str):
        return np.frombuffer(base64.b64decode(value), dtype="<f4")
    return np.asarray(value, dtype=np.float32)


def _time(fn, min_time: float) -> float:
    """Median seconds per call over repeats of at least min_time/5 each."""
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if dt >= min_time / 5:
            break
        n *= 2
    samples = [dt / n]
    for _ in range(4):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return float(np.median(samples))


def run(dims=(4096, 8192), min_time: float = 1.0, on_step=None) -> dict:
    out = {}
    rng = np.random.default_rng(0)
    for dim in dims:
        vec = rng.standard_normal(dim).astype(np.float32)
        row = {"dim": dim, "raw_float32_bytes": 4 * dim}
        for enc in ("float", "base64"):
            raw = build(vec, enc)
            back = parse(raw)
            assert back.dtype == np.float32 and np.array_equal(back, vec), f"{enc} did not round-trip exactly"
            value_bytes = len(json.dumps(encode_vector(vec, enc), separators=(",", ":")))
            t_build = _time(lambda vec=vec, enc=enc: build(vec, enc), min_time)
            t_parse = _time(lambda raw=raw: parse(raw), min_time)
            row[enc] = {
                "vector_bytes": value_bytes,
                "response_bytes": len(raw),
                "build_ms": t_build * 1e3,
                "parse_ms": t_parse * 1e3,
                "total_ms": (t_build + t_parse) * 1e3,
            }
            if on_step:
                on_step()
        row["speedup_base64"] = row["float"]["total_ms"] / row["base64"]["total_ms"]
        row["size_ratio_float_over_base64"] = row["float"]["vector_bytes"] / row["base64"]["vector_bytes"]
        out[str(dim)] = row
    return out
