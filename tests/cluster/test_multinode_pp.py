"""A replica whose two pipeline stages sit on two Ray nodes (issue 65, item 3), on one machine.

`ray.cluster_utils.Cluster` (as tests/cluster/test_multinode.py, whose helpers this reuses) runs a head with one
logical CPU (the engine replica's own bundle; the Router and proxy ask for none) and nodes A and B, each with one
CPU and one `hs_rank`: the custom resource that stands for a device under vLLM's Ray executor on CPUs (tests only,
ledger point 24; `HIDDEN_STATES_TEST_RAY_CPU_DEVICE`). The app runs `engine: {pipeline_parallel_size: 2,
distributed_executor_backend: ray}`: the replica's placement group is {CPU: 1} + two {CPU: 1, hs_rank: 1} bundles,
PACK, so one stage's worker actor lands on A and the other's on B (checked in the actor table).

1. Vectors through Serve over HTTP (httpx and the openai client) are exact against transformers; the first stage
   sent its rows on and the last one received them (each worker's counts), so the capture ran in Ray's workers.
2. Node B (the last stage's) is removed under load: every request in flight ends within `BOUND_S`, none hangs
   (ledger point 23 fails the step as soon as vLLM's worker monitor sees the actor die); the replica's
   check_health fails and Serve replaces it; once a node with an `hs_rank` joins, the new replica's stages span
   two nodes again and its vectors are exact.

Long: HS_LONG_TESTS=1 (`make test-long`). The two tests share one cluster and run in order (`-x`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster.test_multinode import (
    PROXY_PORTS,
    Load,
    _sweep,
    complete,
    keep_ray_address_file,
    out_key,
    wait_for,
)
from tests.conftest import TEST_ENGINE_ARGS, environ, serve_switches
from tests.helpers import free_port

pytestmark = [
    pytest.mark.long,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(
        os.environ.get("HS_LONG_TESTS") != "1", reason="long test: set HS_LONG_TESTS=1 (make test-long)"
    ),
]

APP = "hidden-states-mnpp"
MODEL = "tiny-llama"
DEVICE = "hs_rank"  # the custom resource each worker's bundle holds (deployments/config.py)
DIRECT_PORT = 8470  # the Router's own port (direct ingress), clear of test_multinode's
DEPLOY_TIMEOUT = 600
BOUND_S = 60.0  # every request in flight when a stage's node dies ends within this
ROOT = str(Path(__file__).resolve().parents[2])


def app_args() -> dict:
    return {
        "model": f"builtin:{MODEL}",
        "engine": {**TEST_ENGINE_ARGS, "pipeline_parallel_size": 2, "distributed_executor_backend": "ray"},
        "extraction_timeout_s": 120,
        "request_timeout_s": 300,
    }


class Cluster2:
    def __init__(self, cluster, base: str, node_args: dict):
        self.cluster, self.base, self.node_args = cluster, base, node_args
        self.nodes: dict = {}
        self.pids: set[int] = set()

    def add(self, name: str):
        self.nodes[name] = self.cluster.add_node(**self.node_args, num_cpus=1, resources={DEVICE: 1})
        self.cluster.wait_for_nodes(timeout=120)

    def node_name(self, node_id: str) -> str:
        return next((k for k, n in self.nodes.items() if n.node_id == node_id), node_id[:8])

    def replicas(self) -> dict[str, str]:
        """Alive engine replicas: id -> node id."""
        import ray

        return {
            out_key(a["Name"]): a["Address"]["NodeID"]
            for a in ray._private.state.actors().values()
            if a["State"] == "ALIVE" and (a["Name"] or "").startswith(f"SERVE_REPLICA::{APP}#EngineReplica#")
        }

    def routers(self) -> list[str]:
        """The nodes of the alive Router replicas, by name."""
        import ray

        return [
            self.node_name(a["Address"]["NodeID"])
            for a in ray._private.state.actors().values()
            if a["State"] == "ALIVE" and (a["Name"] or "").startswith(f"SERVE_REPLICA::{APP}#Router#")
        ]

    def workers(self) -> dict[str, str]:
        """vLLM's alive worker actors: "PP0"/"PP1" -> node id (their names end in _PP<stage>)."""
        import ray

        out = {}
        for a in ray._private.state.actors().values():
            name = a["Name"] or ""
            if a["State"] == "ALIVE" and name.startswith("vllm_Worker_"):
                out[name.rsplit("_", 1)[1]] = a["Address"]["NodeID"]
                self.pids.add(a["Pid"])
        return out

    def running(self) -> bool:
        from ray import serve

        app = serve.status().applications.get(APP)
        if app is not None and app.status == "DEPLOY_FAILED":
            raise RuntimeError(f"deploy failed: {app}")
        return (
            app is not None
            and app.status == "RUNNING"
            and app.deployments["EngineReplica"].replica_states == {"RUNNING": 1}
            and len(self.replicas()) == 1
        )


@pytest.fixture(scope="module")
def mnpp():
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    # this checkout in every Ray process; the tests' device resource for vLLM's Ray executor on CPUs
    with serve_switches(DIRECT_PORT), environ({"PYTHONPATH": path, "HIDDEN_STATES_TEST_RAY_CPU_DEVICE": DEVICE}):
        yield from _cluster()


def _cluster():
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from deployments.app import build_app

    temp_dir = tempfile.mkdtemp(prefix="hsmnpp_", dir="/tmp")
    node_args = {"temp_dir": temp_dir, "include_dashboard": False, "object_store_memory": 200 * 1024 * 1024}
    port = free_port(PROXY_PORTS)
    with keep_ray_address_file():
        cluster = Cluster(initialize_head=True, head_node_args={**node_args, "num_cpus": 1})
    c = Cluster2(cluster, f"http://127.0.0.1:{port}", node_args)
    c.nodes["head"] = cluster.head_node
    try:
        ray.init(address=cluster.address, namespace="hs-multinode-pp", logging_level="WARNING")
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        t0 = time.monotonic()
        # Deployed while the head is the only node, so the Router (0 CPUs) lands there, not on a node removed later;
        # the replica's placement group waits for A and B.
        serve.run_many(
            [serve.RunTarget(build_app(app_args()), name=APP, route_prefix="/")],
            wait_for_ingress_deployment_creation=False,
            wait_for_applications_running=False,
        )
        wait_for(lambda: c.routers() == ["head"], DEPLOY_TIMEOUT, "the Router running on the head")
        c.add("A")
        c.add("B")
        wait_for(c.running, DEPLOY_TIMEOUT, "the two-node replica running", every=2)
        wait_for(lambda: httpx.get(f"{c.base}/health", timeout=10).status_code == 200, 120, "HTTP health")
        print(f"\n[multinode-pp] replica running {time.monotonic() - t0:.0f}s after deploy")
        yield c
    finally:
        try:
            if ray.is_initialized():
                c.workers()
                serve.shutdown()
        finally:
            ray.shutdown()
            with keep_ray_address_file():
                cluster.shutdown()
            leftovers = _sweep((temp_dir,), c.pids)
            shutil.rmtree(temp_dir, ignore_errors=True)
            print(f"\n[multinode-pp] teardown: {len(leftovers)} leftover processes killed: {leftovers}")


def stages_on_two_nodes(c: Cluster2) -> dict[str, str]:
    workers = c.workers()
    assert sorted(workers) == ["PP0", "PP1"], workers
    assert workers["PP0"] != workers["PP1"], workers  # the two stages on two nodes
    placed = {stage: c.node_name(n) for stage, n in workers.items()}
    assert set(placed.values()) <= set(c.nodes) - {"head"}, placed  # on the hs_rank nodes
    (replica_node,) = c.replicas().values()
    assert c.node_name(replica_node) == "head", c.replicas()  # the engine core beside the replica
    assert c.routers() == ["head"], c.routers()
    return placed


def serves_exact_vectors(c: Cluster2, reference, first: int) -> tuple[int, float]:
    """Requests through Serve, each vector checked against transformers: (how many, the worst max|error| over
    max|reference|)."""
    import numpy as np
    import openai

    n, worst = 0, 0.0

    def check(ids, vector):
        nonlocal n, worst
        reference.assert_matches(ids, vector)
        want = reference.last_hidden(ids)
        worst = max(worst, float(np.abs(np.asarray(vector, np.float32) - want).max() / np.abs(want).max()))
        n += 1

    with httpx.Client() as client:
        for i in range(first, first + 4):
            r = complete(client, c.base, i, max_tokens=8)
            assert r.ok, (r.status, r.error)
            check(r.ids, r.vector)
    oc = openai.OpenAI(base_url=f"{c.base}/v1", api_key="unused", timeout=120, max_retries=0)
    out = oc.completions.create(
        model=MODEL,
        prompt="Two nodes, two stages",
        max_tokens=6,
        temperature=0,
        extra_body={"return_hidden_states": True, "return_token_ids": True, "hidden_states_layers": [0, -1]},
    )
    (ch,) = out.choices
    check(ch.prompt_token_ids + ch.token_ids, np.asarray(ch.hidden_states_by_layer["-1"], np.float32))
    return n, worst


def worker_counts(c: Cluster2) -> list[dict]:
    stats = httpx.get(f"{c.base}/debug/stats", timeout=60).json()
    workers = stats["replica"]["workers"]
    assert len(workers) == 2 and all(w["installed"] for w in workers), workers
    return workers


# -- 1. the stages on two nodes, vectors exact ------------------------------------------------------------


def test_two_stages_on_two_nodes_serve_exact_vectors(mnpp, reference):
    placed = stages_on_two_nodes(mnpp)
    before = worker_counts(mnpp)
    n, worst = serves_exact_vectors(mnpp, reference, 0)
    after = worker_counts(mnpp)
    # stage 0 (rank 0) sent layer 0's rows on with its intermediate tensors; stage 1 (the output rank) received them
    sent = after[0]["forwarded_rows"] - before[0]["forwarded_rows"]
    assert sent > 0 and sent == after[1]["received_rows"] - before[1]["received_rows"], (before, after)
    assert after[1]["captured"] > before[1]["captured"] and after[0]["captured"] == before[0]["captured"]
    print(
        f"\n[multinode-pp] 1: stages {placed}; {n} requests' vectors exact (worst max|error| / max|reference| "
        f"{worst:.2e}); stage 0 sent {sent} rows"
    )


# -- 2. the last stage's node dies under load: requests end fast, the replica comes back ---------------------


def test_losing_a_stages_node_fails_requests_fast_and_serve_brings_the_replica_back(mnpp, reference):
    from ray import serve

    workers = mnpp.workers()
    lost_node = mnpp.node_name(workers["PP1"])
    (old_replica,) = mnpp.replicas()
    load = Load(mnpp.base, threads=3, max_tokens=48)
    try:
        wait_for(lambda: sum(r.ok for r in load.snapshot()) >= 6, 300, "requests flowing before the removal")
        t_rm0 = time.monotonic()
        mnpp.cluster.remove_node(mnpp.nodes.pop(lost_node))
        with load.lock:
            t_rm1 = time.monotonic()
            started = load.counter  # requests started before the removal finished
        load.stop_event.set()  # no new ones: what is measured is what was in flight
        # every request started before the removal finished ends (an error, or done before the step failed)
        wait_for(
            lambda: len([r for r in load.snapshot() if r.t0 < t_rm1]) == started,
            BOUND_S + 30,
            "the requests in flight at the removal ended",
        )
        wait_for(lambda: old_replica not in mnpp.replicas(), 120, "the replica with the lost stage replaced")
        t_dead = time.monotonic()
    finally:
        results = load.stop(timeout=BOUND_S + 30)
    in_flight = [r for r in results if r.t0 < t_rm1 and r.t1 >= t_rm0]
    assert in_flight, "no request was in flight at the removal"
    slow = [(round(r.t1 - t_rm0, 1), r.status, r.error[:80]) for r in in_flight if r.t1 - t_rm0 > BOUND_S]
    assert not slow, slow
    failed = [r for r in in_flight if not r.ok]
    assert failed, [(r.status, r.ok) for r in in_flight]  # the step on the lost node failed: not answered by luck
    assert all("Timeout" not in r.error for r in failed), [(r.status, r.error) for r in failed]  # not a client's

    # A node with an hs_rank joins (what Ray's autoscaler does for the pending placement group)
    status = serve.status().applications[APP].deployments["EngineReplica"]
    mnpp.add("C")
    t_join = time.monotonic()
    wait_for(mnpp.running, DEPLOY_TIMEOUT, "the replacement replica running", every=2)
    t_back = time.monotonic()
    (new_replica,) = mnpp.replicas()
    assert new_replica != old_replica
    placed = stages_on_two_nodes(mnpp)
    assert "C" in placed.values() and lost_node not in placed.values(), placed
    n, worst = serves_exact_vectors(mnpp, reference, 100)
    ok_before = sum(1 for r in results if r.ok)
    print(
        f"\n[multinode-pp] 2: removed {lost_node} (stage 1's) in {t_rm1 - t_rm0:.1f}s; {len(in_flight)} in flight: "
        f"ended {[round(r.t1 - t_rm0, 1) for r in in_flight]} s after, statuses "
        f"{[r.status or r.error[:40] for r in in_flight]}; replica {old_replica} gone {t_dead - t_rm0:.0f}s after "
        f"(Serve: {status.status}); {new_replica} running {t_back - t_join:.0f}s after node C joined, stages "
        f"{placed}; {ok_before} requests answered before, {n} exact after (worst {worst:.2e})"
    )
