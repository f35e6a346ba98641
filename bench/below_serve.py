"""The cost of hidden states below Ray Serve: where does the on/off gap come from?

    .venv/bin/python -m bench.below_serve [--rounds 6] [--concurrency 1,8] [--model tiny-llama]

One engine (HiddenStatesEngine, the benchmark's engine arguments and environment),
no Ray. Two levels, each with hidden states on vs off, in alternating rounds (the
first arm rotates), on the benchmark's request mix (same lengths per round,
different token contents, ignore_eos):

- `engine`: `HiddenStatesEngine.complete()` (the tail step, the side channel);
- `openai`: vLLM's OpenAI serving over it plus our vector merge
  (`OpenAIFrontend.handle`, what a replica runs for POST /v1/completions).

Throughput ratio = summed wall time off / on, as `make bench` computes it. Set-up as
`make bench` (the bench extra). Prints and writes bench/results/below-serve.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

from bench import workload
from bench.measure import paired_ratio_ci
from bench.procs import ROOT
from bench.report import ci_text
from bench.servers import ENGINE_ENV

ENGINE_ARGS = {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 2**30, "max_model_len": 4096,
               "max_num_batched_tokens": 512, "block_size": 32}
PER_ROUND = {1: 8, 8: 32, 32: 64}


async def _batch(run, items, concurrency: int) -> float:
    queue = list(items)

    async def worker():
        while queue:
            await run(queue.pop())

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0


async def measure(model: str, rounds: int, concurrencies: list[int]) -> dict:
    from vllm import SamplingParams

    from hidden_states.vllm.engine import HiddenStatesEngine
    from hidden_states.models.builtin import build

    path = str(build(model))
    eng = await HiddenStatesEngine.start(path, **ENGINE_ARGS)
    vocab = eng.llm.model_config.get_vocab_size()
    frontend = await eng.openai(model, "below-serve")

    def engine_call(hs: bool):
        async def run(item):
            tag, shape = item
            rng = random.Random(tag)
            prompt = [rng.randrange(2, vocab) for _ in range(shape.prompt_tokens)]
            c = await eng.complete(prompt, SamplingParams(max_tokens=shape.max_tokens, temperature=0.0, ignore_eos=True),
                                   return_hidden_states=hs)
            assert (c.choices[0].hidden_states is not None) == hs
        return run

    def openai_call(hs: bool):
        async def run(item):
            tag, shape = item
            body = workload.body(model, shape, vocab, tag, {"return_hidden_states": True} if hs else None)
            parts = [p async for p in frontend.handle("completions", body)]
            status, raw = parts[0]
            assert status == 200 and (b'"hidden_states"' in raw) == hs, raw[:300]
        return run

    out = {}
    try:
        for level, call in (("engine", engine_call), ("openai", openai_call)):
            for c in concurrencies:
                per = PER_ROUND.get(c, 8)
                shapes = workload.shapes(rounds * per, seed=workload.SEED + c)
                wall = {True: [], False: []}
                for r in range(rounds):
                    sh = shapes[r * per:(r + 1) * per]
                    for hs in ((True, False) if r % 2 == 0 else (False, True)):
                        items = [(f"{level}-{c}-{r}-{hs}-{i}", s) for i, s in enumerate(sh)]
                        wall[hs].append(await _batch(call(hs), items, c))
                ratio = sum(wall[False]) / sum(wall[True])
                per_round = [off / on for on, off in zip(wall[True], wall[False])]
                ci = paired_ratio_ci([(per, w) for w in wall[True]], [(per, w) for w in wall[False]])
                out[f"{level} c={c}"] = {"throughput_on_off": ratio, "per_round": per_round, "ci95": ci,
                                         "on_s": sum(wall[True]), "off_s": sum(wall[False]), "requests_per_arm": rounds * per}
                print(f"{level:7s} c={c:<3d} on/off {ratio:.3f}  95% CI {ci_text(ci)}  "
                      f"rounds {min(per_round):.2f}..{max(per_round):.2f}",
                      flush=True)
    finally:
        eng.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--model", default="tiny-llama")
    args = ap.parse_args()
    for k, v in ENGINE_ENV.items():  # the engine environment of every server in `make bench`
        os.environ.setdefault(k, v)
    t0 = time.time()
    res = asyncio.run(measure(args.model, args.rounds, [int(x) for x in args.concurrency.split(",")]))
    cmd = "python -m bench.below_serve " + " ".join(sys.argv[1:])
    doc = {"command": cmd.strip(), "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0)),
           "seconds": round(time.time() - t0, 1), "model": args.model, "rounds": args.rounds,
           "engine_args": ENGINE_ARGS, "env": {k: os.environ.get(k) for k in ENGINE_ENV}, "results": res}
    out = ROOT / "bench" / "results"
    (out / "below-serve.json").write_text(json.dumps(doc, indent=1))
    lines = ["# Hidden states on/off below Ray Serve", "", f"Command: `{doc['command']}` ({doc['started']}, "
             f"{doc['seconds']:.0f} s); model {args.model}, {args.rounds} alternating rounds; engine arguments "
             f"`{json.dumps(ENGINE_ARGS)}`, environment `{json.dumps(doc['env'])}`.", "",
             "| level | throughput on/off | 95% CI | per-round range | requests per arm |", "|---|---|---|---|---|"]
    for name, r in res.items():
        lines.append(f"| {name} | {r['throughput_on_off']:.3f} | {ci_text(r.get('ci95'))} "
                     f"| {min(r['per_round']):.2f}..{max(r['per_round']):.2f} "
                     f"| {r['requests_per_arm']} |")
    (out / "below-serve.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'below-serve.md'}")


if __name__ == "__main__":
    main()
