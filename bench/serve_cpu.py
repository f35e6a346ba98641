"""The Serve layer's CPU per request, per process, per path, beside vLLM's API server and Ray Serve LLM.

    .venv/bin/python -m bench.serve_cpu [--concurrency 8,32] [--requests 48,96] [--rounds 2] [--name serve-cpu-tiny]

The built-in tiny model on every server, the same engine arguments. The paths (path_roles): vLLM's server, Ray
Serve LLM, our app through the proxy, on the Router's port, `ingress: replica` through the proxy and on its own
port; then clusters with HAProxy and throughput-optimized Serve (--switches). Our paths with no vectors, the final
vector and float16 `completion` rows. Arms rotate round by round, every batch sent by `vllm bench serve`
(bench.cli.batch). CPU: each role's (bench.measure.CpuAccount) above its idle rate, summed over the path's
processes. Also per path: a 4,000-token prompt arrives whole, a body over the limit is a 413.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx

from bench import cli, measure
from bench.arms import rotated
from bench.cli import batch, machine
from bench.procs import RESULTS, command_line, write_results
from bench.servers import ENGINE_ENV, Endpoint, RayCluster, ServeApps, VLLMServer, build_model, down, up

MODEL = "tiny-llama"
# the full run's engine (bench.cli.ENGINE) with a 256 MiB KV cache (a quarter million tokens of the tiny model): up
# to eight engines share the machine.
ENGINE = {**cli.ENGINE, "kv_cache_memory_bytes": 2**28}
VARIANTS = {
    "off": {},
    "final": {"return_hidden_states": True},
    "rows": {"return_hidden_states": True, "hidden_states_position": "completion", "hidden_states_dtype": "float16"},
}
PATHS = {  # the processes a request on each path passes through, outside the engine
    "vllm": ["vllm: api server"],
    "rsllm": ["main: proxy", "rsllm: ingress", "rsllm: server"],
    "proxy": ["main: proxy", "hidden-states: router", "hidden-states: replica"],
    "port": ["hidden-states: router", "hidden-states: replica"],
    "replica_proxy": ["main: proxy", "hs-direct: replica"],
    "replica_port": ["hs-direct: replica"],
    "haproxy": ["haproxy: haproxy", "haproxy: proxy", "hs-haproxy: router", "hs-haproxy: replica"],
    "haproxy_replica": ["haproxy: haproxy", "haproxy: proxy", "hs-haproxy-direct: replica"],
    "tput_proxy": ["tput: proxy", "hs-tput: router", "hs-tput: replica"],
    "tput_port": ["hs-tput: router", "hs-tput: replica"],
}


def daemon_roles(path: str) -> list[str]:
    cluster = None if path == "vllm" else path.split("_")[0] if path.startswith(("haproxy", "tput")) else "main"
    return [] if cluster is None else [f"{cluster}: controller", f"{cluster}: daemons"]


def cpu_figures(runs: list[dict], path: str, idle: dict[str, float]) -> dict:
    """ms of CPU per successful request, by role, above each role's idle rate; per round too."""
    ok = sum(x["ok"] for x in runs)
    by_role: dict[str, float] = defaultdict(float)
    per_round = []
    for x in runs:
        above = {k: v - idle.get(k, 0.0) * x["cpu"]["wall"] for k, v in x["cpu"]["roles"].items()}
        for k, v in above.items():
            by_role[k] += v
        per_round.append(1e3 * sum(above.get(k, 0.0) for k in PATHS[path]) / max(1, x["ok"]))
    ms = {k: 1e3 * v / max(1, ok) for k, v in sorted(by_role.items())}
    return {
        "requests_ok": ok,
        "path_ms": sum(ms.get(k, 0.0) for k in PATHS[path]),
        "path_ms_per_round": per_round,
        "path_by_process_ms": {k: ms.get(k, 0.0) for k in PATHS[path]},
        "daemons_ms": sum(ms.get(k, 0.0) for k in daemon_roles(path)),
        "all_roles_ms": ms,
    }


def body_checks(ep: Endpoint, vocab: int) -> dict:
    """A prompt over HAProxy's default buffer arrives whole; a body over the limit is a 413."""
    prompt = [(7 * i) % (vocab - 1) + 1 for i in range(4000)]
    out: dict = {}
    body = json.dumps({"model": ep.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}).encode()
    r = httpx.post(ep.url, content=body, headers={"content-type": "application/json"}, timeout=120)
    out["large_prompt"] = {
        "body_bytes": len(body),
        "status": r.status_code,
        "prompt_tokens": (r.json().get("usage") or {}).get("prompt_tokens") if r.status_code == 200 else None,
    }
    out["large_prompt"]["whole"] = out["large_prompt"]["prompt_tokens"] == len(prompt)
    big = b'{"model": "%s", "prompt": "%s", "max_tokens": 1}' % (ep.model.encode(), b"a" * (5 * 2**20))
    out["over_limit"] = {"body_bytes": len(big), "status": None, "refused": False}
    try:
        r = httpx.post(ep.url, content=big, headers={"content-type": "application/json"}, timeout=120)
        out["over_limit"].update(status=r.status_code, refused=r.status_code == 413)
    except httpx.HTTPError as e:  # a server that closes the connection after its 413 may reset the upload
        out["over_limit"]["error"] = f"{type(e).__name__}: {e}"[:200]
    return out


def run_phase(
    arms: list[tuple[str, Endpoint, dict]], args, roles: measure.CpuAccount, tokenizer: str, tag: str
) -> dict:
    """Each (path/variant, endpoint, fields) arm's batches through `vllm bench serve`, rounds alternating."""
    roles.measure_idle(args.idle_s)
    out: dict = {"idle_cores": {k: round(v, 4) for k, v in roles.idle.items() if v >= 1e-4}, "by_concurrency": {}}
    lens = (args.input_len, args.output_len)
    for c, per in zip(args.concurrency, args.requests):
        print(f"[{time.strftime('%H:%M:%S')}] {tag}: c={c}, {len(arms)} arms x {args.rounds} rounds x {per}")
        runs: dict[str, list[dict]] = {key: [] for key, _, _ in arms}
        with tempfile.TemporaryDirectory(prefix="bench-cpu-") as folder:
            for r in range(args.rounds):
                for key, ep, fields in rotated(arms, r):
                    runs[key].append(batch(ep, tokenizer, per, c, 1000 * r + c, lens, fields, roles, Path(folder)))
        rate = {k: sum(x["ok"] for x in v) / sum(x["wall"] for x in v) for k, v in runs.items()}
        out["by_concurrency"][str(c)] = {
            key: {
                "req_per_s": rate[key],
                "p50_s": sum(x["latency_ms"].get("p50_e2el_ms", 0.0) for x in runs[key]) / 1e3 / len(runs[key]),
                "errors": 0,  # a batch with a failed request stops the run (bench.cli.batch)
                "cpu": cpu_figures(runs[key], key.split("/")[0], roles.idle),
                "vs_vllm_req_per_s": rate[key] / rate["vllm/off"],
            }
            for key in runs
        }
    return out


def arms_for(paths: dict[str, Endpoint], ours: set[str]) -> list[tuple[str, Endpoint, dict]]:
    return [
        (f"{path}/{v}", ep, dict(extra))
        for path, ep in paths.items()
        for v, extra in VARIANTS.items()
        if v == "off" or path in ours
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]
    ap.add_argument("--concurrency", type=ints, default="8,32")
    ap.add_argument("--requests", type=ints, default="48,96", help="requests per arm per round, one per concurrency")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=20.0, help="the idle window each role's idle rate comes from")
    ap.add_argument("--switches", default="haproxy,tput", help="switch clusters of the second phase ('' for none)")
    ap.add_argument("--name", default="serve-cpu-tiny")
    ap.add_argument("--input-len", type=int, default=128, help="random prompts' tokens (vLLM's random dataset)")
    ap.add_argument("--output-len", type=int, default=32, help="tokens per completion (ignore_eos)")
    args = ap.parse_args()
    switches = [s for s in args.switches.split(",") if s]
    t_start = time.time()
    path = build_model(MODEL)
    vocab = json.loads(Path(path, "config.json").read_text())["vocab_size"]
    roles, started = measure.CpuAccount(), []
    results: dict = {"model": MODEL, "engine": ENGINE, "engine_env": ENGINE_ENV, "variants": VARIANTS}
    results |= {"machine": machine(), "phases": {}}
    try:
        vllm, main_cluster = VLLMServer(path, MODEL, ENGINE, "cpu"), RayCluster("main")
        apps = ServeApps(main_cluster, path, MODEL, ENGINE, "cpu-main", rsllm=True, direct=True)
        up(started, vllm, main_cluster)
        up(started, apps)
        roles.add_root(vllm.proc.pid, "vllm")
        roles.add_root(main_cluster.proc.pid, "main")
        eps = apps.endpoints()
        main_paths = {
            "vllm": vllm.endpoint(),
            "rsllm": eps["rsllm"],
            "proxy": eps["ours"],
            "port": apps.port_endpoint("router"),
            "replica_proxy": eps["direct"],
            "replica_port": apps.port_endpoint("replica", "/direct"),
        }
        results["body_checks"] = {p: body_checks(ep, vocab) for p, ep in main_paths.items()}
        ours = {p for p in PATHS if p not in ("vllm", "rsllm")}
        results["phases"]["main"] = run_phase(arms_for(main_paths, ours), args, roles, path, "main")
        if switches:
            second: dict[str, Endpoint] = {"vllm": main_paths["vllm"], "proxy": main_paths["proxy"]}
            for sw in switches:
                cl, haproxy = RayCluster(sw, second=True), sw == "haproxy"
                a = ServeApps(cl, path, MODEL, ENGINE, f"cpu-{sw}", direct=haproxy, direct_replicas=2)
                up(started, cl)
                up(started, a)
                roles.add_root(cl.proc.pid, sw)
                if haproxy:  # HAProxy -> the Router, and -> 2 ingress replicas
                    second["haproxy"], second["haproxy_replica"] = a.endpoints()["ours"], a.endpoints()["direct"]
                else:
                    second["tput_proxy"] = a.endpoints()["ours"]
                    second["tput_port"] = a.port_endpoint("router")
            for p in [p for p in second if p not in main_paths]:
                results["body_checks"][p] = body_checks(second[p], vocab)
            results["phases"]["switches"] = run_phase(arms_for(second, ours), args, roles, path, "switches")
    finally:
        results["stopped"] = down(started)
    results["wall_s"] = time.time() - t_start
    results["command"] = command_line("bench.serve_cpu")
    rows = [  # CPU ms per request on the path above idle, and over vLLM's API server's in the same phase and c
        {"phase": ph, "c": c, "path/vectors": k, "path ms": a["cpu"]["path_ms"]}
        | {
            "x vLLM": a["cpu"]["path_ms"] / arms["vllm/off"]["cpu"]["path_ms"],
            "by process": a["cpu"]["path_by_process_ms"],
        }
        | {"daemons ms": a["cpu"]["daemons_ms"], "req/s": a["req_per_s"], "p50 s": a["p50_s"]}
        for ph, res in results["phases"].items()
        for c, arms in res["by_concurrency"].items()
        for k, a in arms.items()
    ]
    write_results(RESULTS, args.name, results, rows)


if __name__ == "__main__":
    main()
