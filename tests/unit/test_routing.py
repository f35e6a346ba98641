"""Prefix-aware routing (deployments/routing.py) in memory: the routing key a request's body becomes,
the request router's choices over fake replicas (Serve's RequestRouter with Ray's PrefixTree, no
cluster), the option in AppArgs, and the Router passing the key with its replica calls. No vLLM, no Ray
cluster."""

from __future__ import annotations

import asyncio
import json
import random
import types

import httpx
import pytest
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree
from ray.serve.config import RequestRouterConfig

from bench.routing import FakeReplica, pending
from bench.routing import make_router as make_request_router
from deployments import http, router, routing, wire
from deployments.config import AppArgs
from deployments.routing import KEY_KWARG, PrefixRouter, handle_key, http_key
from deployments.wire import HandleCompletion, HandleCompletionRequest, HandleReply, Reply, ResponseHead
from tests.helpers import asgi_request, run
from tests.serve import test_prefix_routing as served  # the serve test's conversations and checks

BASE = "tiny-llama"
LONG = "The replica keeps the prefix of every conversation it served in its cache. " * 4


def chat(*contents: str) -> dict:
    roles = ["user", "assistant"]
    return {"messages": [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]}


def shared(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# -- the key ------------------------------------------------------------------


def test_a_turn_s_key_extends_the_one_before():
    one = http_key("chat", chat(LONG), BASE)
    two = http_key("chat", chat(LONG, "a reply", "and the next question"), BASE)
    # the conversation's anchor, then one character per 32 bytes
    assert one and len(one) == 1 + -(-len(routing.chat_text(chat(LONG)["messages"]).encode()) // routing.CHUNK_BYTES)
    assert shared(one, two) == len(one) - 1  # the anchor and every whole chunk; the last, shorter one differs
    third = http_key("chat", chat(LONG, "a reply", "and the next question", "another reply", "more?"), BASE)
    assert third[0] == two[0] == one[0] != http_key("chat", chat(LONG + "!"), BASE)[0]  # one anchor per opening
    system = {"messages": [{"role": "system", "content": "Be brief."}, *chat(LONG)["messages"]]}
    assert http_key("chat", system, BASE)[0] != one[0]  # the opening: up to and including the first user message
    text = http_key("completions", {"prompt": LONG}, BASE)
    longer = http_key("completions", {"prompt": LONG + " and more text"}, BASE)
    assert shared(text, longer) == len(text) - 1
    ids = list(range(100, 164))  # 64 ids: 8 whole chunks of 8
    assert http_key("completions", {"prompt": ids + [7, 8, 9]}, BASE).startswith(
        http_key("completions", {"prompt": ids}, BASE)
    )
    assert len(http_key("completions", {"prompt": ids}, BASE)) == 8
    # one character per 32 bytes, each in Unicode's planes 1-16 (encodable: no surrogates)
    assert all(0x10000 <= ord(c) <= 0x10FFFF for c in one + text) and (one + text).encode("utf-8")


def test_adapters_salts_and_forms_never_share_a_key_prefix():
    base = http_key("chat", chat(LONG), BASE)
    assert http_key("chat", {**chat(LONG), "model": BASE}, BASE) == base  # the base model named, or not
    others = [
        http_key("chat", {**chat(LONG), "model": "lora-qv"}, BASE),
        http_key("chat", {**chat(LONG), "cache_salt": "tenant-a"}, BASE),
        http_key("completions", {"prompt": routing.chat_text(chat(LONG)["messages"])}, BASE),
    ]
    for other in others:
        assert other and shared(base, other) == 0
    assert http_key("completions", {"prompt": [1, 2, 3]}, BASE) != http_key("completions", {"prompt": "\x01"}, BASE)


def test_what_has_no_key_routes_by_power_of_two():
    assert http_key("tokenize", {"prompt": LONG}, BASE) == ""
    assert http_key("detokenize", {"tokens": [1, 2]}, BASE) == ""
    assert http_key("completions", {"prompt": [-1, 5]}, BASE) == ""  # the replica answers bad ids
    assert http_key("completions", {"prompt": [[1, 2], "x"]}, BASE) == ""
    assert http_key("completions", {"prompt": ""}, BASE) == ""
    assert http_key("chat", {"messages": "not a list"}, BASE) == ""


def test_prompt_lists_and_content_parts():
    assert http_key("completions", {"prompt": ["ab", "cd"]}, BASE) == http_key("completions", {"prompt": "abcd"}, BASE)
    assert http_key("completions", {"prompt": [[1, 2], [3]]}, BASE) == http_key(
        "completions", {"prompt": [1, 2, 3]}, BASE
    )
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": LONG}]}]}
    assert http_key("chat", parts, BASE) == http_key("chat", chat(LONG), BASE)


def test_media_join_the_key_so_a_conversation_about_one_image_stays_with_its_caches():
    def about(url: str, text: str = LONG) -> dict:
        return {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
                }
            ]
        }

    a, b = "data:image/png;base64,AAAA", "data:image/png;base64,BBBB"
    assert http_key("chat", about(a), BASE) == http_key("chat", about(a), BASE)
    assert http_key("chat", about(a), BASE) != http_key("chat", about(b), BASE)  # same text, other image
    assert http_key("chat", about(a), BASE) != http_key("chat", chat(LONG), BASE)
    audio = {
        "messages": [
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}}]}
        ]
    }
    assert http_key("chat", audio, BASE) != http_key("chat", chat(""), BASE)


def test_a_verification_lands_where_its_choice_was_generated():
    generated = http_key("chat", chat(LONG), BASE)
    verify = http_key("hidden_states", {**chat(LONG), "completion": "the answer it gave"}, BASE)
    assert shared(generated, verify) == len(generated) - 1
    ids = list(range(64))
    assert http_key("hidden_states", {"prompt": ids, "completion": [1, 2]}, BASE).startswith(
        http_key("completions", {"prompt": ids}, BASE)
    )


def test_a_handle_request_s_key_is_its_http_twin_s():
    assert handle_key(HandleCompletionRequest(messages=chat(LONG)["messages"]), BASE) == http_key(
        "chat", chat(LONG), BASE
    )
    assert handle_key(HandleCompletionRequest(prompt=LONG, model=BASE), BASE) == http_key(
        "completions", {"prompt": LONG}, BASE
    )
    assert handle_key(HandleCompletionRequest(prompt=[5, 6], model="lora-qv"), BASE) == http_key(
        "completions", {"prompt": [5, 6], "model": "lora-qv"}, BASE
    )


# -- the request router ----------------------------------------------------------


def make(*replicas: FakeReplica, **kwargs) -> PrefixRouter:
    return make_request_router(PrefixRouter, list(replicas), **kwargs)


async def route(r: PrefixRouter, key: str) -> list[str]:
    """The replicas the router offers the request (Serve takes the least loaded of them)."""
    (chosen,) = await r.choose_replicas(r._replicas_list, pending(key))
    return sorted(c.replica_id.unique_id for c in chosen)


def sent(r: PrefixRouter, key: str, name: str) -> None:
    """Serve reports the request went to `name`."""
    r.on_request_routed(pending(key), next(rid for rid in r._replicas if rid.unique_id == name), None)


def conversation(i: int, turns: int) -> list[str]:
    contents = [f"Conversation {i}: " + LONG]
    keys = [http_key("chat", chat(*contents), BASE)]
    for t in range(1, turns):
        contents += [f"reply {t} of conversation {i}", f"question {t}: tell me more about item {t}"]
        keys.append(http_key("chat", chat(*contents), BASE))
    return keys


def test_next_turns_go_where_their_conversation_went_and_new_ones_spread():
    async def go():
        r = make(FakeReplica("a"), FakeReplica("b"))
        first = {}
        for i in range(32):
            keys = conversation(i, 4)
            (first[i],) = await route(r, keys[0])  # a new prefix: one replica, its rendezvous one
            sent(r, keys[0], first[i])
            for key in keys[1:]:
                assert await route(r, key) == [first[i]], i
                sent(r, key, first[i])
        return r, first

    r, first = run(go())
    counts = sorted(list(first.values()).count(name) for name in "ab")
    assert counts[0] >= 8, first  # new conversations spread over both (rendezvous hashing: 16 each expected)
    assert set(r.tree_shares()) == {"a", "b"} and min(r.tree_shares().values()) > 0


def test_every_router_replica_sends_a_conversation_to_the_same_engine_replica():
    """Each Router replica has its own tree: a turn reaching another Router replica than the turn before
    is a new prefix there, and goes to the same engine replica by the conversation's anchor."""

    async def go():
        replicas = [FakeReplica(n) for n in "abcdefgh"]
        routers = [make(*replicas), make(*replicas), make(*replicas)]
        for i in range(16):
            keys = conversation(i, 6)
            (where,) = await route(routers[0], keys[0])
            sent(routers[0], keys[0], where)
            for t, key in enumerate(keys[1:], start=1):
                r = routers[t % 3]  # turns round-robin over the Router replicas
                assert await route(r, key) == [where], (i, t)
                sent(r, key, where)

    run(go())


def test_without_a_key_or_under_imbalanced_load_power_of_two_decides():
    async def go():
        a, b = FakeReplica("a"), FakeReplica("b")
        r = make(a, b, imbalanced_threshold=8)
        key = conversation(0, 2)
        sent(r, key[0], "a")
        assert await route(r, key[1]) == ["a"]
        assert await route(r, "") == ["a", "b"]  # no key: Serve's two random choices
        r.on_new_queue_len_info(a.replica_id, 20)  # a is 20 requests busier than b: load wins over affinity
        r.on_new_queue_len_info(b.replica_id, 0)
        assert await route(r, key[1]) == ["a", "b"]
        r.on_new_queue_len_info(a.replica_id, 8)  # within the threshold: affinity again
        assert await route(r, key[1]) == ["a"]

    run(go())


def test_replicas_added_and_removed_are_the_tree_s_tenants():
    """Autoscaling: a new replica joins the tree and takes its rendezvous share of new conversations
    while the old ones stay; a removed or dead one leaves the tree and is never offered again, and
    only its conversations move."""

    async def go():
        a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
        r = make(a, b)
        convs = [conversation(i, 3) for i in range(24)]
        where = {}
        for i, keys in enumerate(convs):
            (where[i],) = await route(r, keys[0])
            sent(r, keys[0], where[i])
        r.update_replicas([a, b, c])  # scaled up
        assert r.tree_shares()["c"] == 0
        for i, keys in enumerate(convs):
            assert await route(r, keys[1]) == [where[i]]  # going conversations stay
        new = [(await route(r, conversation(100 + i, 1)[0]))[0] for i in range(24)]
        assert new.count("c") >= 3, new  # 8 expected
        r.update_replicas([b, c])  # scaled down: a leaves
        assert "a" not in r.tree_shares()
        for i, keys in enumerate(convs):
            (now,) = await route(r, keys[2])
            assert now in "bc" and (where[i] == "a" or now == where[i]), (i, where[i], now)
        r.on_replica_actor_died(b.replica_id)
        assert set(r.tree_shares()) == {"c"} and await route(r, convs[0][2]) == ["c"]

    run(go())


def test_a_replica_s_share_of_the_tree_is_bounded():
    async def go():
        r = make(FakeReplica("a"), max_chars_per_replica=200)
        for i in range(100):
            sent(r, http_key("completions", {"prompt": f"prompt {i} " + LONG}, BASE), "a")
        return r

    r = run(go())
    assert 0 < r.tree_shares()["a"] <= 200


def test_bad_router_settings_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="match_rate_threshold"):
        make(FakeReplica("a"), match_rate_threshold=2)


def test_ray_s_router_as_shipped_cannot_read_our_calls():
    """Why PrefixRouter reads a key of its own: Ray's looks for `.prompt` / `.messages` on the call's
    arguments, and ours are the route and the raw body."""

    async def go():
        PrefixCacheAffinityRouter._extract_text_from_request(None, pending(conversation(0, 1)[0]))

    with pytest.raises(ValueError, match="No request with message or prompt"):
        run(go())


# -- the serve test's checks over this router, and over it broken ---------------------------------


class InMemory:
    """What tests/serve/test_prefix_routing.py records of real Serve, from PrefixRouter over fake
    replicas: a turn goes to one of the replicas the router offers (Serve takes the least loaded; all
    are idle here, so one at random), and reads from that replica's prefix cache the whole blocks it
    shares with a prompt the replica computed before (a word of the chat text a token). Made, and
    used, on an event loop (Serve's router's)."""

    def __init__(self, *names: str):
        self.replicas = {n: FakeReplica(n) for n in names}
        self.router = make(*self.replicas.values())
        self.computed: dict[str, list[list[str]]] = {n: [] for n in names}
        self.rng = random.Random(0)

    async def turns(self, chats: list[served.Chat], n: int = 1) -> None:
        for _ in range(n):
            for chat in chats:
                await self.send(chat)

    async def send(self, chat: served.Chat) -> None:
        key = http_key("chat", chat.body(), BASE)
        (offered,) = await self.router.choose_replicas(self.router._replicas_list, pending(key))
        replica = self.rng.choice(sorted(offered, key=lambda r: r.replica_id.unique_id))
        name = replica.replica_id.unique_id
        self.router.on_request_routed(pending(key), replica.replica_id, None)
        tokens = routing.chat_text(chat.messages).split()
        cached = max((shared(tokens, seen) for seen in self.computed[name]), default=0) // served.BLOCK * served.BLOCK
        self.computed[name].append(tokens)
        chat.answered(
            {"replica": name, "prompt_tokens": len(tokens), "cached_tokens": cached},
            f"reply {len(chat.turns)} of conversation {chat.seed}",
        )

    def replace(self, gone: str, new: str) -> None:
        """`gone` crashes and Serve replaces it by `new`: the router hears of both, as from Serve."""
        self.router.on_replica_actor_died(self.replicas.pop(gone).replica_id)
        self.router.update_replicas(list(self.replicas.values()))
        self.replicas[new], self.computed[new] = FakeReplica(new), []
        self.router.update_replicas(list(self.replicas.values()))


def steady() -> list[served.Chat]:
    """The serve test's first run: 8 conversations, 4 to each of a and b by their anchors, 4 turns each."""
    chats = served.pick({"a": 4, "b": 4}, start=500)

    async def go():
        await InMemory("a", "b").turns(chats, served.TURNS)

    run(go())
    return chats


def replacement(going: list[served.Chat] | None = None) -> list[served.Chat]:
    """The serve test's second: 12 conversations on a and 4 on b, one turn; b replaced by c; two more."""
    going = served.pick({"a": 12, "b": 4}, start=2000) if going is None else going

    async def go():
        sim = InMemory("a", "b")
        await sim.turns(going)
        sim.replace("b", "c")
        await sim.turns(going, 2)

    run(go())
    return going


def test_the_serve_test_s_checks_pass_on_this_router():
    chats = steady()
    assert served.spread_problems(chats, {"a", "b"}) == []
    assert served.stay_problems(chats) == [] and served.cache_problems(chats) == []
    going = replacement()
    assert served.tree_problems(going, {"a", "b"}, {"a", "c"}, turn=1) == []
    kept = [c for c in going if c.replicas()[0] == "a" and served.rendezvous(c.anchor, {"a", "c"}) == "c"]
    assert kept and all(c.replicas() == ["a"] * 3 for c in kept)  # hashing alone: to c
    assert served.stay_problems(going, since=2) == [] and served.cache_problems(going, since=2) == []
    assert served.cache_problems([c for c in going if c.replicas()[0] == "a"]) == []


async def _to_one_replica(self, pending_request, candidate_replicas):
    """Broken: every request to the same replica (the first by name)."""
    return [[min(candidate_replicas, key=lambda r: r.replica_id.unique_id)]]


async def _power_of_two(self, pending_request, candidate_replicas):
    """Broken: no affinity, Serve's power of two choices for every request."""
    return [[]]


def test_everything_on_one_replica_fails_the_spread_check(monkeypatch):
    monkeypatch.setattr(PrefixRouter, "_prefix_match_best_replicas", _to_one_replica)
    chats = steady()
    problems = served.spread_problems(chats, {"a", "b"})
    assert problems[0] == "turn 1 of each conversation served by ['a'], not by each of ['a', 'b']"
    assert len(problems) == 1 + 4  # and the 4 conversations whose anchors pick b
    assert served.stay_problems(chats) == []  # sticky, as one replica is: the spread check is what fails


def test_power_of_two_choices_fail_the_stay_and_cache_checks(monkeypatch):
    monkeypatch.setattr(PrefixRouter, "_prefix_match_best_replicas", _power_of_two)
    chats = steady()
    moved = served.stay_problems(chats)
    assert moved and all("turn" in p for p in moved), moved
    missed = served.cache_problems(chats)
    assert missed and len(missed) >= len(moved) // 2, (moved, missed)
    assert served.spread_problems(chats, {"a", "b"})


def test_hashing_alone_passes_the_steady_checks_and_fails_the_tree_check(monkeypatch):
    """The tree bypassed (it never matches: every request a new prefix, its rendezvous replica): the
    steady-state checks cannot tell, the replacement's can."""
    monkeypatch.setattr(PrefixTree, "prefix_match", lambda self, text, available_tenants=None: ("", None))
    chats = steady()
    assert served.spread_problems(chats, {"a", "b"}) == []
    assert served.stay_problems(chats) == [] and served.cache_problems(chats) == []
    going = replacement()
    problems = served.tree_problems(going, {"a", "b"}, {"a", "c"}, turn=1)
    assert problems and all("moved from a, still serving, to c" in p for p in problems), problems
    assert served.cache_problems([c for c in going if c.replicas()[0] == "a"])  # and their cache is missed


def test_the_tree_check_needs_a_conversation_hashing_would_move():
    """A run in which hashing over the new replicas keeps every conversation in place shows nothing:
    the check says so rather than pass."""
    going = [c for c in served.pick({"a": 12, "b": 4}, start=2000) if served.rendezvous(c.anchor, {"a", "c"}) == "a"]
    replacement(going)
    assert served.tree_problems(going, {"a", "b"}, {"a", "c"}, turn=1) == [
        "no conversation that stayed would have moved by hashing alone: nothing here tells the tree from the hash "
        "(more conversations on the surviving replica)"
    ]


# -- the option ----------------------------------------------------------------


def test_auto_routes_by_prefix_behind_the_router_with_more_than_one_replica():
    two = {"replica_autoscaling": {"min_replicas": 1, "max_replicas": 2}}
    assert AppArgs().resolved_replica_routing() == "power_of_two"  # one replica: nothing to choose
    assert AppArgs(**two).resolved_replica_routing() == "prefix"
    assert AppArgs(**two, ingress="replica").resolved_replica_routing() == "power_of_two"
    assert AppArgs(**two, replica_routing="power_of_two").resolved_replica_routing() == "power_of_two"
    assert AppArgs(replica_routing="prefix").resolved_replica_routing() == "prefix"
    assert "request_router_config" not in AppArgs().replica_options()
    config = RequestRouterConfig(**AppArgs(**two).replica_options()["request_router_config"])
    assert config.request_router_class == routing.CLASS_PATH
    cls = config.get_request_router_class()  # as Serve ships it to the Router (by value)
    assert issubclass(cls, PrefixCacheAffinityRouter) and cls.__name__ == "PrefixRouter"


def test_prefix_routing_with_replica_ingress_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="replica_routing: prefix needs ingress: router"):
        AppArgs(replica_routing="prefix", ingress="replica")
    with pytest.raises(ValueError):
        AppArgs(replica_routing="round_robin")


# -- the Router passes the key -----------------------------------------------------


class Replica:
    """The Router's handle to EngineReplica: records each call's method and keyword arguments."""

    def __init__(self, answer: bytes, stream: list[bytes] | None = None):
        self.answer, self.stream, self.calls = answer, stream, []

    def options(self, stream: bool = False):
        return self

    def __getattr__(self, method):
        replica = self

        class Call:
            def __init__(self):
                self.parts = list(replica.stream or ())

            def __await__(self):
                return asyncio.sleep(0, replica.answer).__await__()

            def __aiter__(self):
                return self

            async def __anext__(self):
                if not self.parts:
                    raise StopAsyncIteration
                return self.parts.pop(0)

            def cancel(self):
                pass

        def remote(*args, **kwargs):
            replica.calls.append((method, kwargs))
            return Call()

        return types.SimpleNamespace(remote=remote)


def make_router(replica: Replica, **args):
    cls = router.Router.func_or_class.__mro__[1]  # the class as written, under Serve's ASGI wrapper
    r = cls.__new__(cls)
    r.args = AppArgs(model=f"builtin:{BASE}", replica_autoscaling={"min_replicas": 2, "max_replicas": 2}, **args)
    r.prefix_routing = r.args.resolved_replica_routing() == "prefix"
    r.replica = r.replica_stream = replica
    r.readiness = types.SimpleNamespace(why_not=lambda: asyncio.sleep(0))
    return r


async def post(r, path: str, body: dict) -> httpx.Response:
    return await asgi_request(router.app, r, "POST", path, json=body)


@pytest.mark.parametrize("routing_option,keyed", [("auto", True), ("power_of_two", False)])
def test_the_router_sends_each_call_its_key(routing_option, keyed):
    reply = wire.ENCODER.encode(Reply(ResponseHead(200, "application/json", "r1"), b"{}"))
    stream = [wire.ENCODER.encode(ResponseHead(200, "text/event-stream", "r1")), http.SSE_DONE]
    handle_ok = wire.ENCODER.encode(HandleReply(ok=HandleCompletion("id", "r1", [1], [])))

    async def go():
        plain, streamed, handle = Replica(reply), Replica(b"", stream), Replica(handle_ok)
        await post(make_router(plain, replica_routing=routing_option), "/v1/chat/completions", chat(LONG))
        await post(
            make_router(streamed, replica_routing=routing_option), "/v1/completions", {"prompt": LONG, "stream": True}
        )
        await make_router(handle, replica_routing=routing_option).complete(
            wire.ENCODER.encode(HandleCompletionRequest(messages=chat(LONG)["messages"]))
        )
        await post(make_router(plain, replica_routing=routing_option), "/tokenize", {"prompt": LONG})
        return plain.calls, streamed.calls, handle.calls

    plain, streamed, handle = run(go())
    want = (lambda key: {KEY_KWARG: key}) if keyed else (lambda key: {})
    assert plain[0] == ("openai_unary", want(http_key("chat", chat(LONG), BASE)))
    assert streamed == [("openai", want(http_key("completions", {"prompt": LONG}, BASE)))]
    assert handle == [("complete", want(http_key("chat", chat(LONG), BASE)))]
    assert plain[1] == ("openai_unary", {})  # /tokenize: no key
    assert json.dumps(plain)  # the key is plain text: it crosses as msgpack, never pickled
