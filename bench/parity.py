"""Byte parity of responses across two trees of this project: one corpus of requests, every field and
route, sent one at a time to vLLM's OpenAI serving with this server's vectors (the replica's
`engine.openai(...).handle`, what HTTP and handles serve), each response recorded normalised.

    python -m bench.parity record OUT.jsonl [--requests 1000]   # with this tree
    python -m bench.parity compare A.jsonl B.jsonl              # exit 1 on any difference

Run `record` in each tree (e.g. a `git worktree` of main, with its own source first on the path) and
`compare` the two files. Normalised: response ids (`cmpl-...`, `chatcmpl-...`), `created` timestamps,
`extraction_seconds` (a time). A stream is compared per choice (`canonical`): its text, token ids and
logprobs merged, its rows by position, and its finishing event; where vLLM cuts its chunks and how it
interleaves the choices of n > 1 vary between two identical requests. A whole response is compared as sent.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import random
import re
import sys
from collections import Counter
from typing import Any

PROMPTS = [
    "The replica computes the hidden state",
    "Tell me about the cache.",
    "A verifier checks the vector of",
    "Once upon a time",
    "Sparse autoencoders read features from",
    "The capital of France is",
    "1, 2, 3, 4,",
    "Probes trained on activations",
]
POSITIONS = ["completion_end", "prompt_end", "completion", "all", {"start": 2, "end": -1}, {"start": -3, "stride": 2}]
REFUSED = [  # each a 400 naming the field
    {"return_hidden_states": True, "hidden_states_layers": [99]},
    {"return_hidden_states": True, "hidden_states_foo": 1},
    {"return_hidden_states": True, "hidden_states_topk": 0},
    {"return_hidden_states": True, "hidden_states_dtype": "int8"},
    {"hidden_states_heads": ["nope"]},
]
ENGINE_ARGS = dict(
    dtype="float32",
    enforce_eager=True,
    kv_cache_memory_bytes=128 * 2**20,
    max_model_len=4096,
    max_num_batched_tokens=256,
    max_num_seqs=64,
)


def corpus(count: int, seed: int = 0) -> list[dict]:
    """`count` requests: {route, stream, body}, the same for the same seed on every tree."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        route = rng.choices(["completions", "chat", "hidden_states"], [45, 45, 10])[0]
        prompt = rng.choice(PROMPTS)
        if route == "hidden_states":
            if rng.random() < 0.5:
                body = {"messages": [{"role": "user", "content": prompt}], "completion": rng.sample(range(5, 500), 4)}
            else:
                body = {"prompt": prompt}
            if rng.random() < 0.5:
                body["hidden_states_layers"] = rng.choice([[-1], [0, -1], [1]])
            if rng.random() < 0.3:
                body["hidden_states_position"] = rng.choice(POSITIONS)
            out.append({"route": route, "stream": False, "body": body})
            continue
        body: dict[str, Any] = {"model": "tiny-llama", "max_tokens": rng.randint(1, 10)}
        if route == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if rng.random() < 0.4:
            body.update(temperature=0.9, seed=rng.randint(0, 99), top_p=0.9)
            if rng.random() < 0.5:
                body["n"] = 2
        else:
            body["temperature"] = 0
        if rng.random() < 0.3:
            body["logprobs"] = 2 if route == "completions" else True
            if route == "chat":
                body["top_logprobs"] = 2
        if rng.random() < 0.2:
            body["stop"] = [" the"]
        if rng.random() < 0.5:
            body["return_token_ids"] = True
        stream = rng.random() < 0.35
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        kind = rng.random()
        if kind < 0.55:  # rows
            body["return_hidden_states"] = True
            if rng.random() < 0.5:
                body["hidden_states_layers"] = rng.choice([[-1], [0, -1], [1, -1], [0, 1, 2]])
            if rng.random() < 0.5:
                body["hidden_states_position"] = rng.choice(POSITIONS)
            if rng.random() < 0.3:
                body["hidden_states_dtype"] = rng.choice(["float16", "bfloat16"])
            if rng.random() < 0.4:
                body["hidden_states_encoding"] = "base64"
            if rng.random() < 0.15:
                body["hidden_states_topk"] = rng.choice([1, 8])
        elif kind < 0.65:  # heads (and stop conditions on them)
            body["hidden_states_heads"] = rng.choice([["probe"], [{"name": "sae-topk", "topk": 4}, "probe"]])
            body["hidden_states_position"] = rng.choice(["completion_end", "completion"])
            if rng.random() < 0.5:
                body["hidden_states_stop"] = [{"head": "probe", "label": "pos", "above": rng.choice([0.3, 0.34])}]
        elif kind < 0.72:  # steering
            entry = {"layer": rng.choice([0, 1]), "vector": [0.05 * ((j % 7) - 3) for j in range(128)], "scale": 2.0}
            if rng.random() < 0.3:
                entry = {"layer": 1, "head": "sae-std", "feature": 3, "op": "clamp", "value": 0.0}
            body["hidden_states_steering"] = [entry]
            body["return_hidden_states"] = rng.random() < 0.5
        elif kind < 0.77:  # proofs
            body["hidden_states_proof"] = {"scheme": "toploc"}
        elif kind < 0.85:  # refused: each a 400 naming the field
            body.update(rng.choice(REFUSED))
        out.append({"route": route, "stream": stream, "body": {**body, "stream": True} if stream else body})
    return out


_ID = re.compile(rb'"id": ?"[^"]*"')
_CREATED = re.compile(rb'"created": ?\d+')
_SECONDS = re.compile(rb'"extraction_seconds": ?[0-9.e-]+')


def normalised(data: bytes) -> bytes:
    data = _ID.sub(b'"id":"-"', data)
    data = _CREATED.sub(b'"created":0', data)
    return _SECONDS.sub(b'"extraction_seconds":0', data)


def stream_events(chunks: list[bytes]) -> list[Any]:
    """A stream's events in order, as JSON (chunk boundaries dropped), choices' deltas merged per choice:
    the text, token ids and logprobs each choice got, and every event that carries vectors or usage."""
    text = b"".join(chunks).decode()
    events = [e[len("data: ") :] for e in text.split("\n\n") if e.startswith("data: ")]
    merged: dict[int, dict] = {}
    other = []
    for e in events:
        if e == "[DONE]":
            other.append(e)
            continue
        obj = json.loads(normalised(e.encode()))
        rest = []
        for ch in obj.get("choices", []):
            acc = merged.setdefault(ch.get("index", 0), {"text": "", "token_ids": [], "logprobs": []})
            delta = ch.get("delta") or {}
            acc["text"] += ch.get("text") or delta.get("content") or ""
            acc["token_ids"] += ch.get("token_ids") or []
            if ch.get("prompt_token_ids") is not None:  # on the choice's first chunk, whichever that is
                acc["prompt_token_ids"] = ch["prompt_token_ids"]
            if ch.get("logprobs"):
                acc["logprobs"].append(ch["logprobs"])
            if ch.get("finish_reason") is not None or any(k.startswith("hidden_states") for k in ch):
                rest.append(ch)
        if rest or obj.get("usage"):
            other.append({**obj, "choices": rest})
    return [{str(k): v for k, v in sorted(merged.items())}, other]


async def record(path: str, count: int) -> None:
    from hidden_states.vllm.engine import HiddenStatesEngine
    from tests.heads_ref import build_test_heads

    engine = await HiddenStatesEngine.start("builtin:tiny-llama", heads=build_test_heads(), **ENGINE_ARGS)
    try:
        frontend = await engine.openai("tiny-llama", "parity")
        with open(path, "w") as f:
            for k, req in enumerate(corpus(count)):
                parts = [x async for x in frontend.handle(req["route"], json.dumps(req["body"]).encode())]
                (status, first), rest = parts[0], parts[1:]
                if req["stream"] and status == 200 and not first:
                    got: Any = stream_events(rest)
                else:
                    got = normalised(first).decode()
                line = {"k": k, "status": status, "response": got}
                line["sha256"] = hashlib.sha256(json.dumps(line, sort_keys=True).encode()).hexdigest()
                f.write(json.dumps({**line, "request": req}) + "\n")
                if k % 100 == 0:
                    print(f"{k}/{count}", file=sys.stderr, flush=True)
    finally:
        engine.shutdown()


_DELTA = frozenset({"delta", "text", "token_ids", "logprobs", "prompt_token_ids"})  # merged per choice by stream_events
_ROWS = ("hidden_states", "hidden_states_by_layer", "hidden_states_heads")  # a streamed choice's rows
_CUT = ("positions", "shape", "bytes", "head_bytes")  # what a chunk's share of the rows decides


def _split(value: Any, n: int) -> list:
    """One chunk's field of `n` positions, position by position (base64: its bytes cut in n)."""
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        raw = base64.b64decode(value)
        step = len(raw) // n
        return [raw[i * step : (i + 1) * step].hex() for i in range(n)]
    if isinstance(value, dict) and set(value) == {"indices", "values"}:
        return [{"indices": i, "values": v} for i, v in zip(_split(value["indices"], n), _split(value["values"], n))]
    per_key = {k: _split(v, n) for k, v in value.items()}
    return [{k: items[i] for k, items in per_key.items()} for i in range(n)]


def _by_position(events: list[dict]) -> tuple[dict, list]:
    """A streamed choice's rows by position, whichever chunk carried them, and its events without them."""
    rows: dict[str, dict] = {}
    rest = []
    for ch in events:
        meta = ch.get("hidden_states_meta") or {}
        positions = meta.get("positions")
        if positions is None:
            rest.append(ch)
            continue
        for field in _ROWS:
            if field in ch:
                for p, item in zip(positions, _split(ch[field], len(positions))):
                    rows.setdefault(str(p), {})[field] = item
        if ch.get("finish_reason") is not None:  # (the chunks before it: how many, a matter of timing)
            kept = {k: v for k, v in ch.items() if k not in _ROWS}
            kept["hidden_states_meta"] = {k: v for k, v in meta.items() if k not in _CUT}
            rest.append(kept)
    return rows, rest


def canonical(response: Any) -> Any:
    """A stream per choice: its merged text, token ids, logprobs and prompt token ids, then its vector-carrying
    events in order (how vLLM interleaves the choices of n > 1, and which chunk carries which token, vary between
    identical requests); the usage and [DONE] events in order. A whole response as it is."""
    if not isinstance(response, list):
        return response
    merged, events = response
    merged = {i: {**acc, "logprobs": _joined(acc.get("logprobs") or [])} for i, acc in merged.items()}
    per_choice: dict[str, list] = {}
    rest = []
    for e in events:
        if not isinstance(e, dict):
            rest.append(e)
            continue
        for ch in e.get("choices", []):
            per_choice.setdefault(str(ch.get("index", 0)), []).append({k: v for k, v in ch.items() if k not in _DELTA})
        if e.get("usage"):
            rest.append({k: v for k, v in e.items() if k != "choices"})
    return {
        "merged": merged,
        "choices": {k: _by_position(v) for k, v in sorted(per_choice.items())},
        "events": rest,
    }


def _joined(chunks: list) -> dict:
    """A choice's logprobs over its chunks as one: each field's list joined (completions: text_offset,
    token_logprobs, tokens, top_logprobs; chat: content), however vLLM cut the chunks."""
    out: dict = {}
    for lp in chunks:
        for k, v in (lp or {}).items():
            out.setdefault(k, []).extend(v if isinstance(v, list) else [v])
    return out


def compare(a: str, b: str) -> int:
    """Prints each request whose response differs (status, then the first 300 characters of each)."""
    left = [json.loads(x) for x in open(a)]
    right = [json.loads(x) for x in open(b)]
    if len(left) != len(right) or any(x["request"] != y["request"] for x, y in zip(left, right)):
        print("the two files hold different corpora")
        return 2
    differ = [
        (x, y)
        for x, y in zip(left, right)
        if x["sha256"] != y["sha256"]
        and (x["status"], canonical(x["response"])) != (y["status"], canonical(y["response"]))
    ]
    statuses = Counter(x["status"] for x in left)
    for x, y in differ[:20]:
        where = f"request {x['k']} ({x['request']['route']}, stream={x['request']['stream']})"
        print(f"{where}: {x['status']} vs {y['status']}")
        print("  A:", json.dumps(x["response"])[:300])
        print("  B:", json.dumps(y["response"])[:300])
    print(f"{len(left)} requests (statuses {dict(sorted(statuses.items()))}): {len(differ)} differ")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.parity", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out")
    r.add_argument("--requests", type=int, default=1000)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args(argv)
    if args.cmd == "record":
        asyncio.run(record(args.out, args.requests))
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
