"""The private Ray internals the deployments use (not a patch of vLLM; no ledger number: point 0 in the registry).

Why: Ray Serve has no public API for a prefix-aware router that also balances by queue length, nor for
reading which of Serve's switches reached a process.
What: deployments/routing.py's `PrefixRouter` subclasses `ray.llm._internal...PrefixCacheAffinityRouter`
(overriding `initialize_state`, `_extract_text_from_request`, `_prefix_match_best_replicas`,
`on_request_routed`, `update_replicas`, `on_replica_actor_died`), uses its `PrefixTree`, the base
`RequestRouter`'s queue-length cache and probes, `PendingRequest` and `RunningReplica`;
deployments/replica.py and deployments/serve_env.py read `ray.serve._private.constants` (the switches
`serve_env` sets, e.g. RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD). Nothing of Ray is patched.
Relies on: the symbols below (the drift check runs them with vLLM's).
Remove when: Ray Serve exposes these as public API (or re-check at each Ray upgrade).
"""

from __future__ import annotations

from hidden_states.vllm.patches.drift import _PREFIX, _RR, Symbol

RELIED: tuple[Symbol, ...] = (
    Symbol(f"{_PREFIX}.prefix_aware_router:PrefixCacheAffinityRouter", "ray", kind="class"),
    Symbol(f"{_PREFIX}.prefix_aware_router:PrefixCacheAffinityRouter.initialize_state", "ray", kind="override"),
    Symbol(
        f"{_PREFIX}.prefix_aware_router:PrefixCacheAffinityRouter._extract_text_from_request",
        "ray",
        ("pending_request",),
        "override",
        exact=True,
    ),
    Symbol(
        f"{_PREFIX}.prefix_aware_router:PrefixCacheAffinityRouter._prefix_match_best_replicas",
        "ray",
        ("pending_request", "candidate_replicas"),
        "override",
        exact=True,
    ),
    Symbol(
        f"{_PREFIX}.prefix_aware_router:PrefixCacheAffinityRouter.on_request_routed",
        "ray",
        ("pending_request", "replica_id", "result"),
        "override",
        exact=True,
    ),
    Symbol(
        f"{_PREFIX}.prefix_aware_router:PrefixCacheAffinityRouter.update_replicas",
        "ray",
        ("replicas",),
        "override",
        exact=True,
    ),
    Symbol(
        f"{_PREFIX}.prefix_aware_router:PrefixCacheAffinityRouter.on_replica_actor_died",
        "ray",
        ("replica_id",),
        "override",
        exact=True,
    ),
    Symbol(
        f"{_PREFIX}.prefix_aware_router:PrefixCacheAffinityRouter.choose_replicas",
        "ray",
        ("candidate_replicas", "pending_request"),
        "method",
        mentions=("self._prefix_match_best_replicas(pending_request, candidate_replicas)",),
    ),
    Symbol(f"{_RR}.initialize_state", "ray", kind="method"),
    Symbol(f"{_RR}.update_replicas", "ray", ("replicas",), "called"),
    Symbol(f"{_RR}.on_replica_actor_died", "ray", ("replica_id",), "called"),
    Symbol(f"{_RR}._probe_queue_lens", "ray", ("replicas", "backoff_index"), "called"),
    Symbol(f"{_RR}._replica_queue_len_cache", "ray", kind="init attr"),
    Symbol(f"{_RR}._use_replica_queue_len_cache", "ray", kind="init attr"),
    Symbol(f"{_RR}._replica_id_set", "ray", kind="init attr"),
    Symbol(
        "ray.serve._private.router:AsyncioRouter.request_router",
        "ray",
        kind="property",
        mentions=("request_router.initialize_state(**(self._request_router_kwargs))",),
    ),
    Symbol("ray.serve._private.request_router.common:ReplicaQueueLengthCache.get", "ray", ("replica_id",), "called"),
    Symbol("ray.serve._private.request_router.common:PendingRequest", "ray", kind="class"),
    Symbol("ray.serve._private.request_router.common:PendingRequest.kwargs", "ray", kind="field"),
    Symbol("ray.serve._private.request_router.replica_wrapper:RunningReplica.replica_id", "ray", kind="property"),
    Symbol(
        "ray.serve._private.request_router.replica_wrapper:RunningReplica.max_ongoing_requests", "ray", kind="property"
    ),
    Symbol("ray.serve._private.common:ReplicaID.unique_id", "ray", kind="field"),
    Symbol(f"{_PREFIX}.prefix_tree:PrefixTree", "ray", (), "class"),
    Symbol(f"{_PREFIX}.prefix_tree:PrefixTree.prefix_match", "ray", ("text", "available_tenants"), "called"),
    Symbol(f"{_PREFIX}.prefix_tree:PrefixTree.insert", "ray", ("text", "tenant", "time_s"), "called"),
    Symbol(f"{_PREFIX}.prefix_tree:PrefixTree.evict_tenant_by_lru", "ray", ("tenant", "min_remove_size"), "called"),
    Symbol(f"{_PREFIX}.prefix_tree:PrefixTree.add_tenants", "ray", ("tenants", "time_s"), "called"),
    Symbol(f"{_PREFIX}.prefix_tree:PrefixTree.remove_tenants", "ray", ("tenants",), "called"),
    Symbol(f"{_PREFIX}.prefix_tree:PrefixTree.tenant_to_char_count", "ray", kind="init attr"),
    *(
        Symbol(f"ray.serve._private.constants:{name}", "ray", kind="environment variable")
        for name in (
            "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD",
            "RAY_SERVE_ENABLE_DIRECT_INGRESS",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT",
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S",
        )
    ),
)
