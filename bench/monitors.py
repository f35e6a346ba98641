"""Stop conditions on heads (hidden_states_stop) in half the batch vs none: throughput beside an A/A
control, and the work counted: device-to-host copies per engine step and per token, rows scored.

    .venv/bin/python -m bench.monitors [--model builtin:smollm2-135m-instruct] [--rounds 6] \
        [--concurrency 8] [--requests 16] [--max-tokens 32] [--features 8] [--layer 15] [--probe-layer 22] \
        [--name monitors-smollm2]

One engine (HiddenStatesEngine, float32, eager, synchronous scheduling, bench.heads' arguments), no
Ray, with two heads registered: a top-k SAE (SAELens's format, random weights, bench.heads.make_sae:
`--features` x D features) at layer `--layer`, and a linear probe (safetensors weight [3, D], bias
[3], softmax, labels neg/neutral/pos; tests/heads_ref.make_linear) at layer `--probe-layer`.
Requests go through the engine's OpenAI completions route, each round running three arms in a
rotating order on fresh prompts (`ignore_eos`, every completion `--max-tokens` long):
- `off`: no fields;
- `half`: every other request carries two stop conditions, an SAE feature above 1e9 and the probe's
  `pos` above 1.5 (a softmax output): thresholds no score reaches, so the conditions never hold, the
  completions stay `--max-tokens` long and the arms do equal token work (counted: every completion's
  length and finish reason);
- `off2`: off again, the A/A control.
Throughput ratio = requests per second over off's, pooled over rounds, 95% bootstrap interval over
paired rounds. Counted, not timed, per arm: the workers' device-to-host copies (`host_copies`), the
steps whose plan had rows or scores (`steps_with_rows`), the heads' products and rows (`head_products`,
`head_rows`) and their weight columns times rows (`head_column_rows`), the rows a top-k SAE's
conditions encoded in full to rank their feature (`ranked_rows`: a condition's score is its feature's
encoder column otherwise) and bytes copied; and the engine steps, counted in this process as the engine core's
outputs that carry at least one request's tokens (one per step: every scheduled request samples a
token each step here, prompts being shorter than a step's token budget). Then, counted only, on fresh
prompts: `rows` (the same half asks the SAE's top-32 features of its completion positions, a copy
every step anyway) beside `rows+stop` (the same plus the two conditions): the scores ride that copy;
and `holds`: the probe condition's threshold set at a quantile of the probe's scores (read first
through `hidden_states_heads` on the same prompts), so the conditions do hold: tokens saved against
`--max-tokens`, and each stop against the first position the calibration's scores cross. Prints and
writes bench/results/<name>.{json,md}.
"""

from __future__ import annotations

import asyncio
import os
import tempfile

import numpy as np

from bench.heads import ENGINE_ARGS, WORKER_COUNTS, _arm, _prompts, hidden_size, make_sae, rotation
from bench.measure import paired_ratio_ci
from bench.report import bench_main, ci_text, command_line, ratio_text

ARMS = ("off", "half", "off2")
COUNTS = (*WORKER_COUNTS, "steps_with_rows", "steps_with_capture", "ranked_rows", "head_column_rows")
LABELS = ["neg", "neutral", "pos"]
SAE_FEATURE = 0
NEVER = [{"head": "sae", "feature": SAE_FEATURE, "above": 1e9}, {"head": "probe", "label": "pos", "above": 1.5}]
HEADS = sorted({c["head"] for c in NEVER})  # the heads the conditions read
HOLD_QUANTILE = 0.8  # the holds run's probe threshold: this quantile of every completion position's `pos` score


class StepCounter:
    """Engine steps as this process sees them: the engine core's outputs carrying at least one request's
    tokens (vLLM's AsyncLLM output handler passes each step's outputs to process_outputs, in chunks of
    VLLM_V1_OUTPUT_PROC_CHUNK_SIZE = 128 requests by default: one call a step at this concurrency)."""

    def __init__(self, llm):
        self.steps = self.tokens = 0
        processor = llm.output_processor
        original = processor.process_outputs

        def counted(outputs, *args, **kwargs):
            if outputs:
                self.steps += 1
                self.tokens += sum(len(o.new_token_ids) for o in outputs)
            return original(outputs, *args, **kwargs)

        processor.process_outputs = counted

    def mark(self) -> tuple[int, int]:
        return self.steps, self.tokens


async def _counted(engine, counter, frontend, prompts, fields, args) -> dict:
    """One arm's run and its counts: wall, the workers' counters, steps, tokens, the responses' lengths."""
    s0, t0 = counter.mark()
    wall, _, work, out = await _arm(engine, frontend, prompts, fields, args, COUNTS)
    s1, t1 = counter.mark()
    monitored = [bool(f.get("hidden_states_stop")) for f in fields]
    lengths = [o["usage"]["completion_tokens"] for o in out]
    finish = [o["choices"][0]["finish_reason"] for o in out]
    return {
        "wall": wall,
        "requests": len(out),
        **work,
        "steps": s1 - s0,
        "step_tokens": t1 - t0,
        "completion_tokens": sum(lengths),
        "monitored_requests": sum(monitored),
        "monitored_tokens": sum(n for n, m in zip(lengths, monitored) if m),
        "finish": {r: finish.count(r) for r in sorted(set(finish))},
        "out": out,
        "lengths": lengths,
    }


def _fields(arm: str, n: int, extra: dict | None = None, stop: list | None = None) -> list[dict]:
    """Per request: every other one (the odd ones) carries `stop` (and `extra`) in the monitored arms."""
    if arm.startswith("off"):
        return [{}] * n
    return [{**(extra or {}), **({"hidden_states_stop": stop} if stop else {})} if i % 2 else {} for i in range(n)]


def _add(total: dict, c: dict) -> None:
    for k, v in c.items():
        if isinstance(v, (int, float)) and k != "wall":
            total[k] = total.get(k, 0) + v
        elif k == "finish":
            for r, m in v.items():
                total.setdefault("finish", {})[r] = total.get("finish", {}).get(r, 0) + m


def _per(c: dict) -> dict:
    """An arm's counts as ratios: copies per step and per token, the extra copies, rows scored per token."""
    div = lambda a, b: a / b if b else None
    return {
        "host_copies_per_step": div(c["host_copies"], c["steps"]),
        "host_copies_per_step_with_rows": div(c["host_copies"], c["steps_with_rows"]),
        "host_copies_per_completion_token": div(c["host_copies"], c["completion_tokens"]),
        "host_copies_per_monitored_token": div(c["host_copies"], c["monitored_tokens"]),
        # copies beyond the one a step with rows makes, and beyond one per step at all
        "extra_copies": c["host_copies"] - c["steps_with_rows"],
        "copies_over_steps": max(0, c["host_copies"] - c["steps"]),
        "extra_copies_per_monitored_token": div(c["host_copies"] - c["steps_with_rows"], c["monitored_tokens"]),
        "head_rows_per_monitored_token": div(c["head_rows"], c["monitored_tokens"]),
        # each condition's head scores a monitored request's completion rows: all but the last token's,
        # whose row no step computes (max_tokens - 1 of max_tokens)
        "head_rows_per_monitored_token_per_head": div(c["head_rows"], c["monitored_tokens"] * len(HEADS)),
        "head_products_per_step_with_rows": div(c["head_products"], c["steps_with_rows"]),
        # the products' work: weight columns multiplied per row scored (the probe's 3; the SAE's
        # watched feature's 1, or its 4,608 when a row is ranked: capture._ranked)
        "head_column_rows_per_head_row": div(c["head_column_rows"], c["head_rows"]),
        "bytes_copied_per_monitored_token": div(c["bytes_copied"], c["monitored_tokens"]),
    }


def _strip(c: dict) -> dict:
    return {k: v for k, v in c.items() if k not in ("out", "lengths")}


async def _holds(engine, counter, frontend, args) -> dict:
    """The probe's `pos` scores at every completion position (hidden_states_heads) on fresh prompts, a
    threshold at their HOLD_QUANTILE, then the same prompts with the conditions (the SAE's never holds):
    the completion tokens against max_tokens, and each stop against the calibration's first crossing."""
    prompts = _prompts(args.requests, 7 * 10**6)
    calib = await _counted(
        engine,
        counter,
        frontend,
        prompts,
        [{"hidden_states_heads": [{"name": "probe"}], "hidden_states_position": "completion"}] * len(prompts),
        args,
    )
    pos = LABELS.index("pos")
    scores = [[p["scores"][pos] for p in o["choices"][0]["hidden_states_heads"]["probe"]] for o in calib["out"]]
    threshold = float(np.quantile(np.concatenate(scores), HOLD_QUANTILE))
    # the first completion position whose score is above it: the stop keeps the tokens up to it (j + 1)
    want = [next((j + 1 for j, s in enumerate(row) if s > threshold), args.max_tokens) for row in scores]
    stop = [NEVER[0], {"head": "probe", "label": "pos", "above": threshold}]
    run = await _counted(engine, counter, frontend, prompts, [{"hidden_states_stop": stop}] * len(prompts), args)
    stops = [o["choices"][0].get("hidden_states_meta", {}).get("stop") for o in run["out"]]
    return {
        "threshold": threshold,
        "quantile": HOLD_QUANTILE,
        "conditions": stop,
        "requests": len(prompts),
        "max_tokens": args.max_tokens,
        "completion_tokens": run["completion_tokens"],
        "max_completion_tokens": len(prompts) * args.max_tokens,
        "tokens_saved": len(prompts) * args.max_tokens - run["completion_tokens"],
        "stopped": sum(s is not None for s in stops),
        "finish": run["finish"],
        "stop_reasons": sorted({o["choices"][0].get("stop_reason") for o in run["out"]}, key=str),
        "lengths": run["lengths"],
        "calibrated_lengths": want,
        "agree_with_calibration": sum(a == b for a, b in zip(run["lengths"], want)),
        "counts": _strip(run),
        "per": _per(run),
        "calibration_counts": _strip(calib),
    }


async def _run(args, heads: list[dict]) -> dict:
    from hidden_states.vllm.engine import HiddenStatesEngine

    engine = await HiddenStatesEngine.start(args.model, heads=heads, **ENGINE_ARGS)
    try:
        counter = StepCounter(engine.llm)
        frontend = await engine.openai("m", "bench")
        n = args.requests
        await _counted(engine, counter, frontend, _prompts(n, 10**6), _fields("half", n, stop=NEVER), args)  # warm-up
        walls = {a: [] for a in ARMS}
        counts = {a: {} for a in ARMS}
        for _, arm, prompts in rotation(ARMS, args.rounds, n):
            c = await _counted(engine, counter, frontend, prompts, _fields(arm, n, stop=NEVER), args)
            walls[arm].append((c["requests"], c["wall"]))
            _add(counts[arm], _strip(c))
        rows = {"hidden_states_heads": [{"name": "sae", "topk": 32}], "hidden_states_position": "completion"}
        ride = {}
        for k, (arm, stop) in enumerate((("rows", None), ("rows+stop", NEVER))):
            c = await _counted(
                engine, counter, frontend, _prompts(n, 3 * 10**6 + 1000 * k), _fields("half", n, rows, stop), args
            )
            ride[arm] = {**_strip(c), "per": _per(c)}
        holds = await _holds(engine, counter, frontend, args)
        rate = {a: sum(c for c, _ in w) / sum(t for _, t in w) for a, w in walls.items()}
        ci = {a: paired_ratio_ci(walls[a], walls["off"]) for a in ARMS[1:]}
        overlap = bool(
            ci["half"] and ci["off2"] and max(ci["half"][0], ci["off2"][0]) <= min(ci["half"][1], ci["off2"][1])
        )
        return {
            "command": command_line("bench.monitors", args),
            "model": args.model,
            "hidden_size": engine.hidden_size,
            "heads": {h: {"kind": s.kind, "layer": s.layer, "width": s.width} for h, s in engine.heads.items()},
            "conditions": NEVER,
            "rounds": args.rounds,
            "requests_per_round": n,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "req_per_s": rate,
            **{f"{a}_over_off": rate[a] / rate["off"] for a in ARMS[1:]},
            **{f"{a}_over_off_ci95": ci[a] for a in ARMS[1:]},
            "half_interval_overlaps_aa": overlap,
            "walls": walls,  # per round: (requests, wall seconds)
            "counts": counts,
            "per": {a: _per(counts[a]) for a in ARMS},
            "ride": ride,
            "holds": holds,
        }
    finally:
        engine.shutdown()


def _run_with_heads(args) -> dict:
    """The SAE and the probe made (random weights) in a temporary folder, then the rounds."""
    from tests.heads_ref import make_linear

    d = hidden_size(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        heads = [
            {"name": "sae", "path": make_sae(os.path.join(tmp, "sae"), d, args.features * d, args.layer)},
            {
                "name": "probe",
                "path": make_linear(os.path.join(tmp, "probe.safetensors"), d, len(LABELS), 0),
                "layer": args.probe_layer,
                "activation": "softmax",
                "labels": LABELS,
            },
        ]
        return asyncio.run(_run(args, heads))


def _f(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _summary(args, r: dict) -> list[str]:
    sae, probe = r["heads"]["sae"], r["heads"]["probe"]
    lines = [
        f"# Stop conditions on heads in half the batch vs none ({args.model}, D = {r['hidden_size']}, float32, "
        f"{args.rounds} rounds x {args.requests} requests at concurrency {args.concurrency}, {args.max_tokens} "
        f"tokens each; an SAE of {sae['width']} features at layer {sae['layer']} and a {probe['width']}-class "
        f"softmax probe at layer {probe['layer']})",
        "| arm | req/s | over off (95% CI) | completion tokens | engine steps | steps with rows | host copies | "
        "copies / step | copies / completion token | extra copies / monitored token | "
        "head rows / monitored token | finish |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for a in ARMS:
        c, p = r["counts"][a], r["per"][a]
        ratio = "1" if a == "off" else ratio_text(r, f"{a}_over_off")
        extra = "-" if not c["monitored_tokens"] else _f(p["extra_copies_per_monitored_token"])
        rows = "-" if not c["monitored_tokens"] else _f(p["head_rows_per_monitored_token"])
        lines.append(
            f"| {a} | {r['req_per_s'][a]:.2f} | {ratio} | {c['completion_tokens']} | {c['steps']} | "
            f"{c['steps_with_rows']} | {c['host_copies']} | {_f(p['host_copies_per_step'])} | "
            f"{_f(p['host_copies_per_completion_token'], 4)} | {extra} | {rows} | "
            f"{', '.join(f'{k} {v}' for k, v in c['finish'].items())} |"
        )
    h = r["counts"]["half"]
    ph = r["per"]["half"]
    lines += [
        "",
        f"half over off: {ratio_text(r, 'half_over_off')}; the A/A control, off2 over off: "
        f"{ratio_text(r, 'off2_over_off')}; the intervals "
        f"{'overlap' if r['half_interval_overlaps_aa'] else 'do not overlap'}.",
        "",
        f"In `half`, {h['monitored_requests']} monitored requests ({h['monitored_tokens']} completion tokens) "
        f"carried the two conditions ({'; '.join(str(x) for x in r['conditions'])}), which never hold: every "
        f"completion ran its {args.max_tokens} tokens (finish reasons above). Host copies per monitored token: "
        f"{_f(ph['host_copies_per_monitored_token'])} (one copy a step, shared by the step's monitored "
        f"requests); copies beyond one per step with rows: {ph['extra_copies']}, beyond one per engine step: "
        f"{ph['copies_over_steps']}; head products per step with rows: "
        f"{_f(ph['head_products_per_step_with_rows'], 2)} (one per head); head rows per monitored token "
        f"per head: {_f(ph['head_rows_per_monitored_token_per_head'])} (every completion row but the last "
        f"token's, which no step computes: {args.max_tokens - 1} of {args.max_tokens}); bytes copied per "
        f"monitored token: {_f(ph['bytes_copied_per_monitored_token'], 1)} (a float32 score per condition). "
        f"The SAE condition's score comes from its feature's encoder column, not the full encode: rows the "
        f"top-k SAE encoded in full to rank the feature: {h['ranked_rows']} (only where its rank could decide "
        f"the condition: a score above the threshold, and none comes near it here). Weight columns "
        f"multiplied per row scored, over both heads: {_f(ph['head_column_rows_per_head_row'], 2)} "
        f"({h['head_column_rows']} column-rows for {h['head_rows']} rows: the probe's 3 outputs and the "
        f"SAE feature's one encoder column, where the full encode multiplies {sae['width']}).",
        "",
        "Counted only, one pass each on fresh prompts, the same half monitored:",
        "| arm | engine steps | steps with rows | host copies | copies / step | head products | head rows | "
        "bytes copied |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for a, c in r["ride"].items():
        lines.append(
            f"| {a} | {c['steps']} | {c['steps_with_rows']} | {c['host_copies']} | "
            f"{_f(c['per']['host_copies_per_step'])} | {c['head_products']} | {c['head_rows']} | "
            f"{c['bytes_copied']} |"
        )
    ho = r["holds"]
    a, b = r["ride"]["rows"], r["ride"]["rows+stop"]
    lines += [
        "",
        f"`rows`: the SAE's top-32 features of the completion positions; `rows+stop`: the same and the two "
        f"conditions. Host copies {a['host_copies']} and {b['host_copies']}, one per step with rows in "
        f"both: the scores ride the copy the rows make ({b['bytes_copied'] - a['bytes_copied']} bytes "
        f"more). Head products {a['head_products']} and {b['head_products']}: the conditions run their "
        "own products beside the one the heads' outputs ran on the same rows, the SAE's over its watched "
        f"feature's encoder column (rows encoded in full to rank it: {b['ranked_rows']}).",
        "",
        f"Conditions that hold ({ho['requests']} requests, every one monitored; the probe's `pos` above "
        f"{ho['threshold']:.4f}, the {ho['quantile']:.0%} quantile of its scores at the completion positions "
        f"of the same prompts; the SAE's never holds): {ho['stopped']} of {ho['requests']} stopped, "
        f"{ho['completion_tokens']} completion tokens of {ho['max_completion_tokens']}: "
        f"**{ho['tokens_saved']} tokens saved** ({ho['tokens_saved'] / ho['max_completion_tokens']:.0%}); "
        f"{ho['agree_with_calibration']} of {ho['requests']} completions as long as the calibration's first "
        f"crossing predicts. Host copies per step: {_f(ho['per']['host_copies_per_step'])}.",
        "",
        "`off2` is `off` again (the A/A control). Engine steps are counted in this process: the engine "
        "core's outputs that carry tokens (one per step). `steps with rows`: the workers' steps whose plan "
        "had rows or monitor scores (capture.py's `steps_with_rows`); `host copies` its `host_copies`. "
        f"Intervals: {ci_text(r['half_over_off_ci95'])} (half) and {ci_text(r['off2_over_off_ci95'])} (A/A).",
    ]
    return lines


def main() -> None:
    bench_main(
        "bench.monitors",
        __doc__,
        _run_with_heads,
        _summary,
        name="monitors-smollm2",
        first=("--model", "builtin:smollm2-135m-instruct"),
        requests=16,
        more=[
            ("--features", 8, "SAE features per hidden dimension"),
            ("--layer", 15, "the SAE's layer (hidden_states_layers' numbering)"),
            ("--probe-layer", 22, "the probe's layer"),
        ],
    )


if __name__ == "__main__":
    main()
