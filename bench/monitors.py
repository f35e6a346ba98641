"""Stop conditions (hidden_states_stop) on half a batch: throughput beside an A/A control, and the
host round trips they add, counted.

    .venv/bin/python -m bench.monitors [--model builtin:smollm2-135m-instruct] [--rounds 6] \
        [--concurrency 8] [--requests 16] [--max-tokens 32] [--features 8] [--layer 15] [--name monitors-smollm2]

One engine (HiddenStatesEngine, float32, eager, synchronous scheduling), no Ray, with two heads
registered: a top-k SAE (bench.heads.make_sae: SAELens's format, random weights, `--features` x D
features) at this server's layer `--layer`, and a linear probe (3 classes, softmax) after the final
norm. Requests go through the engine's OpenAI completions route (vLLM's own serving), `ignore_eos`,
every completion `--max-tokens` long, each round running three arms in a rotating order:
- `off`: no fields;
- `half`: every other request carries two stop conditions, an SAE feature's and the probe's, whose
  thresholds no score reaches (a feature above 1e9, a softmax score above 2), so every completion
  stays `--max-tokens` long and the arms do the same token work: what is measured is the judging;
- `off2`: off again, the A/A control.
Throughput ratio = requests per second over off's, pooled over rounds, 95% bootstrap interval over
paired rounds. Counted, not timed, from the workers' counters: forward steps, steps with rows to
send, device-to-host copies, the heads' matrix products and rows; so copies per step (at most one:
the scores ride the step's one copy, which the engine core reads with the step's output) and rows
scored per monitored token. Then a short run whose probe condition holds (class 0 above 0.5): the
completion tokens it generated against max_tokens. Prints and writes bench/results/<name>.{json,md}.
"""

from __future__ import annotations

import asyncio
import os
import tempfile

from bench.heads import ENGINE_ARGS, _arm, _prompts, make_sae
from bench.measure import paired_ratio_ci
from bench.report import bench_main, ratio_text

ARMS = ("off", "half", "off2")
NEVER = [{"head": "sae", "feature": 0, "above": 1e9}, {"head": "probe", "feature": 0, "above": 2.0}]
HOLDS = [{"head": "probe", "feature": 0, "above": 0.5}]


def make_probe(path: str, d_in: int) -> str:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(1)
    save_file({"weight": torch.randn(3, d_in, generator=gen) / d_in ** 0.5, "bias": torch.zeros(3)}, path)
    return path


async def _run_arm(engine, frontend, prompts, conditions, args):
    """The arm's requests, every other one with `conditions`: (wall s, the workers' counts, the answers)."""
    fields = [{"hidden_states_stop": conditions} if conditions and i % 2 == 0 else {} for i in range(len(prompts))]
    wall, _, counts, outs = await _arm(engine, frontend, prompts, fields, args)
    return wall, counts, outs


async def _run(args, folder: str) -> dict:
    from hidden_states.vllm.engine import HiddenStatesEngine

    heads = [{"name": "sae", "path": os.path.join(folder, "sae")},
             {"name": "probe", "path": os.path.join(folder, "probe.safetensors"), "activation": "softmax"}]
    engine = await HiddenStatesEngine.start(args.model, heads=heads, **ENGINE_ARGS)
    try:
        frontend = await engine.openai("m", "bench")
        await _run_arm(engine, frontend, _prompts(args.requests, 10**6), NEVER, args)  # warm-up
        walls = {a: [] for a in ARMS}
        work = {a: {} for a in ARMS}
        tokens = {a: 0 for a in ARMS}
        for r in range(args.rounds):
            for k, arm in enumerate(ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]):
                prompts = _prompts(args.requests, 1000 * (r * len(ARMS) + k))
                wall, counts, outs = await _run_arm(engine, frontend, prompts, NEVER if arm == "half" else None, args)
                walls[arm].append((len(outs), wall))
                for key, v in counts.items():
                    work[arm][key] = work[arm].get(key, 0) + v
                tokens[arm] += sum(o["usage"]["completion_tokens"] for o in outs)
                assert all(o["choices"][0]["finish_reason"] == "length" for o in outs), "a condition held"
        monitored_tokens = tokens["half"] / 2  # every other request, each max_tokens long
        prompts = _prompts(args.requests, 7)
        _, fired, outs = await _run_arm(engine, frontend, prompts, HOLDS, args)
        stopped = [o for i, o in enumerate(outs) if i % 2 == 0]
        rate = {a: sum(c for c, _ in w) / sum(t for _, t in w) for a, w in walls.items()}
        return {
            "model": args.model, "hidden_size": engine.hidden_size, "sae_features": engine.heads["sae"].width,
            "sae_layer": engine.heads["sae"].layer, "rounds": args.rounds, "requests_per_round": args.requests,
            "max_tokens": args.max_tokens, "concurrency": args.concurrency, "req_per_s": rate,
            **{f"{a}_over_off": rate[a] / rate["off"] for a in ARMS[1:]},
            **{f"{a}_over_off_ci95": paired_ratio_ci(walls[a], walls["off"]) for a in ARMS[1:]},
            "worker_counts": work, "completion_tokens": tokens,
            "copies_per_step": {a: work[a]["host_copies"] / max(work[a]["steps"], 1) for a in ARMS},
            "copies_per_step_with_rows": {a: work[a]["host_copies"] / max(work[a]["steps_with_rows"], 1) for a in ARMS},
            "rows_scored_per_monitored_token": work["half"]["head_rows"] / monitored_tokens,
            "products_per_step": work["half"]["head_products"] / max(work["half"]["steps"], 1),
            "holding_run": {"requests_with_condition": len(stopped),
                            "stopped_by_it": sum(o["choices"][0].get("stop_reason") == "hidden_states_stop[0]"
                                                 for o in stopped),
                            "completion_tokens": sum(o["usage"]["completion_tokens"] for o in stopped),
                            "max_tokens_total": len(stopped) * args.max_tokens, "worker_counts": fired},
        }
    finally:
        engine.shutdown()


def _run_with_heads(args) -> dict:
    from transformers import AutoConfig

    from hidden_states.models.builtin import resolve_model

    d = AutoConfig.from_pretrained(resolve_model(args.model)).hidden_size
    with tempfile.TemporaryDirectory() as tmp:
        make_sae(os.path.join(tmp, "sae"), d, args.features * d, args.layer)
        make_probe(os.path.join(tmp, "probe.safetensors"), d)
        return asyncio.run(_run(args, tmp))


def _summary(args, r: dict) -> list[str]:
    w = r["worker_counts"]
    lines = [f"# Stop conditions on half the batch ({args.model}, D = {r['hidden_size']}, float32, an SAE feature "
             f"({r['sae_features']} features, layer {r['sae_layer']}) and a probe after the final norm; {args.rounds} "
             f"rounds x {args.requests} requests at concurrency {args.concurrency}, {args.max_tokens} tokens each)",
             "| arm | req/s | over off (95% CI) | steps | steps with rows | host copies | copies / step | "
             "head products | rows scored |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for a in ARMS:
        ratio = "1" if a == "off" else ratio_text(r, f"{a}_over_off")
        lines.append(f"| {a} | {r['req_per_s'][a]:.2f} | {ratio} | {w[a]['steps']} | {w[a]['steps_with_rows']} | "
                     f"{w[a]['host_copies']} | {r['copies_per_step'][a]:.3f} | {w[a]['head_products']} | "
                     f"{w[a]['head_rows']} |")
    h = r["holding_run"]
    lines += ["", f"Rows scored per monitored token: {r['rows_scored_per_monitored_token']:.3f} (two conditions on two "
                  f"heads: one row per head per completion token but the last, whose row no step computes when "
                  f"max_tokens ends the choice: 2 x {args.max_tokens - 1}/{args.max_tokens} = "
                  f"{2 * (args.max_tokens - 1) / args.max_tokens:.3f}). Head products per step in "
                  f"`half`: {r['products_per_step']:.2f}. Copies per step with rows: "
                  + ", ".join(f"{a} {r['copies_per_step_with_rows'][a]:.3f}" for a in ARMS)
                  + " (the scores ride the step's one copy: no copy, and no wait, of their own).",
              "", f"A condition that holds (probe class 0 above 0.5) on {h['requests_with_condition']} requests: "
                  f"{h['stopped_by_it']} stopped by it, {h['completion_tokens']} completion tokens generated of "
                  f"{h['max_tokens_total']} asked.",
              "", "`off2` is `off` again (the A/A control); the conditions of `half` never hold, so every arm "
                  "generates the same tokens."]
    return lines


def main() -> None:
    bench_main("bench.monitors", __doc__, _run_with_heads, _summary, name="monitors-smollm2",
               first=("--model", "builtin:smollm2-135m-instruct"), requests=16,
               more=[("--features", 8, "SAE features per hidden dimension"),
                     ("--layer", 15, "the SAE's layer (hidden_states_layers' numbering)")])


if __name__ == "__main__":
    main()
