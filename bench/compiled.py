"""Compiled against eager on the CPU, and what the static layer set costs a compiled engine: the
measurement the CPU default of `make serve` (`enforce_eager` in deployments/config.py) is chosen from.

    .venv/bin/python -m bench.compiled [--model builtin:smollm2-135m-instruct] [--rounds 3] \
        [--max-tokens 32] [--layers 4] [--name compiled-smollm2]

Three engines (HiddenStatesEngine, float32, hidden states on, no Ray), started one after another
with fresh compile caches (a first deployment's start: vLLM's and inductor's caches in a temporary
folder), then measured side by side:
- `eager`: enforce_eager true (today's CPU default);
- `compiled`: enforce_eager false (vLLM's default: torch.compile, inductor);
- `traced`: compiled, with `capture_layers` at `--layers` layers (worker/traced.py), nobody asking;
- `eager2`: `eager` again (the A/A control: its interval is the noise floor).
Each round runs every arm at concurrency 1, 8 and 32 (4, 16, 64 requests, `ignore_eos`, every
completion `--max-tokens` long, fresh prompts), in a rotating order. Tokens per second = completion
tokens over wall time, pooled over rounds, with a 95% bootstrap interval over paired rounds against
`eager`. Start time: `HiddenStatesEngine.start` from call to return (compile included, warm-up off
on every arm). Counted: the compiled engines' compilations (vLLM's and dynamo's counters) before and
after the rounds; equal means no request compiled anything. Prints and writes
bench/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

import numpy as np

from bench.measure import paired_ratio_ci
from bench.report import ci_text, command_line, write_results
from bench.servers import ENGINE_ENV

ENGINE_ARGS = {"dtype": "float32", "kv_cache_memory_bytes": 512 * 2**20, "max_model_len": 1024,
               "max_num_batched_tokens": 512}
ARMS = ("eager", "compiled", "traced", "eager2")
LEVELS = {1: 4, 8: 16, 32: 64}  # concurrency -> requests per round


def _prompts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["river", "stone", "light", "market", "engine", "garden", "signal", "paper", "winter", "music"]
    return [f"Story {seed}-{i}: the " + " ".join(rng.choice(words, 6)) for i in range(n)]


async def _level(engine, concurrency: int, prompts: list[str], max_tokens: int) -> tuple[int, float]:
    from vllm import SamplingParams

    sem = asyncio.Semaphore(concurrency)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(p):
        async with sem:
            out = await engine.complete(p, params, return_hidden_states=False)
            return len(out.choices[0].token_ids)

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    return tokens, time.perf_counter() - t0


async def _compilations(engine) -> dict:
    return (await engine.stats())["workers"][0].get("compilations", {})


async def _run(args) -> dict:
    from hidden_states.vllm.engine import HiddenStatesEngine

    cache = tempfile.mkdtemp(prefix="bench-compiled-")
    os.environ["VLLM_CACHE_ROOT"] = os.path.join(cache, "vllm")  # inherited by each engine-core process
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    engines, starts = {}, {}
    try:
        for arm, extra in (("eager", {"enforce_eager": True}), ("compiled", {"enforce_eager": False}),
                           ("traced", {"enforce_eager": False, "capture_layers": None})):
            if arm == "traced":
                L = engines["eager"].num_layers
                extra["capture_layers"] = sorted({int(x) for x in np.linspace(1, L - 1, args.layers)})
            t0 = time.perf_counter()
            engines[arm] = await HiddenStatesEngine.start(args.model, warm_up_s=0, **ENGINE_ARGS, **extra)
            starts[arm] = time.perf_counter() - t0
        engines["eager2"] = engines["eager"]
        for arm in ARMS[:3]:  # warm-up: each batch size's kernels once
            for c, n in LEVELS.items():
                await _level(engines[arm], c, _prompts(n, 10**6 + c), args.max_tokens)
        compiles_before = {a: await _compilations(engines[a]) for a in ("compiled", "traced")}
        walls = {(a, c): [] for a in ARMS for c in LEVELS}
        for r in range(args.rounds):
            for k, arm in enumerate(ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]):
                for c, n in LEVELS.items():
                    await asyncio.sleep(1.5)  # the engine that ran last stops busy-waiting (vLLM's SpinCondition)
                    walls[(arm, c)].append(await _level(engines[arm], c, _prompts(n, 1000 * (r * 8 + k) + c),
                                                        args.max_tokens))
        compiles_after = {a: await _compilations(engines[a]) for a in ("compiled", "traced")}
        tok_s = {f"{a}@{c}": sum(t for t, _ in w) / sum(s for _, s in w) for (a, c), w in walls.items()}
        out = {"model": args.model, "hidden_size": engines["eager"].hidden_size,
               "capture_layers": extra["capture_layers"], "rounds": args.rounds, "max_tokens": args.max_tokens,
               "levels": LEVELS, "start_s": starts, "tok_per_s": tok_s,
               "compilations_unchanged": {a: compiles_before[a] == compiles_after[a] for a in compiles_before},
               "compilations": compiles_after}
        for c in LEVELS:
            for a in ("compiled", "traced", "eager2"):
                out[f"{a}_over_eager@{c}"] = tok_s[f"{a}@{c}"] / tok_s[f"eager@{c}"]
                out[f"{a}_over_eager_ci95@{c}"] = paired_ratio_ci(walls[(a, c)], walls[("eager", c)])
            out[f"traced_over_compiled@{c}"] = tok_s[f"traced@{c}"] / tok_s[f"compiled@{c}"]
            out[f"traced_over_compiled_ci95@{c}"] = paired_ratio_ci(walls[("traced", c)], walls[("compiled", c)])
        return out
    finally:
        for arm in ("eager", "compiled", "traced"):
            if arm in engines:
                engines[arm].shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4, help="layers in the traced arm's capture_layers")
    ap.add_argument("--name", default="compiled-smollm2")
    args = ap.parse_args()
    os.environ.update(ENGINE_ENV)
    r = asyncio.run(_run(args))
    lines = [f"# Compiled against eager on the CPU ({args.model}, D = {r['hidden_size']}, float32, {args.rounds} "
             f"rounds, {args.max_tokens} tokens per completion; traced arm: capture_layers {r['capture_layers']})", "",
             command_line("bench.compiled", args), "",
             "| arm | start s | " + " | ".join(f"tok/s c={c} (over eager, 95% CI)" for c in LEVELS) + " |",
             "| --- | --- | " + " | ".join("---" for _ in LEVELS) + " |"]
    for a in ARMS:
        cells = []
        for c in LEVELS:
            rate = r["tok_per_s"][f"{a}@{c}"]
            cells.append(f"{rate:.1f}" if a == "eager" else
                         f"{rate:.1f} ({r[f'{a}_over_eager@{c}']:.3f}, {ci_text(r[f'{a}_over_eager_ci95@{c}'])})")
        start = f"{r['start_s'][a]:.1f}" if a in r["start_s"] else "(eager's)"
        lines.append(f"| {a} | {start} | " + " | ".join(cells) + " |")
    lines += ["", "The static layer set's cost, traced over compiled: " + ", ".join(
        f"c={c}: {r[f'traced_over_compiled@{c}']:.3f} ({ci_text(r[f'traced_over_compiled_ci95@{c}'])})"
        for c in LEVELS) + ".",
        "", f"Compilations unchanged by the rounds (vLLM's and dynamo's counters): {r['compilations_unchanged']}.",
        "", "`eager2` is `eager` measured again (the A/A control: its interval is the noise floor). Start times "
            "are cold: fresh vLLM and inductor caches."]
    write_results(args.name, r, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
