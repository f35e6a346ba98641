"""The engine's per-feature benches: one harness, each bench a declaration of engines and arms.

    .venv/bin/python -m bench.arms BENCH [--rounds N] [--max-tokens N] [--concurrency 8,32] \
        [--requests N] [--name NAME]        # BENCH: one of BENCHES below; `--list` names them

One process, no Ray: each declared engine is started in turn and requests go through vLLM's own OpenAI serving
over it. Each round runs every arm at every concurrency in a rotating order on fresh prompts, every completion
`--max-tokens` long; an arm with `half` sets its fields on every other request. Per arm: tokens per second and its
ratio over the arm's base with a 95% bootstrap interval over paired rounds (an arm equal to another, `off2`, is
the A/A control); the workers' counters' change; CPU per request by process (frontend, engine); per vector `via`
and `computed_tokens`. Writes bench/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean

import numpy as np
import psutil

from bench.measure import ci_text, paired_ratio_ci
from bench.procs import RESULTS, command_line, write_results

SMOLLM2 = "builtin:smollm2-135m-instruct"
ENGINE = {
    "dtype": "float32",
    "kv_cache_memory_bytes": 512 * 2**20,
    "max_model_len": 1024,
    "max_num_batched_tokens": 512,
}
EAGER, COMPILED = {**ENGINE, "enforce_eager": True}, {**ENGINE, "enforce_eager": False}
WORDS = "river stone light market engine garden signal paper winter music replica router vector".split()
SETTLE_S = 1.5  # the engine that ran last stops busy-waiting (vLLM's SpinCondition) before the next arm


@dataclass(frozen=True)
class Model:
    """What declarations are drawn from: the model's width and depth, and a folder for made files."""

    d: int
    layers: int
    folder: str

    def spread(self, n: int) -> list[int]:
        """n layers spread from 1 to the last (`hidden_states_layers` numbering)."""
        return sorted({int(x) for x in np.linspace(1, self.layers - 1, n)})

    def steering(self, layers: list[int]) -> list[dict]:
        rng = np.random.default_rng(0)
        vec = [(rng.normal(size=self.d) * 2).astype("<f4") for _ in layers]
        return [{"layer": lay, "vector": base64.b64encode(v.tobytes()).decode()} for lay, v in zip(layers, vec)]

    def sae(self, layer: int, per_d: int = 8, k: int = 32) -> dict:
        """A top-k SAE saved by SAELens (random weights, fixed seed): per_d x D features."""
        import torch
        from sae_lens import TopKSAE, TopKSAEConfig

        torch.manual_seed(0)
        path = os.path.join(self.folder, "sae")
        cfg = TopKSAEConfig(d_in=self.d, d_sae=per_d * self.d, k=k, dtype="float32", device="cpu")
        cfg.metadata.hook_name = f"blocks.{layer - 1}.hook_resid_post"
        TopKSAE(cfg).save_model(path)
        return {"name": "sae", "path": path}

    def probe(self, layer: int, labels=("neg", "neutral", "pos")) -> dict:
        """A linear softmax probe (safetensors, random weights, fixed seed)."""
        from tests.heads_ref import make_linear

        path = make_linear(os.path.join(self.folder, "probe.safetensors"), self.d, len(labels), 0)
        return {"name": "probe", "path": path, "layer": layer, "activation": "softmax", "labels": list(labels)}


@dataclass(frozen=True)
class Arm:
    name: str
    engine: str = "main"
    fields: dict | Callable[[Model], dict] = field(default_factory=dict)  # API fields its requests carry
    half: bool = False  # the fields on every other request only
    over: tuple[str, ...] = ()  # the arms its ratios are over; none: the bench's first arm


@dataclass(frozen=True)
class Bench:
    doc: str
    engines: dict[str, Callable[[Model], dict]]  # name -> HiddenStatesEngine.start keywords
    arms: tuple[Arm, ...]
    model: str = SMOLLM2
    rounds: int = 6
    max_tokens: int = 32
    levels: dict[int, int] = field(default_factory=lambda: {8: 16, 32: 64})  # concurrency -> requests a round
    images: bool = False  # chats with one image each (chat/completions) instead of text prompts


def _rows(layers, dtype="float32") -> dict:
    return {
        "return_hidden_states": True,
        "hidden_states_position": "completion",
        "hidden_states_layers": layers,
        "hidden_states_dtype": dtype,
        "hidden_states_encoding": "base64",
    }


def _plain(m: Model) -> dict:
    """The server without the feature (hidden states off), on the engine arguments the other resolves to."""
    from hidden_states.vllm.engine_args import with_defaults

    return {**with_defaults(EAGER, True, True), "enable_return_hidden_states": False}


def _features(m: Model) -> dict:
    """Rows at two static layers at every completion position, the probe there, steering at two others."""
    s = m.spread(4)
    return {**_rows(s[-2:]), "hidden_states_heads": [{"name": "probe"}], "hidden_states_steering": m.steering(s[:2])}


def _stages(m: Model) -> dict:
    """Rows at a layer of each of two pipeline stages at every completion position, steering at another of each."""
    return {
        **_rows([m.layers // 6, m.layers - 5]),
        "hidden_states_steering": m.steering([m.layers // 10, m.layers - 8]),
    }


PP2 = {**EAGER, "pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}
NEVER = [{"head": "sae", "feature": 0, "above": 1e9}, {"head": "probe", "label": "pos", "above": 1.5}]
SAE32 = {"hidden_states_heads": [{"name": "sae", "topk": 32}], "hidden_states_position": "completion"}
PROOF = {"scheme": "toploc", "topk": 128, "decode_batching_size": 32}
SPEC = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},  # the target itself drafts
}


def _spec(method: str) -> Bench:
    def engine(m: Model) -> dict:
        from hidden_states.models.builtin import resolve_model

        spec = SPEC[method] | ({"model": resolve_model("builtin:tiny-llama")} if method == "draft_model" else {})
        return {**EAGER, "block_size": 32, "speculative_config": spec}

    return Bench(
        f"hidden states under speculative decoding ({method}, 3 draft tokens): on vs off, positions per vector",
        {"main": engine},
        (Arm("off"), Arm("on", fields={"return_hidden_states": True}), Arm("off2")),
        model="builtin:tiny-llama",
        rounds=10,
        max_tokens=48,
        levels={8: 24},
    )


BENCHES: dict[str, Bench] = {
    "compiled": Bench(
        "compiled against eager on the CPU; the static layer set (4 layers, a head) nobody asks; the features",
        {
            "eager": lambda m: EAGER,
            "compiled": lambda m: COMPILED,
            "traced": lambda m: {**COMPILED, "capture_layers": m.spread(4), "heads": [m.probe(m.spread(4)[-1])]},
        },
        (
            Arm("eager", "eager"),
            Arm("compiled", "compiled"),
            Arm("traced", "traced", over=("eager", "compiled")),
            Arm("features", "traced", _features, half=True, over=("eager", "compiled")),
            Arm("eager2", "eager"),
            Arm("compiled2", "compiled", over=("eager", "compiled")),
        ),
        rounds=5,
        levels={1: 4, 8: 16, 32: 64},
    ),
    "rows": Bench(
        "rows at every completion position at 2 static layers in half of each batch, on the compiled engine",
        {"main": lambda m: {**COMPILED, "capture_layers": m.spread(4)[-2:]}},
        (Arm("off"), Arm("rows", fields=lambda m: _rows(m.spread(4)[-2:]), half=True), Arm("off2")),
        rounds=8,
    ),
    "heads": Bench(
        "an SAE head's top-32 features vs float16 rows of the same positions (every completion position)",
        {"main": lambda m: {**EAGER, "heads": [m.sae(15)]}},
        (
            Arm("off"),
            Arm("rows16", fields=_rows([15], "float16")),
            Arm("sae32", fields=SAE32, over=("off", "rows16")),
            Arm("off2"),
            Arm("both", fields=_rows([15], "float16") | SAE32),
        ),
        rounds=8,
        levels={8: 24},
    ),
    "steering": Bench(
        "half the batch steers at 4 layers; `plain` is the server without the feature (hidden states off)",
        {"plain": _plain, "main": lambda m: EAGER},
        (
            Arm("off"),
            Arm("plain", "plain"),
            Arm("half", fields=lambda m: {"hidden_states_steering": m.steering(m.spread(4))}, half=True),
            Arm("off2"),
        ),
        rounds=8,
        levels={8: 24},
    ),
    "monitors": Bench(
        "stop conditions on two heads (never holding) in half the batch: throughput, host copies counted",
        {"main": lambda m: {**EAGER, "heads": [m.sae(15), m.probe(22)]}},
        (Arm("off"), Arm("half", fields={"hidden_states_stop": NEVER}, half=True), Arm("off2")),
        rounds=12,
        levels={8: 16},
    ),
    "proofs": Bench(
        "TOPLOC proofs on vs off, CPU per request by process (proofs are built in the frontend)",
        {"main": lambda m: {**EAGER, "kv_cache_memory_bytes": 2**30, "max_model_len": 4096, "block_size": 32}},
        (Arm("off"), Arm("proofs", fields={"hidden_states_proof": PROOF}), Arm("off2")),
        max_tokens=64,
        levels={8: 32, 32: 32},
    ),
    "multimodal": Bench(
        "image chats: the vector on vs off, and from the extraction step (a stop string that never matches)",
        {"main": lambda m: {**EAGER, "kv_cache_memory_bytes": 256 * 2**20}},
        (
            Arm("off"),
            Arm("on", fields={"return_hidden_states": True}),
            Arm("off2"),
            Arm("extract", fields={"return_hidden_states": True, "stop": ["never in this text"]}),
        ),
        model="builtin:tiny-llava",
        levels={8: 24},
        images=True,
    ),
    "pipeline": Bench(
        "pipeline parallelism 2 against one stage, features off and on (rows at a layer of each stage at every "
        "completion position, steering at a layer of each); the rows sent between the stages counted",
        {"pp1": lambda m: EAGER, "pp2": lambda m: PP2},
        (
            Arm("pp1", "pp1"),
            Arm("pp1-features", "pp1", _stages),
            Arm("pp2", "pp2"),
            Arm("pp2-features", "pp2", _stages, over=("pp1", "pp2")),
            Arm("pp1-again", "pp1"),
        ),
        rounds=5,
        levels={8: 16},
    ),
    "spec-ngram": _spec("ngram"),
    "spec-draft": _spec("draft_model"),
}


def _image_chat(seed: int, i: int) -> list[dict]:
    """A user's message of one random picture (PNG, drawn from `seed`) and a question about it."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(seed).random((30, 40, 3)) * 255).astype("uint8")).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": f"What is in picture {i}?"}]
    return [{"role": "user", "content": content}]


def bodies(bench: Bench, n: int, seed: int, max_tokens: int) -> list[dict]:
    """n fresh requests (prompts drawn from `seed`) without the arms' fields."""
    rng = np.random.default_rng(seed)
    base = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if bench.images:
        return [base | {"messages": _image_chat(seed * 1000 + i, i)} for i in range(n)]
    return [base | {"prompt": f"Story {seed}-{i}: the " + " ".join(rng.choice(WORDS, 6))} for i in range(n)]


def rotated(arms: list, r: int) -> list:
    """Round r's order of the arms: rotated by r, so that each goes first in turn."""
    return arms[r % len(arms) :] + arms[: r % len(arms)]


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def cpu_s(pids: set[int]) -> dict[str, float]:
    """CPU seconds (user + system) by role: this process (the frontend), and the arm's engine's processes (the
    children its start added: vLLM's engine core and worker; not the other engines' idle ones)."""
    t = psutil.Process().cpu_times()
    engine = 0.0
    for pid in pids:
        try:
            c = psutil.Process(pid).cpu_times()
            engine += c.user + c.system
        except psutil.Error:
            pass
    return {"frontend": t.user + t.system, "engine": engine}


def summed(workers: list[dict]) -> Counter:
    """The engine's own counters: every number in its workers' stats, summed over workers."""
    total: Counter = Counter()
    for w in workers:
        total.update({k: v for k, v in w.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return total


async def counters(engine) -> Counter:
    return summed((await engine.stats())["workers"] if engine.enabled else [])


async def run_arm(engine, pids, frontend, route: str, reqs: list[dict], fields: dict, half: bool, concurrency: int):
    """The requests at `concurrency`: (completion tokens, wall s, CPU s by role, counters' change, vectors' via
    and computed tokens)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i, body):
        async with sem:
            raw = json.dumps(body | ({} if half and i % 2 else fields)).encode()
            async with asyncio.timeout(600):
                (status, out), *_ = [x async for x in frontend.handle(route, raw)]
            if status != 200:
                raise RuntimeError(f"{route} answered {status}: {out[:300]!r}")
            return json.loads(out)

    c0, cpu0 = await counters(engine), cpu_s(pids)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(i, b) for i, b in enumerate(reqs)))
    wall = time.perf_counter() - t0
    cpu1, c1 = cpu_s(pids), await counters(engine)
    vectors = [
        (m.get("via"), m.get("computed_tokens"))
        for o in outs
        for ch in o["choices"]
        if (m := ch.get("hidden_states_meta") or o.get("hidden_states_meta") or {}).get("via")
    ]
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    work = {k: c1[k] - c0.get(k, 0) for k in c1 if c1[k] != c0.get(k, 0)}
    return tokens, wall, {k: cpu1[k] - cpu0[k] for k in cpu0}, work, vectors


def model_of(name: str, folder: str) -> Model:
    from transformers import AutoConfig

    from hidden_states.models.builtin import resolve_model

    cfg = AutoConfig.from_pretrained(resolve_model(name))
    cfg = getattr(cfg, "text_config", None) or cfg
    return Model(cfg.hidden_size, cfg.num_hidden_layers, folder)


async def measure(bench: Bench, args, folder: str) -> dict:
    from hidden_states.vllm.engine import HiddenStatesEngine

    m = model_of(args.model, folder)
    levels = {c: args.requests or n for c, n in bench.levels.items() if not args.concurrency or c in args.concurrency}
    route = "chat/completions" if bench.images else "completions"
    engines, frontends, starts, pids = {}, {}, {}, {}
    try:
        for name, kwargs in bench.engines.items():
            before, t0 = children(), time.perf_counter()
            engines[name] = await asyncio.wait_for(HiddenStatesEngine.start(args.model, warm_up_s=0, **kwargs(m)), 900)
            starts[name] = time.perf_counter() - t0
            pids[name] = children() - before - set().union(*pids.values())
            frontends[name] = await engines[name].openai("m", "bench")
        fields = {a.name: a.fields(m) if callable(a.fields) else a.fields for a in bench.arms}

        async def run(a: Arm, c: int, n: int, seed: int):
            reqs, e = bodies(bench, n, seed, args.max_tokens), a.engine
            return await run_arm(engines[e], pids[e], frontends[e], route, reqs, fields[a.name], a.half, c)

        for a in bench.arms:  # warm-up: each arm's kernels at each batch size once
            for c, n in levels.items():
                await run(a, c, n, 10**6 + c)
        rows = {(a.name, c): [] for a in bench.arms for c in levels}
        arms = list(bench.arms)
        for r in range(args.rounds):
            for k, a in enumerate(rotated(arms, r)):
                for c, n in levels.items():
                    await asyncio.sleep(SETTLE_S)
                    got = await run(a, c, n, 1000 * (r * len(arms) + k) + c)
                    rows[(a.name, c)].append((n, *got))
                    print(f"round {r} {a.name} c={c}: {got[0] / got[1]:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        for e in engines.values():
            e.shutdown()
    return summarize(bench, args, rows, starts, fields)


def summarize(bench: Bench, args, rows: dict, starts: dict, fields: dict) -> dict:
    """Per arm and concurrency: tok/s pooled over rounds, its ratio over its base with the interval, counters,
    CPU ms per request by role, vectors."""
    first = (bench.arms[0].name,)
    out = {"bench": args.bench, "model": args.model, "rounds": args.rounds, "max_tokens": args.max_tokens}
    out |= {"start_s": starts, "fields": {k: _short(v) for k, v in fields.items()}, "arms": {}}
    for a in bench.arms:
        for c in sorted({c for _, c in rows}):
            got = rows[(a.name, c)]
            requests = sum(g[0] for g in got)
            pairs = [(g[1], g[2]) for g in got]
            ts = [t for g in got for _, t in g[5] if t is not None]  # positions computed per vector
            cell = {
                "requests": requests,
                "tok_per_s": sum(t for t, _ in pairs) / sum(w for _, w in pairs),
                "over": {},
                "cpu_ms_per_request": {k: 1000 * sum(g[3][k] for g in got) / requests for k in got[0][3]},
                "work": dict(sum((Counter(g[4]) for g in got), Counter())),
                "via": dict(Counter(v for g in got for v, _ in g[5])),
                "computed_tokens_per_vector": fmean(ts) if ts else None,
            }
            for b in a.over or first:
                base = [(g[1], g[2]) for g in rows[(b, c)]]
                rate = sum(t for t, _ in base) / sum(w for _, w in base)
                cell["over"][b] = {"ratio": cell["tok_per_s"] / rate, "ci95": paired_ratio_ci(pairs, base)}
            out["arms"][f"{a.name}@{c}"] = cell
    return out


def _short(v):
    """Fields as recorded: steering vectors' bytes left out."""
    if isinstance(v, dict):
        return {k: ("<base64>" if k == "vector" else _short(x)) for k, x in v.items()}
    return [_short(x) for x in v] if isinstance(v, list) else v


def markdown(bench: Bench, r: dict, command: str) -> str:
    lines = [
        f"# {r['bench']}: {bench.doc}",
        "",
        f"`{command}`",
        "",
        f"{r['model']}, {r['rounds']} rounds, {r['max_tokens']} tokens per completion; engine starts "
        + ", ".join(f"{k} {v:.1f} s" for k, v in r["start_s"].items())
        + ". Ratios over the arm named, 95% percentile-bootstrap intervals over paired rounds.",
        "",
        "| arm | c | tok/s | ratio (95% CI) | CPU ms/request frontend, engine | positions per vector | work counted |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, x in r["arms"].items():
        arm, c = key.split("@")
        ratio = "; ".join(
            "1" if b == arm else f"{o['ratio']:.3f} ({ci_text(o['ci95'])}) over {b}" for b, o in x["over"].items()
        )
        cpu = ", ".join(f"{v:.1f}" for v in x["cpu_ms_per_request"].values())
        per = x["computed_tokens_per_vector"]
        per = "-" if per is None else f"{per:.2f} ({x['via']})"
        work = ", ".join(f"{k} {v:g}" for k, v in sorted(x["work"].items()))
        lines.append(f"| {arm} | {c} | {x['tok_per_s']:.1f} | {ratio} | {cpu} | {per} | {work or '-'} |")
    lines += ["", "Fields per arm (`half`: every other request):", "", "```json", json.dumps(r["fields"]), "```"]
    return "\n".join(lines) + "\n"


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.arms", description=__doc__.split("\n\n")[0])
    p.add_argument("bench", nargs="?", choices=sorted(BENCHES))
    p.add_argument("--list", action="store_true", help="name each bench and what it measures")
    p.add_argument("--model", help="the bench's own by default")
    p.add_argument("--rounds", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], help="a subset of its levels")
    p.add_argument("--requests", type=int, help="requests per round at every concurrency")
    p.add_argument("--name", help="results file name (default: the bench's name)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if not args.list and not args.bench:
        p.error("name a bench (or --list)")
    if args.bench:
        b = BENCHES[args.bench]
        args.model = args.model or b.model
        args.rounds = args.rounds or b.rounds
        args.max_tokens = args.max_tokens or b.max_tokens
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.list:
        for name, b in BENCHES.items():
            print(f"{name}: {b.doc}; arms {', '.join(a.name for a in b.arms)}")
        return 0
    from bench.servers import ENGINE_ENV

    os.environ.update(ENGINE_ENV)
    bench = BENCHES[args.bench]
    command = command_line("bench.arms", argv)
    with tempfile.TemporaryDirectory(prefix="bench-arms-") as folder:
        r = asyncio.run(measure(bench, args, folder))
    r["command"] = command
    write_results(args.out, args.name or args.bench, r, markdown(bench, r, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
