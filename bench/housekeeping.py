"""What the CPU start-up warm-up and the worker's malloc_trim thread cost and buy (engine level).

    .venv/bin/python -m bench.housekeeping [--rounds 3] [--models tiny-llama,llama-100m]

Arms: `on` = HiddenStatesEngine.start() defaults (warm_up_s=10, malloc_trim_interval_s=5);
`off` = both 0. An engine's start-up settings cannot change while it runs, so each
arm of each round is its own process (one engine at a time), alternating, the
first arm rotating. Each runs the benchmark's request mix (hidden states on every
request) and reports throughput and the vLLM worker's resident memory after the
first 50 requests and at the end. Prints and writes bench/results/housekeeping.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

from deployments.config import CPU_ENGINE_DEFAULTS

OUT = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]
PLAN = {"tiny-llama": {"requests": 300, "concurrency": 8}, "llama-100m": {"requests": 24, "concurrency": 8}}
FIRST = 50


def _worker_rss() -> int:
    import psutil

    return sum(p.memory_info().rss for p in psutil.Process().children(recursive=True)
               if "VLLM::Worker" in " ".join(p.cmdline() or [p.name()]))


async def _arm(model: str, on: bool, requests: int, concurrency: int) -> dict:
    from vllm import SamplingParams

    from bench import workload
    from hidden_states.vllm.engine import HiddenStatesEngine
    from hidden_states.models.builtin import build

    extra = {} if on else {"warm_up_s": 0, "malloc_trim_interval_s": 0}
    t0 = time.perf_counter()
    eng = await HiddenStatesEngine.start(str(build(model)), **CPU_ENGINE_DEFAULTS, **extra)
    startup_s = time.perf_counter() - t0
    try:
        vocab = eng.llm.model_config.get_vocab_size()
        shapes = workload.shapes(requests, seed=workload.SEED + 11)
        sem, done, rss = asyncio.Semaphore(concurrency), [0], {"start": _worker_rss()}

        async def one(i, s):
            async with sem:
                rng = random.Random(i)
                prompt = [rng.randrange(2, vocab) for _ in range(s.prompt_tokens)]
                await asyncio.wait_for(eng.complete(prompt, SamplingParams(max_tokens=s.max_tokens, temperature=0,
                                                                             ignore_eos=True),
                                                    return_hidden_states=True), 600)
                done[0] += 1
                if done[0] == FIRST:
                    rss["after_first"] = _worker_rss()

        t1 = time.perf_counter()
        await asyncio.gather(*(one(i, s) for i, s in enumerate(shapes)))
        wall = time.perf_counter() - t1
        rss["end"] = _worker_rss()
        return {"req_per_s": requests / wall, "wall_s": wall, "startup_s": startup_s, "rss_bytes": rss,
                "startup": eng.startup}
    finally:
        eng.shutdown()


def _spawn(model: str, arm: str, plan: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.housekeeping", "--arm", arm, "--model", model,
                          "--requests", str(plan["requests"]), "--concurrency", str(plan["concurrency"])],
                         cwd=ROOT, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"{model} {arm}: no result\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.housekeeping", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="tiny-llama,llama-100m")
    ap.add_argument("--arm", choices=("on", "off"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.arm:  # one arm, in its own process
        res = asyncio.run(_arm(args.model, args.arm == "on", args.requests, args.concurrency))
        print("RESULT " + json.dumps(res), flush=True)
        return

    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    results: dict = {}
    for model in args.models.split(","):
        plan = PLAN[model]
        runs = {"on": [], "off": []}
        for r in range(args.rounds):
            for arm in (("on", "off") if r % 2 == 0 else ("off", "on")):
                res = _spawn(model, arm, plan)
                runs[arm].append(res)
                print(f"{model} round {r + 1} {arm}: {res['req_per_s']:.3f} req/s, startup {res['startup_s']:.1f} s, "
                      f"worker RSS after {FIRST} {res['rss_bytes']['after_first'] / 2**20:.0f} MiB "
                      f"-> end {res['rss_bytes']['end'] / 2**20:.0f} MiB", flush=True)
        tput = {a: plan["requests"] * len(v) / sum(x["wall_s"] for x in v) for a, v in runs.items()}
        growth = {a: [x["rss_bytes"]["end"] / x["rss_bytes"]["after_first"] - 1 for x in v] for a, v in runs.items()}
        results[model] = {"plan": plan, "runs": runs, "req_per_s": tput, "ratio_on_off": tput["on"] / tput["off"],
                          "per_round_ratio": [a["req_per_s"] / b["req_per_s"] for a, b in zip(runs["on"], runs["off"])],
                          "worker_rss_growth_after_first_to_end": growth}
    doc = {"command": "python -m bench.housekeeping " + " ".join(argv if argv is not None else sys.argv[1:]),
           "started": started, "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "machine": f"{platform.processor() or platform.machine()}, {platform.platform()}", "models": results}
    OUT.mkdir(exist_ok=True)
    (OUT / "housekeeping.json").write_text(json.dumps(doc, indent=1))
    md = ["# Warm-up and malloc_trim: on (defaults) vs off, engine level", "",
          f"Command: `{doc['command'].strip()}` (from the repository root, `.venv/bin/python`)  ",
          f"Run: {started} .. {doc['finished']}; {doc['machine']}", "",
          "Each arm of each round is a fresh engine in its own process, alternating; hidden states on every request; "
          "the benchmark's request mix; 512-token prefill chunks. Throughput = requests / summed wall time (after "
          f"start-up). Worker RSS growth = the vLLM worker's resident memory at the end vs after the first {FIRST} "
          "requests.", "",
          "| model | requests x rounds | on req/s | off req/s | on/off | per-round on/off | startup s on / off | "
          "worker RSS growth on | off |", "|---|---|---|---|---|---|---|---|---|"]
    for model, r in results.items():
        st = {a: sum(x["startup_s"] for x in v) / len(v) for a, v in r["runs"].items()}
        g = {a: ", ".join(f"{x:+.1%}" for x in v) for a, v in r["worker_rss_growth_after_first_to_end"].items()}
        md.append(f"| {model} | {r['plan']['requests']} x {args.rounds} | {r['req_per_s']['on']:.3f} | "
                  f"{r['req_per_s']['off']:.3f} | {r['ratio_on_off']:.3f} | "
                  f"{', '.join(f'{x:.2f}' for x in r['per_round_ratio'])} | {st['on']:.1f} / {st['off']:.1f} | "
                  f"{g['on']} | {g['off']} |")
    (OUT / "housekeeping.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"wrote {OUT / 'housekeeping.json'}, {OUT / 'housekeeping.md'}")


if __name__ == "__main__":
    main()
