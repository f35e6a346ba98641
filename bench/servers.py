"""The servers under test, each started by the benchmark and stopped by it.

- `RayCluster`: `ray start --head --block --num-cpus 8` (more logical CPUs than
  the 2 cores, so Ray Serve LLM's ingress can be scheduled), its own ports,
  temp dir and auth token, so it is not confused with another cluster here.
- `ServeApps`: `serve run CONFIG` against that cluster: our app
  (`deployments.app:build_app`, args from config.yaml with the benchmark's
  engine args) and/or Ray Serve LLM (`ray.serve.llm:build_openai_app`).
- `VLLMServer`: vLLM's own OpenAI server, `python -m vllm.entrypoints.openai.api_server`.

All three run the same model with the same engine arguments and the same
engine environment (`ENGINE_ENV`).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from bench.procs import BIN, PYTHON, ROOT, WORK, Proc, StartError, free_port, wait_until

RAY_TMP = Path("/tmp/hsbench_ray")

# vLLM's engine environment as our replica gets it, given to all three servers alike:
# hidden_states.vllm.ENGINE_ENV, deployments.config (VLLM_CPU_OMP_THREADS_BIND=nobind), and
# OMP_NUM_THREADS=1, which Ray sets for a replica with num_cpus=1 (ours, and Ray Serve LLM's with a
# {CPU: 1} bundle). Without it vLLM's own server runs 2 unbound OpenMP threads on 2 busy cores and
# is several times slower (seen): that would measure thread oversubscription, not the Serve layer.
ENGINE_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


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


def http_ok(url: str, timeout: float = 5.0) -> bool:
    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def smoke(url: str, model: str, extra: dict | None = None) -> bool:
    body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0.0} | (extra or {})
    try:
        return httpx.post(url, json=body, timeout=60).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Endpoint:
    """One server under test, as the load generator sees it."""

    key: str  # "ours", "vllm", "rsllm"
    label: str
    url: str  # .../v1/completions
    model: str  # the name clients send
    stats_url: str | None = None  # our /debug/stats


class RayCluster:
    def __init__(self, num_cpus: int = 8, extra_env: dict[str, str] | None = None, second: bool = False):
        self.num_cpus = num_cpus
        self.extra_env = dict(extra_env or {})  # Ray Serve switches: every Ray process of this cluster gets them
        self.second = second  # a second cluster at once (bench.serve_cpu's switch clusters): its own temp dir and log
        self.token = secrets.token_hex(32)
        self.port = free_port(6390)
        self.proc: Proc | None = None

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

    def start(self, timeout: float = 180) -> float:
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        argv = [BIN / "ray", "start", "--head", "--block", "--num-cpus", str(self.num_cpus), "--port", str(self.port)]
        argv += ["--ray-client-server-port", str(free_port(25290)), "--dashboard-port", str(free_port(8290))]
        argv += ["--dashboard-agent-listen-port", str(free_port(52490)), "--node-ip-address", "127.0.0.1"]
        argv += ["--include-dashboard=false", "--disable-usage-stats", "--temp-dir", str(self.temp_dir)]
        self.proc = Proc("ray-head" if not self.second else f"ray-head-{self.port}", argv, env=self.env())
        return wait_until(lambda: "block forever" in self.proc.tail(50), timeout, "ray start", [self.proc])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive() and "exited unexpectedly" not in self.proc.tail(200)

    def stop(self) -> list[int]:
        return self.proc.stop() if self.proc else []


class ServeApps:
    """`serve run CONFIG` with our app and/or Ray Serve LLM on one Ray cluster."""

    def __init__(
        self,
        cluster: RayCluster,
        model_path: str,
        model_name: str,
        engine: dict[str, Any],
        ours: bool,
        rsllm: bool,
        tag: str,
        direct: bool = False,
        app_name: str = "hidden-states",
        direct_name: str = "hs-direct",
        direct_replicas: int = 1,
    ):
        """`app_name`, `direct_name`: our app's and its `ingress: replica` copy's names (a cluster's processes'
        titles carry them); `direct_replicas`: that copy's replica count."""
        self.cluster = cluster
        self.app_name, self.direct_name, self.direct_replicas = app_name, direct_name, direct_replicas
        self.model_path, self.model_name, self.engine = model_path, model_name, engine
        self.with_ours, self.with_rsllm, self.tag = ours, rsllm, tag
        self.with_direct = ours and direct  # a second copy of our app with `ingress: replica`
        self.http_port = free_port(8310)
        self.base = f"http://127.0.0.1:{self.http_port}"
        self.proc: Proc | None = None
        self.config_path = WORK / "cfg" / f"serve-{tag}.yaml"

    def config(self) -> dict:
        product = yaml.safe_load((ROOT / "config.yaml").read_text())
        apps = []
        if self.with_ours:
            app = dict(product["applications"][0])
            args = dict(app["args"])
            args["model"] = self.model_path
            args["served_model_name"] = self.model_name
            args["engine"] = dict(self.engine)
            args["enable_return_hidden_states"] = True
            app.update(name=self.app_name, route_prefix="/", args=args)
            apps.append(app)
            if self.with_direct:
                direct = dict(args, ingress="replica")
                if (n := self.direct_replicas) != 1:
                    direct["replica_autoscaling"] = {"min_replicas": n, "max_replicas": n}
                apps.append(dict(app, name=self.direct_name, route_prefix="/direct", args=direct))
        if self.with_rsllm:
            env = dict(ENGINE_ENV)
            apps.append(
                {
                    "name": "rsllm",
                    "route_prefix": "/rsllm",
                    "import_path": "ray.serve.llm:build_openai_app",
                    "runtime_env": {"env_vars": env},
                    "args": {
                        "llm_configs": [
                            {
                                "model_loading_config": {"model_id": self.model_name, "model_source": self.model_path},
                                "engine_kwargs": dict(self.engine),
                                "placement_group_config": {"bundles": [{"CPU": 1}]},
                                "deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}},
                                "runtime_env": {"env_vars": env},
                            }
                        ]
                    },
                }
            )
        http = {"host": "127.0.0.1", "port": self.http_port}
        return {"proxy_location": "HeadOnly", "http_options": http, "applications": apps}

    def launch(self) -> None:
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        env = self.cluster.env()
        env.update(ENGINE_ENV)
        env.update(self.cluster.extra_env)
        argv = [BIN / "serve", "run", "--address", self.cluster.address, self.config_path]
        self.proc = Proc(f"serve-run-{self.tag}", argv, env=env)

    def wait_ready(self, timeout: float) -> float:
        checks = []
        if self.with_ours:
            checks.append(
                lambda: http_ok(f"{self.base}/health") and smoke(f"{self.base}/v1/completions", self.model_name)
            )
        if self.with_rsllm:
            checks.append(lambda: smoke(f"{self.base}/rsllm/v1/completions", self.model_name))
        if self.with_direct:
            checks.append(lambda: smoke(f"{self.base}/direct/v1/completions", self.model_name))
        done = [False] * len(checks)

        def ready() -> bool:
            if not self.cluster.alive():
                raise StartError(f"the Ray cluster died:\n{self.cluster.proc.tail()}")
            for i, c in enumerate(checks):
                done[i] = done[i] or c()
            return all(done)

        return wait_until(ready, timeout, f"serve run ({self.tag})", [self.proc], poll=2)

    def endpoints(self) -> dict[str, Endpoint]:
        out, v1 = {}, "v1/completions"
        if self.with_ours:
            stats = f"{self.base}/debug/stats"
            out["ours"] = Endpoint("ours", "our app (Ray Serve)", f"{self.base}/{v1}", self.model_name, stats)
        if self.with_rsllm:
            out["rsllm"] = Endpoint("rsllm", "Ray Serve LLM", f"{self.base}/rsllm/{v1}", self.model_name)
        if self.with_direct:
            stats = f"{self.base}/direct/debug/stats"
            url = f"{self.base}/direct/{v1}"
            out["direct"] = Endpoint("direct", "our app, ingress: replica", url, self.model_name, stats)
        return out

    def router_port_endpoint(self, ports=(30000, 30100), timeout: float = 60) -> Endpoint | None:
        """Our Router replica's own HTTP port (direct ingress on: deployments/serve_env.py), found by its
        /debug/stats; None when the cluster runs without direct ingress."""
        if self.cluster.extra_env.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") != "1":
            return None
        base = find_ingress("router", ports, timeout=timeout)
        url = f"{base}/v1/completions"
        return Endpoint("port", "our app, the Router's own port", url, self.model_name, f"{base}/debug/stats")

    def stop(self) -> list[int]:
        return self.proc.stop(timeout=20) if self.proc else []


class VLLMServer:
    def __init__(self, model_path: str, model_name: str, engine: dict[str, Any], tag: str):
        self.model_path, self.model_name, self.engine, self.tag = model_path, model_name, engine, tag
        self.port = free_port(8331)
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: Proc | None = None

    def launch(self) -> None:
        argv = [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path, "--host", "127.0.0.1"]
        argv += ["--served-model-name", self.model_name, "--port", str(self.port), *engine_cli(self.engine)]
        self.proc = Proc(f"vllm-server-{self.tag}", argv, env=dict(ENGINE_ENV))

    def wait_ready(self, timeout: float) -> float:
        ready = lambda: http_ok(f"{self.base}/v1/models") and smoke(f"{self.base}/v1/completions", self.model_name)
        return wait_until(ready, timeout, "vLLM's OpenAI server", [self.proc], poll=2)

    def endpoint(self) -> Endpoint:
        return Endpoint("vllm", "vLLM's own server", f"{self.base}/v1/completions", self.model_name)

    def stop(self) -> list[int]:
        return self.proc.stop(timeout=30) if self.proc else []


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


def replica_info(stats_url: str) -> dict:
    return json.loads(httpx.get(stats_url, timeout=30).text)


def find_ray_worker(cluster: RayCluster, needle: str) -> list[int]:
    """Pids of Ray workers under our cluster whose title contains `needle`
    (e.g. 'ServeReplica:hidden-states:Router')."""
    pids = []
    if cluster.proc is None:
        return pids
    for p in cluster.proc.tree():
        try:
            for c in [p, *p.children(recursive=True)]:
                if needle in " ".join(c.cmdline()) and c.pid not in pids:
                    pids.append(c.pid)
        except psutil.Error:
            pass
    return pids
