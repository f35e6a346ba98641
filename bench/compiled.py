"""Compiled against eager on the CPU, and what the static layer set costs a compiled engine: the
measurement the CPU default of `make serve` (`enforce_eager` in deployments/config.py) is chosen from.

    .venv/bin/python -m bench.compiled [--model builtin:smollm2-135m-instruct] [--rounds 5] \
        [--max-tokens 32] [--layers 4] [--name compiled-smollm2]

Three engines (HiddenStatesEngine, float32, hidden states on, no Ray), started one after another
with fresh compile caches (a first deployment's start: vLLM's and inductor's caches in a temporary
folder), then a fourth, `compiled` again on the caches the first filled (a second start: `warm`,
timed, then shut down), then measured side by side:
- `eager`: enforce_eager true (today's CPU default);
- `compiled`: enforce_eager false (vLLM's default: torch.compile, inductor), no `capture_layers`:
  the server without the features;
- `traced`: compiled, with `capture_layers` at `--layers` layers (worker/traced.py) and a linear
  head registered at one of them, nobody asking;
- `features`: the `traced` engine with half of each batch asking for rows at two of its layers
  (every completion position), the head at every completion position, and steering (add) at two
  of its layers;
- `eager2`, `compiled2`: `eager` and `compiled` again (the A/A controls: their intervals are the
  noise floor).
Each round runs every arm at concurrency 1, 8 and 32 (4, 16, 64 requests, `ignore_eos`, every
completion `--max-tokens` long, fresh prompts), in a rotating order. Tokens per second = completion
tokens over wall time, pooled over rounds, with a 95% bootstrap interval over paired rounds against
`eager`, and for the compiled arms against `compiled`. Start time: `HiddenStatesEngine.start` from
call to return (compile included, warm-up off on every arm). Counted: the compiled engines'
compilations (vLLM's and dynamo's counters) before and after the rounds (equal means no request
compiled anything), and the `features` arm's steered rows and head rows (the work it asked for was
done). Prints and writes bench/results/<name>.{json,md}.
"""

from __future__ import annotations

import asyncio
import base64
import os
import tempfile
import time

import numpy as np

from bench.measure import paired_ratio_ci
from bench.report import bench_main, ci_text

ENGINE_ARGS = {
    "dtype": "float32",
    "kv_cache_memory_bytes": 512 * 2**20,
    "max_model_len": 1024,
    "max_num_batched_tokens": 512,
}
ARMS = ("eager", "compiled", "traced", "features", "eager2", "compiled2")
ENGINE_OF = {
    "eager": "eager",
    "compiled": "compiled",
    "traced": "traced",
    "features": "traced",
    "eager2": "eager",
    "compiled2": "compiled",
}
LEVELS = {1: 4, 8: 16, 32: 64}  # concurrency -> requests per round


def _prompts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["river", "stone", "light", "market", "engine", "garden", "signal", "paper", "winter", "music"]
    return [f"Story {seed}-{i}: the " + " ".join(rng.choice(words, 6)) for i in range(n)]


def _features(layers: list[int], d: int) -> dict:
    """What a `features` request asks for: rows at two static layers (every completion position), the
    linear head, steering at two static layers (`hidden_states_layers` numbering: layer l is the
    stream entering decoder layer l)."""
    rng = np.random.default_rng(0)
    steer = [
        {"layer": l, "vector": base64.b64encode((rng.normal(size=d) * 2).astype("<f4").tobytes()).decode()}
        for l in layers[:2]
    ]
    return {"layers": layers[-2:], "position": "completion", "heads": ["probe"], "steering": steer}


async def _level(
    engine, concurrency: int, prompts: list[str], max_tokens: int, features: dict | None = None
) -> tuple[int, float]:
    from vllm import SamplingParams

    sem = asyncio.Semaphore(concurrency)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i, p):
        async with sem:
            if features is not None and i % 2 == 0:
                out = await engine.complete(p, params, **features)
            else:
                out = await engine.complete(p, params, return_hidden_states=False)
            return len(out.choices[0].token_ids)

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    return tokens, time.perf_counter() - t0


async def _work(engine) -> dict[str, int]:
    ws = (await engine.stats())["workers"]
    return {k: sum(int(w.get(k, 0)) for w in ws) for k in ("steered_rows", "head_rows")}


def _make_probe(folder: str, d: int) -> str:
    """A linear head (safetensors weight [2, D], bias [2]), random weights from a fixed seed."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    path = os.path.join(folder, "probe.safetensors")
    save_file({"weight": torch.randn(2, d, generator=gen) / d**0.5, "bias": torch.zeros(2)}, path)
    return path


async def _compilations(engine) -> dict:
    return (await engine.stats())["workers"][0].get("compilations", {})


async def _run(args) -> dict:
    from hidden_states.vllm.engine import HiddenStatesEngine

    cache = tempfile.mkdtemp(prefix="bench-compiled-")
    os.environ["VLLM_CACHE_ROOT"] = os.path.join(cache, "vllm")  # inherited by each engine-core process
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    engines, starts = {}, {}
    try:
        t0 = time.perf_counter()
        engines["eager"] = await HiddenStatesEngine.start(args.model, warm_up_s=0, enforce_eager=True, **ENGINE_ARGS)
        starts["eager"] = time.perf_counter() - t0
        L, d = engines["eager"].num_layers, engines["eager"].hidden_size
        static = sorted({int(x) for x in np.linspace(1, L - 1, args.layers)})
        probe = {"name": "probe", "path": _make_probe(cache, d), "layer": static[-1], "activation": "softmax"}
        for arm, extra in (("compiled", {}), ("traced", {"capture_layers": static, "heads": [probe]})):
            t0 = time.perf_counter()
            engines[arm] = await HiddenStatesEngine.start(
                args.model, warm_up_s=0, enforce_eager=False, **ENGINE_ARGS, **extra
            )
            starts[arm] = time.perf_counter() - t0
        # a second start of `compiled` on the caches the first one filled (what a restarted replica sees)
        t0 = time.perf_counter()
        warm = await HiddenStatesEngine.start(args.model, warm_up_s=0, enforce_eager=False, **ENGINE_ARGS)
        starts["compiled_warm_cache"] = time.perf_counter() - t0
        warm_loaded = await _compilations(warm)
        warm.shutdown()
        features = _features(static, d)
        for arm in ("eager", "compiled", "traced", "features"):  # warm-up: each batch size's kernels once
            for c, n in LEVELS.items():
                await _level(
                    engines[ENGINE_OF[arm]],
                    c,
                    _prompts(n, 10**6 + c),
                    args.max_tokens,
                    features if arm == "features" else None,
                )
        compiles_before = {a: await _compilations(engines[a]) for a in ("compiled", "traced")}
        walls = {(a, c): [] for a in ARMS for c in LEVELS}
        work = {a: {"steered_rows": 0, "head_rows": 0} for a in ("traced", "features")}
        for r in range(args.rounds):
            for k, arm in enumerate(ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]):
                engine = engines[ENGINE_OF[arm]]
                for c, n in LEVELS.items():
                    await asyncio.sleep(1.5)  # the engine that ran last stops busy-waiting (vLLM's SpinCondition)
                    w0 = await _work(engine) if arm in work else None
                    walls[(arm, c)].append(
                        await _level(
                            engine,
                            c,
                            _prompts(n, 1000 * (r * 8 + k) + c),
                            args.max_tokens,
                            features if arm == "features" else None,
                        )
                    )
                    if w0 is not None:
                        w1 = await _work(engine)
                        for key in work[arm]:
                            work[arm][key] += w1[key] - w0[key]
        compiles_after = {a: await _compilations(engines[a]) for a in ("compiled", "traced")}
        tok_s = {f"{a}@{c}": sum(t for t, _ in w) / sum(s for _, s in w) for (a, c), w in walls.items()}
        out = {
            "model": args.model,
            "hidden_size": d,
            "capture_layers": static,
            "features": {k: v for k, v in features.items() if k != "steering"} | {"steering_layers": static[:2]},
            "rounds": args.rounds,
            "max_tokens": args.max_tokens,
            "levels": LEVELS,
            "start_s": starts,
            "warm_start_compilations": warm_loaded,
            "tok_per_s": tok_s,
            "work": work,
            "compilations_unchanged": {a: compiles_before[a] == compiles_after[a] for a in compiles_before},
            "compilations": compiles_after,
        }
        for c in LEVELS:
            for a in ARMS[1:]:
                out[f"{a}_over_eager@{c}"] = tok_s[f"{a}@{c}"] / tok_s[f"eager@{c}"]
                out[f"{a}_over_eager_ci95@{c}"] = paired_ratio_ci(walls[(a, c)], walls[("eager", c)])
            for a in ("traced", "features", "compiled2"):
                out[f"{a}_over_compiled@{c}"] = tok_s[f"{a}@{c}"] / tok_s[f"compiled@{c}"]
                out[f"{a}_over_compiled_ci95@{c}"] = paired_ratio_ci(walls[(a, c)], walls[("compiled", c)])
        return out
    finally:
        for arm in ("eager", "compiled", "traced"):
            if arm in engines:
                engines[arm].shutdown()


def _summary(args, r: dict) -> list[str]:
    lines = [
        f"# Compiled against eager on the CPU ({args.model}, D = {r['hidden_size']}, float32, {args.rounds} "
        f"rounds, {args.max_tokens} tokens per completion; capture_layers {r['capture_layers']})",
        "| arm | start s | " + " | ".join(f"tok/s c={c} (over eager, 95% CI)" for c in LEVELS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in LEVELS) + " |",
    ]
    for a in ARMS:
        cells = []
        for c in LEVELS:
            rate = r["tok_per_s"][f"{a}@{c}"]
            cells.append(
                f"{rate:.1f}"
                if a == "eager"
                else f"{rate:.1f} ({r[f'{a}_over_eager@{c}']:.3f}, {ci_text(r[f'{a}_over_eager_ci95@{c}'])})"
            )
        start = f"{r['start_s'][a]:.1f}" if a in r["start_s"] else f"({ENGINE_OF[a]}'s)"
        lines.append(f"| {a} | {start} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"A second start of `compiled` on the caches the first one filled: {r['start_s']['compiled_warm_cache']:.1f} s "
        f"(cold: {r['start_s']['compiled']:.1f} s).",
        "",
        "Over `compiled` (the server without the features), 95% CI; `compiled2` is the A/A control:",
        "",
        "| arm | " + " | ".join(f"c={c}" for c in LEVELS) + " |",
        "| --- | " + " | ".join("---" for _ in LEVELS) + " |",
    ]
    for a in ("traced", "features", "compiled2"):
        lines.append(
            f"| {a} | "
            + " | ".join(
                f"{r[f'{a}_over_compiled@{c}']:.3f} ({ci_text(r[f'{a}_over_compiled_ci95@{c}'])})" for c in LEVELS
            )
            + " |"
        )
    f = r["features"]
    lines += [
        "",
        f"`features` requests (half of each batch): rows at layers {f['layers']} at every completion position, "
        f"the linear head `probe` (layer {r['capture_layers'][-1]}), steering (add) at layers {f['steering_layers']}. "
        f"Work counted in the rounds: {r['work']['features']['steered_rows']} steered rows and "
        f"{r['work']['features']['head_rows']} head rows (`traced`, nobody asking: {r['work']['traced']}).",
        "",
        f"Compilations unchanged by the rounds (vLLM's and dynamo's counters): {r['compilations_unchanged']}.",
        "",
        "`eager2` and `compiled2` are `eager` and `compiled` measured again (the A/A controls: their intervals "
        "are the noise floor). Start times are cold (fresh vLLM and inductor caches) but for the second start.",
    ]
    return lines


def main() -> None:
    bench_main(
        "bench.compiled",
        __doc__,
        _run,
        _summary,
        name="compiled-smollm2",
        first=("--model", "builtin:smollm2-135m-instruct"),
        rounds=5,
        concurrency=None,
        requests=None,
        more=[("--layers", 4, "layers in the traced arm's capture_layers")],
    )


if __name__ == "__main__":
    main()
