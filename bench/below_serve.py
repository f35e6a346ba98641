"""The cost of hidden states below Ray Serve: where does the on/off gap come from?

    .venv/bin/python -m bench.below_serve [--rounds 6] [--concurrency 1,8] [--model tiny-llama]
    .venv/bin/python -m bench.below_serve --levels engine --concurrency 8,32 --control \
        --position completion --dtype float16 --name below-serve-rows   # issue 24: rows of every token
    .venv/bin/python -m bench.below_serve --levels plain --concurrency 32 --rounds 30 --control \
        --name below-serve-plain   # requests that do not ask: our engine vs vLLM's (--swap, --ours K=V)

One engine (HiddenStatesEngine, the benchmark's engine arguments and environment),
no Ray. Two levels, each with hidden states on vs off, in alternating rounds (the
first arm rotates), on the benchmark's request mix (same lengths per round,
different token contents, ignore_eos):

- `engine`: `HiddenStatesEngine.complete()` (the tail step, the side channel);
- `openai`: vLLM's OpenAI serving over it plus our vector merge
  (`OpenAIFrontend.handle`, what a replica runs for POST /v1/completions);
- `plain` (its own run, `--levels plain`): requests that do not ask for hidden
  states, on our engine with hidden states enabled (our scheduler subclass, the
  worker's hooks, our AsyncLLM) as the "on" arm, against vLLM's own AsyncLLM
  with the same arguments (`scheduling_policy: priority`, which ours sets) as
  "off": what the server costs a user who does not ask. Both engines are up in
  one process; each batch waits 1.5 s first, so the other engine's busy-wait
  after its last step (1 s, vLLM's SpinCondition) is over. `--swap` makes
  vLLM's engine the on arm; `--ours KEY=JSON` passes HiddenStatesEngine.start()
  arguments (e.g. `enable_return_hidden_states=false`).

`--position`, `--dtype`, `--topk`: what the "on" arm asks (default: the final token's
vector); `--control`: a third arm, off again (A/A), whose ratio to off is the noise floor.

Throughput ratio = summed wall time off / on, as `make bench` computes it. Set-up as
`make bench` (the bench extra). Prints and writes bench/results/below-serve.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
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


async def measure(model: str, rounds: int, concurrencies: list[int], levels: list[str] = ("engine", "openai"),
                  rows: dict | None = None, control: bool = False) -> dict:
    from vllm import SamplingParams

    from hidden_states.vllm.engine import HiddenStatesEngine
    from hidden_states.models.builtin import build

    path = str(build(model))
    eng = await HiddenStatesEngine.start(path, **ENGINE_ARGS)
    vocab = eng.llm.model_config.get_vocab_size()
    frontend = await eng.openai(model, "below-serve")

    rows = rows or {}
    fields = {"return_hidden_states": True, **{f"hidden_states_{k}": v for k, v in rows.items()}}
    if rows:
        fields["hidden_states_encoding"] = "base64"

    def engine_call(hs: bool):
        async def run(item):
            tag, shape = item
            rng = random.Random(tag)
            prompt = [rng.randrange(2, vocab) for _ in range(shape.prompt_tokens)]
            c = await eng.complete(prompt, SamplingParams(max_tokens=shape.max_tokens, temperature=0.0, ignore_eos=True),
                                   return_hidden_states=hs, **(rows if hs else {}))
            assert (c.choices[0].hidden_states is not None) == hs
        return run

    def openai_call(hs: bool):
        async def run(item):
            tag, shape = item
            body = workload.body(model, shape, vocab, tag, fields if hs else None)
            parts = [p async for p in frontend.handle("completions", body)]
            status, raw = parts[0]
            assert status == 200 and (b'"hidden_states"' in raw) == hs, raw[:300]
        return run

    out = {}
    try:
        for level, call in (("engine", engine_call), ("openai", openai_call)):
            if level not in levels:
                continue
            for c in concurrencies:
                wall = await _alternate(level, c, rounds, control, lambda arm: call(arm == "on"))
                out[f"{level} c={c}"] = _ratios(wall, PER_ROUND.get(c, 8), rounds, control,
                                                f"{level:7s} c={c:<3d} on/off")
    finally:
        eng.shutdown()
    return out


async def measure_plain(model: str, rounds: int, concurrencies: list[int], control: bool = False,
                        ours_args: dict | None = None, swap: bool = False) -> dict:
    """Level `plain`: unflagged requests, our engine (hidden states enabled; `ours_args`: more
    HiddenStatesEngine.start() arguments) vs vLLM's AsyncLLM."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from hidden_states.models.builtin import build
    from hidden_states.vllm.engine import HiddenStatesEngine

    path = str(build(model))
    ours = await HiddenStatesEngine.start(path, **ENGINE_ARGS, **(ours_args or {}))
    theirs = AsyncLLM.from_engine_args(AsyncEngineArgs(model=path, scheduling_policy="priority", **ENGINE_ARGS))
    vocab = ours.llm.model_config.get_vocab_size()

    def call(llm):
        async def run(item):
            tag, shape = item
            rng = random.Random(tag)
            prompt = {"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(shape.prompt_tokens)]}
            sp = SamplingParams(max_tokens=shape.max_tokens, temperature=0.0, ignore_eos=True)
            async for _ in llm.generate(prompt, sp, f"plain-{tag}"):
                pass
        return run

    # swap: vLLM's engine is the on arm and ours off/off2 (does the arm's place in the rotation decide?)
    on, off = (theirs, ours.llm) if swap else (ours.llm, theirs)
    engines = {"on": on, "off": off, "off2": off}
    out = {}
    try:
        for c in concurrencies:
            per = PER_ROUND.get(c, 8)
            for name, llm in (("on", on), ("off", off)):  # warm both the same way (first batches)
                await _batch(call(llm), [(f"warm-{c}-{name}-{i}", s) for i, s in
                                         enumerate(workload.shapes(per, seed=workload.SEED - c))], c)
            # Each batch after a pause: the other engine's busy-wait after its last step (1 s) is over.
            wall = await _alternate("plain", c, rounds, control, lambda arm: call(engines[arm]), pause_s=1.5)
            out[f"plain c={c}"] = _ratios(wall, per, rounds, control,
                                          f"plain   c={c:<3d} " + ("vLLM/ours" if swap else "ours/vLLM"))
        workers = (await ours.stats())["workers"]
        trims = sum(w.get("malloc_trim", {}).get("trims", 0) for w in workers)
        for r in out.values():
            r["ours_malloc_trims_in_run"] = trims
        print(f"ours: malloc_trim ran {trims} times (idle between its rounds)", flush=True)
    finally:
        theirs.shutdown()
        ours.shutdown()
    return out


async def _alternate(level: str, c: int, rounds: int, control: bool, run_for, pause_s: float = 0.0) -> dict:
    """Wall seconds per arm per round: the arms alternate round by round (the first arm rotates),
    on the same request lengths in a round, with different token contents per arm."""
    per = PER_ROUND.get(c, 8)
    shapes = workload.shapes(rounds * per, seed=workload.SEED + c)
    arms = ["on", "off", "off2"] if control else ["on", "off"]
    wall: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(rounds):
        sh = shapes[r * per:(r + 1) * per]
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            if pause_s:
                await asyncio.sleep(pause_s)
            items = [(f"{level}-{c}-{r}-{arm}-{i}", s) for i, s in enumerate(sh)]
            wall[arm].append(await _batch(run_for(arm), items, c))
    return wall


def _ratios(wall: dict[str, list[float]], per: int, rounds: int, control: bool, label: str) -> dict:
    ratio = sum(wall["off"]) / sum(wall["on"])
    per_round = [off / on for on, off in zip(wall["on"], wall["off"])]
    ci = paired_ratio_ci([(per, w) for w in wall["on"]], [(per, w) for w in wall["off"]])
    res = {"throughput_on_off": ratio, "per_round": per_round, "ci95": ci, "on_s": sum(wall["on"]),
           "off_s": sum(wall["off"]), "requests_per_arm": rounds * per}
    line = f"{label} {ratio:.3f}  95% CI {ci_text(ci)}  rounds {min(per_round):.2f}..{max(per_round):.2f}"
    if control:
        res["control_off2_off"] = sum(wall["off"]) / sum(wall["off2"])
        res["control_ci95"] = paired_ratio_ci([(per, w) for w in wall["off2"]], [(per, w) for w in wall["off"]])
        line += f"  | A/A off2/off {res['control_off2_off']:.3f}  95% CI {ci_text(res['control_ci95'])}"
    print(line, flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--levels", default="engine,openai")
    ap.add_argument("--position", default=None, help="the on arm's hidden_states_position, e.g. completion")
    ap.add_argument("--dtype", default=None, help="the on arm's hidden_states_dtype")
    ap.add_argument("--topk", type=int, default=None, help="the on arm's hidden_states_topk")
    ap.add_argument("--control", action="store_true", help="a third arm, off again: the A/A noise floor")
    ap.add_argument("--name", default="below-serve", help="results file name under bench/results/")
    ap.add_argument("--swap", action="store_true",
                    help="level plain: vLLM's engine as the on arm, ours as off and off2")
    ap.add_argument("--ours", action="append", default=[], metavar="KEY=JSON",
                    help="level plain: a HiddenStatesEngine.start() argument for our engine, "
                         "e.g. malloc_trim_interval_s=0")
    args = ap.parse_args()
    rows = {k: v for k, v in (("position", args.position), ("dtype", args.dtype), ("topk", args.topk))
            if v is not None}
    for k, v in ENGINE_ENV.items():  # the engine environment of every server in `make bench`
        os.environ.setdefault(k, v)
    t0 = time.time()
    concurrencies, levels = [int(x) for x in args.concurrency.split(",")], args.levels.split(",")
    ours_args = {k: json.loads(v) for k, v in (a.split("=", 1) for a in args.ours)}
    if levels == ["plain"]:
        res = asyncio.run(measure_plain(args.model, args.rounds, concurrencies, args.control, ours_args,
                                        args.swap))
        gc.collect()  # vLLM's AsyncLLM shuts down again in __del__: while the interpreter still runs
    elif "plain" in levels:
        sys.exit("--levels plain runs on its own (two engines, other arms)")
    else:
        res = asyncio.run(measure(args.model, args.rounds, concurrencies, levels, rows, args.control))
    cmd = "python -m bench.below_serve " + " ".join(sys.argv[1:])
    doc = {"command": cmd.strip(), "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0)),
           "seconds": round(time.time() - t0, 1), "model": args.model, "rounds": args.rounds,
           "engine_args": ENGINE_ARGS, "env": {k: os.environ.get(k) for k in ENGINE_ENV}, "on_arm": rows or "vector",
           "ours_args": ours_args if levels == ["plain"] else None, "swap": args.swap, "results": res}
    out = ROOT / "bench" / "results"
    (out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    lines = ["# Hidden states on/off below Ray Serve", "", f"Command: `{doc['command']}` ({doc['started']}, "
             f"{doc['seconds']:.0f} s); model {args.model}, {args.rounds} alternating rounds; engine arguments "
             f"`{json.dumps(ENGINE_ARGS)}`, environment `{json.dumps(doc['env'])}`.", "",
             (f"Level plain: requests without hidden states; our engine (hidden states enabled"
              f"{', ' + json.dumps(doc['ours_args']) if doc['ours_args'] else ''}) and vLLM's own AsyncLLM, "
              + ("on = vLLM's, off and off2 = ours" if args.swap else "on = ours, off and off2 = vLLM's")
              + ", each batch after a 1.5 s pause." if levels == ["plain"] else
              f"The on arm asks: {json.dumps(rows) if rows else 'the final token vector'}."), "",
             "| level | throughput on/off | 95% CI | per-round range | requests per arm | A/A off2/off (95% CI) |",
             "|---|---|---|---|---|---|"]
    for name, r in res.items():
        if "ours_malloc_trims_in_run" in r:
            name += f" (our malloc_trim ran {r['ours_malloc_trims_in_run']}x)"
        lines.append(f"| {name} | {r['throughput_on_off']:.3f} | {ci_text(r.get('ci95'))} "
                     f"| {min(r['per_round']):.2f}..{max(r['per_round']):.2f} "
                     f"| {r['requests_per_arm']} | "
                     + (f"{r['control_off2_off']:.3f} ({ci_text(r.get('control_ci95'))})" if "control_off2_off" in r
                        else "-") + " |")
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / (args.name + '.md')}")


if __name__ == "__main__":
    main()
