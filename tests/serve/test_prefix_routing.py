"""Prefix-aware routing over two real engine replicas: multi-turn chat lands where its prefix is cached.

Four conversations of four turns each, run concurrently over real HTTP (each turn's messages are the
last turn's plus the model's reply and a new question, rendered by the tiny model's chat template), on
the main app (`replica_routing` left at `auto`: prefix, two replicas behind the Router) and on the same
app with `replica_routing: power_of_two` (Serve's default). With prefix routing every later turn lands
on its conversation's first replica (`x-replica-id`) and reports `usage.prompt_tokens_details.cached_tokens`
> 0; without, where turns land is chance, so its figures are recorded, not asserted (the total with
routing is at least the total without: a turn can reuse at most what earlier turns left). Each
conversation's final vector is checked against transformers. The figures print with `-s`:

    .venv/bin/python -m pytest -s -q tests/serve/test_prefix_routing.py
"""

from __future__ import annotations

import concurrent.futures

import httpx

from deployments.config import AppArgs
from tests.conftest import long_text
from tests.serve.conftest import APP, app_args, decode_vector

CONVERSATIONS, TURNS = 4, 4


def converse(base: str, i: int) -> list[dict]:
    """One conversation, turn by turn: per turn its replica, usage and final choice."""
    messages = [{"role": "user", "content": long_text(90, seed=500 + i)}]
    turns = []
    with httpx.Client(timeout=120) as client:
        for t in range(TURNS):
            r = client.post(f"{base}/v1/chat/completions", json={
                "model": "tiny-llama", "messages": messages, "max_tokens": 8, "temperature": 0,
                "return_hidden_states": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            body = r.json()
            choice = body["choices"][0]
            turns.append({"replica": r.headers["x-replica-id"], "prompt_tokens": body["usage"]["prompt_tokens"],
                          "cached_tokens": (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"),
                          "prompt_token_ids": body["prompt_token_ids"], "choice": choice})
            messages += [{"role": "assistant", "content": choice["message"]["content"]},
                         {"role": "user", "content": long_text(25, seed=900 + 10 * i + t)}]
    return turns


def run_all(base: str) -> list[list[dict]]:
    with concurrent.futures.ThreadPoolExecutor(CONVERSATIONS) as pool:
        return list(pool.map(lambda i: converse(base, i), range(CONVERSATIONS)))


def figures(name: str, conversations: list[list[dict]]) -> dict:
    later = [t for conv in conversations for t in conv[1:]]
    stayed = sum(t["replica"] == conv[0]["replica"] for conv in conversations for t in conv[1:])
    out = {"cached": sum(t["cached_tokens"] for t in later), "prompt": sum(t["prompt_tokens"] for t in later),
           "stayed": stayed, "later": len(later),
           "first_turn_cached": sum(conv[0]["cached_tokens"] for conv in conversations),
           "replicas": len({t["replica"] for conv in conversations for t in conv})}
    print(f"\n{name}: turns 2-{TURNS} of {CONVERSATIONS} conversations: cached_tokens {out['cached']} of "
          f"{out['prompt']} prompt tokens ({out['cached'] / out['prompt']:.1%}); {stayed} of {len(later)} on "
          f"their conversation's first replica; first turns cached {out['first_turn_cached']}; "
          f"{out['replicas']} replicas served")
    for i, conv in enumerate(conversations):
        print(f"  conversation {i}: " + ", ".join(f"{t['replica'][:6]} {t['cached_tokens']}/{t['prompt_tokens']}"
                                                   for t in conv))
    return out


def check_final_vectors(conversations: list[list[dict]], reference) -> None:
    for conv in conversations:
        last = conv[-1]
        choice = last["choice"]
        reference.assert_matches(last["prompt_token_ids"] + choice["token_ids"], decode_vector(choice["hidden_states"]))


def test_later_turns_land_on_their_conversation_s_replica_and_hit_its_cache(app_slot, reference):
    assert AppArgs.model_validate(app_args()).resolved_replica_routing() == "prefix"  # the main app: the default
    # Serve's default routing first, so the main app is left running for the tests after this one
    without = run_all(app_slot.use("hs-p2c"))
    check_final_vectors(without, reference)
    off = figures("replica_routing: power_of_two", without)
    with_routing = run_all(app_slot.use(APP))
    check_final_vectors(with_routing, reference)
    on = figures("replica_routing: prefix (auto)", with_routing)
    for i, conv in enumerate(with_routing):
        first = conv[0]["replica"]
        for t, turn in enumerate(conv[1:], start=2):
            assert turn["replica"] == first, f"conversation {i} turn {t} went to {turn['replica']}, not {first}"
            assert turn["cached_tokens"] > 0, f"conversation {i} turn {t}: no prefix cache hit ({turn})"
    assert on["stayed"] == on["later"]
    assert on["cached"] >= off["cached"], (on, off)
    # every turn reports cached_tokens, also the first and also without prefix routing
    assert all(isinstance(t["cached_tokens"], int) for conv in without + with_routing for t in conv)
