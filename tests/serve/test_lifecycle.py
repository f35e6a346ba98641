"""One request's lifecycle against the real app (two vLLM replicas behind the Router):
clients that hang up leave nothing behind.

Six streamed clients close after a few chunks and six non-streamed clients give up
after 1-2 s, each on a 4,000-token request (`ignore_eos`) that would run many seconds
longer if nothing cancelled it (the test measures how long), half of
them with hidden states; half go through Serve's proxy, half to the Router's own
port (direct ingress). Within 15 s the Router has nothing pending and counts them
all `cancelled`, and both replicas have no handle call in flight (`in_flight`), no
vector awaited (`pending`) and no unfinished engine request (`unfinished_requests`:
vLLM's output processor).
"""

from __future__ import annotations

import asyncio
import json
import time

from tests.helpers import HUNG_UP, hang_up_plain, hang_up_streamed, post
from tests.serve.conftest import APP, replica_stats, router_ports

HANG_UPS = 6  # of each kind
SETTLE_S = 15
MAX_TOKENS = 4000  # the prompt's ~15 tokens + 4,000 fit the test engine's max_model_len (4,096)


def body(i: int) -> dict:
    return {
        "model": "tiny-llama",
        "prompt": f"Client {i} will not wait for the end of this story:",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "return_hidden_states": i % 2 == 0,
    }


def engine_replicas(want: int = 2, tries: int = 60) -> dict[str, dict]:
    """Each engine replica's stats, by replica id: one handle call reaches one replica,
    so call until `want` distinct replicas answered."""
    from ray import serve

    handle = serve.get_deployment_handle("EngineReplica", APP)
    seen: dict[str, dict] = {}
    for _ in range(tries):
        s = json.loads(handle.stats.remote().result(timeout_s=30))
        seen[s["replica"]] = s
        if len(seen) == want:
            break
    assert len(seen) == want, f"only {sorted(seen)} of {want} engine replicas answered in {tries} calls"
    return seen


def busy(stats: dict) -> dict:
    """What a replica still holds: handle calls, awaited vectors, unfinished engine requests."""
    return {k: stats.get(k) for k in ("in_flight", "pending", "unfinished_requests") if stats.get(k) != 0}


def seconds_per_token(base: str, tokens: int = 200) -> float:
    """One request alone, decoding `tokens` tokens: a lower bound of the time per token under load."""
    t0 = time.monotonic()
    r = post(base, "/v1/completions", {**body(-1), "max_tokens": tokens}, timeout=120)
    assert r.status_code == 200, r.text
    return (time.monotonic() - t0) / tokens


def test_clients_hanging_up_leave_nothing_behind(serve_app):
    alone_s = MAX_TOKENS * seconds_per_token(serve_app)  # a lower bound of how long each request would run
    ports = router_ports()
    bases = [serve_app] + [f"http://127.0.0.1:{p}" for p in ports[:1]]  # the proxy, and the Router's own port
    before = replica_stats(serve_app)["ingress"]

    async def go():
        streamed = [hang_up_streamed(bases[i % len(bases)], body(i), 3, timeout=120) for i in range(HANG_UPS)]
        plain = [hang_up_plain(bases[i % len(bases)], body(HANG_UPS + i), 1.0 + (i % 3) * 0.5) for i in range(HANG_UPS)]
        return await asyncio.gather(*streamed, *plain)

    started = time.monotonic()
    results = asyncio.run(asyncio.wait_for(go(), 300))
    left_at = time.monotonic()
    assert results == [3] * HANG_UPS + [HUNG_UP] * HANG_UPS, results
    assert alone_s > 2 * (left_at - started), f"{MAX_TOKENS} tokens take only {alone_s:.0f} s here: raise MAX_TOKENS"

    deadline = left_at + SETTLE_S
    while True:
        ingress = replica_stats(serve_app)["ingress"]
        replicas = engine_replicas()
        left = {rid: b for rid, s in replicas.items() if (b := busy(s))}
        if (ingress["pending"] == 0 and not left) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    idle_s = time.monotonic() - started
    print(
        f"{MAX_TOKENS} tokens alone: {alone_s:.0f} s; {len(bases)} paths; clients left after "
        f"{left_at - started:.1f} s; idle after {idle_s:.1f} s: {ingress}; "
        + "; ".join(
            f"{rid}: {json.dumps({k: s.get(k) for k in ('in_flight', 'pending', 'unfinished_requests')})}"
            for rid, s in replicas.items()
        )
    )
    assert ingress["pending"] == 0, ingress
    assert not left, f"still running on the engine replicas {SETTLE_S} s after the clients left: {left}"
    # Ended, and long before they could have finished on their own: cancelled, not run out.
    assert idle_s < alone_s / 2, f"idle only after {idle_s:.1f} s; one request alone runs {alone_s:.0f} s"
    assert ingress["cancelled"] - before["cancelled"] == 2 * HANG_UPS, (before, ingress)
    assert ingress["failed"] == before["failed"], (before, ingress)
