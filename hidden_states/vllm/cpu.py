"""CPU engines: start-up steps before a replica takes traffic (ledger points 6, 7: internals read), and the
installation of the CPU fixes in each worker (points 11, 13, 18: hidden_states/vllm/patches/). `cpu_start_up()`
runs them from the engine through `collective_rpc`; `CPUWorkerSteps` (mixed into the worker extension) does
them in each worker.
"""

from __future__ import annotations

import logging
from typing import Any

from hidden_states.vllm import _require
from hidden_states.vllm.patches import install
from hidden_states.vllm.patches.mm_prefix_attention import mm_prefix_model

logger = logging.getLogger(__name__)


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def warm_up_sizes(max_tokens: int) -> list[int]:
    """Batch sizes 1..`max_tokens`, most useful first: every size to 64, every 8th to 512, every
    64th beyond, then the rest."""
    first = [*range(1, 65), *range(72, 513, 8), *range(576, max_tokens + 1, 64)]
    first = [n for n in first if n <= max_tokens]
    seen = set(first)
    return first + [n for n in range(1, max_tokens + 1) if n not in seen]


async def cpu_start_up(
    llm: Any, prefault_kv_cache: bool, warm_up_s: float, malloc_trim_interval_s: float, timeout_s: float
) -> dict[str, Any]:
    """A CPU engine's start-up steps, before it takes requests; returns what they did."""
    out: dict[str, Any] = {}
    if llm.vllm_config.lora_config is not None:  # base rows next to adapter rows stay base rows (point 11)
        out["cpu_lora_fix"] = all(await llm.collective_rpc("hidden_states_fix_cpu_lora", timeout=timeout_s))
    if llm.vllm_config.speculative_config is not None:  # greedy rows stay greedy beside sampled ones (point 13)
        out["cpu_spec_sampling_fix"] = all(
            await llm.collective_rpc("hidden_states_fix_cpu_spec_sampling", timeout=timeout_s)
        )
    if mm_prefix_model(llm.vllm_config):  # Gemma 3's images attend both ways, as in transformers (point 18)
        out["cpu_mm_prefix_fix"] = all(await llm.collective_rpc("hidden_states_fix_cpu_mm_prefix", timeout=timeout_s))
    if prefault_kv_cache:  # resident memory flat from the start (ledger point 6)
        touched = await llm.collective_rpc("hidden_states_prefault_kv_cache", timeout=timeout_s)
        out["kv_cache_prefaulted_bytes"] = sum(touched)
    if warm_up_s > 0:  # kernel caches at their working size before the first request (point 7)
        sizes = warm_up_sizes(llm.vllm_config.scheduler_config.max_num_batched_tokens)
        done = await llm.collective_rpc("hidden_states_warm_up", timeout=timeout_s + warm_up_s, args=(sizes, warm_up_s))
        out.update(
            warm_up_batch_sizes=min(n for n, _ in done),
            warm_up_of=len(sizes),
            warm_up_seconds=round(max(t for _, t in done), 3),
        )
    if malloc_trim_interval_s > 0:  # free heap pages back to the OS when idle (malloc_trim.py)
        started = await llm.collective_rpc(
            "hidden_states_start_trimmer", timeout=timeout_s, args=(malloc_trim_interval_s,)
        )
        out["malloc_trim_interval_s"] = malloc_trim_interval_s if all(started) else None
    return out


class CPUWorkerSteps:
    """Worker-side start-up steps of a CPU engine (no-ops on other devices)."""

    def hidden_states_prefault_kv_cache(self) -> int:
        """Ledger point 6: write every KV-cache page once; returns the bytes touched."""
        runner = getattr(self, "model_runner", None)
        _require(runner is not None and hasattr(runner, "kv_caches"), "GPUModelRunner.kv_caches")
        if getattr(runner, "device", None) is None or runner.device.type != "cpu":
            return 0
        touched, seen = 0, set()
        stack = list(runner.kv_caches)
        while stack:
            t = stack.pop()
            if isinstance(t, (list, tuple)):
                stack.extend(t)
                continue
            if t is None or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            t.zero_()  # the cache holds nothing yet: zeroing only maps the pages
            touched += t.numel() * t.element_size()
        logger.info("KV cache pre-faulted: %.1f MiB", touched / 2**20)
        return touched

    def hidden_states_warm_up(self, sizes: list[int], budget_s: float) -> tuple[int, float]:
        """Ledger point 7: one dummy forward per batch size in `sizes`, in order, until
        `budget_s` seconds have passed; returns (sizes run, seconds taken)."""
        import time

        runner = getattr(self, "model_runner", None)
        _require(runner is not None and hasattr(runner, "_dummy_run"), "GPUModelRunner._dummy_run")
        if getattr(runner, "device", None) is None or runner.device.type != "cpu":
            return 0, 0.0
        t0, done = time.perf_counter(), 0
        for n in sizes:
            if time.perf_counter() - t0 >= budget_s:
                break
            runner._dummy_run(int(n), force_attention=True)
            done += 1
        took = time.perf_counter() - t0
        logger.info("warmed up %d of %d batch sizes in %.1f s", done, len(sizes), took)
        return done, took

    def hidden_states_fix_cpu_lora(self) -> bool:
        """Ledger point 11 in this worker process (patches/lora_ops.py)."""
        return install("worker", "lora")["lora_ops"]

    def hidden_states_fix_cpu_spec_sampling(self, fixed: bool = True) -> bool:
        """Ledger point 13 in this worker process; `fixed=False` puts vLLM's own kernel back
        (the tests show the bug with it; patches/spec_expand_kernel.py)."""
        return install("worker", "spec_sampling", fixed=fixed)["spec_expand_kernel"]

    def hidden_states_fix_cpu_mm_prefix(self, fixed: bool = True) -> bool:
        """Ledger point 18 in this worker process; `fixed=False` puts vLLM's causal kernel back (the
        tests show the difference with it; patches/mm_prefix_attention.py)."""
        return install("worker", "mm_prefix", fixed=fixed)["mm_prefix_attention"]

    def hidden_states_start_trimmer(self, interval_s: float) -> bool:
        """Starts the worker's malloc_trim thread (hidden_states/malloc_trim.py; not a patch)."""
        from hidden_states.malloc_trim import MallocTrimmer

        if getattr(self, "_hidden_states_trimmer", None) is not None:
            return False
        self._hidden_states_trimmer = MallocTrimmer(interval_s).start()
        return self._hidden_states_trimmer.available
