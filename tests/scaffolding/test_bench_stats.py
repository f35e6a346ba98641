"""The benchmark's own statistics: paired ratio intervals; the full run (bench.cli: arms in rotating rounds, each
batch through `vllm bench serve`); the one-engine harness of the engine's benches (bench.arms)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import measure
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


def _fake_batches(monkeypatch, tokens: dict[str, float]):
    """bench.cli.batch replaced: each call recorded; an arm's batch done in 1 s at its `tokens` per request."""
    from bench import cli

    calls = []

    def fake_batch(ep, tokenizer, n, c, seed, lens, fields, cpu, folder):
        calls.append((ep.key, n, c, seed, dict(fields)))
        cpu_d = {"roles": {"client": 0.1} | ({"ours: replica": 0.5} if fields else {}), "wall": 1.0}
        return {"ok": n, "tokens": n * tokens[json.dumps(fields)], "wall": 1.0, "cpu": cpu_d, "work": {"x": 1}}

    monkeypatch.setattr(cli, "batch", lambda *a: fake_batch(*a) | {"latency_ms": {"p50_e2el_ms": 10.0}})
    return calls


def test_the_full_run_rotates_its_arms_on_shared_prompts(monkeypatch):
    """bench.cli: every round runs each arm at each concurrency, the first arm rotating; the arms of a round
    share a seed (the same prompts); ratios, CPU by role (0 where a role was absent) and counters."""
    from bench import arms, cli

    monkeypatch.setattr(arms, "SETTLE_S", 0)
    calls = _fake_batches(monkeypatch, {"{}": 10.0, '{"return_hidden_states": true}': 9.0})
    args = cli.parse(["--parts", "hs", "--concurrency", "1,8", "--rounds", "6", "--requests", "4"])
    args.part = "hs"
    eps = {"ours": Endpoint("ours", "http://h/v1/completions", "m")}
    r = cli.measure(cli.PARTS["hs"], eps, "/tok", args, None, "m")
    assert len(calls) == 6 * 3 * 2 and all(n == 4 for _, n, _, _, _ in calls)
    firsts = [calls[6 * k][4] for k in range(3)]
    assert firsts == [{}, {"return_hidden_states": True}, {}]  # off, on, off2: the first arm rotates
    assert {s for _, _, c, s, _ in calls[:6] if c == 8} == {8}  # one seed per round and concurrency
    on = r["arms"]["on@8"]
    assert on["over"]["off"]["ratio"] == pytest.approx(0.9) and on["latency_ms"] == {"p50_e2el_ms": 10.0}
    assert r["arms"]["off2@1"]["over"]["off"]["ratio"] == pytest.approx(1.0) and on["work"] == {"x": 6}
    assert on["cpu_ms_per_request"] == pytest.approx({"client": 25.0, "ours: replica": 125.0})
    assert r["arms"]["off@8"]["cpu_ms_per_request"] == pytest.approx({"client": 25.0, "ours: replica": 0.0})
    lo, hi = on["over"]["off"]["ci95"]
    assert lo == pytest.approx(0.9) and hi == pytest.approx(0.9)


def test_the_full_run_sends_its_fields_through_vllm_bench_serve(tmp_path, monkeypatch):
    """The argv bench.cli gives `vllm bench serve` is one its own parser reads, the arm's fields as its extra
    body; its saved result becomes the batch's figures, and a failed request stops the run."""
    import argparse
    import subprocess

    from vllm.benchmarks.serve import add_cli_args

    from bench import cli
    from bench.measure import CpuAccount

    ep = Endpoint("ours", "http://127.0.0.1:8000/v1/completions", "m")
    argv = cli.serve_argv(ep, "/tok", 16, 8, 3, (128, 32), {"return_hidden_states": True}, tmp_path / "r.json")
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(argv[argv.index("serve") + 1 :])
    got = (ns.base_url, ns.endpoint, ns.num_prompts, ns.max_concurrency, ns.seed, ns.random_output_len)
    assert got == ("http://127.0.0.1:8000", "/v1/completions", 16, 8, 3, 32)
    assert ns.extra_body == {"return_hidden_states": True} and ns.ignore_eos and ns.save_result
    assert "--extra-body" not in cli.serve_argv(ep, "/tok", 1, 1, 0, (8, 8), {}, tmp_path / "r.json")

    saved = {"completed": 16, "failed": 0, "errors": [], "total_output_tokens": 512, "duration": 2.0}
    saved |= {"p50_e2el_ms": 900.0, "std_ttft_ms": 1.0}

    def fake_run(argv, cwd, timeout):
        out = Path(argv[argv.index("--result-dir") + 1]) / argv[argv.index("--result-filename") + 1]
        out.write_text(json.dumps(saved))
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(cli.subprocess, "run", fake_run)
    b = cli.batch(ep, "/tok", 16, 8, 3, (128, 32), {}, CpuAccount(), tmp_path)
    assert (b["ok"], b["tokens"], b["wall"], b["latency_ms"]) == (16, 512, 2.0, {"p50_e2el_ms": 900.0})
    assert "client" in b["cpu"]["roles"] and b["work"] == {}
    saved.update(failed=1, errors=["", "boom"])
    with pytest.raises(RuntimeError, match="1 of 16 requests failed"):
        cli.batch(ep, "/tok", 16, 8, 3, (128, 32), {}, CpuAccount(), tmp_path)


def test_the_full_run_s_command_line(capsys):
    from bench import cli

    a = cli.parse(["--quick"])
    assert (a.models, a.rounds, a.levels, a.parts) == (["tiny-llama"], 2, {1: 4, 8: 16, 32: 32}, list(cli.PARTS))
    for bad in (["--parts", "memory"], ["--models", "gpt"]):
        with pytest.raises(SystemExit):
            cli.parse(bad)
    for b in cli.PARTS.values():
        names = [a.name for a in b.arms]
        assert sum(a.fields == {} and a.engine == b.arms[0].engine for a in b.arms) >= 2, "no A/A arm"
        assert all(o in names for a in b.arms for o in a.over) and all(a.engine in b.engines for a in b.arms)
    assert cli.main(["--dry-run", "--parts", "hs"]) == 0
    assert '--extra-body {"return_hidden_states": true}' in capsys.readouterr().out


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
