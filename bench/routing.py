"""What prefix-aware routing costs the Router per request, beside Serve's default.

    .venv/bin/python -m bench.routing        # writes bench/results/routing-cost.{json,md}

In one process: Serve's request router over N fake replicas routes multi-turn chats as the Router does (the
body's key, `choose_replicas`, `on_request_routed`), `prefix` (deployments.routing.PrefixRouter) against
`power_of_two` (Serve's default, no key), in turns on the same requests: CPU µs per request, best of the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

from bench.procs import RESULTS, command_line, write_results
from deployments.routing import KEY_KWARG, PrefixRouter, http_key

BASE = "tiny-llama"
WORDS = (
    "the replica keeps every conversation's prefix in its cache and the next turn lands there "
    "so its prompt is prefilled once "
).split()


class FakeReplica:
    """What Serve's request router reads of a replica (RunningReplica's attributes), and its queue length."""

    def __init__(self, name: str, queue: int = 0):
        self.replica_id = ReplicaID(name, DeploymentID(name="EngineReplica", app_name="app"))
        self.node_id = self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.max_ongoing_requests, self.queue, self.is_cross_language = 256, queue, False

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue

    def push_proxy_handle(self, handle) -> None:
        pass


def make_router(cls, replicas: list[FakeReplica], **state):
    r = cls(
        deployment_id=DeploymentID(name="EngineReplica", app_name="app"),
        handle_source=DeploymentHandleSource.REPLICA,
        use_replica_queue_len_cache=True,
    )
    r.initialize_state(**state)
    r.update_replicas(replicas)
    return r


def pending(key: str) -> PendingRequest:
    return PendingRequest(
        args=["chat", b"{}"],
        kwargs={KEY_KWARG: key} if key else {},
        metadata=RequestMetadata("id", "internal", call_method="openai_unary"),
    )


def text(words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] + str((seed + i) % 10) for i in range(words))


def conversations(n: int, turns: int, first_words: int, turn_words: int) -> list[list[dict]]:
    """Request bodies, turn by turn: each turn's messages are the last one's plus a reply and a question."""
    out = []
    for c in range(n):
        messages, bodies = [{"role": "user", "content": text(first_words, c)}], []
        for t in range(turns):
            bodies.append({"model": BASE, "messages": list(messages)})
            messages += [
                {"role": "assistant", "content": text(turn_words // 2, 1000 + c * turns + t)},
                {"role": "user", "content": text(turn_words // 2, 5000 + c * turns + t)},
            ]
        out.append(bodies)
    return out


async def route_all(cls, replicas: int, bodies: list[dict], keyed: bool) -> tuple[float, int]:
    """CPU seconds for routing `bodies` in order (key, choice, record) with a fresh router of `cls`
    (where they land is the tests' question: tests/unit/test_routing.py; here, only the cost)."""
    router = make_router(cls, [FakeReplica(f"r{i}", queue=i % 3) for i in range(replicas)])
    t0 = time.process_time()
    for body in bodies:
        key = http_key("chat", body, BASE) if keyed else ""
        request = pending(key)
        (chosen,) = await router.choose_replicas(router._replicas_list, request)
        replica = min(chosen, key=lambda r: r.queue)  # Serve takes the least loaded of those offered
        router.on_request_routed(request, replica.replica_id, None)
    return time.process_time() - t0, len(bodies)


def measure(replicas: int, first_words: int, n_conv: int, turns: int, rounds: int) -> dict:
    convs = conversations(n_conv, turns, first_words, 60)
    bodies = [conv[t] for t in range(turns) for conv in convs]  # turn 1 of every conversation, then turn 2...
    tokens = len(http_key("chat", bodies[-1], BASE)) * 8  # ~8 tokens of text per key character
    arms = {"prefix": (PrefixRouter, True), "power_of_two": (PowerOfTwoChoicesRequestRouter, False)}
    cpu = {arm: [] for arm in arms}
    for _ in range(rounds):
        for arm, (cls, keyed) in arms.items():  # alternated, a fresh router each round
            s, n = asyncio.run(asyncio.wait_for(route_all(cls, replicas, bodies, keyed), 600))
            cpu[arm].append(s / n * 1e6)
    key_chars = sum(len(http_key("chat", b, BASE)) for b in bodies) / len(bodies)
    return {
        "replicas": replicas,
        "first_turn_words": first_words,
        "requests": len(bodies),
        "last_turn_tokens_approx": tokens,
        "key_chars_mean": round(key_chars, 1),
        **{f"{arm}_us": round(min(v), 1) for arm, v in cpu.items()},
        **{f"{arm}_us_max": round(max(v), 1) for arm, v in cpu.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", default="2,8,32")
    ap.add_argument("--first-words", default="100,3000", help="words in each conversation's first message")
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="routing-cost")
    args = ap.parse_args()
    rows = [
        measure(n, w, args.conversations, args.turns, args.rounds)
        for w in map(int, args.first_words.split(","))
        for n in map(int, args.replicas.split(","))
    ]
    write_results(
        RESULTS, args.name, {"command": command_line("bench.routing"), "rows": rows}, rows
    )  # µs per request, best round


if __name__ == "__main__":
    main()
