"""Part 4, memory: a replica's resident memory across many requests with hidden states.

The replica's pid comes from our `/debug/stats`; its resident memory is the RSS
of that process plus its descendants (vLLM's engine-core and worker processes),
sampled every half second for the peak, and at: start (before the first
request), after the first 100, at the end (2 s after the last answer), and
settled (`settle_s` after the last answer: the engine idle, its worker's
malloc_trim run; hidden_states/malloc_trim.py). Start and settled are both idle
states, so settled vs start is what the run left behind; end vs after-100 (the
target) also counts the allocator's high-water mark under load.
"""

from __future__ import annotations

import time

from bench import measure, workload
from bench.load import Result, run_batch
from bench.servers import Endpoint, replica_info


def run(
    ep: Endpoint,
    vocab: int,
    total: int,
    concurrency: int,
    first: int = 100,
    on_done=None,
    extra_pids: dict[str, int] | None = None,
    settle_s: float = 15.0,
) -> dict:
    stats0 = replica_info(ep.stats_url)
    pid = int(stats0["replica"]["pid"])
    time.sleep(settle_s)  # start idle and trimmed too, whatever ran before (the stats call above included)
    sampler = measure.RssSampler(pid)
    start_total, start_per = measure.rss_tree(pid)
    sampler.series.append((0.0, start_total))
    sampler.peak = start_total
    extra = {k: [measure.rss_tree(p)[0]] for k, p in (extra_pids or {}).items()}
    sh = workload.shapes(total, seed=workload.SEED + 4)

    def bodies(lo, hi):
        return [
            (
                Result(i, sh[i].prompt_tokens, sh[i].max_tokens),
                workload.body(
                    ep.model,
                    sh[i],
                    vocab,
                    f"mem-{i}",
                    {"return_hidden_states": True, "hidden_states_encoding": "base64" if i % 2 else "float"},
                ),
            )
            for i in range(lo, hi)
        ]

    sampler.start()
    t0 = time.perf_counter()
    b1 = run_batch(ep.url, bodies(0, first), concurrency, on_done=on_done)
    after_first, after_per = measure.rss_tree(pid)
    for k, p in (extra_pids or {}).items():
        extra[k].append(measure.rss_tree(p)[0])
    b2 = run_batch(ep.url, bodies(first, total), concurrency, on_done=on_done)
    wall = time.perf_counter() - t0
    time.sleep(2)
    end_total, end_per = measure.rss_tree(pid)
    sampler.stop()
    sampler.series.append((time.perf_counter() - sampler.t0, end_total))
    peak = max(sampler.peak, end_total, after_first)
    for k, p in (extra_pids or {}).items():
        extra[k].append(measure.rss_tree(p)[0])
    # Nothing may ask the engine anything meanwhile: a stats call wakes the worker, which then
    # is not idle and does not trim.
    time.sleep(max(0.0, settle_s - 2))
    settled_total, settled_per = measure.rss_tree(pid)
    stats1 = replica_info(ep.stats_url)
    results = b1.results + b2.results
    ok = [r for r in results if r.ok]
    growth = (end_total - after_first) / after_first if after_first else None
    trims = [
        sum(w.get("malloc_trim", {}).get("trims", 0) for w in (st.get("replica") or {}).get("workers", []))
        for st in (stats0, stats1)
    ]
    return {
        "replica_pid": pid,
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "with_vector": sum(1 for r in ok if r.hs_tokens),
        "concurrency": concurrency,
        "wall_s": wall,
        "rss_bytes": {"start": start_total, f"after_{first}": after_first, "peak": peak, "end": end_total},
        "end_vs_after_first": growth,
        "settled_s": settle_s,
        "settled_bytes": settled_total,
        "per_process_settled": settled_per,
        "settled_vs_start": (settled_total - start_total) / start_total if start_total else None,
        "worker_trims_before_after": trims,
        "per_process_start": start_per,
        "per_process_after_first": after_per,
        "per_process_end": end_per,
        "other_processes_rss_bytes": {k: dict(zip(("start", f"after_{first}", "end"), v)) for k, v in extra.items()},
        "series": [(round(t, 2), v) for t, v in sampler.series],
        "replica_stats_before": stats0.get("replica"),
        "replica_stats_after": stats1.get("replica"),
        "ingress_after": stats1.get("ingress"),
    }
