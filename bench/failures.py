"""What a Serve-layer failure does at scale (issue 32, part 5): the proxy, the Router, a node killed under load.

    .venv/bin/python -m bench.failures            # OUT/failures.json and failures.md (about 6 min)

bench.simulate's cluster, driver and app (FakeEngine replicas behind the real Router and Serve's proxy), with a
second Ray node: `ray start --address HEAD --block` of its own (its own ports, the head's temp dir and token).
HEAD_REPLICAS + NODE_REPLICAS engine replicas, `replica_max_per_node` (AppArgs) = HEAD_REPLICAS, so each node
holds its share; the Router is kept on the head by a custom resource (`sim_head`, given to the head node with
RAY_OVERRIDE_RESOURCES and asked for in the config's `deployments` section), so killing the node kills replicas
only. Under an open-loop Poisson load at --rate (every request with a client timeout, CLIENT_TIMEOUT_S, above the
server's request_timeout_s, SERVER_TIMEOUT_S: a client timeout is a request the server never answered), one at a
time, --kill-after s into the load, then --after-kill s more of it:

- proxy: SIGKILL Serve's proxy actor process (found by its title, `ray::ProxyActor`, under our `ray start`);
- router: SIGKILL the Router replica's process (`ray::ServeReplica:hidden-states:Router`);
- node: SIGKILL the second node's `ray start` process group (its raylet and Ray's daemons; its workers, the
  replicas, go when their raylet does). Last: its replicas cannot be replaced (the head holds its maximum).

Per kill (kill_figures): the requests in flight at the kill and how they ended (200, a status, an exception, a
client timeout), the requests sent after it, how long after the kill the first one that succeeded was sent, and
from when on every request sent succeeded (and had a normal latency); from the controller, polled every second,
when Serve had replaced what was killed (serve_times).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from types import SimpleNamespace

from bench.simulate import (
    APP,
    Load,
    Poller,
    Req,
    Sim,
    _f,
    _md_table,
    add_cluster_flags,
    app_args,
    deploy_config,
    fake_delays,
    log,
    machine_lines,
    pct,
    poisson_arrivals,
    run_load,
)

HEAD_REPLICAS = NODE_REPLICAS = 4
CLIENT_TIMEOUT_S, SERVER_TIMEOUT_S = 30.0, 20.0
TITLES = {
    "proxy": "ray::ProxyActor",
    "router": f"ray::ServeReplica:{APP}:Router",
    "replica": f"ray::ServeReplica:{APP}:EngineReplica",
}
SLOW = 2.0  # a latency over SLOW x the p99 of the requests answered before the kill is not normal


# -- pure logic (tests/scaffolding/test_simulate.py) ---------------------------------------------------------


def outcome(r: Req) -> str:
    """How a request ended: "ok", "timeout" (the client's), "http NNN", or the exception's class."""
    if r.ok:
        return "ok"
    if r.timed_out:
        return "timeout"
    return f"http {r.status}" if r.status else (r.error or "?").split(":", 1)[0]


def kill_figures(reqs: list[Req], kill_t: float, bucket_s: float = 1.0) -> dict:
    """The figures of one kill at `kill_t` (s from the load's start, as Req.sent): the requests in flight then
    (sent before, answered after) and how they ended; those sent after it; how long after the kill the first
    request that succeeded was sent (`first_ok_sent_s`) and answered (`first_ok_answered_s`); from how long after
    the kill on every request sent succeeded (`all_ok_from_s`, 0 when none failed) and was also answered within
    SLOW x the p99 latency of those answered before the kill (`normal_from_s`); outcomes per `bucket_s` of send
    time, from the kill."""
    end = lambda r: r.sent + (r.latency or 0.0)
    before = [r for r in reqs if r.done and end(r) <= kill_t]
    flight = [r for r in reqs if r.sent <= kill_t < end(r) or (r.sent <= kill_t and not r.done)]
    after = sorted((r for r in reqs if r.sent > kill_t), key=lambda r: r.sent)
    p99 = pct([r.latency for r in before if r.ok], 99)
    normal = lambda r: r.ok and (p99 is None or r.latency <= SLOW * p99)
    first = next((r for r in after if r.ok), None)
    since = lambda rs: max((r.sent - kill_t for r in rs), default=0.0) if after else None
    buckets: dict[int, Counter] = {}
    for r in reqs:
        buckets.setdefault(int((r.sent - kill_t) // bucket_s), Counter())[outcome(r)] += 1
    return {
        "requests": len(reqs),
        "ok": sum(r.ok for r in reqs),
        "failed": sum(not r.ok for r in reqs),
        "timeouts": sum(r.timed_out for r in reqs),
        "not_done": sum(not r.done for r in reqs),
        "answered_before_kill": len(before),
        "latency_p99_before_s": p99,
        "in_flight_at_kill": len(flight),
        "in_flight_outcomes": dict(Counter(map(outcome, flight))),
        "sent_after_kill": len(after),
        "after_outcomes": dict(Counter(map(outcome, after))),
        "first_ok_sent_s": None if first is None else first.sent - kill_t,
        "first_ok_answered_s": None if first is None else end(first) - kill_t,
        "all_ok_from_s": since([r for r in after if not r.ok]),
        "normal_from_s": since([r for r in after if not normal(r)]),
        "latency_max_after_s": max((r.latency for r in after if r.ok), default=None),
        "by_send_second": [[k * bucket_s, dict(c)] for k, c in sorted(buckets.items())],
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
        super().__init__(args, results="failures.json")
        for k in ("sizes", "skipped"):
            self.res.pop(k)
        self.res["scenarios"] = {}
        self.node = None
        self.node_id: str | None = None
        self.watched: list[int] = []

    def start_node(self) -> None:
        """The second node: `ray start --address HEAD --block`, its own ports and worker ports, the head's temp dir
        (so nothing is written to Ray's default one) and token, a custom resource `sim_node`."""
        from bench.procs import BIN, Proc, free_port, wait_until

        before = {n["node_id"] for n in self.driver.call("nodes")}
        ports = {
            flag: str(free_port(p))
            for flag, p in (
                ("--node-manager-port", 27100),
                ("--object-manager-port", 27200),
                ("--dashboard-agent-listen-port", 27300),
                ("--dashboard-agent-grpc-port", 27400),
                ("--metrics-export-port", 27500),
                ("--runtime-env-agent-port", 27600),
            )
        }
        argv = [
            BIN / "ray",
            "start",
            "--address",
            self.cluster.address,
            "--block",
            "--num-cpus",
            "8",
            "--node-ip-address",
            "127.0.0.1",
            "--resources",
            json.dumps({"sim_node": 100}),
            "--min-worker-port",
            "27700",
            "--max-worker-port",
            "27999",
            "--object-store-memory",
            str(256 * 2**20),
            "--temp-dir",
            str(self.cluster.temp_dir),
            "--disable-usage-stats",
            *(x for kv in ports.items() for x in kv),
        ]
        env = {**self.cluster.env(), "RAY_OVERRIDE_RESOURCES": ""}  # not the head's sim_head
        self.node = Proc(f"sim-node-{self.cluster.port}", argv, env=env)
        took = wait_until(
            lambda: len([n for n in self.driver.call("nodes") if n["alive"]]) == len(before) + 1,
            180,
            "the second Ray node",
            [self.node],
        )
        self.node_id = next(n["node_id"] for n in self.driver.call("nodes") if n["node_id"] not in before)
        self.res["node_start_s"] = took
        log(f"second node up after {took:.1f} s")

    def config(self, delays: dict) -> dict:
        """bench.simulate's config, HEAD_REPLICAS + NODE_REPLICAS replicas at most HEAD_REPLICAS a node, the Router
        on the head (its options as deployments.app gives them, plus the head's custom resource)."""
        from deployments.config import AppArgs

        n = HEAD_REPLICAS + NODE_REPLICAS
        args = app_args(
            delays,
            {"min_replicas": n, "max_replicas": n, "initial_replicas": n},
            replica_max_per_node=HEAD_REPLICAS,
            request_timeout_s=SERVER_TIMEOUT_S,
        )
        cfg = deploy_config(args, self.http_port)
        cfg["applications"][0]["deployments"].append(
            {
                "name": "Router",
                "ray_actor_options": {
                    "num_cpus": 0,
                    "runtime_env": {"env_vars": AppArgs.model_validate(args).serve_env},
                    "resources": {"sim_head": 1},
                },
            }
        )
        return cfg

    def sample(self) -> dict:
        """The controller's view (proxies, Router, replicas), Ray's nodes, and how many watched pids still run."""
        from bench.simulate import alive

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
        from bench.servers import find_ray_worker

        d = self.details()
        if what == "node":
            procs = self.node.tree()  # remembered, for the stop at the end
            replicas = [r["pid"] for r in self.deployment(d)["replicas"] if r.get("node_id") == self.node_id]
            titled = find_ray_worker(SimpleNamespace(proc=self.node), TITLES["replica"])
            return [self.node.pgid], {
                "processes": len(procs),
                "replica_pids_by_title": len(titled),
                "controller_replicas_on_node": len(replicas),
                "watched": sorted({*titled, *replicas, *(p.pid for p in procs)}),
            }
        pids = find_ray_worker(self.cluster, TITLES[what])
        says = d["proxies"] if what == "proxy" else [r["pid"] for r in self.deployment(d, "Router")["replicas"]]
        if len(pids) != 1 or pids != says:
            raise RuntimeError(f"{what}: by title {pids}, the controller says {says}")
        return pids, {"pid_by_title": pids[0], "controller_pid": says[0], "watched": pids}

    def scenario(self, k: int, what: str) -> dict:
        a = self.args
        arrivals = poisson_arrivals([(a.kill_after + a.after_kill, a.rate, a.rate)], seed=a.seed + 10 + k)
        load, row = Load([Req(at) for at in arrivals]), {}
        poller = Poller(self.sample, 1.0, t0 := time.monotonic())
        runner = threading.Thread(
            target=run_load, args=(self.url, arrivals, self.body, CLIENT_TIMEOUT_S, load), daemon=True
        )
        runner.start()
        while not load.t0 or time.perf_counter() - load.t0 < a.kill_after - 2:
            time.sleep(0.1)
        pids, row["target"] = self.target(what)
        self.watched = row["target"].pop("watched")
        while time.perf_counter() - load.t0 < a.kill_after:
            time.sleep(0.005)
        kill_mono, kill_t = time.monotonic() - t0, time.perf_counter() - load.t0
        (os.killpg if what == "node" else os.kill)(pids[0], signal.SIGKILL)
        row["in_flight_at_kill_client"] = load.in_flight
        log(
            f"{what}: killed ({'process group' if what == 'node' else 'pid'} {pids[0]}) {kill_t:.1f} s into "
            f"the load, {load.in_flight} requests in flight"
        )
        runner.join(a.after_kill + CLIENT_TIMEOUT_S + 60)
        if runner.is_alive():
            raise RuntimeError(f"{what}: the load did not end")  # every request has a timeout: cannot happen
        time.sleep(2)
        samples = poller.stop()
        old = row["target"].get("pid_by_title")
        row.update(
            kill_at_s=kill_t,
            load_wall_s=load.wall,
            figures=kill_figures(load.reqs, kill_t),
            serve=serve_times(samples, kill_mono, what, old, self.node_id),
            samples=[{**s, "t": s["t"] - kill_mono} for s in samples],
            errors=Counter((r.status, (r.error or "")[:160]) for r in load.reqs if not r.ok).most_common(8),
        )
        f = row["figures"]
        log(
            f"{what}: {f['in_flight_at_kill']} in flight at the kill: {f['in_flight_outcomes']}; after it "
            f"{f['after_outcomes']}; first ok sent {_f(f['first_ok_sent_s'])} s after, all ok from "
            f"{_f(f['all_ok_from_s'])} s; Serve: {row['serve']}"
        )
        return row

    def run(self) -> int:
        a = self.args
        eng = self.engine()
        delays = self.res["fake_engine"] = fake_delays(eng["ttft_s"], eng["itl_s"], a.max_tokens)
        self.res["settings"] = {
            "rate_per_s": a.rate,
            "kill_after_s": a.kill_after,
            "after_kill_s": a.after_kill,
            "seed": a.seed,
            "max_tokens": a.max_tokens,
            "prompt_chars": a.prompt_chars,
            "client_timeout_s": CLIENT_TIMEOUT_S,
            "server_request_timeout_s": SERVER_TIMEOUT_S,
            "replicas": {"head": HEAD_REPLICAS, "node": NODE_REPLICAS},
            "slow_factor": SLOW,
            "titles": TITLES,
            "replica_num_cpus": 0.0,
            "router": "1 replica, on the head",
        }
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
        write(self.res, self.out)
        return 0 if not self.res["errors"] and not self.res["stopped_left_running"] else 1


# -- report -----------------------------------------------------------------------------------------------

HEADERS = [
    "killed",
    "in flight at the kill",
    "of those: ok / failed (how)",
    "sent after the kill: ok / failed",
    "client timeouts",
    "first ok sent after s",
    "all ok from s",
    "normal latency from s",
    "Serve back s",
]
LABELS = {
    "proxy": "Serve's proxy (SIGKILL)",
    "router": "the Router replica (SIGKILL)",
    "node": f"a node with {NODE_REPLICAS} of {HEAD_REPLICAS + NODE_REPLICAS} replicas (raylet group SIGKILL)",
}


def rows(res: dict) -> list[list[str]]:
    out = []
    for what, s in res.get("scenarios", {}).items():
        f, sv = s["figures"], s["serve"]
        fo, ao = dict(f["in_flight_outcomes"]), dict(f["after_outcomes"])
        ok_in, ok_after = fo.pop("ok", 0), ao.pop("ok", 0)
        how = ", ".join(f"{v} {k}" for k, v in sorted(fo.items(), key=lambda kv: -kv[1]))
        back = sv.get("replaced_s") if what != "node" else sv.get("replicas_dropped_s")
        out.append(
            [
                LABELS[what],
                f["in_flight_at_kill"],
                f"{ok_in} / {sum(fo.values())}" + (f" ({how})" if how else ""),
                f"{ok_after} / {sum(ao.values())}",
                f["timeouts"],
                _f(f["first_ok_sent_s"]),
                _f(f["all_ok_from_s"], "{:.1f}"),
                _f(f["normal_from_s"], "{:.1f}"),
                _f(back, "{:.1f}"),
            ]
        )
    return out


def markdown(res: dict) -> str:
    st, pl = res["settings"], res.get("placement", {})
    L = [
        "# A Serve-layer failure under load, simulated (issue 32, part 5)",
        "",
        *machine_lines(res),
        "",
        "## Method",
        "",
        f"- bench.simulate's app (FakeEngine replicas sleeping "
        f"{res['fake_engine']['first_token_delay_s'] * 1e3:.0f} ms a request, the real Router, Serve's proxy, "
        f"`make serve`'s Serve switches) on two Ray nodes of this machine: the head ({st['replicas']['head']} "
        f"replicas, the Router, proxy and controller) and a second `ray start` ({st['replicas']['node']} replicas; "
        f"`replica_max_per_node` {st['replicas']['head']}). Placement seen: {pl}.",
        f"- Load: open loop, Poisson at {st['rate_per_s']:g} req/s, {st['kill_after_s']:g} s before each kill and "
        f"{st['after_kill_s']:g} s after; non-streaming POST /v1/completions through the proxy; client timeout "
        f"{st['client_timeout_s']:g} s, the server's request_timeout_s {st['server_request_timeout_s']:g} s, so a "
        "client timeout is a request left hanging.",
        "- One kill at a time, in this order, each after the last was back to all replicas running: Serve's proxy "
        f"actor process (`{st['titles']['proxy']}`, SIGKILL), the Router replica (`{st['titles']['router']}`, "
        "SIGKILL), the second node's `ray start` process group (raylet and daemons, SIGKILL; its replicas die with "
        "their raylet and are not replaced: the head holds its maximum).",
        "- In flight at the kill: sent before it, answered after it. `first ok sent after`: how long after the kill "
        "the first request that then succeeded was sent; `all ok from`: every request sent this long after the kill "
        f"or later succeeded; `normal latency from`: and answered within {st['slow_factor']:g}x the p99 latency of "
        "the requests answered before the kill. `Serve back`: the controller (polled every second) shows a new "
        "proxy HEALTHY / a new Router replica RUNNING / the node's replicas gone from its count.",
        "",
        "## Figures",
        "",
        _md_table(HEADERS, rows(res)),
        "",
    ]
    for what, s in res.get("scenarios", {}).items():
        f, sv = s["figures"], s["serve"]
        L.append(
            f"- {what}: {f['requests']} requests, {f['ok']} ok, {f['failed']} failed, {f['timeouts']} client "
            f"timeouts, {f['not_done']} unfinished; first ok answered {_f(f['first_ok_answered_s'])} s after the "
            f"kill; Serve: "
            + ", ".join(f"{k} {_f(v, '{:.1f}')} s" for k, v in sv.items())
            + (f"; back to all running after {s['back_to_running_s']:.1f} s" if "back_to_running_s" in s else "")
            + f"; target {s['target']}; errors: {s['errors'] or 'none'}"
        )
    L += [
        "",
        f"Stopped: every process started (Ray head, second node, driver) stopped; left running: "
        f"{res.get('stopped_left_running') or 'none'}.",
        "",
    ]
    L += ["## Errors", "", *(f"- {e}" for e in res["errors"]), ""] if res.get("errors") else []
    return "\n".join(L)


def write(res: dict, out) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "failures.md").write_text(markdown(res))
    print(_md_table(HEADERS, rows(res)))


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.failures", description=__doc__.split("\n\n")[0])
    add = ap.add_argument
    add("--rate", type=float, default=20.0, help="offered load, requests/s (open loop)")
    add("--kill-after", type=float, default=15.0, help="seconds of load before each kill")
    add("--after-kill", type=float, default=45.0, help="seconds of load after each kill")
    add_cluster_flags(add)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stop by SIGTERM still stops what was started
    return Failures(args).run()


if __name__ == "__main__":
    sys.exit(main())
