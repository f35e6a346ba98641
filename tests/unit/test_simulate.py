"""bench/simulate.py's pure logic: arrivals, the FakeEngine's delays, the memory gate, the ramp's scale times."""

from __future__ import annotations

import asyncio
import time

import pytest

from bench import simulate as sim
from hidden_states.engine import SamplingOptions
from hidden_states.testing import FakeEngine


def test_poisson_arrivals_are_seeded_and_follow_the_rate():
    flat = [(100.0, 20.0, 20.0)]
    a = sim.poisson_arrivals(flat, seed=1)
    assert a == sim.poisson_arrivals(flat, seed=1) != sim.poisson_arrivals(flat, seed=2)
    assert a == sorted(a) and 0 <= a[0] and a[-1] < 100
    assert abs(len(a) - 2000) < 4 * 2000 ** 0.5  # Poisson: within 4 standard deviations

    ramp = [(10.0, 1.0, 1.0), (60.0, 1.0, 40.0), (30.0, 40.0, 40.0), (60.0, 40.0, 1.0)]
    b = sim.poisson_arrivals(ramp, seed=3)
    expected = sim.expected_count(ramp)
    assert expected == pytest.approx(10 + 60 * 20.5 + 1200 + 60 * 20.5)
    assert abs(len(b) - expected) < 4 * expected ** 0.5
    early = sum(t < 10 for t in b)
    held = sum(70 <= t < 100 for t in b)
    assert early < 30 and abs(held - 1200) < 4 * 1200 ** 0.5


def test_rate_at_is_piecewise_linear_and_zero_after():
    segs = [(10.0, 2.0, 2.0), (10.0, 2.0, 12.0)]
    assert sim.rate_at(segs, 0) == 2.0
    assert sim.rate_at(segs, 15) == pytest.approx(7.0)
    assert sim.rate_at(segs, 20.5) == 0.0
    assert sim.poisson_arrivals([(5.0, 0.0, 0.0)], seed=1) == []


@pytest.mark.parametrize("pacing", ["once", "tokens"])
def test_fake_delays_reproduce_the_measured_request(pacing):
    d = sim.fake_delays(ttft_s=0.4, itl_s=0.03, max_tokens=64, pacing=pacing)
    assert sim.slept_s(d, 64) == pytest.approx(0.4 + 63 * 0.03)  # either way: TTFT + the later tokens
    assert (d["token_delay_s"] == 0) == (pacing == "once")
    with pytest.raises(ValueError):
        sim.fake_delays(0.4, 0.03, 64, "sometimes")


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
    n = sim.largest_fitting(228 * mib, 20 * sim.GIB)
    assert n % 8 == 0 and sim.fits(n, 228 * mib, 20 * sim.GIB)[0] and not sim.fits(n + 8, 228 * mib, 20 * sim.GIB)[0]
    assert sim.largest_fitting(228 * mib, 3 * sim.GIB) == 0


def test_scale_times_from_polled_samples():
    samples = [{"t": t, "running": r, "target": g} for t, r, g in
               [(0, 1, 1), (10, 1, 1), (20, 1, 4), (30, 3, 8), (40, 8, 8), (50, 8, 8), (60, 8, 3), (70, 3, 1),
                (80, 1, 1)]]
    s = sim.scale_times(samples, min_replicas=1, max_replicas=8, up_start=10, down_start=55)
    assert s["max_running"] == 8 and s["first_at_max_running_s"] == 40
    assert s["target_at_max_after_up_start_s"] == 20 and s["running_at_max_after_up_start_s"] == 30
    assert s["back_at_min_after_down_start_s"] == 25
    never = sim.scale_times(samples[:4], 1, 8, 10, 55)
    assert never["running_at_max_after_up_start_s"] is None and never["back_at_min_after_down_start_s"] is None


def test_percentile_and_deploy_config():
    assert sim.percentile([], 50) is None
    assert sim.percentile([3, 1, 2], 50) == 2 and sim.percentile([0, 10], 99) == pytest.approx(9.9)
    args = sim.app_args({"token_delay_s": 0.0, "first_token_delay_s": 2.6},
                        {"min_replicas": 4, "max_replicas": 4})
    cfg = sim.deploy_config(args, 8410)
    app = cfg["applications"][0]
    assert app["import_path"] == "bench.simulate:fake_app" and app["args"] == args
    (dep,) = app["deployments"]
    # only num_cpus differs from the product's replica options; its runtime_env stays
    assert dep["name"] == "EngineReplica" and dep["ray_actor_options"]["num_cpus"] == 0
    assert dep["ray_actor_options"]["runtime_env"]["env_vars"]["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
