"""Many replicas, simulated (issue 32): our Router and Serve's proxy in front of N FakeEngine replicas.

    .venv/bin/python -m bench.simulate                       # sizes 1,8,32,64,128, then the autoscaler's ramp
    .venv/bin/python -m bench.simulate --sizes 1,8 --seconds 20 --ramp-max 8 --out bench/.work/sim-dev  # a try-out
    .venv/bin/python -m bench.failures      # part 5, on this cluster and app: kill the proxy, Router, a node

What runs: a Ray cluster of its own (bench.servers.RayCluster, second=True: its own ports, temp dir and auth token;
`make serve`'s Serve switches, direct ingress on, its ports in 33000-33300 / 43000-43300) and a driver process
(`--driver`; it speaks JSON lines on its pipes, nothing of ours is pickled across processes) that starts Serve (proxy
on a free port, HeadOnly) and deploys the app as `serve run CONFIG` does: `bench.simulate:fake_app`, that is
`deployments.app:build(args, FakeEngine)`, the real Router, replicas, relay and proxy on hidden_states.testing's
FakeEngine. The one option changed from the product's: the replicas' `ray_actor_options.num_cpus`, 0 instead of 1
(in the config's `deployments` section), so N replicas fit on 2 cores.

The FakeEngine sleeps, per request, what a real engine took, measured once (`--engine measure`: vLLM's own OpenAI
server, SmolLM2-135M-Instruct, c=1, streamed: time to first token and per token; kept in OUT/engine.json and reused).
Its sleeps take no CPU, so the CPU the cores spend is the Serve layer's (and the replicas' Python).

Per size N (a fresh deploy, `replica_autoscaling` min = max = N, one Router): the start time, the replicas' resident
memory (a size whose replicas would leave under 4 GiB available is skipped and recorded), an idle window, then an
open-loop load at a fixed rate (Poisson arrivals, the same seed at every N; every request has a timeout): CPU seconds
per request by process role (bench.measure.CpuAccount) and the added latency (measured minus what the FakeEngine
slept). The ramp: replicas min 1, max M, shortened autoscaling delays; the offered rate ramps up, holds, ramps down;
the controller is polled every 2 s (replicas, the autoscaler's count of ongoing requests); nothing may fail or hang.
Results (results.json, summary.md, PNGs) carry no machine paths; everything started is stopped by process group.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import queue
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.measure import pct
from bench.procs import LOGS, PYTHON, ROOT, Proc


def _f(x, fmt="{:.2f}", none="-"):
    return none if x is None else fmt.format(x)


def _md_table(headers, rows) -> str:
    esc = lambda x: str(x).replace("|", "\\|")
    lines = ["| " + " | ".join(map(esc, headers)) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(map(esc, r)) + " |" for r in rows])


APP = "hidden-states"  # bench.measure.ROLE_TITLES know its process titles
MODEL = "sim"
GIB = 2**30
SPARE_BYTES = 4 * GIB  # what a size must leave available
SIM_ENV = {  # `make serve`'s Serve switches (deployments/serve_env.py), direct ingress ports out of others' way
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
    "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "33000",
    "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "33300",
    "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": "43000",
    "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": "43300",
}
ROUTING_ROLES = ("ours: router", "serve: proxy", "serve: controller")  # the brief's "routing CPU"
ROLES_SHOWN = (*ROUTING_ROLES, "ray: system", "ours: replica", "driver")
FAILED_MAX = 0.01  # a size "worked" if at most this share of its requests failed


# -- the app, as Serve's build task imports it -------------------------------------------------------


def fake_app(args: dict):
    """`deployments.app.build(args, FakeEngine)`: the config's import path (`bench.simulate:fake_app`)."""
    from deployments.app import build
    from hidden_states.testing import FakeEngine

    return build(args, engine_cls=FakeEngine)


def app_args(engine: dict, autoscaling: dict, replica_max_ongoing: int = 256, **extra) -> dict:
    """AppArgs for the simulation: FakeEngine delays as `engine` args, the replicas' autoscaling, one Router."""
    return {
        "model": "builtin:tiny-llama",
        "served_model_name": MODEL,  # the FakeEngine loads nothing
        "engine": {k: engine[k] for k in ("token_delay_s", "first_token_delay_s")},
        "request_timeout_s": 60,
        "replica_max_ongoing_requests": replica_max_ongoing,
        "replica_autoscaling": autoscaling,
        "router_autoscaling": {"min_replicas": 1, "max_replicas": 1},
        **extra,
    }


def deploy_config(args: dict, http_port: int) -> dict:
    """The ServeDeploySchema `serve run CONFIG` would read: one app, the replicas' num_cpus 0
    (the config's `ray_actor_options` replaces the code's, so the product's runtime_env goes with it)."""
    from deployments.config import AppArgs

    actor = {**AppArgs.model_validate(args).replica_options()["ray_actor_options"], "num_cpus": 0.0}
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "applications": [
            {
                "name": APP,
                "route_prefix": "/",
                "import_path": "bench.simulate:fake_app",
                "args": args,
                "deployments": [{"name": "EngineReplica", "ray_actor_options": actor}],
            }
        ],
    }


# -- pure logic (tests/scaffolding/test_simulate.py) --------------------------------------------------------


def poisson_arrivals(segments: list[tuple[float, float, float]], seed: int) -> list[float]:
    """Arrival times (s from 0) of a Poisson process whose rate goes linearly from r0 to r1 over each
    (seconds, r0, r1) segment, by thinning at the highest rate: the same seed, the same arrivals."""
    rng = random.Random(seed)
    peak, total = max(max(r0, r1) for _, r0, r1 in segments), sum(d for d, _, _ in segments)
    out: list[float] = []
    t = 0.0
    while peak > 0 and (t := t + rng.expovariate(peak)) < total:
        if rng.random() * peak < rate_at(segments, t):
            out.append(t)
    return out


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


def between(good: int, bad: int, step: int = 8) -> int:
    """A size to try between the largest that worked and one that did not: their midpoint, down to a multiple
    of `step` (0 when there is none strictly between)."""
    m = (good + bad) // 2 // step * step
    return m if good < m < bad else 0


def largest_fitting(replica_bytes: int, available: int, step: int = 8, spare: int = SPARE_BYTES) -> int:
    """The largest multiple of `step` replicas that `fits` (0 if none)."""
    return int(max(0, (available - spare) // max(1, replica_bytes)) // step * step)


def fits(n: int, replica_bytes: int, available: int, spare: int = SPARE_BYTES) -> tuple[bool, str]:
    """Whether n more replicas of `replica_bytes` each leave `spare` of `available`; and why not."""
    need = n * replica_bytes
    left = available - need
    if left >= spare:
        return True, f"needs {need / GIB:.1f} GiB of {available / GIB:.1f} available, leaves {left / GIB:.1f}"
    return False, (
        f"{n} replicas x {replica_bytes / 2**20:.0f} MiB = {need / GIB:.1f} GiB would leave "
        f"{left / GIB:.1f} GiB of {available / GIB:.1f} available (< {spare / GIB:.0f} GiB spare)"
    )


def scale_times(samples: list[dict], min_replicas: int, max_replicas: int, up_start: float, down_start: float) -> dict:
    """From the ramp's polled samples ({t, running, target, ...}, t in s): the largest count of running
    replicas and when it was first reached; from the ramp up's start (`up_start`), how long until the
    autoscaler's target, and the running replicas, first reached max_replicas; from the ramp down's start
    (`down_start`), how long until the running replicas were back at min_replicas."""
    run = [(s["t"], s["running"]) for s in samples if s.get("running") is not None]
    tgt = [(s["t"], s["target"]) for s in samples if s.get("target") is not None]
    peak = max((v for _, v in run), default=None)
    first = lambda series, level: next((t for t, v in series if v >= level), None)
    since = lambda t, t0: None if t is None else t - t0
    back = next((t for t, v in run if t >= down_start and v <= min_replicas), None)
    return {
        "max_running": peak,
        "first_at_max_running_s": None if peak is None else first(run, peak),
        "up_start_s": up_start,
        "down_start_s": down_start,
        "target_at_max_after_up_start_s": since(first(tgt, max_replicas), up_start),
        "running_at_max_after_up_start_s": since(first(run, max_replicas), up_start),
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
        proxies = list((d.get("proxies") or {}).values())
        apps = {
            name: {
                "status": a.get("status"),
                "message": (a.get("message") or "")[-2000:],
                "deployments": {
                    dn: {
                        "status": dep.get("status"),
                        "target": dep.get("target_num_replicas"),
                        "states": dict(Counter(r.get("state") for r in dep.get("replicas") or [])),
                        "replicas": [
                            {k: r.get(k) for k in ("pid", "state", "start_time_s", "node_id")}
                            for r in dep.get("replicas") or []
                        ],
                    }
                    for dn, dep in (a.get("deployments") or {}).items()
                },
            }
            for name, a in (d.get("applications") or {}).items()
        }
        return {
            "controller_pid": (d.get("controller_info") or {}).get("pid"),
            "applications": apps,
            "proxies": [proxy_pid(p.get("actor_id")) for p in proxies],
            "proxy_status": [p.get("status") for p in proxies],
        }

    def proxy_pid(actor_id: str | None) -> int | None:  # Serve's ProxyDetails has no pid; the GCS's actor table does
        import ray._private.state

        return (ray._private.state.actors(actor_id=actor_id) or {}).get("Pid") if actor_id else None

    ops = {
        "deploy": lambda c: client.deploy_apps(ServeDeploySchema.model_validate(c["config"]), _blocking=False),
        "details": lambda c: details(),
        "ongoing": lambda c: ray.get(  # the autoscaler's view: requests at replicas plus queued in handles
            controller._get_total_num_requests_for_deployment_for_testing.remote(
                DeploymentID(name=c["deployment"], app_name=c["app"])
            ),
            timeout=30,
        ),
        "delete": lambda c: serve.delete(c["app"], _blocking=False),
        "nodes": lambda c: [
            {"node_id": n["NodeID"], "alive": n["Alive"], "resources": n.get("Resources")} for n in ray.nodes()
        ],
    }
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                reply = {"id": cmd["id"], "ok": ops[cmd["op"]](cmd)}
            except Exception as e:
                reply = {"id": cmd["id"], "error": f"{type(e).__name__}: {e}"[:2000]}
            print(json.dumps(reply, default=str), flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


class Driver(Proc):
    """The driver process: bench.procs.Proc's own session, log and stop, with pipes for its JSON lines."""

    def __init__(self, cluster, http_port: int):
        LOGS.mkdir(parents=True, exist_ok=True)
        self.name, self.log_path, self._known = "sim-driver", LOGS / "sim-driver.log", set()
        self.argv = [
            str(PYTHON),
            "-m",
            "bench.simulate",
            "--driver",
            "--address",
            cluster.address,
            "--http-port",
            str(http_port),
        ]
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(
            self.argv,
            cwd=str(ROOT),
            env={**os.environ, **cluster.env()},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
            text=True,
            bufsize=1,
        )
        self.pid = self.pgid = self.popen.pid
        self._replies: queue.Queue = queue.Queue()
        self._lock, self._next = threading.Lock(), 0
        threading.Thread(target=self._read, daemon=True).start()
        if not self._replies.get(timeout=180).get("ready"):
            raise RuntimeError(f"the driver did not start: {self.tail()}")

    def _read(self) -> None:
        for line in self.popen.stdout:
            if line.startswith("{"):  # not a stray print
                self._replies.put(json.loads(line))
        self._replies.put({"eof": True})

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
        """Closes stdin (the driver shuts Serve down and disconnects), then Proc.stop: its group, SIGTERM/SIGKILL."""
        self.tree()  # remembers its processes
        try:
            self.popen.stdin.close()
            self.popen.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            pass
        return super().stop(timeout=15)


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def measure_engine(model: str, prompt_tokens: int, max_tokens: int, requests: int, seed: int = 7) -> dict:
    """The real engine, once: vLLM's own OpenAI server (bench.servers.VLLMServer, the bench's engine arguments and
    environment) at c=1 through `vllm bench serve` (bench.cli.batch: random prompts of `prompt_tokens`, `max_tokens`
    out, ignore_eos; two requests first to warm up): the median time to the first token and per later token."""
    from bench.cli import ENGINE, batch
    from bench.measure import CpuAccount
    from bench.servers import ENGINE_ENV, VLLMServer, build_model

    path = build_model(model)
    server, t_start = VLLMServer(path, model, dict(ENGINE), "sim-engine"), time.monotonic()
    server.launch()
    try:
        startup = server.wait_ready(600)
        with tempfile.TemporaryDirectory(prefix="bench-sim-") as folder:
            for n, s in ((2, seed + 1), (requests, seed)):
                b = batch(server.endpoint(), path, n, 1, s, (prompt_tokens, max_tokens), {}, CpuAccount(), Path(folder))
    finally:
        left = server.stop()
    lat = b["latency_ms"]
    return {
        "source": "measured",
        "server": "vLLM's OpenAI server, driven by `vllm bench serve` at c=1",
        "model": model,
        "engine_args": dict(ENGINE),
        "engine_env": dict(ENGINE_ENV),
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "concurrency": 1,
        "requests": b["ok"],
        "ttft_s": lat["p50_ttft_ms"] / 1e3,
        "itl_s": lat["p50_tpot_ms"] / 1e3,
        "latency_s_p50": lat["p50_e2el_ms"] / 1e3,
        "startup_s": startup,
        "measured_at": dt.datetime.now().isoformat(timespec="seconds"),
        "took_s": time.monotonic() - t_start,
        "stopped_left": left,
    }


# -- the load: open loop (bench.load's is closed loop) ---------------------------------------------------


@dataclass
class Req:
    at: float  # scheduled send, s from the load's start
    sent: float = 0.0  # actual send, s from the load's start
    latency: float | None = None
    status: int = 0
    replica: str = ""
    error: str | None = None
    timed_out: bool = False  # the client's timeout ended it
    done: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass
class Load:
    reqs: list[Req]
    wall: float = 0.0
    in_flight: int = 0
    t0: float = 0.0  # its start, time.perf_counter()


def request_body(prompt_chars: int, max_tokens: int, i: int) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "prompt": (f"request {i} " + "x" * prompt_chars)[:prompt_chars],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_hidden_states": True,
        }
    ).encode()


def run_load(url: str, arrivals: list[float], body_of, timeout_s: float, state: Load | None = None) -> Load:
    """Sends request i at arrivals[i] (s from start) whatever the earlier ones are doing (open loop); each has a
    total timeout."""
    import aiohttp

    state = state or Load([Req(at) for at in arrivals])

    async def one(session, r: Req, body: bytes):
        state.in_flight += 1
        r.sent = time.perf_counter() - state.t0
        try:
            async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
                raw = await resp.read()
                r.latency = time.perf_counter() - state.t0 - r.sent
                r.status, r.replica = resp.status, resp.headers.get("x-replica-id", "")
            if r.status != 200:
                r.error = raw[:300].decode(errors="replace")
        except Exception as e:  # counted, never dropped; a timeout is one
            r.latency = time.perf_counter() - state.t0 - r.sent
            r.timed_out, r.error = isinstance(e, asyncio.TimeoutError), f"{type(e).__name__}: {e}"[:300]
        finally:
            r.done = True
            state.in_flight -= 1

    async def main():
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as session:
            tasks, state.t0 = [], time.perf_counter()
            for i, r in enumerate(state.reqs):
                if (delay := r.at - (time.perf_counter() - state.t0)) > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(session, r, body_of(i))))
            await asyncio.gather(*tasks)
            state.wall = time.perf_counter() - state.t0

    asyncio.run(main())
    return state


def latency_summary(load: Load, slept: float) -> dict:
    ok = [r for r in load.reqs if r.ok]
    added, lag = [(r.latency - slept) * 1e3 for r in ok], [(r.sent - r.at) * 1e3 for r in load.reqs]
    per_replica = Counter(r.replica for r in ok).values()
    return {
        "requests": len(load.reqs),
        "ok": len(ok),
        "failed": len(load.reqs) - len(ok),
        "timeouts": sum(r.timed_out for r in load.reqs),
        "not_done": sum(not r.done for r in load.reqs),
        "error_samples": Counter((r.status, (r.error or "")[:120]) for r in load.reqs if not r.ok).most_common(5),
        "wall_s": load.wall,
        "slept_ms": slept * 1e3,
        "latency_ms_p50": pct([r.latency * 1e3 for r in ok], 50),
        **{f"added_ms_p{q}": pct(added, q) for q in (50, 90, 99)},
        "added_ms_max": max(added, default=None),
        "send_lag_ms_p50": pct(lag, 50),
        "send_lag_ms_p99": pct(lag, 99),
        "replicas_hit": len(per_replica),
        "requests_per_replica_min_max": [min(per_replica, default=0), max(per_replica, default=0)],
    }


# -- the run -------------------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[{dt.datetime.now():%H:%M:%S}] {msg}", flush=True)


class Poller(threading.Thread):
    """Calls `sample()` every `every` s until stop(); keeps {"t": s since `t0`, **its dict} (an error as "error")."""

    def __init__(self, sample, every: float, t0: float):
        super().__init__(daemon=True)
        self.fn, self.every, self.t0, self.samples, self._halt = sample, every, t0, [], threading.Event()
        self.start()

    def run(self) -> None:
        while not self._halt.is_set():
            s = {"t": time.monotonic() - self.t0}
            try:
                s.update(self.fn())
            except Exception as e:
                s["error"] = str(e)[:200]
            self.samples.append(s)
            self._halt.wait(max(0.0, self.every - (time.monotonic() - self.t0 - s["t"])))

    def stop(self) -> list[dict]:
        self._halt.set()
        self.join(30)
        return self.samples


class Sim:
    """The Ray cluster, the driver, the app's deploys and deletes; the sizes and the ramp (bench.failures too)."""

    MODULE = "bench.simulate"  # the command the results record

    def __init__(self, args, results: str = "results.json"):
        from bench.cli import machine

        self.args, self.out, self.results, self.t0 = args, args.out, results, time.monotonic()
        self.res: dict = {
            "command": " ".join([f".venv/bin/python -m {self.MODULE}", *map(shlex.quote, sys.argv[1:])]),
            "started": dt.datetime.now().isoformat(timespec="seconds"),
            "machine": machine(),
            "sizes": {},
            "skipped": {},
            "errors": [],
            "notes": [],
        }
        self.cluster = self.driver = self.replica_bytes = None
        self.http_port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1/completions"

    def details(self) -> dict:
        return self.driver.call("details", timeout=60)

    @staticmethod
    def deployment(d: dict, name: str = "EngineReplica") -> dict:
        return (d["applications"].get(APP) or {}).get("deployments", {}).get(name) or {"states": {}, "replicas": []}

    def body(self, i: int) -> bytes:
        return request_body(self.args.prompt_chars, self.args.max_tokens, i)

    def deploy(self, args: dict, n: int, config: dict | None = None) -> tuple[float, dict]:
        self.driver.call("deploy", config=config or deploy_config(args, self.http_port), timeout=120)
        return self.wait_running(n)

    def wait_running(self, n: int, also=lambda d: True) -> tuple[float, dict]:
        """Until the app is RUNNING with n running replicas (and `also(details)`) and a request is answered:
        (seconds, details)."""
        import psutil

        from bench.procs import wait_until
        from bench.servers import smoke

        got: dict = {}

        def ready() -> bool:
            d = got["d"] = self.details()
            app, dep = d["applications"].get(APP) or {}, self.deployment(d)
            if app.get("status") == "DEPLOY_FAILED" or psutil.virtual_memory().available < GIB:
                got["fail"] = app.get("message") or "available memory fell under 1 GiB (others' runs share it)"
            return "fail" in got or (
                app.get("status") == "RUNNING"
                and also(d)
                and smoke(self.url, MODEL)
                and dep["states"].get("RUNNING", 0) == len(dep["replicas"]) == n
            )

        took = wait_until(ready, self.args.start_timeout, f"{n} replicas running", [self.cluster.proc])
        if "fail" in got:
            raise RuntimeError(f"{n} replicas: {got['fail']}")
        return took, got["d"]

    def delete(self) -> float:
        """Deletes the app; waits until it and its replicas' processes are gone."""
        from bench.procs import wait_until

        pids = [r["pid"] for r in self.deployment(self.details())["replicas"] if r.get("pid")]
        self.driver.call("delete", app=APP, timeout=60)
        return wait_until(
            lambda: APP not in self.details()["applications"] and not any(map(alive, pids)),
            self.args.start_timeout,
            "the app deleted",
        )

    def rss(self, d: dict) -> dict:
        import psutil

        def mem(pids) -> list:
            out = []
            for pid in filter(None, pids):
                try:
                    m = psutil.Process(pid).memory_full_info()
                    out.append((m.rss, m.uss, getattr(m, "pss", m.uss)))
                except psutil.Error:
                    pass
            return out

        out: dict = {"replicas": len(rep := mem(r["pid"] for r in self.deployment(d)["replicas"]))}
        if rep:
            out |= {
                f"replica_{k}_mib_mean": sum(x[i] for x in rep) / len(rep) / 2**20
                for i, k in enumerate(("rss", "uss", "pss"))
            }
            out["replicas_rss_gib_total"] = sum(x[0] for x in rep) / GIB
        for name, pids in (
            ("router", [r["pid"] for r in self.deployment(d, "Router")["replicas"]]),
            ("proxy", d["proxies"]),
            ("controller", [d["controller_pid"]]),
        ):
            if xs := mem(pids):
                out[f"{name}_rss_mib"] = sum(x[0] for x in xs) / 2**20
        return out

    def serve_env(self) -> dict:
        """SIM_ENV, then each --serve-env KEY=VALUE (Ray Serve's own switches, e.g. its probe deadline)."""
        return {**SIM_ENV, **dict(kv.split("=", 1) for kv in self.args.serve_env)}

    def start(self, extra_env: dict | None = None) -> None:
        from bench.procs import free_port
        from bench.servers import RayCluster

        self.cluster = RayCluster(num_cpus=8, extra_env={**self.serve_env(), **(extra_env or {})}, second=True)
        log(f"ray start (port {self.cluster.port})")
        self.res["ray_start_s"] = self.cluster.start(timeout=240)
        self.http_port = free_port(8410)
        self.driver = Driver(self.cluster, self.http_port)
        log(f"Serve started by the driver (pid {self.driver.pid}), proxy on port {self.http_port}")

    def stop(self, *more) -> None:
        """Stops the driver, `more` (bench.procs.Proc-likes), the cluster; records what is left; saves."""
        left = []
        for p in (self.driver, *more, self.cluster):
            try:
                left += p.stop() if p is not None else []
            except Exception as e:
                self.res["errors"].append(f"stopping {type(p).__name__}: {e}")
        log(f"stopped; left running: {left or 'none'}")
        self.res.update(
            stopped_left_running=left,
            finished=dt.datetime.now().isoformat(timespec="seconds"),
            duration_s=round(time.monotonic() - self.t0),
        )
        self.res["machine"]["load_average_at_end"] = os.getloadavg()
        self.save()

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / self.results).write_text(json.dumps(self.res, indent=1, default=str) + "\n")

    def engine(self) -> dict:
        path, a = self.out / "engine.json", self.args
        if a.engine == "measure" or (a.engine == "auto" and not path.exists()):
            log(f"measuring the real engine ({a.engine_model}, c=1, {a.prompt_tokens} in, {a.max_tokens} out)")
            eng = measure_engine(a.engine_model, a.prompt_tokens, a.max_tokens, a.engine_requests)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(eng, indent=1) + "\n")
        elif a.engine in ("auto", "file"):
            eng = json.loads(path.read_text())
            eng["source"] = f"measured {eng.get('measured_at')}, reused from engine.json"
        else:
            raise SystemExit(f"--engine {a.engine!r}: measure, file or auto")
        log(f"engine: TTFT {eng['ttft_s'] * 1e3:.1f} ms, per token {eng['itl_s'] * 1e3:.2f} ms")
        self.res["engine"] = {k: v for k, v in eng.items() if k != "samples"}
        return eng

    def size(self, n: int, delays: dict) -> str:
        """One size: deploy, start time, memory, idle CPU, the load, delete: "ok", "failed" (over FAILED_MAX of
        its requests not answered 200) or "skipped" (it does not fit in memory)."""
        import psutil

        from bench.measure import CpuAccount

        a, avail = self.args, psutil.virtual_memory().available
        if self.replica_bytes is not None and not (fit := fits(n, self.replica_bytes, avail))[0]:
            self.res["skipped"][str(n)] = fit[1]
            log(f"N={n}: skipped: {fit[1]}")
            return "skipped"
        row: dict = {"available_gib_before": avail / GIB, "pacing": delays["pacing"]}
        log(f"N={n}: deploying")
        row["start_s"], d = self.deploy(app_args(delays, dict(min_replicas=n, max_replicas=n, initial_replicas=n)), n)
        log(f"N={n}: {n} replicas running after {row['start_s']:.1f} s")
        mem = row["memory"] = {**self.rss(d), "available_gib_running": psutil.virtual_memory().available / GIB}
        if self.replica_bytes is None and mem.get("replica_pss_mib_mean"):  # its share: libraries are mapped once
            self.replica_bytes = int(mem["replica_pss_mib_mean"] * 2**20)
        account = CpuAccount()
        account.add_root(self.cluster.proc.pid, "ray")
        account.add_root(self.driver.pid, "driver")

        def window(run) -> dict:  # CPU by role over run(); the driver's processes ("driver: <module>") one role
            s0 = account.snapshot()
            run()
            delta, roles = account.delta(s0, account.snapshot()), Counter()
            for k, v in delta["roles"].items():
                roles["driver" if k.startswith("driver") else k] += v
            return {**delta, "roles": dict(roles)}

        time.sleep(3)  # the smoke request's and start-up's tail
        idle = window(lambda: time.sleep(a.idle_seconds))
        row["idle_cores"] = {k: v / idle["wall"] for k, v in idle["roles"].items()}
        row["idle_ray_system_cores"] = {k: v / idle["wall"] for k, v in idle["ray_system_detail"].items()}
        arrivals = poisson_arrivals([(a.seconds, a.rate, a.rate)], seed=a.seed)
        log(f"N={n}: load, {len(arrivals)} requests at {a.rate}/s")
        probes0, load = self.probe_timeouts(), Load([Req(at) for at in arrivals])
        busy = window(lambda: run_load(self.url, arrivals, self.body, a.request_timeout, load))
        lat = row["load"] = latency_summary(load, slept_s(delays, a.max_tokens))
        per_req = lambda d: {k: v / lat["ok"] * 1e3 for k, v in d.items()} if lat["ok"] else {}  # none answered: none
        row.update(
            cpu_ms_per_request=per_req(busy["roles"]),
            ray_system_ms_per_request=per_req(busy["ray_system_detail"]),
            net_cpu_ms_per_request=per_req(
                {k: v - row["idle_cores"].get(k, 0.0) * busy["wall"] for k, v in busy["roles"].items()}
            ),
            busy_cores_under_load=busy["busy"] / busy["wall"],
            router_probe_timeouts=self.probe_timeouts() - probes0,
            worked=lat["failed"] <= FAILED_MAX * lat["requests"],
        )
        self.res["sizes"][str(n)] = row
        self.save()
        log(
            f"N={n}: ok {lat['ok']}/{lat['requests']}, routing CPU {_f(routing_ms(row))} ms/request, added p50 "
            f"{_f(lat['added_ms_p50'], '{:.1f}')} p99 {_f(lat['added_ms_p99'], '{:.1f}')} ms, {lat['replicas_hit']} "
            f"replicas hit, {row['router_probe_timeouts']} queue-length probe timeouts logged by the Router"
        )
        row["delete_s"] = self.delete()
        log(f"N={n}: deleted in {row['delete_s']:.1f} s")
        return "ok" if row["worked"] else "failed"

    def probe_timeouts(self) -> int:
        """Lines the Router replicas have logged so far of "Failed to get queue length from Replica(...) within
        Xs" (Serve's power-of-two router, a probe past its deadline), from this cluster's own Serve logs."""
        logs = (self.cluster.temp_dir / "session_latest" / "logs" / "serve").glob(f"replica_{APP}_Router_*.log")
        return sum(f.read_bytes().count(b"Failed to get queue length") for f in logs if f.is_file())

    def attempt(self, what: str, fn, *args) -> str:
        """fn(*args), its exception recorded and the app cleaned up: fn's answer, or "error"."""
        try:
            return fn(*args)
        except Exception as e:
            self.res["errors"].append(f"{what}: {type(e).__name__}: {e}"[:3000])
            log(f"{what}: ERROR: {e}")
            try:
                self.delete()
            except Exception as e2:
                self.res["errors"].append(f"{what}: cleaning up: {e2}"[:1000])
                raise
            return "error"

    def ramp(self, delays: dict) -> None:
        import psutil

        a = self.args
        slept, target, ramp_max = slept_s(delays, a.max_tokens), a.ramp_target, a.ramp_max
        avail = psutil.virtual_memory().available
        if self.replica_bytes is not None and not (fit := fits(ramp_max, self.replica_bytes, avail))[0]:
            ramp_max = largest_fitting(self.replica_bytes, avail, step=4)
            self.res["notes"].append(
                f"- The ramp's max_replicas {a.ramp_max} did not fit ({fit[1]}); ran with {ramp_max}."
            )
            if ramp_max < 4:
                self.res["skipped"]["ramp"] = fit[1]
                return log(f"ramp: skipped: {fit[1]}")
        # 0.75x max_replicas at the target: the rate the Router and proxy answered in full at N=32 on 2 cores
        peak = a.ramp_peak_rate or round(0.75 * ramp_max * target / slept, 1)
        low = max(0.5, round(peak / 20, 1))
        segments = [
            (20.0, low, low),
            (a.ramp_up, low, peak),
            (a.ramp_hold, peak, peak),
            (a.ramp_up, peak, low),
            (20.0, low, low),
        ]
        autoscaling = {
            "min_replicas": 1,
            "max_replicas": ramp_max,
            "initial_replicas": 1,
            "target_ongoing_requests": target,
            "upscale_delay_s": a.upscale_delay,
            "downscale_delay_s": a.downscale_delay,
            "look_back_period_s": a.look_back,
        }
        row = self.res["ramp"] = {
            "segments": segments,
            "autoscaling": autoscaling,
            "peak_rate": peak,
            "replica_max_ongoing_requests": a.ramp_max_ongoing,
            "slept_ms": slept * 1e3,
        }
        row["start_s"], _ = self.deploy(app_args(delays, autoscaling, replica_max_ongoing=a.ramp_max_ongoing), 1)
        arrivals = poisson_arrivals(segments, seed=a.seed + 1)
        load = Load([Req(at) for at in arrivals])

        def sample() -> dict:
            s, dep = {"client_in_flight": load.in_flight}, self.deployment(self.details())
            return s | {
                "running": dep["states"].get("RUNNING", 0),
                "target": dep.get("target"),
                "states": dep["states"],
                "status": dep.get("status"),
                "autoscaler_ongoing": self.driver.call("ongoing", app=APP, deployment="EngineReplica", timeout=30),
            }

        log(
            f"ramp: {len(arrivals)} requests, peak {peak}/s, target {target} ongoing per replica, max {ramp_max} "
            "replicas"
        )
        poller = Poller(sample, 2.0, t0 := time.monotonic())
        load_t0 = time.monotonic() - t0
        run_load(self.url, arrivals, self.body, a.request_timeout, load)
        row["load_window_s"] = [load_t0, time.monotonic() - t0]
        log(f"ramp: load done after {load.wall:.0f} s; watching the scale-down")
        deadline = time.monotonic() + a.downscale_delay + a.look_back + 90
        while time.monotonic() < deadline and not (
            poller.samples and poller.samples[-1].get("running") == 1 and poller.samples[-1].get("target") == 1
        ):
            time.sleep(2)
        time.sleep(4)
        samples = row["samples"] = poller.stop()
        row["load"] = latency_summary(load, slept)
        row["offered"] = [
            [round(load_t0 + k, 1), rate_at(segments, k)] for k in range(int(sum(d for d, _, _ in segments)) + 1)
        ]
        sent = Counter(int(r.sent) for r in load.reqs)
        row["sent_per_s"] = [[load_t0 + k, sent.get(k, 0)] for k in range(int(load.wall) + 1)]
        up_start = load_t0 + segments[0][0]
        sc = row["scale"] = scale_times(samples, 1, ramp_max, up_start, up_start + segments[1][0] + segments[2][0])
        for k in ("autoscaler_ongoing", "client_in_flight"):
            row[f"max_{k}"] = max((s.get(k) or 0 for s in samples), default=None)
        log(
            f"ramp: ok {row['load']['ok']}/{row['load']['requests']}, max running {sc['max_running']}, at max "
            f"{sc['running_at_max_after_up_start_s']} s after the ramp up began, back at 1 "
            f"{sc['back_at_min_after_down_start_s']} s after the ramp down began"
        )
        self.save()
        self.delete()

    def run(self) -> int:
        a = self.args
        eng = self.engine()
        delays = self.res["fake_engine"] = fake_delays(eng["ttft_s"], eng["itl_s"], a.max_tokens, a.pacing)
        self.res["settings"] = {
            "sizes": a.sizes,
            "rate_per_s": a.rate,
            "seconds": a.seconds,
            "idle_seconds": a.idle_seconds,
            "max_tokens": a.max_tokens,
            "prompt_chars": a.prompt_chars,
            "request_timeout_s": a.request_timeout,
            "seed": a.seed,
            "slept_ms_per_request": slept_s(delays, a.max_tokens) * 1e3,
            "pacing": a.pacing,
            "replica_num_cpus": 0.0,
            "router": "1 replica (router_autoscaling 1..1)",
            "ray_cluster": "ray start --head --num-cpus 8 (logical), own ports, temp dir and auth token",
            "serve_env": self.serve_env(),
            "request": "POST /v1/completions through Serve's proxy, non-streaming, "
            "return_hidden_states true (the FakeEngine's 8-float vector)",
        }
        try:
            self.start()
            good = 0
            for n in a.sizes:
                if (status := self.attempt(f"N={n}", self.size, n, delays)) == "ok":
                    good = n
                    continue
                if a.fill:  # once: a size between the last that worked and this one
                    import psutil

                    m = between(good, n)
                    if status == "skipped":
                        m = min(m, largest_fitting(self.replica_bytes, psutil.virtual_memory().available))
                    if m > good:
                        self.res["notes"].append(
                            f"- N={n} {'did not fit' if status == 'skipped' else status}; ran N={m} instead."
                        )
                        good = m if self.attempt(f"N={m}", self.size, m, delays) == "ok" else good
                break  # larger sizes would do no better
            self.res["largest_that_worked"] = good
            if a.ramp_max > 0:
                self.attempt("ramp", self.ramp, delays)
        finally:
            self.stop()
        write_report(self.res, self.out)
        return 0 if not self.res["errors"] and not self.res["stopped_left_running"] else 1


# -- report ----------------------------------------------------------------------------------------------

SHORT = {
    "ours: router": "Router",
    "serve: proxy": "proxy",
    "serve: controller": "controller",
    "ray: system": "Ray daemons",
    "ours: replica": "replicas (all)",
    "driver": "driver",
}
SIZE_HEADERS = [
    "N",
    "Router ms/req",
    "proxy ms/req",
    "controller ms/req",
    "routing ms/req",
    "Ray daemons ms/req",
    "replicas ms/req",
    "idle cores (Serve + Ray + replicas)",
    "added p50 ms",
    "added p99 ms",
    "ok",
    "replicas hit",
    "start s",
    "replica RSS / PSS MiB",
]


def by_n(rows: dict) -> list[tuple[str, dict]]:
    return sorted(rows.items(), key=lambda kv: int(kv[0]))


def routing_ms(r: dict) -> float | None:
    """Router + proxy + controller CPU per request answered (None if none was)."""
    c = r["cpu_ms_per_request"]
    return sum(c.get(k, 0.0) for k in ROUTING_ROLES) if c else None


def size_rows(res: dict) -> list[list[str]]:
    """The figures table: one row per size that ran."""
    rows = []
    for n, r in by_n(res.get("sizes", {})):
        c, lat = r["cpu_ms_per_request"], r["load"]
        idle = sum(r["idle_cores"].get(k, 0.0) for k in ROLES_SHOWN[:-1])
        rows.append(
            [
                n,
                *(_f(c.get(k)) for k in ROUTING_ROLES),
                f"**{_f(routing_ms(r))}**",
                _f(c.get("ray: system")),
                _f(c.get("ours: replica")),
                _f(idle, "{:.3f}"),
                _f(lat["added_ms_p50"], "{:.1f}"),
                _f(lat["added_ms_p99"], "{:.1f}"),
                f"{lat['ok']}/{lat['requests']}",
                f"{lat['replicas_hit']}",
                _f(r["start_s"], "{:.1f}"),
                f"{_f(r['memory'].get('replica_rss_mib_mean'), '{:.0f}')} / "
                f"{_f(r['memory'].get('replica_pss_mib_mean'), '{:.0f}')}",
            ]
        )
    return rows


def plot(res: dict, out: Path) -> list[str]:
    """cpu_per_request.png, added_latency.png, ramp.png (those with data); their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: list[str] = []

    def save(fig, axes, name, ns=None):
        for x in axes:
            if ns:
                x.set(xscale="log", xlabel="replicas N")
                x.set_xticks(ns, [str(n) for n in ns])
            x.grid(alpha=0.3)
            x.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        names.append(name)

    if sizes := by_n(res.get("sizes", {})):
        ns = [int(n) for n, _ in sizes]
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
        for role in ROLES_SHOWN[:-1]:
            ax.plot(ns, [r["cpu_ms_per_request"].get(role) for _, r in sizes], marker="o", label=SHORT[role])
            bx.plot(ns, [r["idle_cores"].get(role, 0.0) for _, r in sizes], marker="o", label=SHORT[role])
        ax.plot(
            ns,
            [routing_ms(r) for _, r in sizes],
            marker="s",
            lw=2.5,
            color="k",
            label="routing = Router + proxy + controller",
        )
        ax.set(
            ylabel="CPU ms per request (under load)",
            title=f"CPU per request at {res['settings']['rate_per_s']:g} req/s, by process",
        )
        bx.set(ylabel="cores busy, idle (no requests)", title="Idle CPU by process: what N costs with no traffic")
        save(fig, (ax, bx), "cpu_per_request.png", ns)
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
        for key, m in (("50", "o"), ("90", "^"), ("99", "s")):
            ax.plot(ns, [r["load"][f"added_ms_p{key}"] for _, r in sizes], marker=m, label=f"p{key}")
        ax.set(
            ylabel="ms",
            title=f"Added latency: measured - the FakeEngine's {res['settings']['slept_ms_per_request']:.0f} ms",
        )
        bx.plot(ns, [r["start_s"] for _, r in sizes], marker="o", label="deploy -> N running + a request answered")
        bx.plot(ns, [r.get("delete_s") for _, r in sizes], marker="x", ls=":", label="delete -> all gone")
        bx.set(ylabel="s", title="Replicas' start (and stop) time")
        save(fig, (ax, bx), "added_latency.png", ns)
    if sm := (ramp := res.get("ramp") or {}).get("samples"):
        fig, (ax, bx, cx) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
        ax.plot(*zip(*ramp["offered"]), label="offered rate (req/s)")
        sent = [v for _, v in ramp["sent_per_s"]]
        smooth = [sum(w := sent[max(0, i - 2) : i + 3]) / len(w) for i in range(len(sent))]
        ax.plot([t for t, _ in ramp["sent_per_s"]], smooth, lw=0.8, alpha=0.8, label="sent per second (5 s mean)")
        ax.set(ylabel="req/s", title="The ramp: offered load, replicas, ongoing requests")
        ts, per = [s["t"] for s in sm], ramp["autoscaling"]["target_ongoing_requests"]
        bx.step(ts, [s.get("running") for s in sm], where="post", label="running replicas")
        bx.step(ts, [s.get("target") for s in sm], where="post", ls="--", label="target replicas (autoscaler)")
        bx.axhline(ramp["autoscaling"]["max_replicas"], color="grey", lw=0.8, ls=":", label="max_replicas")
        bx.set(ylabel="replicas")
        cx.plot(ts, [s.get("client_in_flight") for s in sm], label="in flight at the client")
        cx.plot(ts, [s.get("autoscaler_ongoing") for s in sm], label="ongoing + queued (the autoscaler's count)")
        cx.plot(ts, [(s.get("running") or 0) * per for s in sm], ls=":", label="running x target_ongoing_requests")
        cx.set(ylabel="requests", xlabel="s since the ramp app was running")
        t_phase = ramp["load_window_s"][0]
        for k, (d, _, _) in enumerate(ramp["segments"][:-1]):
            t_phase += d
            for x in (ax, bx, cx):
                x.axvline(t_phase, color="grey", lw=0.6, ls="--" if k in (0, 2) else ":")
        save(fig, (ax, bx, cx), "ramp.png")
    return names


def ramp_lines(res: dict) -> list[str]:
    r = res.get("ramp") or {}
    if not r.get("load"):
        return ["The ramp did not run" + (f": {r}" if r else ".")]
    sc, ld, au, sg = r["scale"], r["load"], r["autoscaling"], r["segments"]
    s0 = lambda k: _f(sc[k], "{:.0f}")
    return [
        f"- Offered: Poisson arrivals, {sg[0][1]:g} req/s for {sg[0][0]:g} s, up to {r['peak_rate']:g} req/s over "
        f"{sg[1][0]:g} s, held {sg[2][0]:g} s, down over {sg[3][0]:g} s, {sg[4][0]:g} s low; {ld['requests']} "
        f"requests of {r['slept_ms']:.0f} ms in the FakeEngine each.",
        f"- Autoscaling: `{json.dumps(au)}`, replica_max_ongoing_requests {r['replica_max_ongoing_requests']}.",
        f"- **{ld['ok']}/{ld['requests']} answered 200, {ld['failed']} failed, {ld['not_done']} unfinished** "
        f"(client timeout {res['settings']['request_timeout_s']:g} s, the server's request_timeout_s 60 s)"
        + (f"; errors: {ld['error_samples']}" if ld["failed"] else "")
        + ".",
        f"- Replicas: max running **{sc['max_running']}** (of max_replicas {au['max_replicas']}), first at "
        f"{s0('first_at_max_running_s')} s. From the ramp up's start ({sc['up_start_s']:.0f} s): the autoscaler's "
        f"target at max after {s0('target_at_max_after_up_start_s')} s, {au['max_replicas']} running after "
        f"{s0('running_at_max_after_up_start_s')} s. From the ramp down's start ({sc['down_start_s']:.0f} s): back "
        f"at 1 replica after {s0('back_at_min_after_down_start_s')} s.",
        f"- Ongoing requests: at most {r['max_client_in_flight']} in flight at the client, "
        f"{_f(r['max_autoscaler_ongoing'], '{:.0f}')} in the autoscaler's count; added latency p50 "
        f"{_f(ld['added_ms_p50'], '{:.1f}')} ms, p99 {_f(ld['added_ms_p99'], '{:.1f}')} ms, max "
        f"{_f(ld['added_ms_max'], '{:.0f}')} ms.",
    ]


def machine_lines(res: dict) -> list[str]:
    """Command, run, machine and load average lines (results' Markdown heads; bench.failures' too)."""
    mc = res["machine"]
    return [
        f"Command: `{res['command']}` (from the repository root)  ",
        f"Run: {res['started']} .. {res.get('finished')} ({res.get('duration_s')} s)  ",
        f"Machine: {mc['cpu']}, {mc['physical_cores']} cores / {mc['logical_cpus']} logical CPUs, "
        f"{mc['memory_gib']} GiB, no accelerator; {mc['os']}; Python {mc['python']}; "
        + ", ".join(f"{k} {v}" for k, v in mc["versions"].items())
        + "  ",
        f"Load average at start {tuple(round(x, 2) for x in mc['load_average_at_start'])}, at end "
        f"{tuple(round(x, 2) for x in mc.get('load_average_at_end', ()))} (a shared machine: other engineers' "
        "runs count in it; CPU is counted per process, so theirs is not in the figures)",
    ]


def summary_md(res: dict, figures: list[str]) -> str:
    st, eng, fe = res["settings"], res["engine"], res["fake_engine"]
    sizes = by_n(res.get("sizes", {}))
    per_n = lambda fn: "; ".join(f"N={n}: {fn(r)}" for n, r in sizes) + "."
    span = lambda x, f="{:.1f}": "..".join(f.format(v * 1e3) for v in x)
    L = [
        "# Many replicas, simulated (issue 32, part 3)",
        "",
        *machine_lines(res),
        "",
        "## Method",
        "",
        f"- The app: `deployments.app:build(args, FakeEngine)` (`bench.simulate:fake_app`), deployed as `serve run "
        f"CONFIG` does, with `make serve`'s Serve switches (`{json.dumps(st['serve_env'])}`), behind Serve's proxy "
        f"(HeadOnly), one Router ({st['router']}), N EngineReplica replicas with `replica_autoscaling` min = max = N "
        f"and `ray_actor_options.num_cpus` {st['replica_num_cpus']:g} (the one option changed from the product's, "
        f"in the config's `deployments` section); {st['ray_cluster']}.",
        f"- The FakeEngine's delays: from {eng['source']}: {eng.get('server')}, {eng['model']}, c=1, "
        f"{eng['prompt_tokens']} prompt tokens, {eng['max_tokens']} out, {eng['requests']} streamed requests: "
        f"time to first token p50 {eng['ttft_s'] * 1e3:.1f} ms (p10..p90 {span(eng['ttft_s_p10_p90'])}), per later "
        f"token p50 {eng['itl_s'] * 1e3:.2f} ms ({span(eng['itl_s_p10_p90'], '{:.2f}')}): a request of "
        f"{st['max_tokens']} tokens takes TTFT + {st['max_tokens'] - 1} x per-token = "
        f"{st['slept_ms_per_request']:.0f} ms, which the FakeEngine sleeps in the replica (`first_token_delay_s` "
        f"{fe['first_token_delay_s']:.4f}, `token_delay_s` {fe['token_delay_s']:.4f}: "
        + (
            "one timer: the requests are not streamed, so the per-token cadence is invisible to them, and "
            f"{st['max_tokens'] + 1} timers per request would add their lateness on these busy cores to the added "
            "latency; `--pacing tokens` runs a timer per token)."
            if fe.get("pacing") == "once"
            else "a timer per token, as the engine's cadence)."
        ),
        f"- Per N: a fresh deploy (start time: deploy until N replicas run and a request is answered), "
        f"{st['idle_seconds']:g} s idle (CPU by process role, no requests), then {st['seconds']:g} s of open-loop "
        f"load at {st['rate_per_s']:g} req/s (Poisson, seed {st['seed']}, the same arrivals at every N; "
        f"{st['request']}; client timeout {st['request_timeout_s']:g} s), then the app deleted. CPU per request = "
        "CPU seconds of each role's processes over the load window / requests answered (bench.measure.CpuAccount: "
        "psutil, every process under our `ray start`, by title); `routing` = Router + proxy + controller. Added "
        "latency = measured latency - the FakeEngine's sleeps. A size whose replicas (one replica's PSS, its share "
        "of the memory, x N) would leave under 4 GiB available is skipped.",
        "",
        "## Figures by N",
        "",
        _md_table(SIZE_HEADERS, size_rows(res)),
        "",
        *(f"- N={n} skipped: {why}" for n, why in res.get("skipped", {}).items()),
        *([""] if res.get("skipped") else []),
        *(
            f"- N={n} did not work: {r['load']['ok']}/{r['load']['requests']} answered 200 (at most "
            f"{FAILED_MAX:.0%} may fail), {r['router_probe_timeouts']} queue-length probe timeouts logged by the "
            "Router, "
            f"cores busy (all processes) {r['busy_cores_under_load']:.2f}; no larger size was run."
            for n, r in by_n(res.get("sizes", {}))
            if not r["worked"]
        ),
        *([""] if any(not r["worked"] for r in res.get("sizes", {}).values()) else []),
        "Net of idle (the load window's CPU minus the idle window's rate over the same time), ms per request: "
        + per_n(lambda r: ", ".join(f"{SHORT[k]} {_f(r['net_cpu_ms_per_request'].get(k))}" for k in ROLES_SHOWN[:-1])),
        "",
        "Idle cores by role (no requests): "
        + per_n(lambda r: ", ".join(f"{SHORT[k]} {r['idle_cores'].get(k, 0.0):.3f}" for k in ROLES_SHOWN)),
        "",
        "Ray's daemons under load, ms per request: "
        + per_n(
            lambda r: (
                ", ".join(
                    f"{k[5:]} {v:.2f}"
                    for k, v in sorted(r["ray_system_ms_per_request"].items(), key=lambda kv: -kv[1])[:4]
                )
                or "-"
            )
        ),
        "",
        "Load checks per N (send lag = actual - scheduled send at the client): "
        + per_n(
            lambda r: (
                f"send lag p99 {_f(r['load']['send_lag_ms_p99'], '{:.1f}')} ms, requests per replica "
                f"{'..'.join(map(str, r['load']['requests_per_replica_min_max']))}, cores busy (all "
                f"processes) {r['busy_cores_under_load']:.2f}, Router RSS "
                f"{_f(r['memory'].get('router_rss_mib'), '{:.0f}')} MiB, controller "
                f"{_f(r['memory'].get('controller_rss_mib'), '{:.0f}')} MiB"
            )
        ),
        "",
        *(line for name in figures for line in (f"![{name[:-4]}]({name})", "")),
        "## The autoscaler under a ramp",
        "",
        *ramp_lines(res),
        "",
    ]
    L += ["## Notes", "", *res["notes"], ""] if res.get("notes") else []
    L += [
        f"Stopped: every process started (Ray cluster, driver) stopped; left running: "
        f"{res.get('stopped_left_running') or 'none'}.",
        "",
    ]
    L += ["## Errors", "", *(f"- {e}" for e in res["errors"]), ""] if res.get("errors") else []
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


def add_cluster_flags(add) -> None:
    """The flags bench.failures shares: the FakeEngine's requests and delays, the cluster, where results go."""
    add("--max-tokens", type=int, default=64)
    add("--prompt-tokens", type=int, default=256, help="the real engine's measured prompt")
    add("--prompt-chars", type=int, default=256, help="the FakeEngine's prompt (bytes = tokens)")
    add("--seed", type=int, default=20261203)
    add("--engine", default="auto", help="measure | file | auto (OUT/engine.json if there, else measure)")
    add("--engine-model", default="smollm2-135m-instruct")
    add("--engine-requests", type=int, default=10)
    add("--start-timeout", type=float, default=900.0)
    add(
        "--serve-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for the Ray cluster (Serve's switches), after SIM_ENV; repeatable",
    )
    add("--out", type=Path, default=Path("bench/results/simulate"))


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__.split("\n\n")[0])
    add = ap.add_argument
    add("--sizes", default="1,8,32,64,128", type=lambda s: [int(x) for x in s.split(",")])
    add("--rate", type=float, default=20.0, help="offered load per size, requests/s (open loop)")
    add("--seconds", type=float, default=60.0, help="load per size")
    add("--idle-seconds", type=float, default=20.0, help="idle window per size, before its load")
    add("--request-timeout", type=float, default=90.0, help="client-side, per request")
    add_cluster_flags(add)
    add("--ramp-max", type=int, default=32, help="the ramp's max_replicas; 0: no ramp")
    add("--ramp-target", type=float, default=2.0, help="target_ongoing_requests")
    add("--ramp-max-ongoing", type=int, default=8, help="the ramp's replica_max_ongoing_requests")
    add("--ramp-peak-rate", type=float, default=None, help="default: 0.75 x max x target / latency")
    add("--ramp-up", type=float, default=180.0, help="seconds up (and down)")
    add("--ramp-hold", type=float, default=60.0)
    add("--upscale-delay", type=float, default=10.0)
    add("--downscale-delay", type=float, default=30.0)
    add("--look-back", type=float, default=10.0, help="look_back_period_s")
    add(
        "--pacing",
        default="once",
        choices=("once", "tokens"),
        help="the FakeEngine's wait: one timer (once) or one per token (tokens); the same total",
    )
    add(
        "--fill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a size that does not fit: run the largest multiple of 8 that does, instead",
    )
    add("--report", type=Path, help="only draw the figures and summary.md again from this results.json")
    add("--driver", action="store_true", help=argparse.SUPPRESS)
    add("--address", help=argparse.SUPPRESS)
    add("--http-port", type=int, help=argparse.SUPPRESS)
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
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stop by SIGTERM still stops what was started
    return Sim(args).run()


if __name__ == "__main__":
    sys.exit(main())
