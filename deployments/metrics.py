"""The server's own metrics, through `ray.serve.metrics` (Ray's Prometheus endpoint, beside vLLM's).

Metrics are created on first use in the recording process, so the module imports anywhere.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from hidden_states.interface import VectorEvent

logger = logging.getLogger(__name__)

SECONDS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60]
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096]


@functools.cache
def _metrics() -> dict[str, Any] | None:
    try:
        import ray
        from ray.serve.metrics import Counter, Gauge, Histogram

        if not ray.is_initialized():
            return None
    except Exception:
        return None
    return {
        "vectors": Counter(
            "hidden_states_vectors",
            "vectors returned, by the step that computed them (tail, extraction, prompt) and position",
            tag_keys=("via", "position"),
        ),
        "seconds": Histogram(
            "hidden_states_extraction_seconds",
            "from a choice's end to its vector",
            boundaries=SECONDS,
            tag_keys=("via",),
        ),
        "computed": Histogram(
            "hidden_states_computed_tokens",
            "positions computed per vector (1 is the floor)",
            boundaries=TOKENS,
            tag_keys=("via",),
        ),
        "cached": Counter(
            "hidden_states_cached_tokens",
            "tokens found in the KV/prefix cache instead of recomputed",
            tag_keys=("via",),
        ),
        "bytes": Counter("hidden_states_vector_bytes", "float32 bytes of vectors returned (before encoding)"),
        "head_outputs": Counter(
            "hidden_states_head_outputs", "positions a head's outputs were returned for, by head", tag_keys=("head",)
        ),
        "head_bytes": Counter(
            "hidden_states_head_bytes",
            "bytes of heads' outputs returned (float32 values, int32 SAE indices; before encoding)",
        ),
        "refused": Counter(
            "hidden_states_requests_refused", "requests refused before any engine work, by status", tag_keys=("status",)
        ),
        "faults": Gauge(
            "hidden_states_vector_faults",
            "the replica's vector fault counters since start (timeouts, malformed_vectors, missing_vectors)",
            tag_keys=("counter",),
        ),
    }


def vector(event: VectorEvent) -> None:
    """An engine observer: one vector handed to a caller."""
    m = _metrics()
    if m is None:
        return
    m["vectors"].inc(tags={"via": event.via, "position": event.position})
    if event.nbytes > 0:
        m["bytes"].inc(event.nbytes)
    for head, n in event.head_outputs.items():
        if n > 0:
            m["head_outputs"].inc(n, tags={"head": head})
    if event.head_bytes > 0:
        m["head_bytes"].inc(event.head_bytes)
    if event.computed_tokens is not None:
        m["computed"].observe(event.computed_tokens, tags={"via": event.via})
        if event.cached_tokens:  # Ray's counters take positive increments only
            m["cached"].inc(event.cached_tokens, tags={"via": event.via})
    if event.seconds is not None:
        m["seconds"].observe(event.seconds, tags={"via": event.via})


def refused(status: int) -> None:
    m = _metrics()
    if m is not None:
        m["refused"].inc(tags={"status": str(status)})


FAULTS = ("timeouts", "malformed_vectors", "missing_vectors", "hook_faults")


def faults(stats: dict) -> None:
    """Sets the vector-fault gauges from an engine's stats()."""
    m = _metrics()
    if m is None:
        return
    for name in FAULTS:
        m["faults"].set(stats.get(name, 0), tags={"counter": name})
