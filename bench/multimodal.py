"""Image chats with vectors on vs off: throughput beside an A/A control, and the work counted.

    .venv/bin/python -m bench.multimodal [--model builtin:tiny-llava] [--rounds 6] [--concurrency 8] \
        [--requests 24] [--max-tokens 32] [--name multimodal-tiny-llava]

One engine (HiddenStatesEngine, float32, synchronous scheduling), no Ray. Requests go through the
engine's OpenAI chat route (vLLM's own chat serving, as a replica's): each a user message with one
image (a distinct random PNG per request and round, 40x30, as a data URL) and a question. Each
round runs four arms in a rotating order on the same requests: `off` (no hidden states), `on`
(return_hidden_states: the tail step), `off2` (off again: the A/A control) and `extract` (on, with
a stop string that never matches: every vector by the extraction step). Throughput ratio =
requests per second of an arm over off's, pooled over rounds, 95% bootstrap interval over paired
rounds. Counted, not timed: the positions computed per vector (hidden_states_meta.computed_tokens)
and the images the vision encoder embedded per request (the workers' `encoder_items`): an
extraction step must add no encoder pass. Prints and writes bench/results/<name>.{json,md}.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time

import numpy as np

from bench.measure import paired_ratio_ci
from bench.report import bench_main, ratio_text

ENGINE_ARGS = {
    "dtype": "float32",
    "enforce_eager": True,
    "kv_cache_memory_bytes": 256 * 2**20,
    "max_model_len": 1024,
    "max_num_batched_tokens": 512,
}
ARMS = ("off", "on", "off2", "extract")
FIELDS = {
    "off": {},
    "off2": {},
    "on": {"return_hidden_states": True},
    "extract": {"return_hidden_states": True, "stop": ["never in this text"]},
}


def _image_url(seed: int) -> str:
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((30, 40, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _bodies(n: int, seed: int, max_tokens: int) -> list[dict]:
    return [
        {
            "model": "vlm",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": _image_url(seed + i)}},
                        {"type": "text", "text": f"What is in picture {i}?"},
                    ],
                }
            ],
        }
        for i in range(n)
    ]


async def _encoder_items(engine) -> int:
    return sum(w.get("encoder_items", 0) for w in (await engine.stats())["workers"])


async def _arm(engine, frontend, bodies, arm: str, concurrency: int):
    sem = asyncio.Semaphore(concurrency)

    async def one(body):
        async with sem:
            raw = json.dumps({**body, **FIELDS[arm]}).encode()
            (status, out), *_ = [x async for x in frontend.handle("chat/completions", raw)]
            assert status == 200, out[:300]
            return json.loads(out)

    e0 = await _encoder_items(engine)
    t0 = time.perf_counter()
    out = await asyncio.gather(*(one(b) for b in bodies))
    wall = time.perf_counter() - t0
    return wall, await _encoder_items(engine) - e0, out


async def _run(args) -> dict:
    from hidden_states.vllm.engine import HiddenStatesEngine

    engine = await HiddenStatesEngine.start(args.model, **ENGINE_ARGS)
    try:
        frontend = await engine.openai("vlm", "bench")
        await _arm(engine, frontend, _bodies(args.requests, 10**6, args.max_tokens), "on", args.concurrency)  # warm-up
        walls: dict[str, list[tuple[int, float]]] = {a: [] for a in ARMS}
        encoded = {a: 0 for a in ARMS}
        computed = {a: [] for a in ARMS}
        for r in range(args.rounds):
            for k, arm in enumerate(ARMS[r % 4 :] + ARMS[: r % 4]):
                # fresh images per arm: no arm finds another's images in the encoder or prefix cache
                bodies = _bodies(args.requests, 1000 * (r * 4 + k), args.max_tokens)
                wall, items, out = await _arm(engine, frontend, bodies, arm, args.concurrency)
                walls[arm].append((len(out), wall))
                encoded[arm] += items
                for o in out:
                    meta = o["choices"][0].get("hidden_states_meta")
                    if meta is not None:
                        computed[arm].append(meta["computed_tokens"])
        n = args.rounds * args.requests
        rate = {a: sum(c for c, _ in w) / sum(t for _, t in w) for a, w in walls.items()}
        return {
            "model": args.model,
            "rounds": args.rounds,
            "requests_per_round": args.requests,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "req_per_s": rate,
            **{f"{a}_over_off": rate[a] / rate["off"] for a in ("on", "off2", "extract")},
            **{f"{a}_over_off_ci95": paired_ratio_ci(walls[a], walls["off"]) for a in ("on", "off2", "extract")},
            "encoder_items_per_request": {a: encoded[a] / n for a in ARMS},
            "computed_positions_per_vector": {a: (float(np.mean(v)) if v else None) for a, v in computed.items()},
        }
    finally:
        engine.shutdown()


def _summary(args, r: dict) -> list[str]:
    enc, pos = r["encoder_items_per_request"], r["computed_positions_per_vector"]
    lines = [
        f"# Image chats with vectors on vs off ({args.model}, float32, {args.rounds} rounds x {args.requests} "
        f"requests at concurrency {args.concurrency}, one image and {args.max_tokens} tokens each)",
        "| arm | req/s | over off (95% CI) | images encoded per request | positions computed per vector |",
        "| --- | --- | --- | --- | --- |",
    ]
    for a in ARMS:
        ratio = "1" if a == "off" else ratio_text(r, f"{a}_over_off")
        p = "-" if pos[a] is None else f"{pos[a]:.2f}"
        lines.append(f"| {a} | {r['req_per_s'][a]:.2f} | {ratio} | {enc[a]:.2f} | {p} |")
    lines += [
        "",
        "`off2` is `off` again (the A/A control: its interval is the noise floor); `extract` takes the "
        "extraction step for every vector (a stop string that never matches).",
    ]
    return lines


def main() -> None:
    bench_main(
        "bench.multimodal",
        __doc__,
        _run,
        _summary,
        name="multimodal-tiny-llava",
        first=("--model", "builtin:tiny-llava"),
    )


if __name__ == "__main__":
    main()
