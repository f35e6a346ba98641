"""The benchmark's own statistics: paired ratio intervals and the order arms run in; the one-engine
harness of the engine's benches (bench.arms)."""

from __future__ import annotations

import pytest

from bench import compare, measure
from bench.load import Batch
from bench.servers import Endpoint


def test_interval_covers_a_known_ratio_and_narrows_with_rounds():
    # arm a is 1.25x faster than b in every round, with +-10% round-to-round noise on both alike
    drift = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.08, 0.92]
    a = [(8, 4.0 * d) for d in drift]
    b = [(8, 5.0 * d) for d in drift]
    lo, hi = measure.paired_ratio_ci(a, b)
    assert lo == pytest.approx(1.25) and hi == pytest.approx(1.25)  # drift shared by the pair cancels

    import random

    rng = random.Random(3)
    noisy = [((8, 4.0 * rng.uniform(0.8, 1.2)), (8, 5.0 * rng.uniform(0.8, 1.2))) for _ in range(200)]
    few = measure.paired_ratio_ci([x for x, _ in noisy[:10]], [y for _, y in noisy[:10]])
    many = measure.paired_ratio_ci([x for x, _ in noisy], [y for _, y in noisy])
    assert many[0] < 1.25 < many[1]
    assert many[1] - many[0] < few[1] - few[0]


def test_no_interval_from_too_few_rounds():
    assert measure.paired_ratio_ci([(8, 4.0)] * 4, [(8, 5.0)] * 4) is None
    assert measure.paired_ratio_ci([(8, 4.0)] * 5, [(8, 5.0)] * 5) is not None


def _fake_runs(monkeypatch, arms, concurrency, rounds, per_round, one_engine=True):
    calls = []

    def fake_run_batch(url, bodies, c, on_done=None):
        calls.append((url, len(bodies), c))
        return Batch([r for r, _ in bodies], wall=1.0, started=0.0)

    monkeypatch.setattr(compare, "run_batch", fake_run_batch)

    class Cpu:
        def snapshot(self):
            return {}

        def delta(self, before, after):
            return {"roles": {}, "busy": 0.0}

    runs = compare.run(arms, 1000, concurrency, rounds, per_round, "t", Cpu(), one_engine=one_engine)
    return calls, runs


def test_one_engine_at_concurrency_one_alternates_request_by_request(monkeypatch):
    arms = [compare.Arm(k, k, Endpoint(k, k, f"http://{k}/v1/completions", "m")) for k in ("on", "off")]
    calls, runs = _fake_runs(monkeypatch, arms, 1, rounds=3, per_round=4)
    assert len(calls) == 24 and all(n == 1 and c == 1 for _, n, c in calls)  # 12 requests per arm, one at a time
    order = [url.split("/")[2] for url, _, _ in calls]
    assert order[:6] == ["on", "off", "off", "on", "on", "off"]  # the first arm rotates
    # each request's shape is the same in both arms of its round
    by = {(x.arm, x.round): x.batch.results[0] for x in runs}
    assert all(by[("on", r)].prompt_tokens == by[("off", r)].prompt_tokens for r in range(12))


def test_higher_concurrency_keeps_whole_rounds(monkeypatch):
    arms = [compare.Arm(k, k, Endpoint(k, k, f"http://{k}/v1/completions", "m")) for k in ("on", "off")]
    calls, _ = _fake_runs(monkeypatch, arms, 8, rounds=3, per_round=16)
    assert len(calls) == 6 and all(n == 16 and c == 8 for _, n, c in calls)


def test_separate_servers_keep_whole_rounds_at_concurrency_one(monkeypatch):
    # each server's engine busy-waits after its last step: alternating requests across
    # servers would run every request beside the previous server's spinning engine
    arms = [compare.Arm(k, k, Endpoint(k, k, f"http://{k}/v1/completions", "m")) for k in ("vllm", "ours")]
    calls, _ = _fake_runs(monkeypatch, arms, 1, rounds=3, per_round=4, one_engine=False)
    assert len(calls) == 6 and all(n == 4 and c == 1 for _, n, c in calls)


def _cells(rates: dict[str, list[float]]) -> dict:
    """bench.arms' rows: per (arm, c), each round's (requests, tokens, wall, CPU by role, counters, vectors)."""
    return {
        (arm, 8): [(4, 100, 100 / r, {"frontend": 0.4, "engine": 2.0}, {"host_copies": 3}, [("tail", 1)]) for r in rs]
        for arm, rs in rates.items()
    }


def test_the_arms_harness_takes_each_ratio_over_its_bases_and_sums_the_counters():
    """bench.arms: tok/s pooled over rounds, the ratio over each base arm with a paired interval (none under
    5 rounds), CPU ms per request by role, the engine's counters summed, vectors' via and positions."""
    import argparse

    from bench import arms

    bench = arms.Bench(
        "d", {"main": lambda m: {}}, (arms.Arm("off"), arms.Arm("on", over=("off", "off2")), arms.Arm("off2"))
    )
    args = argparse.Namespace(bench="x", model="m", rounds=6, max_tokens=25)
    rates = {"off": [10.0] * 6, "on": [9.0, 9.2, 8.8, 9.1, 8.9, 9.0], "off2": [10.0, 10.2, 9.8, 10.1, 9.9, 10.0]}
    r = arms.summarize(bench, args, _cells(rates), {"main": 1.0}, {"off": {}, "on": {"x": 1}, "off2": {}})
    on = r["arms"]["on@8"]
    assert on["tok_per_s"] == pytest.approx(9.0, rel=1e-3) and on["over"]["off"]["ratio"] == pytest.approx(
        0.9, rel=1e-3
    )
    lo, hi = on["over"]["off"]["ci95"]
    assert lo <= 0.9 <= hi and hi < 0.95  # every round below off: the interval excludes 1
    assert on["over"]["off2"]["ratio"] == pytest.approx(0.9, rel=1e-2) and set(on["over"]) == {"off", "off2"}
    assert r["arms"]["off@8"]["over"]["off"]["ratio"] == 1.0 and "on" not in r["arms"]["off2@8"]["over"]
    assert on["cpu_ms_per_request"] == pytest.approx({"frontend": 100.0, "engine": 500.0})
    assert on["work"] == {"host_copies": 18} and on["via"] == {"tail": 6} and on["computed_tokens_per_vector"] == 1
    short = {k: v[:4] for k, v in _cells(rates).items()}
    assert arms.summarize(bench, args, short, {}, {})["arms"]["on@8"]["over"]["off"]["ci95"] is None
    text = arms.markdown(bench, r, "cmd")
    assert "| on | 8 | 9.0 | 0.900 (" in text and "`cmd`" in text


def test_every_declared_bench_runs_its_arms_on_its_engines():
    """Each declaration names engines it starts and bases among its arms; `--list` and the defaults."""
    from bench import arms

    for name, b in arms.BENCHES.items():
        names = [a.name for a in b.arms]
        assert len(set(names)) == len(names) and all(a.engine in b.engines for a in b.arms), name
        assert all(o in names for a in b.arms for o in a.over), name
        assert sum(a.fields == {} and a.engine == b.arms[0].engine for a in b.arms) >= 2, f"{name}: no A/A arm"
    a = arms.parse(["rows", "--concurrency", "8"])
    assert (a.rounds, a.max_tokens, a.concurrency, a.model) == (8, 32, [8], arms.SMOLLM2)
    with pytest.raises(SystemExit):
        arms.parse([])
    m = arms.Model(576, 30, "/nonexistent")
    assert m.spread(4) == [1, 10, 19, 29] and arms._rows(m.spread(4)[-2:])["hidden_states_layers"] == [19, 29]
    assert arms._short({"s": [{"layer": 1, "vector": "QUJD"}]}) == {"s": [{"layer": 1, "vector": "<base64>"}]}


def test_every_arm_s_fields_are_a_request_the_api_accepts():
    """Each arm's fields, on a completions body, pass the API's own parse (a misspelt field would be a 400)."""
    from bench import arms
    from hidden_states.params import HiddenStatesRequestError, parse_fields, refuse_unknown

    m = arms.Model(576, 30, "/nonexistent")
    for b in arms.BENCHES.values():
        for a in b.arms:
            body = {"model": "m", "prompt": "x", "max_tokens": 4, **(a.fields(m) if callable(a.fields) else a.fields)}
            refuse_unknown(body)
            parse_fields(body, enabled=True)
    with pytest.raises(HiddenStatesRequestError):
        refuse_unknown({"model": "m", "prompt": "x", "hidden_states_layer": [1]})
