"""A Serve-layer failure under load: the proxy, the Router, a node killed (SIGKILL), one at a time.

    .venv/bin/python -m bench.failures            # OUT/failures.json and failures.md (about 6 min)

bench.simulate's cluster, driver and app with a second Ray node; HEAD_REPLICAS + NODE_REPLICAS replicas, at most
HEAD_REPLICAS a node, the Router kept on the head (a custom resource, `sim_head`). Under an open-loop Poisson load at
--rate, --kill-after s into it (then --after-kill s more): Serve's proxy, the Router replica (found by their process
titles), the second node's `ray start` process group. Per kill (kill_figures): the requests in flight at the kill and
how they ended, those sent after it, from when on every one succeeded; when Serve had replaced what was killed
(serve_times, from the controller polled every second).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

from bench.procs import BIN, Proc, alive, free_port, wait_until, write_results
from bench.servers import find_ray_worker
from bench.simulate import APP, MODEL, Poller, Sim, app_args, deploy_config, log, parser, run_main

HEAD_REPLICAS = NODE_REPLICAS = 4
CLIENT_TIMEOUT_S, SERVER_TIMEOUT_S = 30.0, 20.0
TITLES = {
    "proxy": "ray::ProxyActor",
    "router": f"ray::ServeReplica:{APP}:Router",
    "replica": f"ray::ServeReplica:{APP}:EngineReplica",
}


# -- its own open-loop load: the kill's figures need every request's send and end time, failed ones too, and a
# client timeout per request (vllm bench serve records no end of a failed request; its client waits 6 hours) --


@dataclass
class Req:
    at: float  # scheduled send, s from the load's start
    sent: float = 0.0  # actual send, s from the load's start
    latency: float | None = None
    status: int = 0
    error: str | None = None
    timed_out: bool = False  # the client's timeout ended it
    done: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def run_load(url: str, reqs: list[Req], max_tokens: int, state: dict) -> None:
    """Sends reqs[i] at reqs[i].at (s from start) whatever the earlier ones are doing (open loop), each with
    CLIENT_TIMEOUT_S; state["t0"] is the start (time.perf_counter()), state["in_flight"] the count."""
    import aiohttp

    async def one(session, i: int, r: Req):
        state["in_flight"] += 1
        r.sent = time.perf_counter() - state["t0"]
        body = {"model": MODEL, "prompt": f"request {i} " + "x" * 240, "max_tokens": max_tokens}
        try:
            async with session.post(url, json=body | {"temperature": 0.0, "return_hidden_states": True}) as resp:
                raw = await resp.read()
                r.status = resp.status
            r.error = None if r.status == 200 else raw[:300].decode(errors="replace")
        except Exception as e:  # counted, never dropped; a timeout is one
            r.timed_out, r.error = isinstance(e, asyncio.TimeoutError), f"{type(e).__name__}: {e}"[:300]
        r.latency, r.done = time.perf_counter() - state["t0"] - r.sent, True
        state["in_flight"] -= 1

    async def main():
        limits = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=limits, timeout=aiohttp.ClientTimeout(CLIENT_TIMEOUT_S)) as s:
            tasks, state["t0"] = [], time.perf_counter()
            for i, r in enumerate(reqs):
                await asyncio.sleep(max(0.0, r.at - (time.perf_counter() - state["t0"])))
                tasks.append(asyncio.create_task(one(s, i, r)))
            await asyncio.gather(*tasks)

    asyncio.run(main())


def arrivals(seconds: float, rate: float, seed: int) -> list[float]:
    """Poisson arrival times (s from 0) at `rate` for `seconds`: the same seed, the same arrivals."""
    rng, t, out = random.Random(seed), 0.0, []
    while (t := t + rng.expovariate(rate)) < seconds:
        out.append(t)
    return out


# -- pure logic (tests/scaffolding/test_simulate.py) ---------------------------------------------------------


def outcome(r: Req) -> str:
    """How a request ended: "ok", "timeout" (the client's), "http NNN", or the exception's class."""
    if r.ok:
        return "ok"
    if r.timed_out:
        return "timeout"
    return f"http {r.status}" if r.status else (r.error or "?").split(":", 1)[0]


def kill_figures(reqs: list[Req], kill_t: float) -> dict:
    """The figures of one kill at `kill_t` (s from the load's start, as Req.sent): the requests in flight then
    (sent before, answered after) and how they ended; those sent after it; how long after the kill the first
    request that succeeded was sent (`first_ok_sent_s`); from how long after the kill on every request sent
    succeeded (`all_ok_from_s`, 0 when none failed)."""
    end = lambda r: r.sent + (r.latency or 0.0)
    before = [r for r in reqs if r.done and end(r) <= kill_t]
    flight = [r for r in reqs if r.sent <= kill_t < end(r) or (r.sent <= kill_t and not r.done)]
    after = sorted((r for r in reqs if r.sent > kill_t), key=lambda r: r.sent)
    first = next((r for r in after if r.ok), None)
    since = lambda rs: max((r.sent - kill_t for r in rs), default=0.0) if after else None
    return {
        "requests": len(reqs),
        "ok": sum(r.ok for r in reqs),
        "failed": sum(not r.ok for r in reqs),
        "timeouts": sum(r.timed_out for r in reqs),
        "not_done": sum(not r.done for r in reqs),
        "answered_before_kill": len(before),
        "in_flight_at_kill": len(flight),
        "in_flight_outcomes": dict(Counter(map(outcome, flight))),
        "sent_after_kill": len(after),
        "after_outcomes": dict(Counter(map(outcome, after))),
        "first_ok_sent_s": None if first is None else first.sent - kill_t,
        "all_ok_from_s": since([r for r in after if not r.ok]),
    }


def first_at(samples: list[dict], since: float, pred) -> float | None:
    """How long after `since` (s, the samples' clock) the first sample then or later for which pred(sample)."""
    return next((s["t"] - since for s in samples if s["t"] >= since and "error" not in s and pred(s)), None)


def serve_times(
    samples: list[dict],
    kill_s: float,
    what: str,
    old_pid: int | None,
    node_id: str | None = None,
    replicas: int = HEAD_REPLICAS + NODE_REPLICAS,
) -> dict:
    """From the controller's polled samples (Failures.sample), how long after the kill (`kill_s`, their clock):
    the proxy or Router: until a new process (another pid) ran (and, the proxy, was HEALTHY); the node: until
    Ray marked it dead and until the controller counted its replicas gone (`replicas` - NODE_REPLICAS running);
    any: until the processes watched at the kill were all gone."""
    out = {"watched_gone_s": first_at(samples, kill_s, lambda s: s.get("watched_alive") == 0)}
    if what == "proxy":
        out["replaced_s"] = first_at(
            samples,
            kill_s,
            lambda s: s["proxy_pids"] and old_pid not in s["proxy_pids"] and set(s["proxy_status"]) == {"HEALTHY"},
        )
    elif what == "router":
        out["replaced_s"] = first_at(samples, kill_s, lambda s: s["router_pids"] and old_pid not in s["router_pids"])
    else:
        out["node_dead_s"] = first_at(samples, kill_s, lambda s: not s["nodes_alive"].get(node_id, True))
        out["replicas_dropped_s"] = first_at(samples, kill_s, lambda s: s["engine_running"] <= replicas - NODE_REPLICAS)
    return out


# -- the run ----------------------------------------------------------------------------------------------


class Failures(Sim):
    MODULE = "bench.failures"

    def __init__(self, args):
        super().__init__(args, results="failures.json")  # its .md: write_results
        for k in ("sizes", "skipped"):
            self.res.pop(k)
        self.res["scenarios"] = {}
        self.node = None
        self.node_id: str | None = None
        self.watched: list[int] = []

    def start_node(self) -> None:
        """The second node: `ray start --address HEAD --block`, its own ports and worker ports, the head's temp dir
        (so nothing is written to Ray's default one) and token, a custom resource `sim_node`."""
        before = {n["node_id"] for n in self.driver.call("nodes")}
        flags = (
            "node-manager object-manager dashboard-agent-listen dashboard-agent-grpc metrics-export runtime-env-agent"
        )
        ports = {f"--{f}-port": str(free_port(27100 + 100 * i)) for i, f in enumerate(flags.split())}
        argv = [BIN / "ray", "start", "--address", self.cluster.address, "--block", "--resources", '{"sim_node": 100}']
        argv += "--num-cpus 8 --node-ip-address 127.0.0.1 --min-worker-port 27700 --max-worker-port 27999".split()
        argv += ["--object-store-memory", str(256 * 2**20), "--temp-dir", str(self.cluster.temp_dir)]
        argv += ["--disable-usage-stats", *(x for kv in ports.items() for x in kv)]
        env = {**self.cluster.env(), "RAY_OVERRIDE_RESOURCES": ""}  # not the head's sim_head
        self.node = Proc(f"sim-node-{self.cluster.port}", argv, env=env)
        joined = lambda: len([n for n in self.driver.call("nodes") if n["alive"]]) == len(before) + 1
        took = wait_until(joined, 180, "the second Ray node", [self.node])
        self.node_id = next(n["node_id"] for n in self.driver.call("nodes") if n["node_id"] not in before)
        self.res["node_start_s"] = took
        log(f"second node up after {took:.1f} s")

    def config(self, delays: dict) -> dict:
        """bench.simulate's config, HEAD_REPLICAS + NODE_REPLICAS replicas at most HEAD_REPLICAS a node, the Router
        on the head (its options as deployments.app gives them, plus the head's custom resource)."""
        from deployments.config import AppArgs

        n = HEAD_REPLICAS + NODE_REPLICAS
        args = app_args(delays, n, replica_max_per_node=HEAD_REPLICAS, request_timeout_s=SERVER_TIMEOUT_S)
        cfg = deploy_config(args, self.http_port)
        env = {"env_vars": AppArgs.model_validate(args).serve_env}
        router = {"num_cpus": 0, "runtime_env": env, "resources": {"sim_head": 1}}
        cfg["applications"][0]["deployments"].append({"name": "Router", "ray_actor_options": router})
        return cfg

    def sample(self) -> dict:
        """The controller's view (proxies, Router, replicas), Ray's nodes, and how many watched pids still run."""
        d = self.details()
        router, eng = self.deployment(d, "Router"), self.deployment(d)
        running = lambda dep: [r["pid"] for r in dep["replicas"] if r["state"] == "RUNNING"]
        return {
            "proxy_pids": d["proxies"],
            "proxy_status": d["proxy_status"],
            "router_pids": running(router),
            "engine_running": len(running(eng)),
            "engine_states": eng["states"],
            "app": (d["applications"].get(APP) or {}).get("status"),
            "nodes_alive": {n["node_id"]: n["alive"] for n in self.driver.call("nodes")},
            "watched_alive": sum(map(alive, self.watched)),
        }

    def target(self, what: str) -> tuple[list[int], dict]:
        """The pids a kill takes (by process title, and the controller's pid beside it) and what was found."""
        d = self.details()
        if what == "node":
            procs = self.node.tree()  # remembered, for the stop at the end
            replicas = [r["pid"] for r in self.deployment(d)["replicas"] if r.get("node_id") == self.node_id]
            titled = find_ray_worker(self.node, TITLES["replica"])
            return [self.node.pgid], {
                "processes": len(procs),
                "replica_pids_by_title": len(titled),
                "controller_replicas_on_node": len(replicas),
                "watched": sorted({*titled, *replicas, *(p.pid for p in procs)}),
            }
        pids = find_ray_worker(self.cluster.proc, TITLES[what])
        says = d["proxies"] if what == "proxy" else [r["pid"] for r in self.deployment(d, "Router")["replicas"]]
        if len(pids) != 1 or pids != says:
            raise RuntimeError(f"{what}: by title {pids}, the controller says {says}")
        return pids, {"pid_by_title": pids[0], "controller_pid": says[0], "watched": pids}

    def scenario(self, k: int, what: str) -> dict:
        a = self.args
        reqs = [Req(t) for t in arrivals(a.kill_after + a.after_kill, a.rate, a.seed + 10 + k)]
        state, row = {"t0": 0.0, "in_flight": 0}, {}
        poller = Poller(self.sample, 1.0, t0 := time.monotonic())
        runner = threading.Thread(target=run_load, args=(self.url, reqs, a.max_tokens, state), daemon=True)
        runner.start()
        since = lambda: time.perf_counter() - state["t0"] if state["t0"] else 0.0
        while since() < a.kill_after - 2:
            time.sleep(0.1)
        pids, row["target"] = self.target(what)
        self.watched = row["target"].pop("watched")
        while since() < a.kill_after:
            time.sleep(0.005)
        kill_mono, kill_t = time.monotonic() - t0, since()
        (os.killpg if what == "node" else os.kill)(pids[0], signal.SIGKILL)
        log(f"{what}: killed {pids[0]} {kill_t:.1f} s into the load, {state['in_flight']} requests in flight")
        runner.join(a.after_kill + CLIENT_TIMEOUT_S + 60)
        if runner.is_alive():
            raise RuntimeError(f"{what}: the load did not end")  # every request has a timeout: cannot happen
        time.sleep(2)
        samples = poller.stop()
        row.update(
            kill_at_s=kill_t,
            figures=kill_figures(reqs, kill_t),
            serve=serve_times(samples, kill_mono, what, row["target"].get("pid_by_title"), self.node_id),
            samples=[{**s, "t": s["t"] - kill_mono} for s in samples],
            errors=Counter((r.status, (r.error or "")[:160]) for r in reqs if not r.ok).most_common(8),
        )
        f = row["figures"]
        log(f"{what}: in flight at the kill: {f['in_flight_outcomes']}; after: {f['after_outcomes']}; {row['serve']}")
        return row

    def run(self) -> int:
        a = self.args
        delays = self.delays()
        self.res["settings"] = {**vars(a), "out": str(a.out), "client_timeout_s": CLIENT_TIMEOUT_S}
        self.res["settings"]["server_request_timeout_s"] = SERVER_TIMEOUT_S
        try:
            self.start(extra_env={"RAY_OVERRIDE_RESOURCES": json.dumps({"sim_head": 100})})
            self.start_node()
            self.res["nodes"] = [{**n, "head": n["node_id"] != self.node_id} for n in self.driver.call("nodes")]
            self.res["deploy_s"], d = self.deploy({}, HEAD_REPLICAS + NODE_REPLICAS, self.config(delays))
            on_node = sum(r.get("node_id") == self.node_id for r in self.deployment(d)["replicas"])
            router_nodes = {r.get("node_id") for r in self.deployment(d, "Router")["replicas"]}
            self.res["placement"] = {
                "replicas_on_node": on_node,
                "replicas_on_head": HEAD_REPLICAS + NODE_REPLICAS - on_node,
                "router_on_node": self.node_id in router_nodes,
            }
            log(f"deployed in {self.res['deploy_s']:.1f} s: {self.res['placement']}")
            for k, what in enumerate(("proxy", "router", "node")):
                self.res["scenarios"][what] = self.scenario(k, what)
                self.save()
                if what != "node":  # back to normal before the next
                    took, _ = self.wait_running(
                        HEAD_REPLICAS + NODE_REPLICAS, lambda d: set(d["proxy_status"]) == {"HEALTHY"}
                    )
                    self.res["scenarios"][what]["back_to_running_s"] = took
        except Exception as e:
            self.res["errors"].append(f"{type(e).__name__}: {e}"[:3000])
            log(f"ERROR: {e}")
        finally:
            self.stop(self.node)
        rows = [kill_row(what, sc) for what, sc in self.res["scenarios"].items()]
        write_results(self.out, "failures", self.res, rows)
        return self.status()


def kill_row(what: str, sc: dict) -> dict:
    """A kill's row of the table docs/benchmarks.md gives."""
    f, back = sc["figures"], sc["serve"].get("replicas_dropped_s" if what == "node" else "replaced_s")
    row = {"killed": what, "in flight at the kill": f["in_flight_at_kill"], "of those": f["in_flight_outcomes"]}
    row |= {"sent after": f["after_outcomes"], "client timeouts": f["timeouts"], "all ok from s": f["all_ok_from_s"]}
    return row | {"Serve back s": back}


def parse(argv=None):
    ap = parser("bench.failures", __doc__)
    add = ap.add_argument
    add("--rate", type=float, default=20.0, help="offered load, requests/s (open loop)")
    add("--kill-after", type=float, default=15.0, help="seconds of load before each kill")
    add("--after-kill", type=float, default=45.0, help="seconds of load after each kill")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    return run_main(Failures, parse(argv))


if __name__ == "__main__":
    sys.exit(main())
