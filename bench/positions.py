"""Part `positions` (issue 24): rows across the whole completion, against hidden states off.

Arms on the one engine, interleaved round by round (compare.run): hidden states off, off again
(the A/A control: how far two identical arms differ on this machine), every generated token's
row in float16 (`"completion"`), and its top-128 entries. Then, counted rather than timed:

- the payload per generated token for each encoding (`hidden_states_meta.bytes`, and the
  response body as received, over the same requests);
- the engine's device-to-host copies against the steps that had rows to copy (worker counters:
  `host_copies` where the copy is made, `steps_with_rows` where the step's rows are sliced);
- what a request in flight holds (its rows until the finish): the largest `bytes` seen,
  against the app's bound `max_hidden_states_bytes`.
"""

from __future__ import annotations

from bench import compare, workload
from bench.load import Result, run_batch
from bench.servers import replica_info
from bench.targets import (
    POSITIONS_F16_MIN as COMPLETION_F16_MIN,
)
from bench.targets import (
    POSITIONS_TOPK as TOPK,
)
from bench.targets import (
    POSITIONS_TOPK_MIN as TOPK_MIN,
)

ROWS = {"return_hidden_states": True, "hidden_states_position": "completion", "hidden_states_encoding": "base64"}
ENCODINGS = {  # the payload table: one row per encoding
    "float32": {**ROWS, "hidden_states_dtype": "float32"},
    "float16": {**ROWS, "hidden_states_dtype": "float16"},
    "bfloat16": {**ROWS, "hidden_states_dtype": "bfloat16"},
    f"float16 top-{TOPK}": {**ROWS, "hidden_states_dtype": "float16", "hidden_states_topk": TOPK},
    "float16, JSON floats": {**ROWS, "hidden_states_dtype": "float16", "hidden_states_encoding": "float"},
}


def _workers(ep) -> dict:
    (w,) = replica_info(ep.stats_url)["replica"]["workers"]
    return w


def run(bench, model: str, ep, vocab: int, cpu, check, max_bytes: int) -> dict:
    args = bench.args
    arms = [
        compare.Arm("off", "hidden states off", ep, {}),
        compare.Arm("off2", "hidden states off (control)", ep, {}),
        compare.Arm("f16", "completion, float16", ep, ENCODINGS["float16"]),
        compare.Arm("topk", f"completion, float16 top-{TOPK}", ep, ENCODINGS[f"float16 top-{TOPK}"]),
    ]
    bench.phase(f"{model} positions: warm-up")
    compare.warmup(arms, vocab, 8, 8, f"{model}-pos")
    out: dict = {"targets": {"completion_f16_min": COMPLETION_F16_MIN, "topk_min": TOPK_MIN}, "by_concurrency": {}}
    before = _workers(ep)
    for c in args.concurrency:
        rounds = args.rounds or bench.plan[model]["rounds"]["hs"]
        per = bench.plan[model]["per_round"].get(c, 8)
        bench.phase(f"{model} positions: c={c} x{rounds} rounds")
        runs = compare.run(
            arms, vocab, c, rounds, per, f"{model}-pos", cpu, on_done=bench.tick, check=check, one_engine=True
        )
        rows = [r for x in runs if x.arm in ("f16", "topk") for r in x.batch.ok]
        out["by_concurrency"][str(c)] = {
            **{a.key: compare.summarize(runs, a.key) for a in arms},
            "f16_vs_off": compare.compare(runs, "f16", "off"),
            "topk_vs_off": compare.compare(runs, "topk", "off"),
            "control_ratio": compare.compare(runs, "off2", "off"),
            # every generated token has its row (positions = completion tokens), none missing
            "rows_equal_completion_tokens": sum(1 for r in rows if r.hs_rows == r.completion_tokens),
            "requests_with_rows": len(rows),
        }
    after = _workers(ep)
    counts = {
        k: after.get(k, 0) - before.get(k, 0) for k in ("steps_with_rows", "host_copies", "bytes_copied", "captured")
    }
    counts["copies_per_step_with_rows"] = (
        counts["host_copies"] / counts["steps_with_rows"] if counts["steps_with_rows"] else None
    )
    counts["requests_per_copy"] = counts["captured"] / counts["host_copies"] if counts["host_copies"] else None
    out["engine"] = counts
    out["payload"], answered = _payload(model, ep, vocab)
    held = [r.hs_bytes for r in answered]
    out["memory"] = {
        "max_bytes_held_per_request": max(held) if held else None,
        "bound_bytes": max_bytes,
        "note": "a request's rows wait in the frontend until its finish (streams: until the next chunk); "
        "the engine's scheduler holds a step's rows until that step's output",
    }
    return out


def _payload(model: str, ep, vocab: int, n: int = 8) -> tuple[dict, list[Result]]:
    """Bytes per generated token of each encoding, over the same `n` requests (one at a time);
    and every answered request."""
    shapes = workload.shapes(n, seed=workload.SEED + 99)
    table, everything = {}, []
    for name, extra in [("off", {}), *ENCODINGS.items()]:
        bodies = [
            (Result(i, s.prompt_tokens, s.max_tokens), workload.body(ep.model, s, vocab, f"payload-{model}-{i}", extra))
            for i, s in enumerate(shapes)
        ]
        ok = run_batch(ep.url, bodies, 1).ok
        toks = sum(r.completion_tokens for r in ok)
        table[name] = {
            "requests": len(ok),
            "completion_tokens": toks,
            "rows_bytes_per_token": sum(r.hs_bytes for r in ok) / toks if toks else None,
            "body_bytes_per_token": sum(r.body_bytes for r in ok) / toks if toks else None,
        }
        everything += ok
    base = table["off"]["body_bytes_per_token"]
    for name in ENCODINGS:
        b = table[name]["body_bytes_per_token"]
        table[name]["added_body_bytes_per_token"] = None if b is None or base is None else b - base
    return table, everything


def lines(res: dict) -> list[str]:
    """The part's Markdown summary."""
    out = [
        "| concurrency | completion f16 / off (95% CI) | top-128 / off (95% CI) | A/A control (95% CI) "
        "| rows = tokens |",
        "|---|---|---|---|---|",
    ]

    def cell(r: dict, minimum: float | None) -> str:
        ci = r.get("req_per_s_ci95")
        v = r.get("req_per_s")
        s = "n/a" if v is None else f"{v:.3f}x"
        if ci:
            s += f" ({ci[0]:.3f}..{ci[1]:.3f})"
        if minimum is not None and v is not None:
            s += f" {'PASS' if v >= minimum else 'MISS'} (>= {minimum})"
        return s

    for c, r in res.get("by_concurrency", {}).items():
        out.append(
            f"| {c} | {cell(r['f16_vs_off'], COMPLETION_F16_MIN if c in ('8', '32') else None)} | "
            f"{cell(r['topk_vs_off'], TOPK_MIN)} | {cell(r['control_ratio'], None)} | "
            f"{r['rows_equal_completion_tokens']}/{r['requests_with_rows']} |"
        )
    e = res.get("engine") or {}
    if e:
        out += [
            "",
            f"Engine: {e['host_copies']} device-to-host copies over {e['steps_with_rows']} steps with rows "
            f"({e['copies_per_step_with_rows']} per step), {e['requests_per_copy'] or 0:.2f} requests' rows "
            f"per copy, {e['bytes_copied']} bytes copied.",
        ]
    p = res.get("payload") or {}
    if p:
        out += [
            "",
            "| encoding | rows bytes / generated token | response bytes / token (added over off) |",
            "|---|---|---|",
        ]
        for name, r in p.items():
            rb = r.get("rows_bytes_per_token")
            added = r.get("added_body_bytes_per_token")
            out.append(
                f"| {name} | {'-' if not rb else f'{rb:.0f}'} | {r['body_bytes_per_token'] or 0:.0f}"
                f"{'' if added is None else f' (+{added:.0f})'} |"
            )
    m = res.get("memory") or {}
    if m:
        out += [
            "",
            f"Largest rows held by one request: {m['max_bytes_held_per_request']} bytes "
            f"(bound: max_hidden_states_bytes = {m['bound_bytes']}).",
        ]
    return out
