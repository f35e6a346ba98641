"""An SAE head on the device vs float16 rows of the same positions: throughput beside an A/A
control, bytes per token, frontend CPU per request, and the work counted.

    .venv/bin/python -m bench.heads [--model builtin:smollm2-135m-instruct] [--rounds 6] \
        [--concurrency 8] [--requests 24] [--max-tokens 32] [--features 8] [--layer 15] [--name heads-smollm2]

One engine (HiddenStatesEngine, float32, eager, synchronous scheduling), no Ray, with a top-k SAE
registered (SAELens's format, random weights, k = 32, `--features` x D features: 4,608 on
SmolLM2, D = 576) at `blocks.{layer-1}.hook_resid_post`, i.e. this server's layer `--layer`.
Requests go through the engine's OpenAI completions route (vLLM's own serving, as a replica's),
each round running five arms in a rotating order on the same prompts (`ignore_eos`, every
completion `--max-tokens` long):
- `off`: no hidden states (the server has the SAE registered; nobody reads it);
- `rows16`: float16 rows of every completion position at the SAE's layer, base64;
- `sae32`: the SAE's top-32 features of the same positions (`hidden_states_heads`), no rows;
- `off2`: off again, the A/A control (its interval is the noise floor);
- `both`: rows16 and sae32 in one request.
Throughput ratio = requests per second over off's, pooled over rounds, 95% bootstrap interval
over paired rounds. Counted, not timed: bytes per completion token as the responses report them
(`hidden_states_meta.bytes`, `head_bytes`) and as the workers copied them to the host
(`bytes_copied`), the heads' matrix products and rows (`head_products`, `head_rows`: zero in the
arms that read no head), and this process's CPU seconds per request (the frontend: vLLM's serving,
our formatting, and the load generator, the same in every arm). Prints and writes
bench/results/<name>.{json,md}.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
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
ARMS = ("off", "rows16", "sae32", "off2", "both")
K = 32


def _fields(layer: int) -> dict[str, dict]:
    rows = {
        "return_hidden_states": True,
        "hidden_states_position": "completion",
        "hidden_states_dtype": "float16",
        "hidden_states_layers": [layer],
        "hidden_states_encoding": "base64",
    }
    sae = {"hidden_states_heads": [{"name": "sae", "topk": K}], "hidden_states_position": "completion"}
    return {"off": {}, "off2": {}, "rows16": rows, "sae32": sae, "both": {**rows, **sae}}


def make_sae(folder: str, d_in: int, d_sae: int, layer: int) -> str:
    """A top-k SAE (k = 32) saved by SAELens, random weights from a fixed seed."""
    import torch
    from sae_lens import TopKSAE, TopKSAEConfig

    cfg = TopKSAEConfig(d_in=d_in, d_sae=d_sae, k=K, dtype="float32", device="cpu")
    cfg.metadata.hook_name = f"blocks.{layer - 1}.hook_resid_post"
    torch.manual_seed(0)
    TopKSAE(cfg).save_model(folder)
    return folder


def _prompts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["river", "stone", "light", "market", "engine", "garden", "signal", "paper", "winter", "music"]
    return [f"Story {seed}-{i}: the " + " ".join(rng.choice(words, 6)) for i in range(n)]


WORKER_COUNTS = ("bytes_copied", "head_products", "head_rows", "host_copies")


async def _workers(engine, keys=WORKER_COUNTS) -> dict[str, int]:
    """The workers' counters (capture.py's _RunnerHook), summed over workers."""
    ws = (await engine.stats())["workers"]
    return {k: sum(w.get(k, 0) for w in ws) for k in keys}


async def _arm(engine, frontend, prompts, fields: dict | list[dict], args, keys=WORKER_COUNTS):
    """One arm: the prompts through the completions route at `args.concurrency`, each with `fields` (or
    with its own, a list beside the prompts): (wall s, this process's CPU s, the workers' counts, responses)."""
    sem = asyncio.Semaphore(args.concurrency)
    each = fields if isinstance(fields, list) else [fields] * len(prompts)

    async def one(prompt, f):
        async with sem:
            raw = json.dumps(
                {
                    "model": "m",
                    "prompt": prompt,
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    **f,
                }
            ).encode()
            (status, out), *_ = [x async for x in frontend.handle("completions", raw)]
            assert status == 200, out[:300]
            return json.loads(out)

    w0, c0 = await _workers(engine, keys), time.process_time()
    t0 = time.perf_counter()
    out = await asyncio.gather(*(one(p, f) for p, f in zip(prompts, each)))
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    w1 = await _workers(engine, keys)
    return wall, cpu, {k: w1[k] - w0[k] for k in w0}, out


def rotation(arms: tuple, rounds: int, requests: int):
    """(round, arm, prompts) in each round's rotating order of `arms`, fresh prompts each time (no arm
    hits another's prefix)."""
    for r in range(rounds):
        for k, arm in enumerate(arms[r % len(arms) :] + arms[: r % len(arms)]):
            yield r, arm, _prompts(requests, 1000 * (r * len(arms) + k))


async def _run(args, folder: str) -> dict:
    from hidden_states.vllm.engine import HiddenStatesEngine

    engine = await HiddenStatesEngine.start(args.model, heads=[{"name": "sae", "path": folder}], **ENGINE_ARGS)
    try:
        fields = _fields(args.layer)
        frontend = await engine.openai("m", "bench")
        await _arm(engine, frontend, _prompts(args.requests, 10**6), fields["both"], args)  # warm-up
        walls = {a: [] for a in ARMS}
        cpu = {a: 0.0 for a in ARMS}
        work = {a: {} for a in ARMS}
        reported = {a: {"row_bytes": 0, "head_bytes": 0, "positions": 0} for a in ARMS}
        for _, arm, prompts in rotation(ARMS, args.rounds, args.requests):
            wall, c, w, out = await _arm(engine, frontend, prompts, fields[arm], args)
            walls[arm].append((len(out), wall))
            cpu[arm] += c
            for key, v in w.items():
                work[arm][key] = work[arm].get(key, 0) + v
            for o in out:
                meta = o["choices"][0].get("hidden_states_meta") or {}
                reported[arm]["row_bytes"] += meta.get("bytes", 0)
                reported[arm]["head_bytes"] += meta.get("head_bytes", 0)
                reported[arm]["positions"] += len(meta.get("positions", ()))
        n = args.rounds * args.requests
        tokens = n * args.max_tokens
        rate = {a: sum(c for c, _ in w) / sum(t for _, t in w) for a, w in walls.items()}
        per_token = {
            a: {
                "response": (reported[a]["row_bytes"] + reported[a]["head_bytes"]) / tokens,
                "copied_to_host": work[a]["bytes_copied"] / tokens,
            }
            for a in ARMS
        }
        return {
            "model": args.model,
            "hidden_size": engine.hidden_size,
            "sae_features": engine.heads["sae"].width,
            "sae_layer": engine.heads["sae"].layer,
            "topk": K,
            "rounds": args.rounds,
            "requests_per_round": args.requests,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "req_per_s": rate,
            **{f"{a}_over_off": rate[a] / rate["off"] for a in ARMS[1:]},
            **{f"{a}_over_off_ci95": paired_ratio_ci(walls[a], walls["off"]) for a in ARMS[1:]},
            "sae32_over_rows16": rate["sae32"] / rate["rows16"],
            "sae32_over_rows16_ci95": paired_ratio_ci(walls["sae32"], walls["rows16"]),
            "bytes_per_token": per_token,
            "rows16_over_sae32_bytes": per_token["rows16"]["response"] / per_token["sae32"]["response"],
            "frontend_cpu_s_per_request": {a: cpu[a] / n for a in ARMS},
            "worker_counts_per_request": {a: {k: v / n for k, v in work[a].items()} for a in ARMS},
            "positions_per_request": {a: reported[a]["positions"] / n for a in ARMS},
        }
    finally:
        engine.shutdown()


def hidden_size(model: str) -> int:
    """The model's D, from its config (before any engine starts)."""
    from transformers import AutoConfig

    from hidden_states.models.builtin import resolve_model

    return AutoConfig.from_pretrained(resolve_model(model)).hidden_size


def _run_with_sae(args) -> dict:
    """The SAE made (random weights) in a temporary folder, then the rounds."""
    d = hidden_size(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(_run(args, make_sae(os.path.join(tmp, "sae"), d, args.features * d, args.layer)))


def _summary(args, r: dict) -> list[str]:
    bpt, cpu, counts = r["bytes_per_token"], r["frontend_cpu_s_per_request"], r["worker_counts_per_request"]
    lines = [
        f"# An SAE head (top-{K} of {r['sae_features']} features, layer {r['sae_layer']}) vs float16 rows of the "
        f"same positions ({args.model}, D = {r['hidden_size']}, float32, {args.rounds} rounds x {args.requests} "
        f"requests at concurrency {args.concurrency}, {args.max_tokens} tokens each, every completion position)",
        "| arm | req/s | over off (95% CI) | bytes/token in responses | bytes/token copied to host | "
        "head products / request | frontend CPU s / request |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for a in ARMS:
        ratio = "1" if a == "off" else ratio_text(r, f"{a}_over_off")
        lines.append(
            f"| {a} | {r['req_per_s'][a]:.2f} | {ratio} | {bpt[a]['response']:.1f} | "
            f"{bpt[a]['copied_to_host']:.1f} | {counts[a].get('head_products', 0):.2f} | {cpu[a]:.4f} |"
        )
    lines += [
        "",
        f"sae32 over rows16: {ratio_text(r, 'sae32_over_rows16')}; "
        f"bytes per token, rows16 over sae32: {r['rows16_over_sae32_bytes']:.2f}x "
        f"(k x 8 = {K * 8} against D x 2 = {2 * r['hidden_size']}).",
        "",
        "`off2` is `off` again (the A/A control). The server has the SAE registered in every arm; `off` "
        "and `off2` read no head (their head products are counted: 0).",
    ]
    return lines


def main() -> None:
    bench_main(
        "bench.heads",
        __doc__,
        _run_with_sae,
        _summary,
        name="heads-smollm2",
        first=("--model", "builtin:smollm2-135m-instruct"),
        more=[
            ("--features", 8, "SAE features per hidden dimension"),
            ("--layer", 15, "the SAE's layer (hidden_states_layers' numbering)"),
        ],
    )


if __name__ == "__main__":
    main()
