"""TOPLOC proofs on the server: throughput with proofs on vs off, their size, and the validation's cost.

    .venv/bin/python -m bench.proofs [--rounds 6] [--concurrency 8,32] [--requests 32] [--max-tokens 64] \
        [--name proofs-smollm2]

One engine (HiddenStatesEngine, SmolLM2-135M-Instruct in float32, synchronous scheduling), no
Ray. Per concurrency, each round runs three arms in a rotating order on the same request mix
(greedy, ignore_eos, different prompts per round): `off` (no hidden states), `on`
(hidden_states_proof: TOPLOC, top-128, 32 decode tokens per proof), and `off2` (off again: the
A/A control, whose ratio to off is the noise floor). Throughput ratio = requests per second of
an arm over off's, pooled over rounds, with a 95% bootstrap interval over paired rounds. Also:
the proofs' bytes per 32 tokens (raw and base64), CPU per request in each arm in this process
(the frontend: proofs are built here) and in its children (vLLM's engine core and worker: the
rows' top-k and their copies), the work wall time on 2 cores cannot settle, and the validation
(POST /v1/hidden_states with compare.toploc, through the engine's OpenAI routes) per 1,000 tokens
against a plain prefill of the same tokens (max_tokens 1, nothing asked). Prints and writes
bench/results/<name>.{json,md}.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time

from bench.measure import paired_ratio_ci
from bench.report import bench_main, ratio_text

MODEL = "builtin:smollm2-135m-instruct"
ENGINE_ARGS = {
    "dtype": "float32",
    "enforce_eager": True,
    "kv_cache_memory_bytes": 2**30,
    "max_model_len": 4096,
    "max_num_batched_tokens": 512,
    "block_size": 32,
}
PROOF = {"scheme": "toploc", "topk": 128, "decode_batching_size": 32}
WORDS = (
    "the replica cache step token vector router engine prefix hidden state model batch proof verifier "
    "window chunk polynomial"
).split()


def _prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["Write about " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) for _ in range(n)]


async def _arm(engine, prompts, proof: bool, concurrency: int, max_tokens: int):
    from vllm import SamplingParams

    sem = asyncio.Semaphore(concurrency)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(p):
        async with sem:
            return await engine.complete(p, params, return_hidden_states=False, proof=PROOF if proof else None)

    t0, c0, e0 = time.perf_counter(), time.process_time(), _engine_cpu_s()
    out = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0, time.process_time() - c0, _engine_cpu_s() - e0, out


def _engine_cpu_s() -> float:
    """CPU seconds (user + system) of this process's children: vLLM's engine core and its worker."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


async def _validation(engine, routes, outs) -> dict:
    """compare.toploc per 1,000 tokens against a plain prefill of the same tokens."""
    from vllm import SamplingParams

    check_s, prefill_s, tokens = 0.0, 0.0, 0
    for c in outs:
        ch = c.choices[0]
        prompt, completion = list(c.prompt_token_ids), list(ch.token_ids)
        body = json.dumps(
            {"prompt": prompt, "completion": completion, "compare": {"toploc": {**PROOF, "proofs": list(ch.proofs)}}}
        ).encode()
        t0 = time.perf_counter()
        async for status, raw in routes.handle("hidden_states", body):
            assert status == 200 and json.loads(raw)["comparison"]["ok"], raw[:300]
        check_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        await engine.complete(
            prompt + completion[:-1], SamplingParams(max_tokens=1, temperature=0.0), return_hidden_states=False
        )
        prefill_s += time.perf_counter() - t0
        tokens += len(prompt) + len(completion) - 1
    return {
        "sequences": len(outs),
        "tokens": tokens,
        "validate_s_per_1k_tokens": 1000 * check_s / tokens,
        "plain_prefill_s_per_1k_tokens": 1000 * prefill_s / tokens,
        "validate_over_prefill": check_s / prefill_s,
    }


async def _run(args) -> dict:
    from hidden_states.vllm.engine import HiddenStatesEngine

    engine = await HiddenStatesEngine.start(MODEL, **ENGINE_ARGS)
    try:
        routes = await engine.openai("smollm2", "bench")
        await _arm(engine, _prompts(args.requests, 999), True, 8, args.max_tokens)  # warm-up
        per_c, last = [], None
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            arms = ["off", "on", "off2"]
            walls: dict[str, list[tuple[int, float]]] = {a: [] for a in arms}
            cpu: dict[str, float] = {a: 0.0 for a in arms}
            engine_cpu: dict[str, float] = {a: 0.0 for a in arms}
            proof_bytes, proofs, decode_tokens = 0, 0, 0
            for r in range(args.rounds):
                prompts = _prompts(args.requests, 1000 * concurrency + r)
                for arm in arms[r % 3 :] + arms[: r % 3]:
                    wall, cpu_s, engine_s, out = await _arm(engine, prompts, arm == "on", concurrency, args.max_tokens)
                    walls[arm].append((len(out), wall))
                    cpu[arm] += cpu_s
                    engine_cpu[arm] += engine_s
                    if arm == "on":
                        last = out
                        for c in out:
                            ch = c.choices[0]
                            proofs += len(ch.proofs)
                            proof_bytes += sum(len(base64.b64decode(p)) for p in ch.proofs)
                            decode_tokens += len(ch.token_ids)
            rate = {a: sum(n for n, _ in w) / sum(t for _, t in w) for a, w in walls.items()}
            n = args.rounds * args.requests
            per_c.append(
                {
                    "concurrency": concurrency,
                    "req_per_s": rate,
                    "on_over_off": rate["on"] / rate["off"],
                    "on_over_off_ci95": paired_ratio_ci(walls["on"], walls["off"]),
                    "aa_over_off": rate["off2"] / rate["off"],
                    "aa_over_off_ci95": paired_ratio_ci(walls["off2"], walls["off"]),
                    "frontend_cpu_ms_per_request": {a: 1000 * cpu[a] / n for a in arms},
                    "engine_cpu_ms_per_request": {a: 1000 * engine_cpu[a] / n for a in arms},
                    "proofs": proofs,
                    "proof_bytes_raw": proof_bytes // max(proofs, 1),
                    "proof_bytes_base64": 4 * -(-(proof_bytes // max(proofs, 1)) // 3),
                    "bytes_per_32_tokens": 32 * proof_bytes / max(decode_tokens, 1),
                }
            )
        validation = await _validation(engine, routes, last[:8])
        return {
            "model": MODEL,
            "rounds": args.rounds,
            "requests_per_round": args.requests,
            "max_tokens": args.max_tokens,
            "proof": PROOF,
            "by_concurrency": per_c,
            "validation": validation,
        }
    finally:
        engine.shutdown()


def _summary(args, r: dict) -> list[str]:
    v = r["validation"]
    lines = [
        f"# TOPLOC proofs on the server (SmolLM2-135M-Instruct, float32, {args.rounds} rounds x "
        f"{args.requests} requests, {args.max_tokens} tokens each; top-128, 32 tokens per proof)",
        "| c | proofs on/off req/s (95% CI) | A/A off2/off (95% CI) | frontend CPU ms/request off, on, off2 | "
        "engine CPU ms/request off, on, off2 | bytes per proof (raw, base64) | bytes per 32 tokens |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in r["by_concurrency"]:
        cpu, eng = c["frontend_cpu_ms_per_request"], c["engine_cpu_ms_per_request"]
        lines.append(
            f"| {c['concurrency']} | {ratio_text(c, 'on_over_off')} | {ratio_text(c, 'aa_over_off')} | "
            f"{cpu['off']:.1f}, {cpu['on']:.1f}, {cpu['off2']:.1f} | "
            f"{eng['off']:.1f}, {eng['on']:.1f}, {eng['off2']:.1f} | "
            f"{c['proof_bytes_raw']}, {c['proof_bytes_base64']} | {c['bytes_per_32_tokens']:.0f} |"
        )
    lines += [
        "",
        f"Validation (compare.toploc, {v['sequences']} sequences, {v['tokens']} tokens): "
        f"{v['validate_s_per_1k_tokens']:.3f} s per 1,000 tokens against a plain prefill's "
        f"{v['plain_prefill_s_per_1k_tokens']:.3f} s ({v['validate_over_prefill']:.2f}x).",
    ]
    return lines


def main() -> None:
    bench_main(
        "bench.proofs", __doc__, _run, _summary, name="proofs-smollm2", concurrency="8,32", requests=32, max_tokens=64
    )


if __name__ == "__main__":
    main()
