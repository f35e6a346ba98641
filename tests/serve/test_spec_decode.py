"""The real app with n-gram speculative decoding (`engine: {speculative_config: ...}`), one replica.

Over HTTP with the openai client, at batch 8: completions and chat, streamed and not, the
final-token vector and every row across the completion, each checked against transformers on
the choice's own tokens; every vector from the tail step (one position computed); the same
requests without hidden states give the same text, tokens and finishes; and vLLM's own counters,
scraped from Ray's metrics endpoint, show drafts proposed and accepted while they ran.
(tests/engine/test_spec_decode.py checks the engine, under a draft model too.)
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

from tests.serve.conftest import decode_vector, replica_stats
from tests.serve.test_metrics import family, scrape

MODEL = "tiny-llama"
HS = {"return_hidden_states": True, "return_token_ids": True}
PROMPTS = [
    "The replica computes the hidden state",
    "a b a b a b a b",
    "one two three one two three one",
    "Hello! How are you today?",
    "Code: def add(a, b):",
    "The cache keeps the cache keeps the",
    "What is the capital of France?",
    "the the the the",
]


@pytest.fixture
def spec_client(spec_app):
    return openai.OpenAI(base_url=f"{spec_app}/v1", api_key="unused", timeout=120, max_retries=0)


def _rows(reference, ids) -> np.ndarray:
    torch = reference.torch
    with torch.no_grad():
        return reference.model(torch.tensor([list(ids)]), output_hidden_states=True).hidden_states[-1][0].numpy()


def _one(client, i: int, prompt: str, hs: bool, stream: bool):
    """Request i (chat when i % 3 == 0; rows across the completion when i % 2) -> what came back,
    a stream's chunks put together (rows concatenated by position)."""
    rows = hs and i % 2 == 1
    body = {"return_token_ids": True}
    if hs:
        body.update(return_hidden_states=True, hidden_states_encoding="float" if rows else "base64")
        if rows:
            body["hidden_states_position"] = "completion"
    kw = dict(model=MODEL, max_tokens=12 + 2 * i, temperature=0, stream=stream, extra_body=body)
    chat = i % 3 == 0
    if chat:
        r = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
    else:
        r = client.completions.create(prompt=prompt, **kw)
    got = {
        "text": "",
        "finish": None,
        "prompt": None,
        "tokens": [],
        "vector": None,
        "meta": {},
        "positions": [],
        "rows": [],
    }
    chunks = [r] if not stream else r
    for chunk in chunks:
        got["prompt"] = (
            got["prompt"]
            or getattr(chunk, "prompt_token_ids", None)
            or (chunk.model_extra or {}).get("prompt_token_ids")
        )
        for ch in chunk.choices:
            e = ch.model_extra or {}
            got["prompt"] = got["prompt"] or e.get("prompt_token_ids")
            if stream:
                got["text"] += (ch.delta.content or "") if chat else (ch.text or "")
            else:
                got["text"] = ch.message.content if chat else ch.text
            got["tokens"] += e.get("token_ids") or []
            got["finish"] = ch.finish_reason or got["finish"]
            if e.get("hidden_states") is not None:
                meta = e["hidden_states_meta"]
                got["meta"].update(meta)
                if rows:
                    got["positions"] += meta["positions"]
                    got["rows"] += e["hidden_states"]
                else:
                    got["vector"] = e["hidden_states"]
    return got


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_vectors_exact_under_ngram_speculative_decoding(spec_app, spec_client, reference, stream):
    before = _settled_counts()  # tests before this one on the app may still be exporting theirs
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        flagged = list(pool.map(lambda a: _one(spec_client, *a, True, stream), enumerate(PROMPTS)))
        plain = list(pool.map(lambda a: _one(spec_client, *a, False, stream), enumerate(PROMPTS)))
    for i, (f, p) in enumerate(zip(flagged, plain)):
        assert (f["text"], f["tokens"], f["finish"]) == (p["text"], p["tokens"], p["finish"]), i
        ids = list(f["prompt"]) + list(f["tokens"])
        ref = _rows(reference, ids)
        meta = f["meta"]
        assert meta["via"] == "tail" and meta["computed_tokens"] == 1, meta
        if i % 2:  # every row across the completion: positions P..T-1, nothing rejected, nothing past a stop
            P = len(f["prompt"])
            assert f["positions"] == list(range(P, len(ids))), (i, f["positions"], P, len(ids))
            got, want = np.asarray(f["rows"], np.float32), ref[P:]
        else:
            got, want = decode_vector(f["vector"]), ref[-1]
        err, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
        assert err <= 1e-5 * scale + 1e-6, (i, err, scale)
    stats = replica_stats(spec_app)["replica"]
    assert stats["pending"] == 0 and stats["missing_vectors"] == 0, stats
    # Speculative decoding ran: vLLM's counters moved (Ray exports them every few seconds).
    deadline, after = time.monotonic() + 60, before
    while time.monotonic() < deadline and not after[1] > before[1]:
        time.sleep(3)
        after = _spec_counts()
    after = _settled_counts()  # both counters from one export, not one each side of it
    drafted, accepted = after[0] - before[0], after[1] - before[1]
    assert accepted > 0 and drafted >= accepted, (drafted, accepted)
    print(
        f"\nn-gram through Serve ({'stream' if stream else 'whole'}): {accepted:.0f} of {drafted:.0f} "
        "draft tokens accepted"
    )


def _spec_counts() -> tuple[float, float]:
    """vLLM's draft tokens proposed and accepted, as Ray's metrics endpoint exports them."""
    sums = scrape()
    return (
        family(sums, "ray_vllm_spec_decode_num_draft_tokens"),
        family(sums, "ray_vllm_spec_decode_num_accepted_tokens"),
    )


def _settled_counts(timeout_s: float = 60.0) -> tuple[float, float]:
    """_spec_counts once two scrapes a few seconds apart agree: Ray exports the two counters on its own
    schedule, so a scrape between their exports pairs a new count with an old one."""
    last, deadline = _spec_counts(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(4)
        now = _spec_counts()
        if now == last:
            return now
        last = now
    return last
