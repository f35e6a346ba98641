"""Side-by-side comparisons: arms alternate round by round on the same request shapes.

Round r runs every arm once, starting from arm r mod k (A,B / B,A / ... for two
arms), so no arm always goes first. Each arm's requests in a round have the same
(prompt, completion) lengths as the other arms' but their own token contents.

When every arm reaches one engine (`one_engine`: hidden states on vs off), a round
at concurrency 1 is one request: the arms alternate request by request (the same
requests as `rounds` rounds of `per_round`), so the machine's drift over seconds,
which here moves whole rounds by +-20%, falls on every arm alike. Not across
servers: each vLLM engine busy-waits for a second after its last step, so there
every request would run beside the previous arm's spinning engine, always the same
one (measured: our app 1.28x of vLLM's server that way, 1.05x in rounds). Every
ratio comes with a 95% interval, bootstrapped over the rounds
(`measure.paired_ratio_ci`), where there are enough of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from bench import measure, workload
from bench.load import Batch, Result, run_batch
from bench.servers import Endpoint


@dataclass
class Arm:
    key: str
    label: str
    endpoint: Endpoint
    extra: dict = field(default_factory=dict)  # extra request fields, e.g. return_hidden_states


@dataclass
class ArmRun:
    arm: str
    round: int
    concurrency: int
    batch: Batch
    cpu: dict


def warmup(arms: list[Arm], vocab: int, n: int, concurrency: int, tag: str) -> None:
    sh = workload.shapes(n, seed=workload.SEED + 7)
    for a in arms:
        bodies = [
            (
                Result(i, s.prompt_tokens, s.max_tokens),
                workload.body(a.endpoint.model, s, vocab, f"warm-{tag}-{a.key}-{i}", a.extra),
            )
            for i, s in enumerate(sh)
        ]
        run_batch(a.endpoint.url, bodies, concurrency)


def run(
    arms: list[Arm],
    vocab: int,
    concurrency: int,
    rounds: int,
    per_round: int,
    tag: str,
    cpu: measure.CpuAccount,
    on_done: Callable[[Result], None] | None = None,
    check: Callable[[], None] | None = None,
    one_engine: bool = False,
) -> list[ArmRun]:
    """Returns one ArmRun per (round, arm). `one_engine`: every arm reaches the same engine."""
    all_shapes = workload.shapes(rounds * per_round, seed=workload.SEED + concurrency)
    if one_engine and concurrency == 1:  # the same requests, the arms alternating one at a time
        rounds, per_round = rounds * per_round, 1
    out = []
    for r in range(rounds):
        sh = all_shapes[r * per_round : (r + 1) * per_round]
        order = [arms[(r + i) % len(arms)] for i in range(len(arms))]
        for a in order:
            if check:
                check()
            bodies = [
                (
                    Result(i, s.prompt_tokens, s.max_tokens),
                    workload.body(a.endpoint.model, s, vocab, f"{tag}-c{concurrency}-r{r}-{a.key}-{i}", a.extra),
                )
                for i, s in enumerate(sh)
            ]
            before = cpu.snapshot()
            batch = run_batch(a.endpoint.url, bodies, concurrency, on_done=on_done)
            after = cpu.snapshot()
            if check:
                check()  # a server killed during the batch: its errors must not count as results
            out.append(ArmRun(a.key, r, concurrency, batch, cpu.delta(before, after)))
    return out


def summarize(runs: list[ArmRun], arm: str) -> dict:
    """Pooled over rounds: throughput = requests (tokens) / summed wall time; latency percentiles."""
    mine = [x for x in runs if x.arm == arm]
    results = [r for x in mine for r in x.batch.results]
    ok = [r for r in results if r.ok]
    wall = sum(x.batch.wall for x in mine)
    lat = [r.latency for r in ok]
    toks = sum(r.completion_tokens for r in ok)
    roles: dict[str, float] = {}
    detail: dict[str, float] = {}
    for x in mine:
        for k, v in x.cpu["roles"].items():
            roles[k] = roles.get(k, 0.0) + v
        for k, v in x.cpu.get("ray_system_detail", {}).items():
            detail[k] = detail.get(k, 0.0) + v
    busy = sum(x.cpu["busy"] for x in mine)
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if r.error})[:3],
        "inexact_lengths": sum(1 for r in ok if r.completion_tokens != r.max_tokens),
        "wall_s": wall,
        "req_per_s": len(ok) / wall if wall else None,
        "out_tok_per_s": toks / wall if wall else None,
        "p50_s": measure.pct(lat, 50),
        "p99_s": measure.pct(lat, 99),
        "per_round_req_per_s": [len(x.batch.ok) / x.batch.wall for x in mine],
        "cpu_s_per_request": {k: v / max(1, len(ok)) for k, v in sorted(roles.items())},
        "ray_system_cpu_s_per_request": {
            k: v / max(1, len(ok))
            for k, v in sorted(detail.items(), key=lambda kv: -kv[1])
            if v / max(1, len(ok)) >= 1e-4
        },
        "cpu_busy_cores": busy / wall if wall else None,
        "not_ours_cores": roles.get("other (not ours)", 0.0) / wall if wall else None,
    }


def compare(runs: list[ArmRun], arm: str, base: str) -> dict:
    a, b = summarize(runs, arm), summarize(runs, base)
    pa = {x.round: (len(x.batch.ok), x.batch.wall) for x in runs if x.arm == arm}
    pb = {x.round: (len(x.batch.ok), x.batch.wall) for x in runs if x.arm == base}
    both = [r for r in sorted(pa) if r in pb]
    per_round = [(pa[r][0] / pa[r][1]) / (pb[r][0] / pb[r][1]) for r in both if pb[r][0] and pa[r][1] and pb[r][1]]
    ci = measure.paired_ratio_ci([pa[r] for r in both], [pb[r] for r in both])
    return {
        "req_per_s": measure.ratio(a["req_per_s"], b["req_per_s"]),
        "out_tok_per_s": measure.ratio(a["out_tok_per_s"], b["out_tok_per_s"]),
        "p50": measure.ratio(a["p50_s"], b["p50_s"]),
        "p99": measure.ratio(a["p99_s"], b["p99_s"]),
        "p50_added_ms": None if a["p50_s"] is None or b["p50_s"] is None else (a["p50_s"] - b["p50_s"]) * 1e3,
        "p99_added_ms": None if a["p99_s"] is None or b["p99_s"] is None else (a["p99_s"] - b["p99_s"]) * 1e3,
        "per_round_req_per_s": per_round,
        "req_per_s_ci95": None if ci is None else list(ci),
    }


def paired_added_latency(runs: list[ArmRun], arm: str, base: str) -> list[float]:
    """Per request: latency(arm) - latency(base) for the same round and the same shape (seconds)."""
    out = []
    by = {(x.arm, x.round): x for x in runs}
    for (k, r), x in by.items():
        if k != arm or (base, r) not in by:
            continue
        other = {res.index: res for res in by[(base, r)].batch.results}
        for res in x.batch.results:
            o = other.get(res.index)
            if o is not None and res.ok and o.ok:
                out.append(res.latency - o.latency)
    return out


def overhead_probe(arms: list[Arm], vocab: int, n: int, tag: str, prompt_tokens: int = 16) -> dict:
    """A serving layer's fixed cost per request, apart from the engine's: `n` requests of
    `prompt_tokens` prompt tokens and 1 completion token per arm, one at a time, the arms
    interleaved request by request (the first rotates), so each one sees the machine the others
    see. Returns per arm {"n", "p50_ms", "p90_ms", "errors"} and, for every arm but the first,
    `added_p50_ms` over the first (the baseline: vLLM's own server)."""
    lat: dict[str, list[float]] = {a.key: [] for a in arms}
    errors = {a.key: 0 for a in arms}
    shape = workload.Shape(prompt_tokens, 1)
    for i in range(n):
        for a in arms[i % len(arms) :] + arms[: i % len(arms)]:
            body = workload.body(a.endpoint.model, shape, vocab, f"probe-{tag}-{a.key}-{i}", a.extra)
            r = run_batch(a.endpoint.url, [(Result(i, prompt_tokens, 1), body)], 1).results[0]
            if r.ok:
                lat[a.key].append(r.latency)
            else:
                errors[a.key] += 1
    out = {}
    for a in arms:
        v = lat[a.key]
        out[a.key] = {
            "n": len(v),
            "errors": errors[a.key],
            **{f"p{q}_ms": None if not v else 1000 * measure.pct(v, q) for q in (50, 90)},
        }
    base = out[arms[0].key]["p50_ms"]
    for a in arms[1:]:
        p = out[a.key]["p50_ms"]
        out[a.key]["added_p50_ms"] = None if p is None or base is None else p - base
    return out
