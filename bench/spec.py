"""Hidden states under speculative decoding: throughput on vs off, and tokens computed per vector.

    .venv/bin/python -m bench.spec [--methods ngram,draft_model] [--rounds 6] [--concurrency 8] \
        [--requests 16] [--max-tokens 48] [--name spec-tiny]

One engine per method (HiddenStatesEngine, the tiny model, synchronous scheduling, 3 draft
tokens per step; the draft model is the target itself), no Ray. Each round runs three arms in
a rotating order on the same request mix (greedy, ignore_eos, different prompts per round):
`off` (return_hidden_states false), `on` (the final-token vector), and `off2` (off again: the
A/A control, whose ratio to off is the noise floor). Throughput ratio = requests per second of
an arm over off's, pooled over rounds, with a 95% bootstrap interval over paired rounds. Per
vector: how it was computed (`via`) and the positions computed for it (`computed_tokens`, the
floor is 1). vLLM's own counters give the mean accepted draft tokens per verify step.
Prints and writes bench/results/<name>.{json,md}.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

from bench.measure import paired_ratio_ci
from bench.report import bench_main, ratio_text

ENGINE_ARGS = {
    "dtype": "float32",
    "enforce_eager": True,
    "kv_cache_memory_bytes": 2**30,
    "max_model_len": 4096,
    "max_num_batched_tokens": 512,
    "block_size": 32,
}
WORDS = (
    "the replica cache step token vector router engine prefix hidden state model batch draft "
    "accept reject stop final row layer"
).split()


def _prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    # Repeated phrases, so n-gram lookup finds matches (a random model also repeats itself).
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 8))) * rng.randint(2, 4) for _ in range(n)]


def _spec_counts() -> tuple[float, float, float]:
    """(verify steps, draft tokens proposed, accepted) so far, from vLLM's Prometheus counters in this process."""
    import prometheus_client

    steps = drafts = accepted = 0.0
    for metric in prometheus_client.REGISTRY.collect():
        for s in metric.samples:
            if not s.name.endswith("_total"):
                continue
            if s.name.startswith("vllm:spec_decode_num_draft_tokens"):
                drafts += s.value
            elif s.name.startswith("vllm:spec_decode_num_drafts"):
                steps += s.value
            elif s.name.startswith("vllm:spec_decode_num_accepted_tokens") and "per_pos" not in s.name:
                accepted += s.value
    return steps, drafts, accepted


async def _arm(engine, prompts, hs: bool, concurrency: int, max_tokens: int):
    from vllm import SamplingParams

    sem = asyncio.Semaphore(concurrency)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(p):
        async with sem:
            return await engine.complete(p, params, return_hidden_states=hs)

    t0 = time.perf_counter()
    out = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0, out


async def _method(method: str, model_dir: str, args) -> dict:
    from hidden_states.vllm.engine import HiddenStatesEngine

    spec = (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
        if method == "ngram"
        else {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3}
    )
    engine = await HiddenStatesEngine.start(model_dir, speculative_config=spec, **ENGINE_ARGS)
    try:
        await _arm(engine, _prompts(args.requests, 999), True, args.concurrency, args.max_tokens)  # warm-up
        arms = ["off", "on", "off2"]
        walls: dict[str, list[tuple[int, float]]] = {a: [] for a in arms}
        vias: dict[str, int] = {}
        computed: list[int] = []
        s0, d0, a0 = _spec_counts()
        for r in range(args.rounds):
            prompts = _prompts(args.requests, r)
            for arm in arms[r % 3 :] + arms[: r % 3]:
                wall, out = await _arm(engine, prompts, arm == "on", args.concurrency, args.max_tokens)
                walls[arm].append((len(out), wall))
                if arm == "on":
                    for c in out:
                        for ch in c.choices:
                            vias[ch.extraction.via] = vias.get(ch.extraction.via, 0) + 1
                            computed.append(ch.extraction.computed_tokens)
        s1, d1, a1 = _spec_counts()
        steps = s1 - s0
        rate = {a: sum(n for n, _ in w) / sum(t for _, t in w) for a, w in walls.items()}
        return {
            "method": method,
            "rounds": args.rounds,
            "requests_per_round": args.requests,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "req_per_s": rate,
            "on_over_off": rate["on"] / rate["off"],
            "on_over_off_ci95": paired_ratio_ci(walls["on"], walls["off"]),
            "aa_over_off": rate["off2"] / rate["off"],
            "aa_over_off_ci95": paired_ratio_ci(walls["off2"], walls["off"]),
            "vectors": len(computed),
            "via": vias,
            "computed_tokens_per_vector": {"mean": statistics.fmean(computed), "max": max(computed)},
            "accepted_per_verify_step": (a1 - a0) / steps if steps else None,
            "draft_acceptance_rate": (a1 - a0) / (d1 - d0) if d1 > d0 else None,
        }
    finally:
        engine.shutdown()


def _methods(args) -> list[dict]:
    """Each method of `--methods` in turn, on the tiny model."""
    from hidden_states.models.builtin import build

    model_dir = str(build("tiny-llama"))
    return [asyncio.run(_method(m, model_dir, args)) for m in args.methods.split(",")]


def _summary(args, results: list[dict]) -> list[str]:
    lines = [
        f"# Hidden states under speculative decoding (tiny model, {args.rounds} rounds x {args.requests} "
        f"requests, c={args.concurrency}, {args.max_tokens} tokens each, 3 draft tokens)",
        "| drafter | on/off req/s (95% CI) | A/A off2/off (95% CI) | vectors | via | computed tokens per vector "
        "(mean, max) | accepted drafts per verify step | acceptance rate |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        acc = r["accepted_per_verify_step"]
        rate = r["draft_acceptance_rate"]
        lines.append(
            f"| {r['method']} | {ratio_text(r, 'on_over_off')} | {ratio_text(r, 'aa_over_off')} | "
            f"{r['vectors']} | {r['via']} | "
            f"{r['computed_tokens_per_vector']['mean']:.2f}, {r['computed_tokens_per_vector']['max']} | "
            f"{'-' if acc is None else f'{acc:.2f}'} | {'-' if rate is None else f'{rate:.2f}'} |"
        )
    return lines


def main() -> None:
    bench_main(
        "bench.spec",
        __doc__,
        _methods,
        _summary,
        name="spec-tiny",
        first=("--methods", "ngram,draft_model"),
        requests=16,
        max_tokens=48,
    )


if __name__ == "__main__":
    main()
