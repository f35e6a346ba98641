"""The servers under test, each started by the benchmark (`up`) and stopped by it (`down`): a Ray cluster of its
own (`RayCluster`), `serve run` of our app and Ray Serve LLM on it (`ServeApps`), vLLM's own OpenAI server
(`VLLMServer`). All run the same model with the same engine arguments and environment (`ENGINE_ENV`).
"""

from __future__ import annotations

import secrets
import subprocess
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from bench.procs import BIN, PYTHON, ROOT, WORK, Proc, StartError, free_port, wait_until
from deployments.serve_env import SERVE_SWITCHES

RAY_TMP = Path("/tmp/hsbench_ray")

# vLLM's engine environment as our replica gets it, given to all three servers alike:
# hidden_states.vllm.ENGINE_ENV, deployments.config (VLLM_CPU_OMP_THREADS_BIND=nobind), and
# OMP_NUM_THREADS=1, which Ray sets for a replica with num_cpus=1 (ours, and Ray Serve LLM's with a
# {CPU: 1} bundle). Without it vLLM's own server runs 2 unbound OpenMP threads on 2 busy cores and
# is several times slower (seen): that would measure thread oversubscription, not the Serve layer.
ENGINE_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
# cluster name -> (its Serve switches, our apps' names there (the app, its `ingress: replica` copy), the
# direct-ingress HTTP ports its replicas take)
CLUSTERS = {
    "main": (SERVE_SWITCHES, ("hidden-states", "hs-direct"), (30000, 30100)),  # `make serve`'s switches
    "haproxy": ({"RAY_SERVE_ENABLE_HA_PROXY": "1"}, ("hs-haproxy", "hs-haproxy-direct"), (32000, 32100)),
    "tput": ({"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}, ("hs-tput", "hs-tput-direct"), (34000, 34100)),
    "sim": (SERVE_SWITCHES, ("hidden-states", "hs-direct"), (33000, 33300)),  # bench.simulate's, bench.failures'
}


def cluster_env(name: str) -> dict[str, str]:
    """A cluster's switches and its direct-ingress ports (gRPC 10,000 above HTTP), out of the others' way."""
    switches, _, (lo, hi) = CLUSTERS[name]
    return {
        **switches,
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(lo),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(hi),
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(lo + 10000),
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(hi + 10000),
    }


def build_model(name: str) -> str:
    argv = [str(PYTHON), "-m", "hidden_states.models.builtin", name]
    out = subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True, timeout=1800)
    path = out.stdout.strip().splitlines()[-1].strip()
    if not Path(path, "config.json").exists():
        raise StartError(f"model {name}: no config.json in {path!r}\n{out.stderr[-2000:]}")
    return path


def engine_cli(engine: dict[str, Any]) -> list[str]:
    argv = []
    for k, v in engine.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            argv.append(flag)
        elif v is False:
            argv.append("--no-" + k.replace("_", "-"))
        else:
            argv += [flag, str(v)]
    return argv


def http_ok(url: str, body: dict | None = None, timeout: float = 5.0) -> bool:
    """A GET of `url` (or a POST of `body`) answered 200."""
    try:
        r = httpx.post(url, json=body, timeout=60) if body is not None else httpx.get(url, timeout=timeout)
        return r.status_code == 200
    except httpx.HTTPError:
        return False


def smoke(url: str, model: str) -> bool:
    return http_ok(url, {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0.0})


@dataclass
class Endpoint:
    """One server under test, as the load generator sees it."""

    key: str  # "ours", "vllm", "rsllm"
    url: str  # .../v1/completions
    model: str  # the name clients send
    stats_url: str | None = None  # our /debug/stats


class Server:
    """A server process the benchmark starts (`launch`, then `wait_ready`; `up` does both) and stops."""

    proc: Proc | None = None
    stop_timeout = 30.0

    def stop(self) -> list[int]:
        return self.proc.stop(timeout=self.stop_timeout) if self.proc else []


def up(started: list[Server], *servers: Server, timeout: float = 900) -> None:
    """Launches each server, then waits until each is ready; each goes first on `started` (`down` stops them)."""
    for s in servers:
        s.launch()
        started.insert(0, s)
    for s in servers:
        s.wait_ready(timeout)


def down(started: list[Server]) -> dict[str, list[int]]:
    """Stops each server in turn: the pids left running, by kind (should be none)."""
    return {type(s).__name__: s.stop() for s in started}


class RayCluster(Server):
    """`ray start --head --block` with more logical CPUs than the 2 cores (so Ray Serve LLM's ingress can be
    scheduled), its own ports, temp dir and auth token: not confused with another cluster here. `name`'s Serve
    switches, apps' names and ports (CLUSTERS), then `extra_env`."""

    def __init__(self, name: str, extra_env: dict[str, str] | None = None, second: bool = False, num_cpus: int = 8):
        _, self.apps, self.ports = CLUSTERS[name]
        self.num_cpus = num_cpus
        self.extra_env = {**cluster_env(name), **(extra_env or {})}  # every Ray process of this cluster gets them
        self.second = second  # a second cluster at once (bench.serve_cpu's switch clusters): its own temp dir and log
        self.token = secrets.token_hex(32)
        self.port = free_port(6390)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        # A token of our own: a driver on this machine that reads ~/.ray/auth_token cannot reach this cluster.
        return {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "PYTHONPATH": str(ROOT),
            "RAY_USAGE_STATS_ENABLED": "0",
            **self.extra_env,
        }

    @property
    def temp_dir(self) -> Path:
        # a second cluster at once needs its own temp dir: Ray keeps one session per temp dir
        return RAY_TMP if not self.second else RAY_TMP.with_name(f"hsbench_ray_{self.port}")

    def launch(self) -> None:
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        argv = [BIN / "ray", "start", "--head", "--block", "--num-cpus", str(self.num_cpus), "--port", str(self.port)]
        argv += ["--ray-client-server-port", str(free_port(25290)), "--dashboard-port", str(free_port(8290))]
        argv += ["--dashboard-agent-listen-port", str(free_port(52490)), "--node-ip-address", "127.0.0.1"]
        argv += ["--include-dashboard=false", "--disable-usage-stats", "--temp-dir", str(self.temp_dir)]
        self.proc = Proc("ray-head" if not self.second else f"ray-head-{self.port}", argv, env=self.env())

    def wait_ready(self, timeout: float = 180) -> float:
        return wait_until(lambda: "block forever" in self.proc.tail(50), timeout, "ray start", [self.proc])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive() and "exited unexpectedly" not in self.proc.tail(200)


def serve_config(http_port: int, apps: list[dict]) -> dict:
    """What `serve run CONFIG` reads: these apps behind Serve's proxy on the head, on `http_port`."""
    http = {"host": "127.0.0.1", "port": http_port}
    return {"proxy_location": "HeadOnly", "http_options": http, "applications": apps}


class ServeRun(Server):
    """`serve run CONFIG` on one Ray cluster: `config()` its apps, ready when each of `checks()` has passed."""

    stop_timeout = 20.0
    env: dict[str, str] = {}  # for the `serve run` process, beside the cluster's

    def __init__(self, cluster: RayCluster, tag: str):
        self.cluster, self.tag = cluster, tag
        self.http_port = free_port(8310)
        self.base = f"http://127.0.0.1:{self.http_port}"

    def launch(self) -> None:
        path = WORK / "cfg" / f"serve-{self.tag}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        argv = [BIN / "serve", "run", "--address", self.cluster.address, path]
        self.proc = Proc(f"serve-run-{self.tag}", argv, env={**self.cluster.env(), **self.env})

    def wait_ready(self, timeout: float) -> float:
        checks = self.checks()
        done = [False] * len(checks)

        def ready() -> bool:
            if not self.cluster.alive():
                raise StartError(f"the Ray cluster died:\n{self.cluster.proc.tail()}")
            for i, c in enumerate(checks):
                done[i] = done[i] or c()
            return all(done)

        return wait_until(ready, timeout, f"serve run ({self.tag})", [self.proc], poll=2)


class ServeApps(ServeRun):
    """Our app on one Ray cluster; with `direct` a copy of it with `ingress: replica` (`direct_replicas` replicas),
    with `rsllm` Ray Serve LLM."""

    env = ENGINE_ENV

    def __init__(
        self,
        cluster: RayCluster,
        model_path: str,
        model_name: str,
        engine: dict[str, Any],
        tag: str,
        rsllm: bool = False,
        direct: bool = False,
        direct_replicas: int = 1,
    ):
        super().__init__(cluster, tag)
        (self.app_name, self.direct_name), self.direct_replicas = cluster.apps, direct_replicas
        self.model_path, self.model_name, self.engine = model_path, model_name, engine
        self.with_rsllm, self.with_direct = rsllm, direct

    def config(self) -> dict:
        product = yaml.safe_load((ROOT / "config.yaml").read_text())
        app = dict(product["applications"][0])
        args = {**app["args"], "model": self.model_path, "served_model_name": self.model_name}
        args |= {"engine": dict(self.engine), "enable_return_hidden_states": True}
        apps = [dict(app, name=self.app_name, route_prefix="/", args=args)]
        if self.with_direct:
            direct = dict(args, ingress="replica")
            if (n := self.direct_replicas) != 1:
                direct["replica_autoscaling"] = {"min_replicas": n, "max_replicas": n}
            apps.append(dict(app, name=self.direct_name, route_prefix="/direct", args=direct))
        if self.with_rsllm:
            env = dict(ENGINE_ENV)
            llm = {
                "model_loading_config": {"model_id": self.model_name, "model_source": self.model_path},
                "engine_kwargs": dict(self.engine),
                "placement_group_config": {"bundles": [{"CPU": 1}]},
                "deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}},
                "runtime_env": {"env_vars": env},
            }
            apps.append(
                {"name": "rsllm", "route_prefix": "/rsllm", "import_path": "ray.serve.llm:build_openai_app"}
                | {"runtime_env": {"env_vars": env}, "args": {"llm_configs": [llm]}}
            )
        return serve_config(self.http_port, apps)

    def prefixes(self) -> dict[str, str]:
        """Each app's route prefix, by its endpoint's key."""
        on = {"ours": True, "rsllm": self.with_rsllm, "direct": self.with_direct}
        return {k: "" if k == "ours" else f"/{k}" for k, x in on.items() if x}

    def checks(self) -> list:
        urls = [f"{self.base}{p}/v1/completions" for p in self.prefixes().values()]
        return [partial(http_ok, f"{self.base}/health"), *(partial(smoke, url, self.model_name) for url in urls)]

    def endpoints(self) -> dict[str, Endpoint]:
        """Each app through Serve's proxy; ours (not Ray Serve LLM) with our replica's counters."""
        out = {}
        for k, p in self.prefixes().items():
            stats = None if k == "rsllm" else f"{self.base}{p}/debug/stats"
            out[k] = Endpoint(k, f"{self.base}{p}/v1/completions", self.model_name, stats)
        return out

    def port_endpoint(self, kind: str, prefix: str = "") -> Endpoint:
        """Our Router's (or, `kind` "replica", an `ingress: replica` replica's) own HTTP port, as an endpoint."""
        base = find_ingress(kind, self.cluster.ports, prefix)
        url, stats = f"{base}/v1/completions", f"{base}/debug/stats"
        return Endpoint(f"{kind}_port", url, self.model_name, stats)


class VLLMServer(Server):
    def __init__(self, model_path: str, model_name: str, engine: dict[str, Any], tag: str):
        self.model_path, self.model_name, self.engine, self.tag = model_path, model_name, engine, tag
        self.port = free_port(8331)
        self.base = f"http://127.0.0.1:{self.port}"

    def launch(self) -> None:
        argv = [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path, "--host", "127.0.0.1"]
        argv += ["--served-model-name", self.model_name, "--port", str(self.port), *engine_cli(self.engine)]
        self.proc = Proc(f"vllm-server-{self.tag}", argv, env=dict(ENGINE_ENV))

    def wait_ready(self, timeout: float) -> float:
        ready = lambda: http_ok(f"{self.base}/v1/models") and smoke(f"{self.base}/v1/completions", self.model_name)
        return wait_until(ready, timeout, "vLLM's OpenAI server", [self.proc], poll=2)

    def endpoint(self) -> Endpoint:
        return Endpoint("vllm", f"{self.base}/v1/completions", self.model_name)


def find_ingress(kind: str, ports: tuple[int, int], prefix: str = "", timeout: float = 90) -> str:
    """The base URL of the one replica answering /debug/stats with this ingress kind (router or replica) in
    `ports` (a replica's own port serves its app's route prefix too)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for port in range(*ports):
            base = f"http://127.0.0.1:{port}{prefix}"
            try:
                r = httpx.get(f"{base}/debug/stats", timeout=1)
                if r.status_code == 200 and r.json().get("ingress", {}).get("kind") == kind:
                    return base
            except (httpx.HTTPError, ValueError):
                continue
        time.sleep(2)
    raise StartError(f"no {kind} ingress answered on ports {ports[0]}..{ports[1]} in {timeout:.0f}s")


def find_ray_worker(proc: Proc, needle: str) -> list[int]:
    """Pids of the processes under `proc` (a Ray node's `ray start`) whose title contains `needle`
    (e.g. 'ServeReplica:hidden-states:Router')."""
    pids = []
    for p in proc.tree():
        try:
            if needle in " ".join(p.cmdline()):
                pids.append(p.pid)
        except psutil.Error:
            pass
    return pids
