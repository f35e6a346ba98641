"""The benchmark's own statistics: paired ratio intervals and the order arms run in; the one-engine
benches' command line (bench.report.bench_main)."""

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


def test_bench_main_parses_runs_and_writes_the_command_under_the_title(monkeypatch):
    """Typed flags, then --name; the run (a coroutine awaited, or a plain result) with bench.servers' ENGINE_ENV in
    the environment; the results and the summary, the command line under its title, handed to write_results."""
    import os

    from bench import report
    from bench.servers import ENGINE_ENV

    for k in ENGINE_ENV:
        monkeypatch.setenv(k, "before")  # restored after the test
    written = []
    monkeypatch.setattr(report, "write_results", lambda name, results, text: written.append((name, results, text)))
    summary = lambda args, r: [f"# {args.model}", "| rounds |", f"| {r['rounds']!r} |"]

    async def run(args):
        return {"env": {k: os.environ[k] for k in ENGINE_ENV}, "rounds": args.rounds}

    report.bench_main(
        "bench.x",
        "Its description.\n\nMore.",
        run,
        summary,
        name="x-tiny",
        first=("--model", "m"),
        argv=["--rounds", "3"],
    )
    report.bench_main(
        "bench.x",
        "Its description.",
        lambda args: {"rounds": args.rounds},
        summary,
        name="x-tiny",
        first=("--model", "m"),
        concurrency="8,32",
        requests=None,
        more=[("--layers", 4, "help")],
        argv=["--name", "other", "--model", "n"],
    )
    assert written == [
        (
            "x-tiny",
            {"env": ENGINE_ENV, "rounds": 3},
            "# m\n\n`.venv/bin/python -m bench.x --model m --rounds 3 "
            "--concurrency 8 --requests 24 --max-tokens 32 --name x-tiny`\n\n| rounds |\n| 3 |\n",
        ),
        (
            "other",
            {"rounds": 6},
            "# n\n\n`.venv/bin/python -m bench.x --model n --rounds 6 --concurrency 8,32 "
            "--max-tokens 32 --layers 4 --name other`\n\n| rounds |\n| 6 |\n",
        ),
    ]
