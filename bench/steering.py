"""Steering's cost: a batch in which half the requests steer, and what the feature costs requests that
do not, beside an A/A control and a server without the feature.

    .venv/bin/python -m bench.steering [--model builtin:smollm2-135m-instruct] [--rounds 6] \
        [--concurrency 8] [--requests 24] [--max-tokens 32] [--layers 4] [--name steering-smollm2]

Two engines (HiddenStatesEngine, float32, eager, synchronous scheduling), no Ray, side by side:
`plain` is started with enable_return_hidden_states false (no hooks, no worker extension: the
server without the feature) on the engine arguments the other resolves to (its block size and
scheduling policy); the other has it on. Requests go through each engine's OpenAI
completions route (`ignore_eos`, every completion `--max-tokens` long), on fresh prompts per arm,
in a rotating order each round:
- `plain`: the server without the feature, no request steers;
- `off`: the server with it, no request steers;
- `half`: the same, every other request steers at `--layers` layers (all positions);
- `off2`: `off` again (the A/A control: its interval is the noise floor).
Throughput ratio = requests per second over `off`'s, pooled over rounds, 95% bootstrap interval over
paired rounds. Counted: the rows the workers steered (`steered_rows`) per arm. Prints and writes
bench/results/<name>.{json,md}.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np

from bench.measure import paired_ratio_ci
from bench.report import bench_main, ratio_text

ENGINE_ARGS = {
    "dtype": "float32",
    "enforce_eager": True,
    "kv_cache_memory_bytes": 512 * 2**20,
    "max_model_len": 1024,
    "max_num_batched_tokens": 512,
}
ARMS = ("plain", "off", "half", "off2")


def _prompts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["river", "stone", "light", "market", "engine", "garden", "signal", "paper", "winter", "music"]
    return [f"Story {seed}-{i}: the " + " ".join(rng.choice(words, 6)) for i in range(n)]


def _steering(d: int, layers: int, num_layers: int) -> list[dict]:
    rng = np.random.default_rng(0)
    picks = np.linspace(1, num_layers - 1, layers).astype(int)
    return [
        {"layer": int(layer), "vector": base64.b64encode((rng.normal(size=d) * 2).astype("<f4").tobytes()).decode()}
        for layer in picks
    ]


async def _steered_rows(engine) -> int:
    return sum(w.get("steered_rows", 0) for w in (await engine.stats())["workers"]) if engine.enabled else 0


async def _arm(engine, frontend, prompts, steer: list | None, args):
    sem = asyncio.Semaphore(args.concurrency)

    async def one(i, prompt):
        async with sem:
            body = {"model": "m", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
            if steer is not None and i % 2 == 0:
                body["hidden_states_steering"] = steer
            (status, out), *_ = [x async for x in frontend.handle("completions", json.dumps(body).encode())]
            assert status == 200, out[:300]
            return json.loads(out)

    s0 = await _steered_rows(engine)
    t0 = time.perf_counter()
    out = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    return wall, await _steered_rows(engine) - s0, out


async def _run(args) -> dict:
    from hidden_states.vllm.engine import HiddenStatesEngine
    from hidden_states.vllm.engine_args import with_defaults

    # The server without the feature, on the engine arguments the one with it resolves to (block size,
    # scheduling policy): the arms differ by the feature alone.
    same = with_defaults(ENGINE_ARGS, True, True)
    plain = await HiddenStatesEngine.start(args.model, enable_return_hidden_states=False, **same)
    on = await HiddenStatesEngine.start(args.model, **ENGINE_ARGS)
    try:
        engines = {"plain": plain, "off": on, "half": on, "off2": on}
        frontends = {"plain": await plain.openai("m", "bench"), "on": await on.openai("m", "bench")}
        steer = _steering(on.hidden_size, args.layers, on.num_layers)
        for arm in ("plain", "half"):  # warm-up
            await _arm(
                engines[arm],
                frontends["plain" if arm == "plain" else "on"],
                _prompts(args.requests, 10**6),
                steer if arm == "half" else None,
                args,
            )
        walls = {a: [] for a in ARMS}
        steered = {a: 0 for a in ARMS}
        for r in range(args.rounds):
            for k, arm in enumerate(ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]):
                prompts = _prompts(args.requests, 1000 * (r * len(ARMS) + k))
                wall, rows, out = await _arm(
                    engines[arm],
                    frontends["plain" if arm == "plain" else "on"],
                    prompts,
                    steer if arm == "half" else None,
                    args,
                )
                walls[arm].append((len(out), wall))
                steered[arm] += rows
        n = args.rounds * args.requests
        rate = {a: sum(c for c, _ in w) / sum(t for _, t in w) for a, w in walls.items()}
        return {
            "model": args.model,
            "hidden_size": on.hidden_size,
            "steered_layers": [e["layer"] for e in steer],
            "rounds": args.rounds,
            "requests_per_round": args.requests,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "req_per_s": rate,
            **{f"{a}_over_off": rate[a] / rate["off"] for a in ("plain", "half", "off2")},
            **{f"{a}_over_off_ci95": paired_ratio_ci(walls[a], walls["off"]) for a in ("plain", "half", "off2")},
            "steered_rows_per_request": {a: steered[a] / n for a in ARMS},
        }
    finally:
        on.shutdown()
        plain.shutdown()


def _summary(args, r: dict) -> list[str]:
    lines = [
        f"# Steering: half the requests steer at {len(r['steered_layers'])} layers {r['steered_layers']} "
        f"({args.model}, D = {r['hidden_size']}, float32, {args.rounds} rounds x {args.requests} requests at "
        f"concurrency {args.concurrency}, {args.max_tokens} tokens each)",
        "| arm | req/s | over off (95% CI) | rows steered per request |",
        "| --- | --- | --- | --- |",
    ]
    for a in ARMS:
        ratio = "1" if a == "off" else ratio_text(r, f"{a}_over_off")
        lines.append(f"| {a} | {r['req_per_s'][a]:.2f} | {ratio} | {r['steered_rows_per_request'][a]:.1f} |")
    lines += [
        "",
        "`plain`: a server without the feature (hidden states off: no hooks); `off`, `off2` (the A/A "
        "control), `half`: the server with it, where nobody steers, or every other request does.",
    ]
    return lines


def main() -> None:
    bench_main(
        "bench.steering",
        __doc__,
        _run,
        _summary,
        name="steering-smollm2",
        first=("--model", "builtin:smollm2-135m-instruct"),
        more=[("--layers", 4, "layers each steering request steers")],
    )


if __name__ == "__main__":
    main()
