"""Large payloads through each path: 8-16 MB of rows per response, bytes per second and CPU per MB.

    .venv/bin/python -m bench.payloads        # writes bench/results/payloads.{json,md}

A 4,096-wide model's `completion` rows (float16, base64) over --tokens tokens from FakeEngine replicas behind the
real Router, replicas, Serve's proxy and HAProxy, on the `main` and `haproxy` clusters; the paths of bench.serve_cpu's
PATHS. Per path and size, whole and streamed: MB/s of responses and each role's CPU per MB
(bench.measure.CpuAccount, idle subtracted; the replica's includes the FakeEngine making the rows).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time
from functools import partial

import httpx

from bench import servers
from bench.measure import CpuAccount
from bench.procs import RESULTS, command_line, write_results
from bench.serve_cpu import PATHS
from bench.servers import RayCluster, ServeRun, down, find_ingress, http_ok, up

MODEL = "fake"
HIDDEN = 4096
PATH_ROLES = {p: PATHS[p] for p in ("proxy", "port", "replica_port", "haproxy", "haproxy_replica")}


def serve_config(http_port: int, names: tuple[str, str], max_body: int) -> dict:
    """Two FakeEngine apps (`bench.simulate:fake_app`): one behind the Router, one `ingress: replica`."""
    args = {"model": "builtin:tiny-llama", "served_model_name": MODEL, "engine": {"hidden_size": HIDDEN}}
    args |= {"request_timeout_s": 120, "max_request_body_bytes": max_body}
    app = {"route_prefix": "/", "import_path": "bench.simulate:fake_app", "args": args}
    direct = {"name": names[1], "route_prefix": "/direct", "args": args | {"ingress": "replica"}}
    return servers.serve_config(http_port, [app | {"name": names[0]}, app | direct])


class FakeApps(ServeRun):
    """`serve run CONFIG` of serve_config() on one cluster, its apps named as the cluster names ours."""

    def config(self) -> dict:
        return serve_config(self.http_port, self.cluster.apps, 4 * 2**20)

    def checks(self) -> list:
        return [partial(http_ok, f"{self.base}/health"), partial(http_ok, f"{self.base}/direct/health")]


def body(tokens: int, stream: bool) -> bytes:
    rows = {"return_hidden_states": True, "hidden_states_position": "completion", "hidden_states_dtype": "float16"}
    body = {"model": MODEL, "prompt": "Rows, please.", "max_tokens": tokens, "stream": stream}
    return json.dumps(body | rows | {"hidden_states_encoding": "base64"}).encode()


def one(client: httpx.Client, url: str, tokens: int, stream: bool) -> int:
    """One request; its response's bytes, after checking it carries `tokens` rows of HIDDEN."""
    r = client.post(url, content=body(tokens, stream), headers={"content-type": "application/json"})
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
    if stream:
        rows = 0
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    rows += len((c.get("hidden_states_meta") or {}).get("positions") or ())
    else:
        meta = r.json()["choices"][0]["hidden_states_meta"]
        rows = meta["shape"][0] if meta["shape"][-1] == HIDDEN else -1
    if rows != tokens:
        raise RuntimeError(f"{rows} rows of {HIDDEN}, not {tokens}")
    return len(r.content)


def run_arm(roles: CpuAccount, url: str, tokens: int, stream: bool, requests: int, concurrency: int, path: str) -> dict:
    a = roles.snapshot()
    sizes, errors = [], []
    with httpx.Client(timeout=300) as client, concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(one, client, url, tokens, stream) for _ in range(requests)]:
            try:
                sizes.append(f.result(timeout=600))
            except Exception as e:  # counted and shown, never dropped
                errors.append(f"{type(e).__name__}: {e}"[:200])
    d = roles.delta(a, roles.snapshot())
    mb = sum(sizes) / 1e6
    cpu = {r: max(0.0, d["roles"].get(r, 0.0) - roles.idle.get(r, 0.0) * d["wall"]) for r in PATH_ROLES[path]}
    return {
        "requests": requests,
        "ok": len(sizes),
        "errors": len(errors),
        "error_samples": errors[:3],
        "mb_per_response": round(mb / max(1, len(sizes)), 2),
        "mb_per_s": round(mb / d["wall"], 1),
        "cpu_ms_per_mb": {r: round(s / mb * 1e3, 2) for r, s in cpu.items()} if mb else {},
        "cpu_ms_per_mb_total": round(sum(cpu.values()) / mb * 1e3, 2) if mb else None,
    }


def fake_rows_cpu_ms(tokens: int) -> float:
    """CPU the FakeEngine spends making one response's rows (part of the replica's figure)."""
    from hidden_states.protocol import narrow
    from hidden_states.testing import fake_rows

    ids = list(range(tokens + 13))
    t0 = time.process_time()
    narrow(fake_rows(ids, range(13, tokens + 13), size=HIDDEN).values[-1], "float16")
    return round((time.process_time() - t0) * 1e3, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1000,2000", help="completion tokens: rows per response")
    ap.add_argument("--requests", type=int, default=12, help="requests per path, size and mode")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=15.0)
    ap.add_argument("--name", default="payloads")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    roles, started = CpuAccount(), []
    results: dict = {
        "hidden_size": HIDDEN,
        "dtype": "float16",
        "encoding": "base64",
        "paths": PATH_ROLES,
        "fake_rows_cpu_ms": {str(t): fake_rows_cpu_ms(t) for t in tokens},
        "runs": {},
    }
    try:
        urls = {}
        for name in ("main", "haproxy"):
            cluster = RayCluster(name, second=name != "main")
            apps = FakeApps(cluster, f"payloads-{name}")
            up(started, cluster)
            up(started, apps, timeout=600)
            roles.add_root(cluster.proc.pid, name)
            if name == "main":
                urls["proxy"] = f"{apps.base}/v1/completions"
                urls["port"] = f"{find_ingress('router', cluster.ports)}/v1/completions"
                urls["replica_port"] = f"{find_ingress('replica', cluster.ports, '/direct')}/v1/completions"
            else:
                urls["haproxy"] = f"{apps.base}/v1/completions"
                urls["haproxy_replica"] = f"{apps.base}/direct/v1/completions"
        roles.measure_idle(args.idle_s)
        for t in tokens:
            for stream in (False, True):
                for path, url in urls.items():
                    one(httpx.Client(timeout=300), url, t, stream)  # warm: the first large answer
                    key = f"{path}/{t}/{'stream' if stream else 'unary'}"
                    print(f"[{time.strftime('%H:%M:%S')}] {key}", flush=True)
                    results["runs"][key] = run_arm(roles, url, t, stream, args.requests, args.concurrency, path)
    finally:
        results["stopped"] = down(started)
    results["command"] = command_line("bench.payloads")
    rows = [  # CPU ms per MB of response by process, idle subtracted; the replica's includes making the rows
        {"path/rows/mode": k} | {x: r[x] for x in ("mb_per_response", "mb_per_s", "cpu_ms_per_mb", "errors")}
        for k, r in results["runs"].items()
    ]
    write_results(RESULTS, args.name, results, rows)


if __name__ == "__main__":
    main()
