"""The real app on a real multi-node Ray cluster, on one machine (issue 6, item 3).

`ray.cluster_utils.Cluster` starts a head and worker nodes as separate Ray
nodes (own raylet, own object store) in a private temp dir. The app is the real
`build_app` with the built-in model; every vector is checked against the
transformers reference.

Placement is steered by resources and order only (the app has no per-node
knob): the head has 1 logical CPU, room for one engine replica (1 CPU each;
the Router and proxy ask for 0 CPUs). The app is deployed while the head is
the only node, so the Router and the first replica land there; the second
replica waits for resources until the worker joins. Removing the worker leaves
its replica with nowhere to go until a new node joins (what Ray's autoscaler
does on a real cluster), and the replacement lands there. Serve autoscaling
then adds a third replica under load and removes it when the load stops.

Every node runs with `make serve`'s Ray Serve switches (deployments/serve_env.py:
direct ingress), so the Router also answers on a port of its own next to the proxy;
test 1 checks vectors through both. The three tests share one cluster and run in
order (`-x`). Long: run with HS_LONG_TESTS=1 (`make test-long`).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import numpy as np
import psutil
import pytest

from tests.conftest import TEST_ENGINE_ARGS, router_ports, serve_switches
from tests.helpers import free_port

pytestmark = [
    pytest.mark.long,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(
        os.environ.get("HS_LONG_TESTS") != "1", reason="long test: set HS_LONG_TESTS=1 (make test-long)"
    ),
]

APP = "hidden-states-mn"
MODEL = "tiny-llama"
MIN_REPLICAS, MAX_REPLICAS, TARGET_ONGOING = 2, 3, 2
LOAD_THREADS = 10  # ceil(10 / TARGET_ONGOING) = 5 -> capped at MAX_REPLICAS
DEPLOY_TIMEOUT = 900  # engines start in ~60 s on an idle machine; this one is shared
HS = {"return_hidden_states": True, "return_token_ids": True}


# -- helpers -------------------------------------------------------------------

DIRECT_PORT = 8450  # direct ingress: the Router's own port, from here up
PROXY_PORTS = range(8347, 8447)  # Serve's proxy: the first free one (clear of 8000 and 8123)


def wait_for(cond, timeout: float, what: str, every: float = 1.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(every)
    raise TimeoutError(f"{what}: not reached within {timeout:.0f}s (last: {last!r})")


@contextmanager
def keep_ray_address_file():
    """Cluster() writes /tmp/ray/ray_current_cluster and shutdown() deletes it:
    other people's `ray start` clusters on this machine rely on that file."""
    import ray

    saved = (ray._private.utils.write_ray_address, ray._common.utils.reset_ray_address)
    ray._private.utils.write_ray_address = lambda *a, **k: None
    ray._common.utils.reset_ray_address = lambda *a, **k: None
    try:
        yield
    finally:
        ray._private.utils.write_ray_address, ray._common.utils.reset_ray_address = saved


@dataclass
class Result:
    ok: bool
    t0: float
    t1: float
    status: int = 0
    replica: str | None = None
    ids: list[int] | None = None
    vector: np.ndarray | None = None
    error: str = ""


def complete(client: httpx.Client, base: str, i: int, max_tokens: int = 8) -> Result:
    t0 = time.monotonic()
    body = {
        "model": MODEL,
        "prompt": f"request {i}: the quick brown fox {i % 97}",
        "max_tokens": max_tokens,
        "temperature": 0,
        **HS,
    }
    try:
        r = client.post(f"{base}/v1/completions", json=body, timeout=300)
    except httpx.HTTPError as e:
        return Result(False, t0, time.monotonic(), error=f"{type(e).__name__}: {e}")
    t1 = time.monotonic()
    if r.status_code != 200:
        return Result(False, t0, t1, r.status_code, error=r.text[:300])
    c = r.json()["choices"][0]
    return Result(
        True,
        t0,
        t1,
        200,
        r.headers.get("x-replica-id"),
        c["prompt_token_ids"] + c["token_ids"],
        np.asarray(c["hidden_states"], np.float32),
    )


class Load:
    """`threads` loops of sequential requests until stopped; every result kept."""

    def __init__(self, base: str, threads: int, max_tokens: int):
        self.base, self.max_tokens = base, max_tokens
        self.results: list[Result] = []
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.counter = 0
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self):
        with httpx.Client() as client:
            while not self.stop_event.is_set():
                with self.lock:
                    self.counter += 1
                    i = self.counter
                r = complete(client, self.base, i, self.max_tokens)
                with self.lock:
                    self.results.append(r)
                if not r.ok:
                    time.sleep(0.2)

    def snapshot(self) -> list[Result]:
        with self.lock:
            return list(self.results)

    def stop(self, timeout: float = 330):
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "load threads did not finish"
        return self.snapshot()


@dataclass
class MultiNode:
    cluster: object
    head_id: str
    base: str
    nodes: dict = field(default_factory=dict)  # name -> ray Node
    pids: set = field(default_factory=set)  # replica processes and their children seen so far
    procs: dict = field(default_factory=dict)  # replica id -> its process and the engine's processes

    def node_id(self, name: str) -> str:
        return self.nodes[name].node_id

    def replicas(self) -> dict[str, dict]:
        """Alive EngineReplica actors: replica id -> {node, pid}, from the GCS actor table."""
        import ray

        out = {}
        for a in ray._private.state.actors().values():
            name = a["Name"] or ""
            if a["State"] == "ALIVE" and name.startswith(f"SERVE_REPLICA::{APP}#EngineReplica#"):
                out[out_key(name)] = {"node": a["Address"]["NodeID"], "pid": a["Pid"]}
                try:
                    p = psutil.Process(a["Pid"])
                    mine = {p.pid} | {c.pid for c in p.children(recursive=True)}
                    self.pids |= mine
                    self.procs.setdefault(out_key(name), set()).update(mine)
                except psutil.Error:
                    pass
        return out

    def replica_states(self) -> dict[str, int]:
        from ray import serve

        app = serve.status().applications.get(APP)
        if app is None or "EngineReplica" not in app.deployments:
            return {}
        return {str(k): v for k, v in app.deployments["EngineReplica"].replica_states.items()}

    def running(self) -> int:
        return self.replica_states().get("RUNNING", 0)

    def settled_at(self, n: int) -> bool:
        """Exactly n replicas, all RUNNING, and n alive replica actors."""
        states = self.replica_states()
        return states == {"RUNNING": n} and len(self.replicas()) == n


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def out_key(actor_name: str) -> str:
    return actor_name.rsplit("#", 1)[1]


def app_args() -> dict:
    return {
        "model": f"builtin:{MODEL}",
        "engine": dict(TEST_ENGINE_ARGS),
        "enable_return_hidden_states": True,
        "extraction_timeout_s": 120,
        "request_timeout_s": 300,
        "replica_autoscaling": {
            "min_replicas": MIN_REPLICAS,
            "max_replicas": MAX_REPLICAS,
            "target_ongoing_requests": TARGET_ONGOING,
            # Extra keys pass through AppArgs (extra="allow") to Serve's autoscaling_config.
            "upscale_delay_s": 3,
            "downscale_delay_s": 5,
            "look_back_period_s": 5,
            "metrics_interval_s": 1,
        },
    }


def _sweep(paths: tuple[str, ...], pids: set[int]) -> list[int]:
    """Processes this module started that outlived the cluster's shutdown: killed by pid."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if p.pid in pids or any(path in cmd for path in paths):
                left.append(p)
        except psutil.Error:
            pass
    left = [p for p in left if p.pid != os.getpid()]
    _, alive = psutil.wait_procs(left, timeout=30)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=15)
    return [p.pid for p in alive]


@pytest.fixture(scope="module")
def mn():
    with serve_switches(DIRECT_PORT):  # make serve's switches on every node this module starts
        yield from _multinode()


def _multinode():
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from deployments.app import build_app

    temp_dir = tempfile.mkdtemp(prefix="hsmn_", dir="/tmp")
    node_args = {"temp_dir": temp_dir, "include_dashboard": False, "object_store_memory": 200 * 1024 * 1024}
    port = free_port(PROXY_PORTS)
    with keep_ray_address_file():
        cluster = Cluster(initialize_head=True, head_node_args={**node_args, "num_cpus": 1})
    m = MultiNode(cluster, cluster.head_node.node_id, f"http://127.0.0.1:{port}", {"head": cluster.head_node})
    m.node_args = node_args
    try:
        ray.init(address=cluster.address, namespace="hs-multinode", logging_level="WARNING")
        # One proxy, on the head: proxies on every node would all bind this port on this one machine.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        # Not serve.run: it waits for the app to be RUNNING, and its second replica waits for the worker.
        serve.run_many(
            [serve.RunTarget(build_app(app_args()), name=APP, route_prefix="/")],
            wait_for_ingress_deployment_creation=False,
            wait_for_applications_running=False,
        )

        def router_running():
            app = serve.status().applications.get(APP)
            return (
                app is not None
                and "Router" in app.deployments
                and app.deployments["Router"].replica_states.get("RUNNING", 0) >= 1
            )

        wait_for(router_running, DEPLOY_TIMEOUT, "Router running on the head")
        wait_for(lambda: m.running() >= 1, DEPLOY_TIMEOUT, "first engine replica running on the head")
        m.nodes["worker"] = cluster.add_node(**node_args, num_cpus=4)
        cluster.wait_for_nodes(timeout=120)

        def app_running():
            app = serve.status().applications.get(APP)
            if app is not None and app.status == "DEPLOY_FAILED":
                raise RuntimeError(f"deploy failed: {app}")
            return app is not None and app.status == "RUNNING" and m.settled_at(MIN_REPLICAS)

        wait_for(app_running, DEPLOY_TIMEOUT, "app running with 2 replicas", every=2)
        wait_for(lambda: httpx.get(f"{m.base}/health", timeout=10).status_code == 200, 120, "HTTP health")
        yield m
    finally:
        try:
            if ray.is_initialized():
                m.replicas()  # note the pids of the replicas still alive, for the sweep below
        except Exception:
            pass
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            with keep_ray_address_file():
                cluster.shutdown()
            leftovers = _sweep((temp_dir,), m.pids)
            shutil.rmtree(temp_dir, ignore_errors=True)
            print(f"\n[multinode] teardown: {len(leftovers)} leftover processes killed: {leftovers}")


def check_vectors(reference, results: list[Result]) -> int:
    n = 0
    for r in results:
        if r.ok:
            reference.assert_matches(r.ids, r.vector)
            n += 1
    return n


# -- 1. replicas on both nodes serve vectors -------------------------------------


def test_replicas_on_both_nodes_serve_vectors(mn, reference):
    reps = mn.replicas()
    nodes = {r["node"] for r in reps.values()}
    assert nodes == {mn.head_id, mn.node_id("worker")}, (reps, mn.head_id, mn.node_id("worker"))

    seen: dict[str, int] = {}
    results = []
    with httpx.Client() as client:
        for i in range(200):
            r = complete(client, mn.base, i)
            assert r.ok, (r.status, r.error)
            assert r.replica in reps, (r.replica, reps)
            results.append(r)
            seen[r.replica] = seen.get(r.replica, 0) + 1
            if len(seen) == 2 and min(seen.values()) >= 3:
                break
    assert set(seen) == set(reps), f"not every replica served: {seen}"
    # Direct ingress: the Router's own port serves the same API, vectors from both nodes' replicas.
    ports = router_ports(DIRECT_PORT)
    assert len(ports) == 1, ports
    direct = f"http://127.0.0.1:{ports[0]}"
    via_port: dict[str, int] = {}
    with httpx.Client() as client:
        for i in range(1000, 1200):
            r = complete(client, direct, i)
            assert r.ok, (r.status, r.error)
            results.append(r)
            via_port[r.replica] = via_port.get(r.replica, 0) + 1
            if len(via_port) == 2 and min(via_port.values()) >= 2:
                break
    assert set(via_port) == set(reps), f"not every replica served through the Router's port: {via_port}"
    checked = check_vectors(reference, results)
    by_node = {("head" if reps[k]["node"] == mn.head_id else "worker"): v for k, v in seen.items()}
    print(
        f"\n[multinode] 1: {checked} vectors checked; requests by node {by_node} through the proxy, "
        f"{sum(via_port.values())} through the Router's own port {ports[0]}"
    )
    stats = httpx.get(f"{mn.base}/debug/stats", timeout=60).json()
    assert stats["ingress"]["pending"] == 0 and stats["replica"]["pid"] in {r["pid"] for r in reps.values()}


# -- 2. removing the worker node: its replica is rescheduled, requests go on ----------


def test_remove_worker_node_reschedules_replica(mn, reference):
    before = mn.replicas()
    worker_id = mn.node_id("worker")
    lost = [k for k, v in before.items() if v["node"] == worker_id]
    assert len(lost) == 1, before

    load = Load(mn.base, threads=2, max_tokens=24)
    try:
        wait_for(lambda: sum(r.ok for r in load.snapshot()) >= 10, 300, "requests flowing before the removal")
        t_rm0 = time.monotonic()
        mn.cluster.remove_node(mn.nodes.pop("worker"))
        t_rm1 = time.monotonic()

        # The lost replica's actor is dead, its engine processes with it; Serve wants a
        # replacement and has nowhere to put it.
        wait_for(lambda: lost[0] not in mn.replicas(), 120, "the worker's replica gone")
        lost_procs = mn.procs[lost[0]]
        assert len(lost_procs) >= 2, lost_procs  # the replica and at least the engine core
        wait_for(lambda: not [p for p in lost_procs if running(p)], 120, "the lost engine's processes gone")
        time.sleep(5)
        assert len(mn.replicas()) == 1, mn.replicas()
        # A new node joins, as Ray's autoscaler would add one for the pending replica.
        mn.nodes["worker2"] = mn.cluster.add_node(**mn.node_args, num_cpus=4)
        mn.cluster.wait_for_nodes(timeout=120)
        wait_for(lambda: mn.settled_at(MIN_REPLICAS), DEPLOY_TIMEOUT, "replacement replica running", every=2)
        after = mn.replicas()
        new = [k for k in after if k not in before]
        assert len(new) == 1 and after[new[0]]["node"] == mn.node_id("worker2"), (before, after)
        t_back = time.monotonic()
        wait_for(
            lambda: sum(1 for r in load.snapshot() if r.ok and r.replica == new[0] and r.t0 > t_back) >= 3,
            300,
            "the replacement replica serving",
        )
    finally:
        results = load.stop()

    failed = [r for r in results if not r.ok]
    # Allowed: requests in flight when the node went away (started before the removal
    # finished, unanswered when it began) -- at most one per load thread.
    in_flight = [r for r in failed if r.t0 < t_rm1 and r.t1 >= t_rm0]
    late = [r for r in failed if r not in in_flight]
    assert not late, [(round(r.t0 - t_rm1, 2), r.status, r.error) for r in late]
    assert len(in_flight) <= len(load.threads), [(r.status, r.error) for r in in_flight]
    after_rm = [r for r in results if r.t0 >= t_rm1]
    assert after_rm and all(r.ok for r in after_rm)
    assert {r.replica for r in results if r.ok and r.t0 > t_back} <= set(after)
    checked = check_vectors(reference, results)
    assert mn.settled_at(MIN_REPLICAS)
    print(
        f"\n[multinode] 2: {len(results)} requests during the removal, {len(failed)} failed "
        f"(in flight at removal: {len(in_flight)}: {[r.status or r.error[:60] for r in in_flight]}); "
        f"{checked} vectors checked; replacement {new[0]} on worker2; removal took {t_rm1 - t_rm0:.1f}s"
    )


# -- 3. Serve autoscaling: a replica added under load, removed after --------------


def test_autoscaling_adds_and_removes_a_replica(mn, reference):
    assert mn.settled_at(MIN_REPLICAS)
    before = set(mn.replicas())
    expected = min(MAX_REPLICAS, math.ceil(LOAD_THREADS / TARGET_ONGOING))
    assert expected > MIN_REPLICAS

    counts: list[tuple[float, int]] = []
    done = threading.Event()

    def monitor():
        while not done.is_set():
            try:
                counts.append((time.monotonic(), len(mn.replicas())))
            except Exception:
                pass
            done.wait(1)

    mon = threading.Thread(target=monitor, daemon=True)
    mon.start()
    t_load = time.monotonic()
    load = Load(mn.base, threads=LOAD_THREADS, max_tokens=48)
    try:
        wait_for(lambda: mn.settled_at(expected), DEPLOY_TIMEOUT, f"{expected} replicas under load", every=2)
        t_up = time.monotonic()
        reps = mn.replicas()
        added = [k for k in reps if k not in before]
        assert len(added) == expected - MIN_REPLICAS
        added_on = ["head" if reps[k]["node"] == mn.head_id else "worker2" for k in added]
        wait_for(
            lambda: sum(1 for r in load.snapshot() if r.ok and r.replica in added) >= 3,
            300,
            "the added replica serving",
        )
    finally:
        results = load.stop()
    t_stop = time.monotonic()
    try:
        wait_for(lambda: mn.settled_at(MIN_REPLICAS), 600, "back to min_replicas after the load", every=2)
    finally:
        done.set()
        mon.join(10)
    t_down = time.monotonic()

    failed = [r for r in results if not r.ok]
    assert not failed, [(r.status, r.error) for r in failed[:3]]
    checked = check_vectors(reference, results)
    seen = [c for _, c in counts]
    assert max(seen) == expected and seen[-1] == MIN_REPLICAS
    stats = httpx.get(f"{mn.base}/debug/stats", timeout=60).json()
    assert stats["ingress"]["pending"] == 0
    placement = {k: ("head" if v["node"] == mn.head_id else "worker2") for k, v in mn.replicas().items()}
    print(
        f"\n[multinode] 3: {len(results)} requests under load ({LOAD_THREADS} concurrent), {checked} vectors checked; "
        f"replicas {MIN_REPLICAS} -> {max(seen)} after {t_up - t_load:.0f}s of load, -> {seen[-1]} "
        f"{t_down - t_stop:.0f}s after it stopped; counts seen {sorted(set(seen))}; added on {added_on}; "
        f"final placement {placement}"
    )
