"""The cost of asking for 4 layers against the last layer alone (engine level).

    .venv/bin/python -m bench.layers [--rounds 4] [--requests 16] [--concurrency 8]

Same engine, same requests (different token contents per arm, so neither finds
the other's prompts in the prefix cache), alternating rounds; prints and
writes bench/results/layers.{json,md}. Model: the benchmark's ~100M Llama
(hidden 768, 12 layers), where compute dominates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from deployments.config import CPU_ENGINE_DEFAULTS

OUT = Path(__file__).parent / "results"
ARMS = {"last layer [-1]": [-1], "4 layers [3, 6, 9, -1]": [3, 6, 9, -1]}


async def run(args) -> dict:
    from vllm import SamplingParams

    from hidden_states.vllm.engine import HiddenStatesEngine
    from hidden_states.models.builtin import build

    path = str(build("llama-100m"))
    eng = await HiddenStatesEngine.start(path, **{**CPU_ENGINE_DEFAULTS, "max_model_len": 2048})
    rng = np.random.default_rng(7)
    vocab = eng.llm.model_config.get_vocab_size()
    lengths = rng.integers(64, 600, size=args.requests)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {a: [] for a in ARMS}
    extraction_s: dict[str, list[float]] = {a: [] for a in ARMS}
    try:
        for r in range(args.rounds):
            order = list(ARMS) if r % 2 == 0 else list(reversed(ARMS))
            for arm in order:
                prompts = [rng.integers(10, vocab, size=int(n)).tolist() for n in lengths]
                sem = asyncio.Semaphore(args.concurrency)

                async def one(p, layers=ARMS[arm]):
                    async with sem:
                        return await eng.complete(p, params, layers=layers)

                t0 = time.perf_counter()
                done = await asyncio.gather(*(one(p) for p in prompts))
                times[arm].append(time.perf_counter() - t0)
                extraction_s[arm] += [c.choices[0].extraction.seconds for c in done]
                assert all(len(c.choices[0].hidden_states_by_layer) == len(ARMS[arm]) for c in done)
                print(f"round {r} {arm}: {times[arm][-1]:.2f}s", file=sys.stderr)
    finally:
        eng.shutdown()
    base, four = list(ARMS)
    thr = {a: args.requests * args.rounds / sum(times[a]) for a in ARMS}
    return {
        "command": "python -m bench.layers " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores, {platform.platform()}",
        "model": "builtin llama-100m (hidden 768, 12 layers), float32, eager, CPU",
        "workload": {"requests_per_round": args.requests, "rounds": args.rounds, "concurrency": args.concurrency,
                     "prompt_tokens": [64, 600], "max_tokens": args.max_tokens},
        "throughput_req_s": thr,
        "ratio_4_layers_over_last": thr[four] / thr[base],
        "extraction_p50_ms": {a: 1000 * statistics.median(v) for a, v in extraction_s.items()},
        "round_seconds": times,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    res = asyncio.run(run(ap.parse_args()))
    OUT.mkdir(exist_ok=True)
    (OUT / "layers.json").write_text(json.dumps(res, indent=2))
    base, four = list(ARMS)
    md = (f"# Cost of 4 layers vs the last layer\n\nCommand: `{res['command']}`  \nMachine: {res['machine']}  \n"
          f"Model: {res['model']}; workload: {json.dumps(res['workload'])}; arms alternate by round.\n\n"
          f"| arm | req/s | extraction p50 ms |\n|---|---|---|\n"
          + "".join(f"| {a} | {res['throughput_req_s'][a]:.3f} | {res['extraction_p50_ms'][a]:.1f} |\n" for a in ARMS)
          + f"\n4 layers / last layer throughput: **{res['ratio_4_layers_over_last']:.3f}x**\n")
    (OUT / "layers.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
