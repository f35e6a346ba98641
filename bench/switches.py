"""Part `switches`: Ray Serve 2.60's switches, each measured against the same app without it.

Each switch is an environment variable Ray reads when its processes start, so each
runs on a Ray cluster of its own, started with it (every Ray process of that
cluster gets it): our app (hidden states off in the requests) on that cluster is
one arm; our app on the main cluster through Serve's proxy, and vLLM's own server,
are the others. The arms alternate round by round as in every comparison, on the same
request lengths. One switch cluster is up at a time; it is stopped before the next.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from bench import compare
from bench.procs import StartError
from bench.servers import Endpoint, RayCluster, ServeApps


@dataclass(frozen=True)
class Switch:
    key: str
    env: dict[str, str]
    what: str
    needs: str | None = None          # a program on PATH


SWITCHES = (
    Switch("haproxy", {"RAY_SERVE_ENABLE_HA_PROXY": "1"},
           "HAProxy (4 threads, Ray's default) on the HTTP port forwards to the Router replica's own port "
           "(direct ingress), in place of Serve's Python proxy", needs="haproxy"),
    Switch("haproxy_1thread", {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_NBTHREAD": "1"},
           "the same with one HAProxy thread (2 cores here)", needs="haproxy"),
    Switch("grpc", {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1", "RAY_SERVE_PROXY_USE_GRPC": "1"},
           "handle calls (proxy -> Router -> engine replica) over gRPC instead of Ray actor calls"),
    Switch("router_same_loop", {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"},
           "a handle's request router runs on the caller's own event loop, not a separate thread's"),
)
# Direct ingress, the switch the product runs with (deployments/serve_env.py), is measured in the
# serve part: the main cluster has it, and its Router's own port is an arm there.
# Replica ports of a switch cluster (HAProxy's direct ingress): away from the main cluster's.
SWITCH_CLUSTER_PORTS = {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "32000", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "32100",
                        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": "42000", "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": "42100"}


def run(bench, model: str, path: str, vocab: int, eps: dict, cpu, check, switches=SWITCHES) -> dict:
    """`bench` is the running Bench (plan, args, progress); eps has "ours" and "vllm"."""
    args = bench.args
    out: dict = {"by_switch": {}}
    for sw in switches:
        res: dict = {"env": sw.env, "what": sw.what}
        out["by_switch"][sw.key] = res
        if sw.needs and shutil.which(sw.needs) is None:
            res["error"] = f"{sw.needs} is not installed (scripts/setup.sh installs it with HS_EXTRAS=bench)"
            continue
        cluster = RayCluster(extra_env={**sw.env, **SWITCH_CLUSTER_PORTS}, second=True)
        apps = ServeApps(cluster, path, model, args.engine, ours=True, rsllm=False, tag=f"{model}-{sw.key}")
        try:
            bench.phase(f"{model} switches: {sw.key}: starting")
            cluster.start()
            apps.launch()
            res["startup_s"] = apps.wait_ready(600, on_tick=bench.idle_tick)
            ep = apps.endpoints()["ours"]
            ep = Endpoint(f"ours_{sw.key}", f"our app, {sw.key}", ep.url, ep.model, stats_url=ep.stats_url)
            res["url"] = ep.url
            cpu.add_root(cluster.proc.pid, "ray: switch cluster")
            arms = [compare.Arm("vllm", eps["vllm"].label, eps["vllm"]),
                    compare.Arm("ours", "our app (no switch)", eps["ours"]),
                    compare.Arm("switched", ep.label, ep)]
            compare.warmup(arms, vocab, 8, 8, f"{model}-sw-{sw.key}")
            res["by_concurrency"] = {}
            for c in args.concurrency:
                rounds = args.rounds or bench.plan[model]["rounds"]["switches"]
                per = bench.plan[model]["per_round"].get(c, 8)
                bench.phase(f"{model} switches: {sw.key} c={c} x{rounds}")
                runs = compare.run(arms, vocab, c, rounds, per, f"{model}-sw-{sw.key}", cpu, on_done=bench.tick,
                                   check=check)
                res["by_concurrency"][str(c)] = {
                    "vllm": compare.summarize(runs, "vllm"), "ours": compare.summarize(runs, "ours"),
                    "switched": compare.summarize(runs, "switched"),
                    "switched_vs_ours": compare.compare(runs, "switched", "ours"),
                    "switched_vs_vllm": compare.compare(runs, "switched", "vllm"),
                    "ours_vs_vllm": compare.compare(runs, "ours", "vllm"),
                }
        except StartError as e:
            res["error"] = f"did not start: {e}"[:3000]
        finally:
            res["stopped"] = {"serve_run": apps.stop(), "ray_cluster": cluster.stop()}
    return out
