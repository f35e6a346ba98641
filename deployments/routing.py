"""Prefix-aware routing (`replica_routing: prefix`): Ray's PrefixCacheAffinityRouter on a routing
key the Router computes, so a conversation's next turn lands where its prefix is cached.

The key: the Router builds it from the body it already parsed (`http_key`, `handle_key`) and
passes it as the call's `routing_key` keyword, read by the handle's router in the Router's
process. Chat messages: role, 0x1F, text (an image or audio part: a digest of its data or URL),
0x1E per message, led by an anchor character (a hash
of the messages up to the first user message); text prompts: the text; token ids: 4-byte
integers; /v1/hidden_states: prompt extended by its `completion`; anything else: no key
(power of two choices). The bytes are cut into 32-byte chunks, one 20-bit-hash character each,
seeded by form, adapter and `cache_salt` (vLLM's prefix cache is per adapter and salt). A miss
costs prefill, never a wrong answer.

`PrefixRouter` is Ray's policy except: a new prefix goes to the key's first character's
rendezvous replica (the same in every Router replica, no shared tree); the tree is Ray's
`PrefixTree` in this process, not the `PrefixTreeActor` (a blocking `ray.get` on the routing
loop); each replica's share is bounded by `max_chars_per_replica` (LRU down to 90%); a request
without a key uses power of two choices; replicas join and leave the tree as Serve reports them.
"""

from __future__ import annotations

import array
import hashlib
import logging
import time
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

# The module itself, not the public `ray.serve.llm.request_router`: that one imports Ray Serve LLM's
# deployments (torch, 20 s and 300 MB in the Router's process); the class is the same. These private Ray
# names are listed, with the drift check's symbols for them, in hidden_states/vllm/patches/ray_internals.py.
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree
from ray.serve._private.request_router.common import PendingRequest

logger = logging.getLogger(__name__)

KEY_KWARG = "routing_key"  # the replica call's keyword argument the key rides in
CLASS_PATH = "deployments.routing.PrefixRouter"  # Serve's request_router_class
CHUNK_BYTES = 32  # bytes of UTF-8 text, or 8 token ids of 4 bytes, per key character
_PLANE1, _HASH_MASK = 0x10000, (1 << 20) - 1  # key characters: U+10000..U+10FFFF (no surrogates)
_WORD_MUL = np.array(
    [0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93], dtype=np.uint64
)  # CHUNK_BYTES // 8 words per chunk
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def key_of(form: str, data: bytes, adapter: str = "", salt: str = "") -> str:
    """`data` (UTF-8 text or 4-byte ids) as one character per CHUNK_BYTES, seeded by form, adapter, salt."""
    if not data:
        return ""
    seed = np.uint64(
        (zlib.crc32(f"{form}\0{adapter}\0{salt}".encode("utf-8", "surrogatepass")) * 0x9E3779B97F4A7C15)
        & 0xFFFFFFFFFFFFFFFF
    )
    words = np.frombuffer(data + bytes(-len(data) % CHUNK_BYTES), dtype="<u8").reshape(-1, len(_WORD_MUL))
    h = (words * _WORD_MUL).sum(axis=1, dtype=np.uint64) ^ seed  # wraps modulo 2^64
    h = (h ^ (h >> np.uint64(30))) * _MIX1  # splitmix64's finalizer
    h = (h ^ (h >> np.uint64(27))) * _MIX2
    h ^= h >> np.uint64(31)
    return ((h & np.uint64(_HASH_MASK)).astype("<u4") + np.uint32(_PLANE1)).tobytes().decode("utf-32-le")


def _part_text(part: Any) -> str:
    """A content part's text; an image's or audio's: a digest of its payload between 0x1D marks, so
    the same text about different media keys apart, and the same media keys alike."""
    if not isinstance(part, dict):
        return ""
    if isinstance(part.get("text"), str):
        return part["text"]
    media = part.get(part.get("type") or "")
    if media is None:
        return ""
    payload = media.get("url") or media.get("data") if isinstance(media, dict) else media
    return "\x1d" + hashlib.blake2b(str(payload).encode("utf-8", "surrogatepass"), digest_size=8).hexdigest() + "\x1d"


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(p) for p in content)
    return ""


def chat_text(messages: Sequence[Any]) -> str:
    """The messages' roles and text contents, in order: a turn's text extends the one before."""
    return "".join(
        f"{m.get('role', '')}\x1f{_content_text(m.get('content'))}\x1e" for m in messages if isinstance(m, dict)
    )


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
            return messages[: i + 1]
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
    return _key(
        req.get("prompt") if route != "chat" else None,
        req.get("messages") if route != "completions" else None,
        req.get("completion") if route == "hidden_states" else None,
        adapter,
        salt if isinstance(salt, str) else "",
    )


def handle_key(req: Any, base_model: str) -> str:
    """The key of a Python handle's request (wire.HandleCompletionRequest)."""
    adapter = "" if req.model is None or req.model == base_model else req.model
    return _key(req.prompt, req.messages, None, adapter, "")


def _rendezvous(first: str, replica: str) -> int:
    """Highest random weight hashing: the replica a key's first character goes to, the same in every Router."""
    return int.from_bytes(
        hashlib.blake2b(f"{first}\0{replica}".encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little"
    )


class PrefixRouter(PrefixCacheAffinityRouter):
    """Ray's PrefixCacheAffinityRouter on the Router's routing key, with its tree in this process."""

    def initialize_state(
        self, imbalanced_threshold: float = 8, match_rate_threshold: float = 0.1, max_chars_per_replica: int = 50_000
    ) -> None:
        if not (imbalanced_threshold >= 0 and 0 <= match_rate_threshold <= 1 and max_chars_per_replica >= 1):
            raise ValueError(
                f"PrefixRouter: imbalanced_threshold >= 0, 0 <= match_rate_threshold <= 1 and "
                f"max_chars_per_replica >= 1, not {imbalanced_threshold}, {match_rate_threshold}, "
                f"{max_chars_per_replica}"
            )
        self._imbalanced_threshold = imbalanced_threshold
        self._match_rate_threshold = match_rate_threshold
        self._max_chars = int(max_chars_per_replica)
        self._evict_to = int(max_chars_per_replica * 0.9)
        self._tree = PrefixTree()  # tenants: ReplicaIDs

    def _extract_text_from_request(self, pending_request: PendingRequest | None) -> str:
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

    async def _prefix_match_best_replicas(
        self, pending_request: PendingRequest | None, candidate_replicas: list
    ) -> list[list]:
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
