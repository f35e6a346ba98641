"""Hidden states on/off through each HTTP path of our app: where above the replica does the gap open?

    .venv/bin/python -m bench.hs_paths [--rounds 6] [--concurrency 1] [--model tiny-llama]

`bench.below_serve` measures on/off on the engine and on vLLM's OpenAI serving in
one process (about 1-2%); `make bench`'s part 1 measures it through Serve's proxy
and the Router (0.91x at c=1 on the tiny model). This runs part 1's comparison
(the same mix, alternating rounds, the first arm rotating) on one Ray cluster with
only our app, through every path at once, the paths interleaved too:

- `proxy`: Serve's proxy -> Router -> engine replica (port 8000 in `make serve`);
- `port`: the Router's own port (direct ingress) -> engine replica;
- `direct`: Serve's proxy -> the engine replica (`ingress: replica`, a second app).

Set-up as `make bench`. Prints and writes bench/results/hs-paths.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench import compare, measure
from bench.cli import ENGINE, MAIN_CLUSTER_ENV
from bench.procs import ROOT
from bench.report import ci_text
from bench.servers import RayCluster, ServeApps, build_model

PER_ROUND = {1: 8, 8: 32, 32: 64}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--concurrency", default="1")
    ap.add_argument("--model", default="tiny-llama")
    args = ap.parse_args()
    t0 = time.time()
    path = build_model(args.model)
    vocab = int(json.loads(Path(path, "config.json").read_text())["vocab_size"])
    engine = dict(ENGINE)  # make bench's engine arguments
    cluster = RayCluster(extra_env=MAIN_CLUSTER_ENV)
    serve = None
    res: dict = {}
    try:
        cluster.start()
        serve = ServeApps(cluster, path, args.model, engine, ours=True, rsllm=False, tag=f"paths-{args.model}",
                          direct=True)
        serve.launch()
        serve.wait_ready(900)
        eps = serve.endpoints()
        port = serve.router_port_endpoint()
        paths = {"proxy": eps["ours"], "direct": eps["direct"]}
        if port is not None:
            paths["port"] = port
        arms = []
        for name, ep in paths.items():
            arms += [compare.Arm(f"{name}_on", f"{name}, hidden states on", ep, {"return_hidden_states": True}),
                     compare.Arm(f"{name}_off", f"{name}, hidden states off", ep, {})]
        compare.warmup(arms, vocab, 8, 8, f"paths-{args.model}")
        cpu = measure.CpuAccount()
        for c in [int(x) for x in args.concurrency.split(",")]:
            runs = compare.run(arms, vocab, c, args.rounds, PER_ROUND.get(c, 8), f"paths-{args.model}", cpu)
            for name in paths:
                r = compare.compare(runs, f"{name}_on", f"{name}_off")
                res[f"{name} c={c}"] = r
                rr = r.get("per_round_req_per_s") or [r["req_per_s"]]
                print(f"{name:7s} c={c:<3d} on/off {r['req_per_s']:.3f}  95% CI {ci_text(r.get('req_per_s_ci95'))}  "
                      f"rounds {min(rr):.2f}..{max(rr):.2f}  p50 added {r['p50_added_ms'] or 0:+.1f} ms", flush=True)
    finally:
        if serve is not None:
            serve.stop()
        cluster.stop()
    cmd = ("python -m bench.hs_paths " + " ".join(sys.argv[1:])).strip()
    doc = {"command": cmd, "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0)),
           "seconds": round(time.time() - t0, 1), "model": args.model, "rounds": args.rounds, "engine_args": engine,
           "results": res}
    out = ROOT / "bench" / "results"
    (out / "hs-paths.json").write_text(json.dumps(doc, indent=1, default=str))
    lines = ["# Hidden states on/off through each HTTP path of our app", "",
             f"Command: `{cmd}` ({doc['started']}, {doc['seconds']:.0f} s); model {args.model}, {args.rounds} "
             "rounds, every arm interleaved (the first rotating); only our app on the cluster.", "",
             "| path | throughput on/off | 95% CI | per-round range | p50 added (ms) |", "|---|---|---|---|---|"]
    for name, r in res.items():
        rr = r.get("per_round_req_per_s") or [r["req_per_s"]]
        lines.append(f"| {name} | {r['req_per_s']:.3f} | {ci_text(r.get('req_per_s_ci95'))} | {min(rr):.2f}..{max(rr):.2f} "
                     f"| {r['p50_added_ms'] or 0:+.1f} |")
    (out / "hs-paths.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'hs-paths.md'}")


if __name__ == "__main__":
    main()
