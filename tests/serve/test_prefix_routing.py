"""Prefix-aware routing over two real engine replicas: multi-turn chat lands where its prefix is cached.

Eight conversations of four turns each, run four at a time over real HTTP (each turn's messages are
the last turn's plus the model's reply and a new question, rendered by the tiny model's chat
template), on the main app (`replica_routing` left at `auto`: prefix, two replicas behind the Router)
and on the same app with `replica_routing: power_of_two` (Serve's default). Which replica served a
turn is its response's `x-replica-id` (the replica's Serve id). The conversations are picked so that
rendezvous hashing on their anchor (deployments/routing.py) sends four to each replica, and the
running Router must do just that (`spread_problems`), keep every later turn where its conversation
went (`stay_problems`), and report for each later turn `usage.prompt_tokens_details.cached_tokens`
covering the whole blocks of the turn before's prompt (`cache_problems`). Under Serve's default
routing the same checks fail (the run is recorded, and its figures printed).

Hashing alone passes those three: in a steady state the tree and the rendezvous hash agree. They
differ when the replicas change: a replica is killed (its process and its engine's, as a crash does)
and Serve replaces it. Then the tree keeps every conversation of the surviving replica there, where
its prefix is cached, though hashing over the new pair would move about half of them to the new
replica; the dead replica's conversations go to their rendezvous replica among those left; new
conversations spread over the survivor and the newcomer (`tree_problems`).

Each check is a function of what the runs recorded; tests/unit/test_routing.py runs the same
functions over an in-memory PrefixRouter and breaks the routing (everything to one replica, power of
two choices, the tree bypassed) to show each then fails. The figures print with `-s`:

    .venv/bin/python -m pytest -s -q tests/serve/test_prefix_routing.py
"""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx
import pytest

from deployments import routing
from tests.conftest import long_text
from tests.serve.conftest import APP, decode_vector

MODEL = "tiny-llama"
TURNS = 4
BLOCK = 32  # tokens per KV-cache block: the CPU engine's; a GPU engine's 16 divides it
CONCURRENCY = 4  # conversations at once: the replicas' queues never differ by more than Ray's 8


# -- the conversations ------------------------------------------------------------------------------


class Chat:
    """One conversation: its messages so far, and per turn what its response showed."""

    def __init__(self, seed: int):
        self.seed = seed
        self.messages = [{"role": "user", "content": long_text(90, seed=seed)}]
        self.turns: list[dict] = []  # per turn: replica, prompt_tokens, cached_tokens, (serve:) the choice
        self.anchor = anchor_of(self.body())

    def body(self) -> dict:
        return {
            "model": MODEL,
            "messages": list(self.messages),
            "max_tokens": 8,
            "temperature": 0,
            "return_hidden_states": True,
            "return_token_ids": True,
        }

    def answered(self, turn: dict, reply: str) -> None:
        """A turn's record; the next turn's messages: these, the reply and a new question."""
        self.turns.append(turn)
        self.messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": long_text(25, seed=900 + 10 * self.seed + len(self.turns))},
        ]

    def replicas(self) -> list[str]:
        return [t["replica"] for t in self.turns]


def anchor_of(body: dict) -> str:
    """The first character of the request's routing key: its conversation's anchor (deployments/routing.py)."""
    return routing.http_key("chat", body, MODEL)[0]


def rendezvous(anchor: str, replicas) -> str:
    """The replica rendezvous hashing picks for a new prefix: what hashing alone would pick."""
    return max(sorted(replicas), key=lambda r: routing._rendezvous(anchor, r))


def pick(counts: dict[str, int], start: int) -> list[Chat]:
    """Conversations (seeds from `start` on) whose anchors hash to each replica as many times as `counts` says."""
    left, out, seed = dict(counts), [], start
    while any(left.values()):
        chat = Chat(seed)
        where = rendezvous(chat.anchor, left)
        if left[where] > 0:
            left[where] -= 1
            out.append(chat)
        seed += 1
    return out


# -- the checks (tests/unit/test_routing.py runs them over an in-memory router, and breaks it) -----


def spread_problems(chats: list[Chat], replicas, turn: int = 0) -> list[str]:
    """Conversations spread over all the replicas: each one's turn `turn` (a new prefix there) on the
    replica its anchor picks by rendezvous hashing over `replicas`, and every replica serving some."""
    out = []
    served = {c.turns[turn]["replica"] for c in chats}
    if served != set(replicas):
        out.append(
            f"turn {turn + 1} of each conversation served by {sorted(served)}, not by each of {sorted(replicas)}"
        )
    for c in chats:
        if (got := c.turns[turn]["replica"]) != (want := rendezvous(c.anchor, replicas)):
            out.append(f"conversation {c.seed} turn {turn + 1}: on {got}, not {want}, its rendezvous replica")
    return out


def stay_problems(chats: list[Chat], since: int = 1) -> list[str]:
    """Each conversation's turns from `since` on land where its turn before did."""
    return [
        f"conversation {c.seed} turn {t + 1}: on {c.turns[t]['replica']}, its turn {t} on {c.turns[t - 1]['replica']}"
        for c in chats
        for t in range(max(since, 1), len(c.turns))
        if c.turns[t]["replica"] != c.turns[t - 1]["replica"]
    ]


def cache_problems(chats: list[Chat], since: int = 1) -> list[str]:
    """Each turn from `since` on reads from the prefix cache at least the whole blocks of the prompt
    of the turn before (which the replica it went to computed)."""
    out = []
    for c in chats:
        for t in range(max(since, 1), len(c.turns)):
            want = c.turns[t - 1]["prompt_tokens"] // BLOCK * BLOCK
            if not (isinstance(got := c.turns[t]["cached_tokens"], int) and got >= want):
                out.append(f"conversation {c.seed} turn {t + 1}: cached_tokens {got}, not the {want} of its turn {t}")
    return out


def tree_problems(chats: list[Chat], before, after, turn: int) -> list[str]:
    """The replicas changed from `before` to `after` between turns `turn` and `turn + 1` (1-based: the
    turn index `turn` is the first after). A conversation on a replica still there stays on it (the
    tree holds its prefix there); one on a replica that left goes to its rendezvous replica among
    `after`. And for at least one that stayed, rendezvous hashing over `after` picks another replica:
    the decision is the tree's, not the hash's (else this run cannot tell them apart)."""
    out, kept_by_tree = [], []
    for c in chats:
        was, now = c.turns[turn - 1]["replica"], c.turns[turn]["replica"]
        if was not in before:
            out.append(f"conversation {c.seed}: turn {turn} on {was}, not one of {sorted(before)}")
        elif was in after:
            if now != was:
                out.append(f"conversation {c.seed}: moved from {was}, still serving, to {now}")
            elif rendezvous(c.anchor, after) != was:
                kept_by_tree.append(c)
        elif now != (want := rendezvous(c.anchor, after)):
            out.append(f"conversation {c.seed}: its replica {was} left; on {now}, not {want}, its rendezvous replica")
    if not out and not kept_by_tree:
        out.append(
            "no conversation that stayed would have moved by hashing alone: nothing here tells the tree "
            "from the hash (more conversations on the surviving replica)"
        )
    return out


# -- over real Serve ---------------------------------------------------------------------------------


def send(base: str, chat: Chat, client: httpx.Client) -> None:
    r = client.post(f"{base}/v1/chat/completions", json=chat.body())
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    chat.answered(
        {
            "replica": r.headers["x-replica-id"],
            "prompt_tokens": body["usage"]["prompt_tokens"],
            "cached_tokens": (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"),
            "prompt_token_ids": body["prompt_token_ids"],
            "choice": choice,
        },
        choice["message"]["content"],
    )


def run(base: str, chats: list[Chat], turns: int) -> None:
    """`turns` more turns of each conversation, CONCURRENCY conversations at a time."""

    def converse(chat: Chat) -> None:
        with httpx.Client(timeout=120) as client:
            for _ in range(turns):
                send(base, chat, client)

    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(converse, chats))


def engine_replicas(app: str) -> dict[str, int]:
    """The app's alive engine replicas, from the GCS actor table: Serve id (`x-replica-id`) -> pid."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#EngineReplica#"
    return {
        a["Name"].rsplit("#", 1)[1]: a["Pid"]
        for a in ray._private.state.actors().values()
        if a["State"] == "ALIVE" and (a["Name"] or "").startswith(prefix)
    }


def kill(pid: int) -> None:
    """A replica's crash: SIGKILL to its process and its engine's (EngineCore, workers)."""
    import psutil

    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def replaced(app: str, base: str, before, gone: str, timeout: float = 300) -> set[str]:
    """Waits until Serve runs a replica in place of `gone` (one of `before`) and the Router routes to it;
    the replicas then."""
    from ray import serve

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = engine_replicas(app)
        status = serve.status().applications.get(app)
        states = {str(k): v for k, v in status.deployments["EngineReplica"].replica_states.items()} if status else {}
        if len(now) == len(before) and not set(now) & {gone} and states == {"RUNNING": len(before)}:
            break
        time.sleep(2)
    else:
        raise TimeoutError(f"{gone} not replaced in {timeout}s: {engine_replicas(app)}")
    # The Router learns of the new one by Serve's long poll: keyless requests (power of two choices,
    # the tree untouched) until one lands there.
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < deadline:
            r = client.post(f"{base}/tokenize", json={"model": MODEL, "prompt": "which replica"})
            if r.status_code == 200 and r.headers.get("x-replica-id") in set(now) - set(before):
                return set(now)
            time.sleep(0.5)
    raise TimeoutError(f"the Router never routed to the new replica of {sorted(now)}")


def figures(name: str, chats: list[Chat]) -> dict:
    later = [t for c in chats for t in c.turns[1:]]
    stayed = sum(t["replica"] == c.turns[0]["replica"] for c in chats for t in c.turns[1:])
    out = {
        "cached": sum(t["cached_tokens"] for t in later),
        "prompt": sum(t["prompt_tokens"] for t in later),
        "stayed": stayed,
        "later": len(later),
        "replicas": len({t["replica"] for c in chats for t in c.turns}),
    }
    print(
        f"\n{name}: turns 2-{TURNS} of {len(chats)} conversations: cached_tokens {out['cached']} of "
        f"{out['prompt']} prompt tokens ({out['cached'] / out['prompt']:.1%}); {stayed} of {len(later)} on "
        f"their conversation's first replica; {out['replicas']} replicas served"
    )
    for c in chats:
        print(
            f"  conversation {c.seed}: "
            + ", ".join(f"{t['replica'][:6]} {t['cached_tokens']}/{t['prompt_tokens']}" for t in c.turns)
        )
    return out


def check_final_vectors(chats: list[Chat], reference) -> None:
    for c in chats:
        last = c.turns[-1]
        choice = last["choice"]
        reference.assert_matches(last["prompt_token_ids"] + choice["token_ids"], decode_vector(choice["hidden_states"]))


@pytest.mark.serve_app(APP, "first")
def test_later_turns_land_on_their_conversation_s_replica_and_hit_its_cache(app_slot, reference):
    # Serve's default routing first, so the main app is left running for its other tests (this one runs first of them)
    base = app_slot.use("hs-p2c")
    p2c_replicas = engine_replicas("hs-p2c")
    without = pick(dict.fromkeys(p2c_replicas, 4), start=500)
    run(base, without, TURNS)
    check_final_vectors(without, reference)
    figures("replica_routing: power_of_two", without)

    base = app_slot.use(APP)
    replicas = engine_replicas(APP)
    assert len(replicas) == 2, replicas
    chats = pick(dict.fromkeys(replicas, 4), start=500)
    run(base, chats, TURNS)
    check_final_vectors(chats, reference)
    figures("replica_routing: prefix (auto)", chats)
    assert spread_problems(chats, replicas) == []
    assert stay_problems(chats) == []
    assert cache_problems(chats) == []
    # Serve's default routing fails them: 8 first turns each on its rendezvous replica by chance
    # (1 in 256) and all 24 later turns where their conversation went.
    failed = spread_problems(without, p2c_replicas) + stay_problems(without)
    assert failed, "power of two choices passed the prefix routing checks"
    print(f"power_of_two: {len(failed)} problems, e.g. {failed[:2]}")
    # every turn reports cached_tokens, also the first and also without prefix routing
    assert all(isinstance(t["cached_tokens"], int) for c in without + chats for t in c.turns)


@pytest.mark.serve_app(APP, "last")  # it kills one of the main app's replicas: after the app's other tests
def test_after_a_replica_is_replaced_going_conversations_stay_and_new_ones_spread(app_slot):
    """A replica crashes and Serve replaces it. The tree keeps the survivor's conversations there, where
    hashing over the new pair would move about half; the dead one's go to their rendezvous replica;
    new conversations spread over both; every turn after stays where its conversation went."""
    base = app_slot.use(APP)
    before = engine_replicas(APP)
    assert len(before) == 2, before
    survivor, victim = sorted(before)
    # 12 on the survivor: that hashing over the new pair moves none of them has odds 1 in 4096
    going = pick({survivor: 12, victim: 4}, start=2000)
    run(base, going, 1)
    assert spread_problems(going, before) == []

    kill(before[victim])
    after = replaced(APP, base, before, victim)
    (new,) = after - {survivor}
    run(base, going, 2)
    kept = [c for c in going if c.turns[0]["replica"] == survivor and rendezvous(c.anchor, after) == new]
    print(
        f"\nreplaced {victim} by {new}: {len(kept)} of 12 conversations on {survivor} kept there by the tree "
        f"(hashing alone: to {new}); the 4 of {victim} went to "
        + ", ".join(c.turns[1]["replica"] for c in going if c.turns[0]["replica"] == victim)
    )
    assert tree_problems(going, before, after, turn=1) == []
    assert stay_problems(going, since=2) == []
    assert cache_problems([c for c in going if c.turns[0]["replica"] == survivor]) == []
    assert cache_problems(going, since=2) == []

    fresh = pick({survivor: 2, new: 2}, start=3000)
    run(base, fresh, 2)
    assert spread_problems(fresh, after) == []
    assert stay_problems(fresh) == []
    assert cache_problems(fresh) == []
