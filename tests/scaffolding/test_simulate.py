"""bench/simulate.py's and bench/failures.py's pure logic: the FakeEngine's delays, the memory gate, the deploy config;
a kill's figures from its requests and the controller's samples; the poller."""

from __future__ import annotations

import asyncio
import time

import pytest

from bench import simulate as sim
from hidden_states.interface import SamplingOptions
from hidden_states.testing import FakeEngine


def test_failures_arrivals_are_seeded_and_follow_the_rate():
    from bench.failures import arrivals

    a = arrivals(100.0, 20.0, seed=1)
    assert a == arrivals(100.0, 20.0, seed=1) != arrivals(100.0, 20.0, seed=2)
    assert a == sorted(a) and 0 <= a[0] and a[-1] < 100
    assert abs(len(a) - 2000) < 4 * 2000**0.5  # Poisson: within 4 standard deviations


def test_fake_delays_reproduce_the_measured_request():
    d = sim.fake_delays(ttft_s=0.4, itl_s=0.03, max_tokens=64)
    assert sim.slept_s(d, 64) == pytest.approx(0.4 + 63 * 0.03)  # TTFT + the later tokens, as one wait
    assert d["token_delay_s"] == 0


def test_fake_engine_waits_its_first_token_delay_once_per_request():
    async def timed(**delays):
        engine = await FakeEngine.start(**delays)
        t0 = time.perf_counter()
        await engine.complete([1, 2, 3], SamplingOptions(max_tokens=4, n=2), return_hidden_states=False)
        return time.perf_counter() - t0

    assert asyncio.run(timed()) < 0.05  # no delay by default, as before
    took = asyncio.run(timed(first_token_delay_s=0.2, token_delay_s=0.01))
    assert 0.2 + 2 * 4 * 0.01 <= took < 0.2 * 2  # the prefill once, not per choice; a tick per token


def test_memory_gate_leaves_four_gib():
    mib = 2**20
    ok, why = sim.fits(8, 200 * mib, 10 * sim.GIB)
    assert ok and "leaves" in why
    ok, why = sim.fits(128, 228 * mib, 20 * sim.GIB)
    assert not ok and "128 replicas x 228 MiB" in why and "< 4 GiB spare" in why


def test_deploy_config():
    args = sim.app_args({"token_delay_s": 0.0, "first_token_delay_s": 2.6}, 4)
    cfg = sim.deploy_config(args, 8410)
    app = cfg["applications"][0]
    assert app["import_path"] == "bench.simulate:fake_app" and app["args"] == args
    (dep,) = app["deployments"]
    # only num_cpus differs from the product's replica options; its runtime_env stays
    assert dep["name"] == "EngineReplica" and dep["ray_actor_options"]["num_cpus"] == 0
    assert dep["ray_actor_options"]["runtime_env"]["env_vars"]["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"


def test_the_load_goes_through_vllm_bench_serve_at_a_rate(tmp_path, monkeypatch):
    """bench.simulate's load: an argv `vllm bench serve`'s own parser reads (open loop: no concurrency cap), its
    saved result becomes the size's figures, and the added latency is vLLM's percentiles minus the sleep."""
    import argparse
    import json
    import subprocess

    from vllm.benchmarks.serve import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    read = lambda argv: parser.parse_args(argv[argv.index("serve") + 1 :])
    url = "http://127.0.0.1:8410/v1/completions"
    ns = read(sim.load_argv(url, 1200, 7, (256, 64), 20.0, tmp_path / "r.json"))
    assert (ns.num_prompts, ns.request_rate, ns.max_concurrency, ns.seed, ns.model) == (1200, 20.0, None, 7, "sim")
    assert ns.extra_body == {"return_hidden_states": True} and ns.metric_percentiles == "50,90,99"

    saved = {"completed": 99, "failed": 1, "duration": 5.0, "p50_e2el_ms": 2300.0, "p99_e2el_ms": 2400.0}

    def fake_run(argv, cwd, stdout, stderr, timeout):
        out = sim.Path(argv[argv.index("--result-dir") + 1]) / argv[argv.index("--result-filename") + 1]
        out.write_text(json.dumps(saved | {"errors": ["x"]}))
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(sim.subprocess, "run", fake_run)
    got = sim.vllm_load(url, 100, 7, (256, 64), 20.0, timeout=60)
    assert got["completed"] == 99 and got["failed"] == 1 and got["p99_e2el_ms"] == 2400.0 and "errors" not in got
    assert sim.added_ms(got, slept=2.267) == {"added_ms_p50": pytest.approx(33.0), "added_ms_p99": pytest.approx(133.0)}


def test_failures_has_a_command_line_of_its_own():
    """`python -m bench.failures`: its load and kills, bench.simulate's cluster flags; bench.simulate runs no kills."""
    from bench import failures

    a = failures.parse([])
    assert (a.rate, a.kill_after, a.after_kill) == (20.0, 15.0, 45.0)
    assert (a.max_tokens, a.seed, a.engine, a.out) == (64, 20261203, "auto", sim.Path("bench/.work/simulate"))
    assert failures.parse(["--serve-env", "K=V", "--out", "x"]).serve_env == ["K=V"]
    for flag in ("--failures", "--kill-after=5"):
        with pytest.raises(SystemExit):
            sim.parse([flag])
    with pytest.raises(SystemExit):
        failures.parse(["--sizes", "1,8"])


# -- bench/failures.py's pure logic: the figures of one kill ------------------------------------------


def _req(sent, latency, status=None, error=None, timed_out=False):
    from bench.failures import Req

    status = (200 if error is None else 0) if status is None else status  # an exception leaves no status
    return Req(at=sent, sent=sent, latency=latency, status=status, error=error, timed_out=timed_out, done=True)


def test_kill_figures_count_in_flight_and_recovery():
    from bench.failures import kill_figures, outcome

    reqs = [
        _req(0.0, 1.0),
        _req(1.0, 1.0),
        _req(7.0, 2.0),  # answered before the kill at 10
        _req(9.5, 0.6, status=500, error="boom"),  # in flight: a 500
        _req(9.8, 0.4, error="ServerDisconnectedError: gone"),  # in flight: dropped
        _req(9.9, 1.5),  # in flight: survived
        _req(10.5, 0.01, error="ClientConnectorError: refused"),  # after: refused
        _req(12.0, 30.0, error="TimeoutError: ", timed_out=True),  # after: hung until the client gave up
        _req(13.0, 2.0),
        _req(14.0, 9.0),
        _req(15.0, 2.0),
    ]  # after: ok, one of them slow
    assert [outcome(r) for r in reqs[3:8]] == [
        "http 500",
        "ServerDisconnectedError",
        "ok",
        "ClientConnectorError",
        "timeout",
    ]
    f = kill_figures(reqs, kill_t=10.0)
    assert f["answered_before_kill"] == 3 and f["in_flight_at_kill"] == 3
    assert f["in_flight_outcomes"] == {"http 500": 1, "ServerDisconnectedError": 1, "ok": 1}
    assert f["sent_after_kill"] == 5 and f["after_outcomes"] == {"ClientConnectorError": 1, "timeout": 1, "ok": 3}
    assert f["failed"] == 4 and f["timeouts"] == 1 and f["not_done"] == 0
    assert f["first_ok_sent_s"] == pytest.approx(3.0)
    assert f["all_ok_from_s"] == pytest.approx(2.0)  # the last failure was sent 2 s after the kill


def test_kill_figures_without_failures_and_a_request_left_unfinished():
    from bench.failures import Req, kill_figures

    clean = kill_figures([_req(t, 1.0) for t in range(20)], kill_t=10.5)
    assert clean["failed"] == 0 and clean["all_ok_from_s"] == 0.0
    assert clean["in_flight_at_kill"] == 1 and clean["first_ok_sent_s"] == pytest.approx(0.5)
    hung = Req(at=9.0, sent=9.0)  # never done: in flight, not ok
    f = kill_figures([_req(1.0, 1.0), hung], kill_t=10.0)
    assert f["in_flight_at_kill"] == 1 and f["not_done"] == 1 and f["sent_after_kill"] == 0
    assert f["all_ok_from_s"] is None and f["first_ok_sent_s"] is None


def test_serve_times_from_polled_samples():
    from bench.failures import serve_times

    s = lambda t, **kw: (
        {
            "t": t,
            "proxy_pids": [1],
            "proxy_status": ["HEALTHY"],
            "router_pids": [5],
            "engine_running": 8,
            "nodes_alive": {"n2": True},
            "watched_alive": 1,
        }
        | kw
    )
    samples = [
        s(9.0),
        s(11.0),
        s(12.0, error="timeout"),
        s(13.0, proxy_pids=[2], proxy_status=["STARTING"]),
        s(15.0, proxy_pids=[2], watched_alive=0),
        s(16.0, router_pids=[]),
        s(18.0, router_pids=[6]),
    ]
    p = serve_times(samples, 10.0, "proxy", old_pid=1)
    assert p == {"watched_gone_s": 5.0, "replaced_s": 5.0}  # HEALTHY again, under another pid
    assert serve_times(samples, 10.0, "router", old_pid=5)["replaced_s"] == 8.0
    node = [s(9.0), s(12.0, nodes_alive={"n2": False}), s(14.0, nodes_alive={"n2": False}, engine_running=4)]
    n = serve_times(node, 10.0, "node", None, node_id="n2")
    assert n["node_dead_s"] == 2.0 and n["replicas_dropped_s"] == 4.0 and n["watched_gone_s"] is None


def test_poller_samples_on_its_clock_and_keeps_errors():
    calls = iter([{"v": 1}, RuntimeError("controller busy"), {"v": 3}] + [{"v": 9}] * 100)

    def sample():
        x = next(calls)
        if isinstance(x, Exception):
            raise x
        return x

    t0 = time.monotonic()
    poller = sim.Poller(sample, 0.02, t0)
    time.sleep(0.2)
    samples = poller.stop()
    assert not poller.is_alive() and 5 <= len(samples) <= 12
    assert [s.get("v") for s in samples[:3]] == [1, None, 3] and samples[1]["error"] == "controller busy"
    assert all(b["t"] > a["t"] for a, b in zip(samples, samples[1:])) and samples[0]["t"] < 0.02
