"""Many replicas, simulated: our Router and Serve's proxy in front of N FakeEngine replicas.

    .venv/bin/python -m bench.simulate --sizes 1,8,32,48,64      # OUT/results.json (--out, bench/.work/simulate)

A Ray cluster of its own (`make serve`'s Serve switches) and a driver process (`--driver`, JSON lines on its pipes)
that starts Serve and deploys `bench.simulate:fake_app` (`deployments.app:build(args, FakeEngine)`) as `serve run`
does, the replicas' num_cpus 0. The FakeEngine sleeps what vLLM's server took at c=1 (OUT/engine.json, measured
once). Per size N: start time, the replicas' PSS (a size leaving under 4 GiB is skipped), an idle window, then
`vllm bench serve --request-rate` (Poisson, one seed): CPU per request by role (bench.measure.CpuAccount) and the
added latency (vLLM's end-to-end percentiles minus the FakeEngine's sleep).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import psutil

from bench.measure import CpuAccount
from bench.procs import LOGS, PYTHON, ROOT, Proc, alive, command_line, free_port, wait_until
from bench.servers import RayCluster, cluster_env, serve_config, smoke

APP = "hidden-states"
MODEL = "sim"
GIB = 2**30
SPARE_BYTES = 4 * GIB  # what a size must leave available
ROUTING_ROLES = (f"{APP}: router", "ray: proxy", "ray: controller")  # "routing CPU" (bench.measure.CpuAccount)
FAILED_MAX = 0.01  # a size "worked" if at most this share of its requests failed


def fake_app(args: dict):
    """`deployments.app.build(args, FakeEngine)`: the config's import path (`bench.simulate:fake_app`)."""
    from deployments.app import build
    from hidden_states.testing import FakeEngine

    return build(args, engine_cls=FakeEngine)


def app_args(engine: dict, replicas: int, **extra) -> dict:
    """AppArgs for the simulation: FakeEngine delays as `engine` args, `replicas` replicas, one Router."""
    return {
        "model": "builtin:tiny-llama",
        "served_model_name": MODEL,  # the FakeEngine loads nothing
        "engine": {k: engine[k] for k in ("token_delay_s", "first_token_delay_s")},
        "request_timeout_s": 60,
        "replica_max_ongoing_requests": 256,
        "replica_autoscaling": {"min_replicas": replicas, "max_replicas": replicas, "initial_replicas": replicas},
        "router_autoscaling": {"min_replicas": 1, "max_replicas": 1},
        **extra,
    }


def deploy_config(args: dict, http_port: int) -> dict:
    """The ServeDeploySchema `serve run CONFIG` would read: one app, the replicas' num_cpus 0
    (the config's `ray_actor_options` replaces the code's, so the product's runtime_env goes with it)."""
    from deployments.config import AppArgs

    actor = {**AppArgs.model_validate(args).replica_options()["ray_actor_options"], "num_cpus": 0.0}
    app = {"name": APP, "route_prefix": "/", "import_path": "bench.simulate:fake_app", "args": args}
    app["deployments"] = [{"name": "EngineReplica", "ray_actor_options": actor}]
    return serve_config(http_port, [app])


# -- pure logic (tests/scaffolding/test_simulate.py) --------------------------------------------------------


def slept_s(engine: dict, max_tokens: int, n: int = 1) -> float:
    """What the FakeEngine sleeps for one request (hidden_states/testing.py): the prefill once, a tick per token."""
    return engine["first_token_delay_s"] + n * max_tokens * engine["token_delay_s"]


def fake_delays(ttft_s: float, itl_s: float, max_tokens: int) -> dict:
    """FakeEngine args that reproduce a measured engine's request of `max_tokens`, ending at
    `ttft_s + (max_tokens - 1) * itl_s`: the whole wait as the prefill (one timer a request, not one a token,
    keeps the timers' lateness on busy cores out of the added latency)."""
    return {"token_delay_s": 0.0, "first_token_delay_s": ttft_s + (max_tokens - 1) * itl_s}


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


# -- the driver: a Ray job of its own that starts Serve and deploys, spoken to in JSON lines --------


def driver_main(address: str, http_port: int) -> None:
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    ray.init(address=address, namespace="serve", logging_level="WARNING", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": http_port}, proxy_location="HeadOnly")
    client = _get_global_client()
    controller = client._controller

    def details() -> dict:
        """The controller's view, trimmed: per app its status and per deployment its replicas' pid, state, node."""
        d = ray.get(controller.get_serve_instance_details.remote(), timeout=30)
        proxies = list((d.get("proxies") or {}).values())

        def deployment(dep: dict) -> dict:
            reps = dep.get("replicas") or []
            out = {"status": dep.get("status"), "target": dep.get("target_num_replicas")}
            out["states"] = dict(Counter(r.get("state") for r in reps))
            return out | {"replicas": [{k: r.get(k) for k in ("pid", "state", "node_id")} for r in reps]}

        apps = {
            name: {"status": a.get("status"), "message": (a.get("message") or "")[-2000:]}
            | {"deployments": {dn: deployment(dep) for dn, dep in (a.get("deployments") or {}).items()}}
            for name, a in (d.get("applications") or {}).items()
        }
        return {
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
        argv = [PYTHON, "-m", "bench.simulate", "--driver", "--address", cluster.address, "--http-port", http_port]
        super().__init__("sim-driver", argv, env=cluster.env(), pipes=True)
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


def measure_engine(model: str, prompt_tokens: int, max_tokens: int, requests: int, seed: int = 7) -> dict:
    """The real engine, once: vLLM's own OpenAI server (bench.servers.VLLMServer, the bench's engine arguments and
    environment) at c=1 through `vllm bench serve` (bench.cli.batch: random prompts of `prompt_tokens`, `max_tokens`
    out, ignore_eos; two requests first to warm up): the median time to the first token and per later token."""
    from bench.cli import ENGINE, batch
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
    got = {"ttft_s": lat["p50_ttft_ms"] / 1e3, "itl_s": lat["p50_tpot_ms"] / 1e3, "requests": b["ok"], "left": left}
    got |= {"model": model, "engine_args": dict(ENGINE), "engine_env": dict(ENGINE_ENV), "startup_s": startup}
    got |= {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "took_s": time.monotonic() - t_start}
    return got | {"source": "measured", "measured_at": dt.datetime.now().isoformat(timespec="seconds")}


# -- the load: `vllm bench serve` (bench.cli.serve_argv) at a request rate, open loop ---------------------------


def load_argv(url: str, n: int, seed: int, lens: tuple[int, int], rate: float, result: Path) -> list[str]:
    """`vllm bench serve` (bench.cli.serve_argv): n requests of `lens` (prompt, completion tokens; the final vector
    asked) at `--request-rate rate`, no concurrency cap."""
    from bench.cli import serve_argv
    from hidden_states.models.builtin import resolve_model

    ep, fields = SimpleNamespace(url=url, model=MODEL), {"return_hidden_states": True}
    argv = serve_argv(ep, resolve_model("builtin:tiny-llama"), n, None, seed, lens, fields, result)
    return argv + ["--request-rate", str(rate), "--ready-check-timeout-sec", "60"]


def vllm_load(url: str, n: int, seed: int, lens: tuple[int, int], rate: float, timeout: float) -> dict:
    """load_argv's run, within `timeout` s: vLLM's result (completed, failed, e2el ms percentiles, duration)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-sim-") as folder:
        result = Path(folder) / "load.json"
        with open(LOGS / "sim-load.log", "ab") as out:
            argv = load_argv(url, n, seed, lens, rate, result)
            done = subprocess.run(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        if done.returncode != 0 or not result.exists():
            raise RuntimeError(f"vllm bench serve exited {done.returncode} (its log: bench/.work/logs/sim-load.log)")
        r = json.loads(result.read_text())
    keep = ("completed", "failed", "duration", "request_throughput", "max_concurrent_requests")
    return {k: r.get(k) for k in keep} | {k: v for k, v in r.items() if k.endswith("_e2el_ms")}


def added_ms(r: dict, slept: float) -> dict:
    """vLLM's end-to-end latency percentiles (answered requests) minus what the FakeEngine slept, ms."""
    return {f"added_ms_p{q}": r[f"p{q}_e2el_ms"] - slept * 1e3 for q in (50, 90, 99) if r.get(f"p{q}_e2el_ms")}


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
    """The Ray cluster, the driver, the app's deploys and deletes; the sizes (bench.failures too)."""

    MODULE = "bench.simulate"  # the command the results record

    def __init__(self, args, results: str = "results.json"):
        from bench.cli import machine

        self.args, self.out, self.results, self.t0 = args, args.out, results, time.monotonic()
        self.res: dict = {
            "command": command_line(self.MODULE),
            "started": dt.datetime.now().isoformat(timespec="seconds"),
            "machine": machine(),
            "sizes": {},
            "skipped": {},
            "errors": [],
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

    def deploy(self, args: dict, n: int, config: dict | None = None) -> tuple[float, dict]:
        self.driver.call("deploy", config=config or deploy_config(args, self.http_port), timeout=120)
        return self.wait_running(n)

    def wait_running(self, n: int, also=lambda d: True) -> tuple[float, dict]:
        """Until the app is RUNNING with n running replicas (and `also(details)`) and a request is answered:
        (seconds, details)."""
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
        pids = [r["pid"] for r in self.deployment(self.details())["replicas"] if r.get("pid")]
        self.driver.call("delete", app=APP, timeout=60)
        return wait_until(
            lambda: APP not in self.details()["applications"] and not any(map(alive, pids)),
            self.args.start_timeout,
            "the app deleted",
        )

    def pss_mib(self, d: dict) -> float | None:
        """The replicas' mean PSS, MiB (a replica's share: libraries are mapped once)."""
        pss = []
        for r in self.deployment(d)["replicas"]:
            try:
                m = psutil.Process(r["pid"]).memory_full_info()
                pss.append(getattr(m, "pss", m.uss) / 2**20)
            except (psutil.Error, TypeError, ValueError):
                pass
        return sum(pss) / len(pss) if pss else None

    def serve_env(self) -> dict:
        """The `sim` cluster's switches, then each --serve-env KEY=VALUE (Ray Serve's own, e.g. its probe deadline)."""
        return {**cluster_env("sim"), **dict(kv.split("=", 1) for kv in self.args.serve_env)}

    def start(self, extra_env: dict | None = None) -> None:
        self.cluster = RayCluster("sim", extra_env={**self.serve_env(), **(extra_env or {})}, second=True)
        log(f"ray start (port {self.cluster.port})")
        self.cluster.launch()
        self.res["ray_start_s"] = self.cluster.wait_ready(timeout=240)
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
        now = dt.datetime.now().isoformat(timespec="seconds")
        self.res.update(stopped_left_running=left, finished=now, duration_s=round(time.monotonic() - self.t0))
        self.res["machine"]["load_average_at_end"] = os.getloadavg()
        self.save()

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / self.results).write_text(json.dumps(self.res, indent=1, default=str) + "\n")

    def delays(self) -> dict:
        """The FakeEngine's delays (recorded), from the real engine measured (--engine measure, or auto with no
        OUT/engine.json yet) or from OUT/engine.json."""
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
        self.res["fake_engine"] = fake_delays(eng["ttft_s"], eng["itl_s"], a.max_tokens)
        return self.res["fake_engine"]

    def status(self) -> int:
        """The exit status: 1 after an error or with a process left running."""
        return 0 if not self.res["errors"] and not self.res["stopped_left_running"] else 1

    def size(self, n: int, delays: dict) -> str:
        """One size: deploy, start time, memory, idle CPU, the load, delete: "ok", "failed" (over FAILED_MAX of
        its requests not answered) or "skipped" (it does not fit in memory)."""
        a, avail = self.args, psutil.virtual_memory().available
        if self.replica_bytes is not None and not (fit := fits(n, self.replica_bytes, avail))[0]:
            self.res["skipped"][str(n)] = fit[1]
            log(f"N={n}: skipped: {fit[1]}")
            return "skipped"
        row: dict = {"available_gib_before": avail / GIB}
        log(f"N={n}: deploying")
        row["start_s"], d = self.deploy(app_args(delays, n), n)
        log(f"N={n}: {n} replicas running after {row['start_s']:.1f} s")
        pss = row["replica_pss_mib"] = self.pss_mib(d)
        if self.replica_bytes is None and pss:
            self.replica_bytes = int(pss * 2**20)
        account = CpuAccount()
        account.add_root(self.cluster.proc.pid, "ray")
        account.add_root(self.driver.pid, "driver")

        def window(run) -> dict:  # CPU by role over run(); the driver's processes ("driver: <module>") one role
            s0 = account.snapshot()
            got = run()
            delta, roles = account.delta(s0, account.snapshot()), Counter()
            for k, v in delta["roles"].items():
                roles["driver" if k.startswith("driver") else k] += v
            return {**delta, "roles": dict(roles), "got": got}

        time.sleep(3)  # the smoke request's and start-up's tail
        idle = window(lambda: time.sleep(a.idle_seconds))
        row["idle_cores"] = {k: v / idle["wall"] for k, v in idle["roles"].items()}
        requests = round(a.rate * a.seconds)
        log(f"N={n}: load, {requests} requests at {a.rate}/s")
        probes0 = self.probe_timeouts()
        lens = (a.prompt_tokens, a.max_tokens)
        busy = window(lambda: vllm_load(self.url, requests, a.seed, lens, a.rate, a.seconds * 3 + a.request_timeout))
        lat = row["load"] = busy["got"] | added_ms(busy["got"], slept_s(delays, a.max_tokens))
        ok = lat["completed"]
        per_req = lambda d: {k: v / ok * 1e3 for k, v in d.items()} if ok else {}  # none answered: none
        row.update(
            cpu_ms_per_request=per_req(busy["roles"]),
            routing_ms_per_request=sum(per_req(busy["roles"]).get(k, 0.0) for k in ROUTING_ROLES) if ok else None,
            net_cpu_ms_per_request=per_req(
                {k: v - row["idle_cores"].get(k, 0.0) * busy["wall"] for k, v in busy["roles"].items()}
            ),
            router_probe_timeouts=self.probe_timeouts() - probes0,
            worked=lat["failed"] <= FAILED_MAX * requests,
        )
        self.res["sizes"][str(n)] = row
        self.save()
        log(
            f"N={n}: ok {ok}/{requests}, routing CPU {row['routing_ms_per_request']} ms/request, added "
            f"{ {k: round(v, 1) for k, v in added_ms(lat, 0).items()} } ms, {row['router_probe_timeouts']} "
            "queue-length probe timeouts logged by the Router"
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

    def run(self) -> int:
        a = self.args
        delays = self.delays()
        self.res["settings"] = {**vars(a), "out": str(a.out), "serve_env": self.serve_env()}
        self.res["settings"]["slept_ms_per_request"] = slept_s(delays, a.max_tokens) * 1e3
        try:
            self.start()
            for n in a.sizes:
                if self.attempt(f"N={n}", self.size, n, delays) != "ok":
                    break  # larger sizes would do no better
                self.res["largest_that_worked"] = n
        finally:
            self.stop()
        return self.status()


def parser(module: str, doc: str) -> argparse.ArgumentParser:
    """The command line with the flags bench.failures shares: the FakeEngine's requests and delays, the cluster,
    where results go."""
    ap = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    add = ap.add_argument
    add("--max-tokens", type=int, default=64)
    add("--prompt-tokens", type=int, default=256)
    add("--seed", type=int, default=20261203)
    add("--engine", default="auto", help="measure | file | auto (OUT/engine.json if there, else measure)")
    add("--engine-model", default="smollm2-135m-instruct")
    add("--engine-requests", type=int, default=10)
    add("--start-timeout", type=float, default=900.0)
    add("--serve-env", action="append", default=[], metavar="KEY=VALUE", help="for the Ray cluster; repeatable")
    add("--out", type=Path, default=Path("bench/.work/simulate"), help="bench/results/simulate holds the records")
    add("--dry-run", action="store_true", help="print the settings and exit; starts nothing")
    return ap


def parse(argv=None):
    ap = parser("bench.simulate", __doc__)
    add = ap.add_argument
    add("--sizes", default="1,8,32,64,128", type=lambda s: [int(x) for x in s.split(",")])
    add("--rate", type=float, default=20.0, help="offered load per size, requests/s (vllm bench serve's)")
    add("--seconds", type=float, default=60.0, help="load per size")
    add("--idle-seconds", type=float, default=20.0, help="idle window per size, before its load")
    add("--request-timeout", type=float, default=90.0, help="added to each load's own time limit")
    add("--driver", action="store_true", help=argparse.SUPPRESS)
    add("--address", help=argparse.SUPPRESS)
    add("--http-port", type=int, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def run_main(cls, args) -> int:
    """--dry-run prints the settings; else `cls(args).run()`, a SIGTERM still stopping what it started."""
    if args.dry_run:
        print(json.dumps({**vars(args), "out": str(args.out)}, indent=1))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return cls(args).run()


def main(argv=None) -> int:
    args = parse(argv)
    if args.driver:
        driver_main(args.address, args.http_port)
        return 0
    return run_main(Sim, args)


if __name__ == "__main__":
    sys.exit(main())
