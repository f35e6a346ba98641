"""Prefix-aware routing to the engine replicas (`replica_routing: prefix`): Ray's PrefixCacheAffinityRouter
on a routing key the Router computes, so a conversation's next turn lands where its prefix is cached.

The routing key. The Router has already parsed the request's body for its checks; from that parse it
builds a short string, the key (`http_key`, `handle_key`), and passes it to the replica call as the
keyword argument `routing_key`: Serve hands the call's arguments to the handle's request router, in
the Router's process, which reads the key there (the replica ignores it). The key is plain text
(msgpack on Ray's wire, as the route and body are), never the body again, never pickled.

- Chat messages (`/v1/chat/completions`, a handle's `messages`): each message as its role, 0x1F, its
  text content (a string, or the `text` of each content part; images and tool calls are left out),
  0x1E, one after the other. The next turn's messages extend this one's, so its key does too. The
  key starts with one more character, the conversation's anchor: a hash of its opening (the messages
  up to and including the first user message), which every turn of it shares.
- Text prompts (`/v1/completions` `prompt`, a list of prompts joined): the text itself.
- Token-id prompts (`prompt` as ids, or a list of them joined): the ids as 4-byte unsigned integers.
- `/v1/hidden_states`: its prompt or messages as above, extended by its `completion` when that is of
  the same form (text after text or chat, ids after ids): a verification of a choice lands where the
  choice was generated, whose prefix cache holds it.
- `/tokenize`, `/detokenize`, anything unreadable: no key, so Serve's power of two choices.

That text (UTF-8) or those ids are cut into 32-byte chunks (about 8 tokens of text; 8 ids), the last
one shorter, and each chunk becomes one character (a 20-bit hash, in Unicode's planes 1-16), seeded
by the form (chat, text, ids), the adapter the request names (`model`, when it is not the base
model) and its `cache_salt`: vLLM keeps a prefix cache per adapter and salt, so these never share a
key prefix. Two keys share their first k characters exactly when (up to a 2^-20 chance per chunk)
the requests share their form, adapter, salt and first k chunks. The key is 1/32 of the prompt's
length (4 bytes a character on the wire: 1/8 of the prompt's bytes), and so is the work on it.
Chat keys come from the messages, not the rendered chat template, so a chat request and a text
prompt of the same tokens do not share a key; nor do a text prompt and its token ids. Tools,
documents and chat-template arguments are not part of the key (a routing hint: a miss costs
prefill, never a wrong answer).

The router (`PrefixRouter`) is Ray's policy but for new prefixes: when the candidates' queue lengths
differ by more than `imbalanced_threshold`, power of two choices; else the replicas holding the
longest prefix of the key, if it covers at least `match_rate_threshold` of it, the least loaded of
them taking the request; else (a new prefix) the replica the key's first character picks by
rendezvous hashing over the candidates. The key is inserted for the replica the request went to.
Where it differs from Ray's:
- a new prefix goes to its rendezvous replica, where Ray's picks the smallest share of its tree:
  every Router replica picks the same one without sharing a tree, so a conversation whose turns
  reach different Router replicas still lands on one engine replica (a chat key's first character
  is its conversation's anchor; a text's, its first 32 bytes); new conversations spread evenly
  in expectation, and when a replica leaves, only its own conversations move;
- the tree is Ray's `PrefixTree`, in this process (one per handle: one per Router replica), not
  the detached `PrefixTreeActor` Ray's router calls with a blocking `ray.get`, without timeout,
  two or three times per request, on the routing loop (a wait with no deadline, on the loop every
  request of this Router is routed on);
- a replica's share of the tree is kept under `max_chars_per_replica` key characters (evicted
  least recently used first, down to 90%), so the tree's memory is bounded (Ray's eviction is
  off by default);
- a request without a key routes by power of two choices (Ray's divides by its length: an empty
  text raises);
- replicas added or removed by autoscaling or replaced after a failure become tenants of the tree
  or leave it as Serve reports them (`update_replicas`, `on_replica_actor_died`); a new replica
  takes its rendezvous share of new conversations, and the conversations of one that left move
  to theirs.
LoRA adapters: Serve's model multiplexing is not used here (a request names its adapter by `model`,
and every replica serves every adapter), so requests carry no multiplexed model id and Ray's
multiplexing branch never runs; the adapter is in the key's seed instead.
"""

from __future__ import annotations

import array
import hashlib
import logging
import time
import zlib
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
# The module itself, not the public `ray.serve.llm.request_router`: that one imports Ray Serve LLM's
# deployments (torch, 20 s and 300 MB in the Router's process); the class is the same.
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree
from ray.serve._private.request_router.common import PendingRequest

logger = logging.getLogger(__name__)

KEY_KWARG = "routing_key"  # the replica call's keyword argument the key rides in
CLASS_PATH = "deployments.routing.PrefixRouter"  # Serve's request_router_class
CHUNK_BYTES = 32  # bytes of UTF-8 text, or 8 token ids of 4 bytes, per key character
_PLANE1, _HASH_MASK = 0x10000, (1 << 20) - 1  # key characters: U+10000..U+10FFFF (no surrogates)
_WORD_MUL = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93],
                     dtype=np.uint64)  # CHUNK_BYTES // 8 words per chunk
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def key_of(form: str, data: bytes, adapter: str = "", salt: str = "") -> str:
    """`data` (UTF-8 text or 4-byte ids) as one character per CHUNK_BYTES, seeded by form, adapter, salt."""
    if not data:
        return ""
    seed = np.uint64((zlib.crc32(f"{form}\0{adapter}\0{salt}".encode("utf-8", "surrogatepass"))
                      * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
    words = np.frombuffer(data + bytes(-len(data) % CHUNK_BYTES), dtype="<u8").reshape(-1, len(_WORD_MUL))
    h = (words * _WORD_MUL).sum(axis=1, dtype=np.uint64) ^ seed  # wraps modulo 2^64
    h = (h ^ (h >> np.uint64(30))) * _MIX1  # splitmix64's finalizer
    h = (h ^ (h >> np.uint64(27))) * _MIX2
    h ^= h >> np.uint64(31)
    return ((h & np.uint64(_HASH_MASK)).astype("<u4") + np.uint32(_PLANE1)).tobytes().decode("utf-32-le")


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def chat_text(messages: Sequence[Any]) -> str:
    """The messages' roles and text contents, in order: a turn's text extends the one before."""
    return "".join(f"{m.get('role', '')}\x1f{_content_text(m.get('content'))}\x1e"
                   for m in messages if isinstance(m, dict))


def _ids_bytes(prompt: Any) -> bytes | None:
    """Token ids (a list, or a list of lists) as 4-byte integers; None if it is not that."""
    if not isinstance(prompt, list) or not prompt:
        return None
    try:
        if all(isinstance(t, int) for t in prompt):
            return array.array("I", prompt).tobytes()
        if all(isinstance(p, list) for p in prompt):
            return b"".join(array.array("I", p).tobytes() for p in prompt)
    except (OverflowError, TypeError):  # negative or huge ids: the replica answers them
        return None
    return None


def _text(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return "".join(prompt)
    return None


def _opening(messages: list) -> list:
    """The messages up to and including the first user message: what every turn of a conversation shares."""
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            return messages[:i + 1]
    return messages


def _anchor(data: bytes, adapter: str, salt: str) -> str:
    """One key character for a conversation's opening, whatever its length (its own 20-bit hash)."""
    h = zlib.crc32(data, zlib.crc32(f"opening\0{adapter}\0{salt}".encode("utf-8", "surrogatepass")))
    return chr(_PLANE1 + ((h * 0x9E3779B1) >> 12 & _HASH_MASK))


def _key(prompt: Any, messages: Any, completion: Any, adapter: str, salt: str) -> str:
    if messages is not None:
        if not isinstance(messages, list):
            return ""
        text = chat_text(messages) + (completion if isinstance(completion, str) else "")
        key = key_of("chat", text.encode("utf-8", "surrogatepass"), adapter, salt)
        opening = chat_text(_opening(messages)).encode("utf-8", "surrogatepass")
        return _anchor(opening, adapter, salt) + key if key else ""
    if (text := _text(prompt)) is not None:
        text += completion if isinstance(completion, str) else ""
        return key_of("text", text.encode("utf-8", "surrogatepass"), adapter, salt)
    if (ids := _ids_bytes(prompt)) is not None:
        return key_of("ids", ids + (_ids_bytes(completion) or b""), adapter, salt)
    return ""


def http_key(route: str, req: dict, base_model: str) -> str:
    """The key of an HTTP request's parsed body (the Router's `http.check` parse); "" for none."""
    if route not in ("completions", "chat", "hidden_states"):
        return ""
    model = req.get("model")
    adapter = "" if model is None or model == base_model else str(model)
    salt = req.get("cache_salt")
    return _key(req.get("prompt") if route != "chat" else None, req.get("messages") if route != "completions"
                else None, req.get("completion") if route == "hidden_states" else None, adapter,
                salt if isinstance(salt, str) else "")


def handle_key(req: Any, base_model: str) -> str:
    """The key of a Python handle's request (wire.HandleCompletionRequest)."""
    adapter = "" if req.model is None or req.model == base_model else req.model
    return _key(req.prompt, req.messages, None, adapter, "")


def _rendezvous(first: str, replica: str) -> int:
    """Highest random weight hashing: the replica a key's first character goes to, the same in every Router."""
    return int.from_bytes(hashlib.blake2b(f"{first}\0{replica}".encode("utf-8", "surrogatepass"),
                                          digest_size=8).digest(), "little")


class PrefixRouter(PrefixCacheAffinityRouter):
    """Ray's PrefixCacheAffinityRouter on the Router's routing key, with its tree in this process."""

    def initialize_state(self, imbalanced_threshold: float = 8, match_rate_threshold: float = 0.1,
                         max_chars_per_replica: int = 50_000) -> None:
        if not (imbalanced_threshold >= 0 and 0 <= match_rate_threshold <= 1 and max_chars_per_replica >= 1):
            raise ValueError(f"PrefixRouter: imbalanced_threshold >= 0, 0 <= match_rate_threshold <= 1 and "
                             f"max_chars_per_replica >= 1, not {imbalanced_threshold}, {match_rate_threshold}, "
                             f"{max_chars_per_replica}")
        self._imbalanced_threshold = imbalanced_threshold
        self._match_rate_threshold = match_rate_threshold
        self._max_chars = int(max_chars_per_replica)
        self._evict_to = int(max_chars_per_replica * 0.9)
        self._tree = PrefixTree()  # tenants: ReplicaIDs

    def _extract_text_from_request(self, pending_request: Optional[PendingRequest]) -> str:
        if pending_request is None or not pending_request.kwargs:
            return ""
        key = pending_request.kwargs.get(KEY_KWARG)
        return key if isinstance(key, str) else ""

    async def _imbalanced(self, candidates: list) -> bool:
        """Ray's load check: the candidates' queue lengths (cached, or probed) differ by more than the threshold."""
        lengths, probe = [], []
        for r in candidates:
            n = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if n is None or n >= r.max_ongoing_requests:
                probe.append(r)
            else:
                lengths.append(n)
        if probe:  # Serve's probe, with its own deadline
            lengths += [n for _, n in await self._probe_queue_lens(probe, 0) if n is not None]
        return bool(lengths) and max(lengths) - min(lengths) > self._imbalanced_threshold

    async def _prefix_match_best_replicas(self, pending_request: Optional[PendingRequest],
                                          candidate_replicas: list) -> list[list]:
        """[[replicas to choose among]], or [[]] for power of two choices."""
        key = self._extract_text_from_request(pending_request)
        if not key or not candidate_replicas or await self._imbalanced(candidate_replicas):
            return [[]]
        by_id = {r.replica_id: r for r in candidate_replicas}
        matched, tenants = self._tree.prefix_match(key, list(by_id))
        if len(matched) < self._match_rate_threshold * len(key):  # a new prefix: its rendezvous replica
            tenants = [max(by_id, key=lambda rid: _rendezvous(key[0], rid.unique_id))]
        return [[by_id[rid] for rid in tenants or () if rid in by_id]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        key = self._extract_text_from_request(pending_request)
        if not key:
            return
        self._tree.insert(key, replica_id, time.time())
        held = self._tree.tenant_to_char_count.get(replica_id, 0)
        if held > self._max_chars:
            self._tree.evict_tenant_by_lru(replica_id, held - self._evict_to)

    def update_replicas(self, replicas: list) -> None:
        new = {r.replica_id for r in replicas}
        old = set(self._replica_id_set)
        if added := new - old:
            self._tree.add_tenants(list(added), time.time())
        super(PrefixCacheAffinityRouter, self).update_replicas(replicas)  # Serve's own, not Ray LLM's
        if removed := old - new:
            self._tree.remove_tenants(list(removed))

    def on_replica_actor_died(self, replica_id) -> None:
        super(PrefixCacheAffinityRouter, self).on_replica_actor_died(replica_id)
        self._tree.remove_tenants([replica_id])

    def tree_shares(self) -> dict[str, int]:
        """Each replica's share of the tree, in key characters (for tests and debugging)."""
        return {rid.unique_id: n for rid, n in self._tree.tenant_to_char_count.items()}
