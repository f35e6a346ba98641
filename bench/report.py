"""The console table, results JSON, Markdown summary and plot; the one-engine benches' command line and
results (`bench_main`)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import targets as T
from bench.measure import ci_text


def _f(x, fmt="{:.2f}", none="-"):
    return none if x is None else fmt.format(x)


def _mb(b):
    return None if b is None else b / 2**20


# -- the targets, one row per figure --------------------------------------------------


def target_rows(res: dict) -> list[dict]:
    rows = []

    def add(part, model, c, figure, value, target, status, fmt="{:.3f}", bad=None, ci=None):
        if bad and status in ("PASS", "MISS") or bad and status.startswith(("PASS ", "MISS ")):
            status = f"{status.split()[0]} ({bad})"
        shown = _f(value, fmt) + (f" (95% CI {ci_text(ci)})" if ci and value is not None else "")
        rows.append(
            {
                "part": part,
                "model": model,
                "concurrency": c,
                "figure": figure,
                "value": value,
                "ci95": ci,
                "shown": shown,
                "target": target,
                "status": status,
            }
        )

    def failed(*arms) -> str | None:
        n = sum(a["errors"] for a in arms)
        return f"INVALID: {n} requests failed" if n else None

    for model, m in res.get("models", {}).items():
        hs = m.get("hs", {})
        for c, row in hs.get("by_concurrency", {}).items():
            r = row["ratio"]
            bad = failed(row["hs_on"], row["hs_off"])
            add(
                "1 hidden states",
                model,
                c,
                "throughput on/off, req/s",
                r["req_per_s"],
                f">= {T.HS_THROUGHPUT_MIN:.2f}x",
                T.at_least(r["req_per_s"], T.HS_THROUGHPUT_MIN),
                bad=bad,
                ci=r.get("req_per_s_ci95"),
            )
            add(
                "1 hidden states",
                model,
                c,
                "throughput on/off, output tok/s",
                r["out_tok_per_s"],
                f">= {T.HS_THROUGHPUT_MIN:.2f}x",
                T.at_least(r["out_tok_per_s"], T.HS_THROUGHPUT_MIN),
                bad=bad,
            )
            if "control_ratio" in row:  # --hs-control: two identical arms, the noise floor of the line above
                k = row["control_ratio"]
                add(
                    "1 hidden states",
                    model,
                    c,
                    "(diagnostic) A/A control: off / off again, req/s",
                    k["req_per_s"],
                    "1.00x",
                    "info",
                    ci=k.get("req_per_s_ci95"),
                )
            ex = row["extraction"]
            ones = ex.get("exactly_one_token_computed")
            ok = None if not ex["vectors"] or ones is None else (ones == ex["vectors"] and ex["missing_vectors"] == 0)
            add(
                "1 hidden states",
                model,
                c,
                "tokens computed per vector (max; every stop is engine-side)",
                ex["recomputed_max"],
                f"exactly {T.HS_TOKENS_PER_VECTOR} on every request",
                T.status(ok),
                "{:.0f}",
            )
        if "error" in hs:
            add("1 hidden states", model, "-", "part failed", None, "-", "ERROR")
        pos = m.get("positions", {})
        for c, row in pos.get("by_concurrency", {}).items():
            for key, label, minimum in (
                ("f16_vs_off", "completion float16 / off", T.POSITIONS_F16_MIN),
                ("topk_vs_off", f"completion top-{T.POSITIONS_TOPK} / off", T.POSITIONS_TOPK_MIN),
            ):
                r = row[key]
                add(
                    "1b positions",
                    model,
                    c,
                    f"{label}, req/s",
                    r["req_per_s"],
                    f">= {minimum:.2f}x",
                    T.at_least(r["req_per_s"], minimum),
                    bad=failed(row["off"], row[key[: key.index("_vs")]]),
                    ci=r.get("req_per_s_ci95"),
                )
            k = row["control_ratio"]
            add(
                "1b positions",
                model,
                c,
                "(diagnostic) A/A control: off / off again, req/s",
                k["req_per_s"],
                "1.00x",
                "info",
                ci=k.get("req_per_s_ci95"),
            )
            add(
                "1b positions",
                model,
                c,
                "rows = generated tokens (requests)",
                row["rows_equal_completion_tokens"],
                f"all {row['requests_with_rows']}",
                T.status(row["rows_equal_completion_tokens"] == row["requests_with_rows"]),
                "{:.0f}",
            )
        if eng := pos.get("engine"):
            add(
                "1b positions",
                model,
                "-",
                "device-to-host copies per step with rows",
                eng["copies_per_step_with_rows"],
                "exactly 1",
                T.status(eng["copies_per_step_with_rows"] == 1.0),
                "{:.3f}",
            )
        if "error" in pos:
            add("1b positions", model, "-", "part failed", None, "-", "ERROR")
        sv = m.get("serve", {})
        for c, row in sv.get("by_concurrency", {}).items():
            r, q = row["ours_vs_vllm"], row["ours_vs_rsllm"]
            bad = failed(row["ours"], row["vllm"])
            add(
                "2 Serve layer",
                model,
                c,
                "ours / vLLM server, req/s",
                r["req_per_s"],
                f">= {T.SERVE_VS_VLLM_MIN:.2f}x",
                T.at_least(r["req_per_s"], T.SERVE_VS_VLLM_MIN),
                bad=bad,
                ci=r.get("req_per_s_ci95"),
            )
            add(
                "2 Serve layer",
                model,
                c,
                "ours / vLLM server, output tok/s",
                r["out_tok_per_s"],
                f">= {T.SERVE_VS_VLLM_MIN:.2f}x",
                T.at_least(r["out_tok_per_s"], T.SERVE_VS_VLLM_MIN),
                bad=bad,
            )
            add(
                "2 Serve layer",
                model,
                c,
                "ours - vLLM server, p50 latency (ms)",
                r["p50_added_ms"],
                f"<= {T.added_p50_max(c):.0f} ms",
                T.at_most(r["p50_added_ms"], T.added_p50_max(c)),
                "{:+.1f}",
                bad=bad,
            )
            add(
                "2 Serve layer",
                model,
                c,
                "ours / Ray Serve LLM, req/s",
                q["req_per_s"],
                f">= {T.SERVE_VS_RSLLM_MIN:.2f}x (ahead)",
                T.at_least(q["req_per_s"], T.SERVE_VS_RSLLM_MIN),
                bad=failed(row["ours"], row["rsllm"]),
                ci=q.get("req_per_s_ci95"),
            )
            if "port" in row:  # the Router's own port (direct ingress, what `make serve` adds): the same targets
                d, dq = row["port_vs_vllm"], row["port_vs_rsllm"]
                bad_p = failed(row["port"], row["vllm"])
                add(
                    "2 Serve layer",
                    model,
                    c,
                    "ours, Router's own port / vLLM server, req/s",
                    d["req_per_s"],
                    f">= {T.SERVE_VS_VLLM_MIN:.2f}x",
                    T.at_least(d["req_per_s"], T.SERVE_VS_VLLM_MIN),
                    bad=bad_p,
                    ci=d.get("req_per_s_ci95"),
                )
                add(
                    "2 Serve layer",
                    model,
                    c,
                    "ours, Router's own port / vLLM server, output tok/s",
                    d["out_tok_per_s"],
                    f">= {T.SERVE_VS_VLLM_MIN:.2f}x",
                    T.at_least(d["out_tok_per_s"], T.SERVE_VS_VLLM_MIN),
                    bad=bad_p,
                )
                add(
                    "2 Serve layer",
                    model,
                    c,
                    "ours, Router's own port - vLLM server, p50 latency (ms)",
                    d["p50_added_ms"],
                    f"<= {T.added_p50_max(c):.0f} ms",
                    T.at_most(d["p50_added_ms"], T.added_p50_max(c)),
                    "{:+.1f}",
                    bad=bad_p,
                )
                add(
                    "2 Serve layer",
                    model,
                    c,
                    "ours, Router's own port / Ray Serve LLM, req/s",
                    dq["req_per_s"],
                    f">= {T.SERVE_VS_RSLLM_MIN:.2f}x (ahead)",
                    T.at_least(dq["req_per_s"], T.SERVE_VS_RSLLM_MIN),
                    bad=failed(row["port"], row["rsllm"]),
                    ci=dq.get("req_per_s_ci95"),
                )
            if "direct" in row:  # the option `ingress: replica`: the same targets, for the record
                d, dq = row["direct_vs_vllm"], row["direct_vs_rsllm"]
                add(
                    "2 Serve layer",
                    model,
                    c,
                    "ours, ingress: replica / vLLM server, req/s",
                    d["req_per_s"],
                    f">= {T.SERVE_VS_VLLM_MIN:.2f}x",
                    T.at_least(d["req_per_s"], T.SERVE_VS_VLLM_MIN),
                    bad=failed(row["direct"], row["vllm"]),
                    ci=d.get("req_per_s_ci95"),
                )
                add(
                    "2 Serve layer",
                    model,
                    c,
                    "ours, ingress: replica - vLLM server, p50 latency (ms)",
                    d["p50_added_ms"],
                    f"<= {T.added_p50_max(c):.0f} ms",
                    T.at_most(d["p50_added_ms"], T.added_p50_max(c)),
                    "{:+.1f}",
                    bad=failed(row["direct"], row["vllm"]),
                )
                add(
                    "2 Serve layer",
                    model,
                    c,
                    "ours, ingress: replica / Ray Serve LLM, req/s",
                    dq["req_per_s"],
                    f">= {T.SERVE_VS_RSLLM_MIN:.2f}x (ahead)",
                    T.at_least(dq["req_per_s"], T.SERVE_VS_RSLLM_MIN),
                    bad=failed(row["direct"], row["rsllm"]),
                    ci=dq.get("req_per_s_ci95"),
                )
        probe = sv.get("overhead_probe")
        if probe:  # diagnostic: the fixed per-request cost, 1-token requests interleaved
            names = {
                "ours": "ours",
                "port": "ours, Router's own port",
                "direct": "ours, ingress: replica",
                "rsllm": "Ray Serve LLM",
            }
            for key, name in names.items():
                p = probe.get(key)
                if p and p.get("added_p50_ms") is not None:
                    add(
                        "2 Serve layer",
                        model,
                        1,
                        f"(diagnostic) {name} - vLLM server, p50 of {p['n']} one-token "
                        f"requests (ms; vLLM {probe['vllm']['p50_ms']:.1f})",
                        p["added_p50_ms"],
                        f"<= {T.added_p50_max(1):.0f} ms",
                        "info: "
                        + (
                            "INVALID: requests failed"
                            if p["errors"] or probe["vllm"]["errors"]
                            else T.at_most(p["added_p50_ms"], T.added_p50_max(1))
                        ),
                        "{:+.1f}",
                    )
        if "error" in sv:
            add("2 Serve layer", model, "-", "part failed", None, "-", "ERROR")
    pl = res.get("payload", {})
    if "4096" in pl:
        v = pl["4096"]["speedup_base64"]
        add(
            "3 payload",
            "-",
            "-",
            "base64 speedup (build+parse) at D=4096",
            v,
            f">= {T.BASE64_SPEEDUP_MIN:.0f}x",
            T.at_least(v, T.BASE64_SPEEDUP_MIN),
            "{:.1f}x",
        )
    for model, m in res.get("models", {}).items():
        mem = m.get("memory")
        if mem and "rss_bytes" in mem:
            g = mem["end_vs_after_first"]
            add(
                "4 memory",
                model,
                mem["concurrency"],
                f"RSS end vs after first 100 ({mem['requests']} requests)",
                None if g is None else 100 * g,
                f"<= {100 * T.MEMORY_GROWTH_MAX:.0f}%",
                T.at_most(g, T.MEMORY_GROWTH_MAX) if mem["errors"] == 0 else "MISS (errors)",
                "{:+.2f}%",
            )
            gs = mem.get("settled_vs_start")
            if gs is not None:
                tb, ta = mem.get("worker_trims_before_after") or (None, None)
                add(
                    "4 memory",
                    model,
                    mem["concurrency"],
                    f"(diagnostic) idle {mem['settled_s']:.0f} s after the run vs idle before it "
                    f"(worker malloc_trims {tb} -> {ta})",
                    100 * gs,
                    f"<= {100 * T.MEMORY_GROWTH_MAX:.0f}%",
                    "info: " + T.at_most(gs, T.MEMORY_GROWTH_MAX),
                    "{:+.2f}%",
                )
        elif mem and "error" in mem:
            add("4 memory", model, "-", "part failed", None, "-", "ERROR")
    return rows


# -- console -----------------------------------------------------------------------


def _range(r: dict) -> str:
    pr = r.get("per_round_req_per_s") or []
    return f"{min(pr):.2f}..{max(pr):.2f}" if pr else "-"


def _grid(headers: list[str], rows: list[list[str]]) -> str:
    w = [max(len(str(x)) for x in col) for col in zip(headers, *rows)] if rows else [len(h) for h in headers]
    line = lambda r: "  ".join(str(x).ljust(n) for x, n in zip(r, w))
    return "\n".join([line(headers), line(["-" * n for n in w]), *[line(r) for r in rows]])


def part_tables(res: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    out = []
    for model, m in res.get("models", {}).items():
        hs = m.get("hs", {})
        if hs.get("by_concurrency"):
            rows = []
            for c, row in hs["by_concurrency"].items():
                on, off, r, ex = row["hs_on"], row["hs_off"], row["ratio"], row["extraction"]
                rows.append(
                    [
                        c,
                        _f(on["req_per_s"]),
                        _f(off["req_per_s"]),
                        _f(r["req_per_s"], "{:.3f}"),
                        ci_text(r.get("req_per_s_ci95")),
                        _range(r),
                        _f(r["out_tok_per_s"], "{:.3f}"),
                        f"{_f(on['p50_s'] and on['p50_s'] * 1e3, '{:.0f}')}/"
                        f"{_f(off['p50_s'] and off['p50_s'] * 1e3, '{:.0f}')}",
                        f"{_f(on['p99_s'] and on['p99_s'] * 1e3, '{:.0f}')}/"
                        f"{_f(off['p99_s'] and off['p99_s'] * 1e3, '{:.0f}')}",
                        f"{_f(ex['recomputed_mean'], '{:.1f}')}/{_f(ex['recomputed_max'], '{:.0f}')}",
                        _f(ex["added_latency_ms_p50"], "{:+.1f}"),
                        f"{on['errors']}/{off['errors']}",
                        _f(max(on.get("not_ours_cores") or 0, off.get("not_ours_cores") or 0)),
                    ]
                )
            out.append(
                (
                    f"Part 1, cost of hidden states — {model} (on vs off, same server; "
                    f"target on/off >= {T.HS_THROUGHPUT_MIN:.2f}x)",
                    [
                        "conc",
                        "on req/s",
                        "off req/s",
                        "req/s on/off",
                        "95% CI",
                        "per-round range",
                        "tok/s on/off",
                        "p50 ms on/off",
                        "p99 ms on/off",
                        "computed tokens mean/max",
                        "added ms p50 (paired)",
                        "errors",
                        "not-ours CPU (cores)",
                    ],
                    rows,
                )
            )
        sv = m.get("serve", {})
        if sv.get("by_concurrency"):
            rows = []
            for c, row in sv["by_concurrency"].items():
                v, o, q = row["vllm"], row["ours"], row["rsllm"]
                r, rq, qv = row["ours_vs_vllm"], row["ours_vs_rsllm"], row["rsllm_vs_vllm"]
                rows.append(
                    [
                        c,
                        _f(v["req_per_s"]),
                        _f(o["req_per_s"]),
                        _f(q["req_per_s"]),
                        _f(r["req_per_s"], "{:.3f}"),
                        ci_text(r.get("req_per_s_ci95")),
                        _range(r),
                        _f(r["out_tok_per_s"], "{:.3f}"),
                        _f(r["p50_added_ms"], "{:+.1f}"),
                        _f(r["p99_added_ms"], "{:+.1f}"),
                        _f(rq["req_per_s"], "{:.3f}"),
                        _f(qv["req_per_s"], "{:.3f}"),
                        f"{v['errors']}/{o['errors']}/{q['errors']}",
                        _f(max(x.get("not_ours_cores") or 0 for x in (v, o, q))),
                    ]
                )
                if "port" in row:
                    d = row["port"]
                    rows[-1] += [
                        _f(d["req_per_s"]),
                        _f(row["port_vs_vllm"]["req_per_s"], "{:.3f}"),
                        ci_text(row["port_vs_vllm"].get("req_per_s_ci95")),
                        _f(row["port_vs_vllm"]["p50_added_ms"], "{:+.1f}"),
                        _f(row["port_vs_ours"]["req_per_s"], "{:.3f}"),
                        str(d["errors"]),
                    ]
                if "direct" in row:
                    d = row["direct"]
                    rows[-1] += [
                        _f(d["req_per_s"]),
                        _f(row["direct_vs_vllm"]["req_per_s"], "{:.3f}"),
                        _f(row["direct_vs_vllm"]["p50_added_ms"], "{:+.1f}"),
                        _f(row["direct_vs_ours"]["req_per_s"], "{:.3f}"),
                        str(d["errors"]),
                    ]
            out.append(
                (
                    f"Part 2, cost of the Serve layer — {model} (ours with hidden states off; "
                    f"targets: ours/vLLM >= {T.SERVE_VS_VLLM_MIN:.2f}x, "
                    f"+p50 <= {T.SERVE_ADDED_P50_MS_C1:.0f} ms at c=1 and {T.SERVE_ADDED_P50_MS:.0f} ms above, "
                    "ours/RSLLM >= 1.00x)",
                    [
                        "conc",
                        "vLLM req/s",
                        "ours req/s",
                        "RSLLM req/s",
                        "ours/vLLM req/s",
                        "95% CI",
                        "per-round range",
                        "ours/vLLM tok/s",
                        "ours-vLLM p50 ms",
                        "ours-vLLM p99 ms",
                        "ours/RSLLM req/s",
                        "RSLLM/vLLM req/s",
                        "errors v/o/r",
                        "not-ours CPU (cores)",
                    ]
                    + (
                        [
                            "port req/s",
                            "port/vLLM req/s",
                            "port/vLLM 95% CI",
                            "port-vLLM p50 ms",
                            "port/ours req/s",
                            "port errors",
                        ]
                        if any("port" in row for row in sv["by_concurrency"].values())
                        else []
                    )
                    + (
                        [
                            "direct req/s",
                            "direct/vLLM req/s",
                            "direct-vLLM p50 ms",
                            "direct/ours req/s",
                            "direct errors",
                        ]
                        if any("direct" in row for row in sv["by_concurrency"].values())
                        else []
                    ),
                    rows,
                )
            )
    pl = res.get("payload")
    if pl:
        rows = []
        for d, row in pl.items():
            f, b = row["float"], row["base64"]
            rows.append(
                [
                    d,
                    f"{f['vector_bytes']:,}",
                    f"{b['vector_bytes']:,}",
                    f"{row['raw_float32_bytes']:,}",
                    _f(f["build_ms"], "{:.3f}"),
                    _f(f["parse_ms"], "{:.3f}"),
                    _f(b["build_ms"], "{:.3f}"),
                    _f(b["parse_ms"], "{:.3f}"),
                    _f(row["speedup_base64"], "{:.1f}x"),
                ]
            )
        out.append(
            (
                "Part 3, payload per vector (target: base64 >= 5x faster to build+parse at D=4096)",
                [
                    "D",
                    "float bytes",
                    "base64 bytes",
                    "raw bytes",
                    "float build ms",
                    "float parse ms",
                    "b64 build ms",
                    "b64 parse ms",
                    "speedup",
                ],
                rows,
            )
        )
    for model, m in res.get("models", {}).items():
        mem = m.get("memory")
        if mem and "rss_bytes" in mem:
            rb = mem["rss_bytes"]
            keys = list(rb)
            out.append(
                (
                    f"Part 4, replica resident memory — {model}: {mem['requests']} requests with hidden states, "
                    f"concurrency {mem['concurrency']} (target: end within 5% of after-100)",
                    [*(f"{k} MiB" for k in keys), "end vs after-100", "errors"],
                    [
                        [
                            *(_f(_mb(rb[k]), "{:.0f}") for k in keys),
                            _f(100 * mem["end_vs_after_first"], "{:+.2f}%"),
                            str(mem["errors"]),
                        ]
                    ],
                )
            )
    return out


def table(res: dict) -> str:
    parts = []
    for title, headers, rows in part_tables(res):
        parts.append(f"\n{title}\n{_grid(headers, rows)}")
    rows = [
        [r["part"], r["model"], str(r["concurrency"]), r["figure"], r["shown"], r["target"], r["status"]]
        for r in target_rows(res)
    ]
    parts.append("\nTargets\n" + _grid(["part", "model", "conc", "figure", "value", "target", "status"], rows))
    if res.get("errors"):
        parts.append("\nErrors:\n" + "\n".join(f"- {e}" for e in res["errors"]))
    return "\n".join(parts)


# -- Markdown ------------------------------------------------------------------------


def _md_table(headers, rows) -> str:
    esc = lambda x: str(x).replace("|", "\\|")
    return "\n".join(
        [
            "| " + " | ".join(map(esc, headers)) + " |",
            "|" + "---|" * len(headers),
            *("| " + " | ".join(map(esc, r)) + " |" for r in rows),
        ]
    )


ARM_LABELS = {"vllm": "vLLM server", "ours": "our app", "rsllm": "Ray Serve LLM", "direct": "our app, ingress: replica"}


def _cpu_table(by_c: dict) -> list[str]:
    lines = []
    for c, row in by_c.items():
        arms = [a for a in ("vllm", "ours", "rsllm", "direct") if a in row]
        roles = set()
        for arm in arms:
            roles |= set(row[arm]["cpu_s_per_request"])
        roles = sorted(roles, key=lambda k: -max(row[a]["cpu_s_per_request"].get(k, 0) for a in arms))
        rows = []
        for role in roles:
            vals = [row[a]["cpu_s_per_request"].get(role, 0.0) * 1e3 for a in arms]
            if max(vals) < 0.5:
                continue
            rows.append([role, *(f"{v:.1f}" for v in vals)])
        rows.append(["**cores busy (all processes)**", *(_f(row[a]["cpu_busy_cores"]) for a in arms)])
        lines += [
            f"\nConcurrency {c}: CPU milliseconds per request, by process role, while each server was under load\n",
            _md_table(["role", *(ARM_LABELS[a] for a in arms)], rows),
        ]
        det = []
        for a, label in (("ours", "our app"), ("rsllm", "Ray Serve LLM")):
            d = row[a].get("ray_system_cpu_s_per_request") or {}
            if d:
                det.append(f"{label}: " + ", ".join(f"{k[5:]} {v * 1e3:.1f}" for k, v in list(d.items())[:6]))
        if det:
            lines.append("\n`ray: system` by process (ms/request): " + "; ".join(det) + ".")
    return lines


SERVE_ROLES = {
    "vllm": ("vllm: api server",),
    "ours": ("ours: router", "ours: replica", "serve: proxy", "serve: controller", "ray: system"),
    "rsllm": ("rsllm: ingress", "rsllm: server", "serve: proxy", "serve: controller", "ray: system"),
    "direct": ("direct: replica", "serve: proxy", "serve: controller", "ray: system"),
}
ENGINE_ROLES = {
    "vllm": "vllm: engine",
    "ours": "ours: replica: engine",
    "rsllm": "rsllm: server: engine",
    "direct": "direct: replica: engine",
}


def serve_layer_lines(by_c: dict) -> list[str]:
    """CPU per request outside the engine, per server: what the Serve layer costs on a machine where it shares cores."""
    lines = []
    for c, row in by_c.items():
        parts = []
        for arm, label in (
            ("vllm", "vLLM's server"),
            ("ours", "our app"),
            ("rsllm", "Ray Serve LLM"),
            ("direct", "our app with `ingress: replica`"),
        ):
            if arm not in row:
                continue
            cpu = row[arm]["cpu_s_per_request"]
            layer = sum(cpu.get(k, 0.0) for k in SERVE_ROLES[arm]) * 1e3
            eng = cpu.get(ENGINE_ROLES[arm], 0.0) * 1e3
            parts.append(f"{label} {layer:.1f} ms outside the engine + {eng:.1f} ms in it")
        lines.append(f"- concurrency {c}: " + "; ".join(parts) + ".")
    return lines


def markdown(res: dict, plot_name: str | None) -> str:
    mc = res.get("machine", {})
    L = [
        f"# Benchmark results{' (quick mode)' if res.get('quick') else ''}",
        "",
        f"Command: `{res['command']}` (from the repository root, `.venv/bin/python`; `make bench` runs the full one)  ",
        f"Run: {res['started']} .. {res.get('finished')} ({res.get('duration_s')} s)  ",
        f"Machine: {mc.get('cpu')} ({mc.get('simd')}), {mc.get('physical_cores')} cores / "
        f"{mc.get('logical_cpus')} logical CPUs, "
        f"{mc.get('memory_gib')} GiB, no accelerator; {mc.get('os')}; Python {mc.get('python')}; "
        + ", ".join(f"{k} {v}" for k, v in mc.get("versions", {}).items())
        + "  ",
        f"Load average at start {tuple(round(x, 2) for x in mc.get('load_average_at_start', ()))}, "
        f"at end {tuple(round(x, 2) for x in mc.get('load_average_at_end', ()))}",
        "",
    ]
    st = res.get("settings", {})
    L += [
        "## Method",
        "",
        f"- Engine arguments, identical for all servers: `{json.dumps(st.get('engine_args'))}`; engine environment "
        f"`{json.dumps(st.get('engine_env'))}`; the product's `config.yaml` otherwise (router and replica autoscaling, "
        "`ingress: router`).",
        f"- Workload: {json.dumps(st.get('workload'))}. Closed loop: `concurrency` clients, each sends its next "
        "request when its last one returns.",
        "- Each comparison runs its arms alternately, round by round (the first arm rotates), on the same request "
        "lengths in a round but with different token contents, so no arm finds another's prompts in a prefix cache. "
        "In part 1 (one engine, hidden states on vs off) a round at concurrency 1 is one request: the arms "
        "alternate request by request (the plan's rounds x requests, as single requests), so the machine's drift "
        "falls on both alike; not across servers, where each request would run beside the previous server's "
        "engine, busy-waiting for a second after its last step. "
        "Throughput = successful requests (output tokens) / summed wall time over the rounds; latency percentiles "
        "pool all rounds. Ratios are arm / baseline. 95% CI: percentile bootstrap (2,000 resamples) of a ratio over "
        "its rounds, pairs kept, given at least 5 rounds; a status is judged on the measured ratio, not its interval.",
        f"- Plan (requests per arm per round by concurrency, rounds): `{json.dumps(st.get('plan'))}`.",
        "- Servers: a Ray cluster (`ray start --head --num-cpus 8`), our app (`deployments.app:build_app`), a second "
        "copy of it with `ingress: replica` (no Router: Serve's proxy calls the engine replica; the `direct` columns) "
        "and Ray Serve LLM (`ray.serve.llm:build_openai_app`, `placement_group_config: {bundles: [{CPU: 1}]}`, "
        "pyarrow from bench/.work/extra only) in one `serve run`, and vLLM's own server "
        "(`python -m vllm.entrypoints.openai.api_server`), "
        "all up during a model's parts (the idle CPU of the ones not under load is shown below). Everything started is "
        "stopped by process group and checked.",
        "- CPU accounting: every process's CPU seconds before and after each batch, attributed to the server that "
        "started it (`ray: system` = Ray's daemons, the `serve run` driver and idle workers). `not-ours CPU` is CPU "
        "used by processes the benchmark did not start (other test runs on this shared 2-core machine): where it is "
        "well above ~0.1 cores, that comparison is noisy. vLLM's engine processes busy-wait (sched_yield) for up to "
        "1 s after each step (`SpinCondition`, shm_broadcast.py), so their CPU includes spinning, and more of it "
        "when the process feeding them is slow.",
        "",
    ]
    rows = [
        [r["part"], r["model"], r["concurrency"], r["figure"], r["shown"], r["target"], f"**{r['status']}**"]
        for r in target_rows(res)
    ]
    L += ["## Targets", "", _md_table(["part", "model", "conc", "figure", "measured", "target", "status"], rows), ""]
    if plot_name:
        L += [f"![ratios, payload and memory]({plot_name})", ""]
    for title, headers, trs in part_tables(res):
        L += [f"### {title}", "", _md_table(headers, trs), ""]
    for model, m in res.get("models", {}).items():
        L += [f"## {model}: details", ""]
        md = m.get("model", {})
        L.append(
            f"Model: hidden size {md.get('hidden_size')}, {md.get('layers')} layers, vocab {md.get('vocab_size')}, "
            f"~{(md.get('parameters') or 0) / 1e6:.1f}M parameters. Start-up (s): "
            + ", ".join(f"{k} {v:.0f}" for k, v in m.get("startup_s", {}).items())
            + f". Stopped: {m.get('stopped')}."
        )
        L.append("")
        eng = m.get("engines", {})
        if eng:
            rows = [
                [
                    k,
                    e["title"],
                    e["pid"],
                    e["threads"],
                    e["OMP_NUM_THREADS"],
                    e["VLLM_CPU_OMP_THREADS_BIND"],
                    e["cpu_affinity"],
                ]
                for k, es in eng.items()
                for e in es
            ]
            L += [
                "Engine processes (their thread settings decide how many cores the model uses):",
                "",
                _md_table(["server", "process", "pid", "threads", "OMP_NUM_THREADS", "bind", "affinity"], rows),
                "",
            ]
        idle = m.get("idle_cpu")
        if idle:
            L.append(
                "Idle CPU with every server up and no load (cores busy, by role): "
                + ", ".join(
                    f"{k} {v / idle['wall']:.3f}"
                    for k, v in sorted(idle["roles"].items(), key=lambda kv: -kv[1])
                    if v / idle["wall"] >= 0.005
                )
                + f"; total {idle['busy'] / idle['wall']:.2f} of 2 cores."
            )
            L.append("")
        hs = m.get("hs", {})
        if hs.get("by_concurrency"):
            rows = []
            for c, row in hs["by_concurrency"].items():
                ex = row["extraction"]
                via = ", ".join(f"{k} {v}" for k, v in (ex.get("via") or {}).items()) or "-"
                rows.append(
                    [
                        c,
                        ex["vectors"],
                        ex["missing_vectors"],
                        ex["tokens_equal_prompt_plus_completion"],
                        via,
                        _f(ex["recomputed_mean"], "{:.1f}"),
                        _f(ex["recomputed_p50"], "{:.0f}"),
                        _f(ex["recomputed_max"], "{:.0f}"),
                        f"{ex.get('exactly_one_token_computed', '-')}/{ex['vectors']}",
                        ex["cached_tokens_gcd"],
                        _f(ex["added_latency_ms_p50"], "{:+.1f}"),
                        _f(ex["added_latency_ms_p90"], "{:+.1f}"),
                    ]
                )
            L += [
                "The final token's hidden state per request (from each choice's `hidden_states_meta`: "
                "computed = tokens - "
                f"cached_tokens; via = tail step or extraction request; block size {hs['block_size']}; added latency = "
                f"latency with - without, paired by request shape and round):",
                "",
                _md_table(
                    [
                        "conc",
                        "vectors",
                        "missing",
                        "tokens = prompt+completion",
                        "via",
                        "computed mean",
                        "p50",
                        "max",
                        "exactly 1",
                        "gcd(cached)",
                        "added ms p50",
                        "added ms p90",
                    ],
                    rows,
                ),
                "",
            ]
        pos = m.get("positions", {})
        if pos.get("by_concurrency"):
            from bench import positions

            L += [
                "Rows across the completion (`--parts positions`: every generated token's row, base64, against "
                "hidden states off on the same engine, interleaved; the A/A control is off against off):",
                "",
                *positions.lines(pos),
                "",
            ]
        elif pos:
            L += [f"Positions: {pos.get('error', pos)}", ""]
        sv = m.get("serve", {})
        if sv.get("by_concurrency"):
            L += [
                "CPU per request (milliseconds of CPU, all processes of a server; the Serve layer = proxy, controller, "
                "Ray's daemons, router/ingress and the replica's Python; for vLLM's server its API process):",
                "",
                *serve_layer_lines(sv["by_concurrency"]),
                "",
            ]
            L += _cpu_table(sv["by_concurrency"])
            L.append("")
        mem = m.get("memory")
        if mem and "rss_bytes" in mem:
            L += [
                f"Memory: replica pid {mem['replica_pid']}; {mem['ok']}/{mem['requests']} ok, "
                f"{mem['with_vector']} with a "
                f"vector, {mem['wall_s']:.0f} s. Per process at the end (MiB): "
                + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in mem["per_process_end"].items())
                + ". Router/proxy RSS (MiB) start/after-100/end: "
                + "; ".join(
                    f"{k} " + "/".join(f"{x / 2**20:.0f}" for x in v.values())
                    for k, v in mem.get("other_processes_rss_bytes", {}).items()
                )
                + f". Replica counters after: `{json.dumps(_strip(mem.get('replica_stats_after')))}`.",
                "",
            ]
            if mem.get("settled_bytes"):
                L += [
                    f"Settled ({mem['settled_s']:.0f} s after the last answer, the engine idle; worker malloc_trims "
                    f"before/after the run {mem.get('worker_trims_before_after')}), MiB per process: "
                    + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in mem["per_process_settled"].items())
                    + f"; total {mem['settled_bytes'] / 2**20:.0f} vs "
                    + f"{mem['rss_bytes']['start'] / 2**20:.0f} at the start "
                    f"({_f(100 * mem['settled_vs_start'], '{:+.2f}%')}). The KV cache is resident from the start "
                    "(pre-faulted), so what end adds over after-100 and settled gives back is the allocators' "
                    "high-water mark under load; what settled keeps over start, the run left behind.",
                    "",
                ]
    if res.get("notes"):
        L += ["## Notes", "", *res["notes"], ""]
    notes = Path(__file__).with_name("NOTES.md")
    if notes.exists() and not res.get("quick"):
        L += [notes.read_text().strip(), ""]
    if res.get("errors"):
        L += ["## Errors", "", *(f"- {e}" for e in res["errors"]), ""]
    return "\n".join(L)


def _strip(d):
    if not isinstance(d, dict):
        return d
    return {k: v for k, v in d.items() if k != "workers"}


# -- plot ------------------------------------------------------------------------------


def ratio_series(res: dict) -> dict[str, list[dict]]:
    """The plot's ratio lines, {"hs": [...], "serve": [...]}: each {label, marker, ls, points: [(concurrency,
    ratio, (low, high) or None)]}, the interval the ratio's recorded `req_per_s_ci95` (None before those were
    recorded, or with too few rounds). Ratios that are None are left out."""
    out: dict[str, list[dict]] = {"hs": [], "serve": []}

    def add(panel, label, bc, get, key="req_per_s", marker="o", ls="-"):
        points = []
        for c, row in bc.items():
            r = get(row)
            if r is not None and r.get(key) is not None:
                ci = r.get(f"{key}_ci95")
                points.append((c, r[key], tuple(ci) if ci else None))
        if points:
            no_ci = "" if any(ci for _, _, ci in points) else " (no 95% CI)"
            out[panel].append({"label": label + no_ci, "marker": marker, "ls": ls, "points": points})

    for model, m in res.get("models", {}).items():
        bc = m.get("hs", {}).get("by_concurrency", {})
        add("hs", f"{model} req/s", bc, lambda row: row["ratio"])
        add("hs", f"{model} tok/s", bc, lambda row: row["ratio"], key="out_tok_per_s", marker="x", ls=":")
        add(
            "hs",
            f"{model} A/A control (off / off again)",
            bc,
            lambda row: row.get("control_ratio"),
            marker=".",
            ls="--",
        )
        bc = m.get("positions", {}).get("by_concurrency", {})
        add("hs", f"{model} rows float16 / off", bc, lambda row: row["f16_vs_off"], marker="v")
        add("hs", f"{model} rows top-{T.POSITIONS_TOPK} / off", bc, lambda row: row["topk_vs_off"], marker="^")
        add("hs", f"{model} rows A/A control", bc, lambda row: row.get("control_ratio"), marker=".", ls="--")
        bc = m.get("serve", {}).get("by_concurrency", {})
        add("serve", f"{model}: ours / vLLM", bc, lambda row: row["ours_vs_vllm"])
        add("serve", f"{model}: ours / Ray Serve LLM", bc, lambda row: row["ours_vs_rsllm"], marker="s")
        add("serve", f"{model}: Ray Serve LLM / vLLM", bc, lambda row: row["rsllm_vs_vllm"], marker="^", ls=":")
        add(
            "serve",
            f"{model}: ours (Router's own port) / vLLM",
            bc,
            lambda row: row.get("port_vs_vllm"),
            marker="P",
            ls="-.",
        )
        add(
            "serve",
            f"{model}: ours (ingress: replica) / vLLM",
            bc,
            lambda row: row.get("direct_vs_vllm"),
            marker="D",
            ls="--",
        )
    return out


def error_bars(points: list[tuple]) -> tuple[list[float], list[float]]:
    """matplotlib's yerr for a series' points: how far each interval reaches below and above its ratio
    (0 where there is none; a ratio outside its bootstrap interval gets 0 on that side)."""
    return (
        [max(0.0, y - ci[0]) if ci else 0.0 for _, y, ci in points],
        [max(0.0, ci[1] - y) if ci else 0.0 for _, y, ci in points],
    )


def _draw_ratios(ax, series: list[dict]) -> None:
    """Each series with its 95% intervals as error bars, on one x slot per concurrency (series side by side)."""
    cs = sorted({c for s in series for c, _, _ in s["points"]}, key=lambda c: float(c))
    slot = {c: i for i, c in enumerate(cs)}
    for k, s in enumerate(series):
        dx = 0.05 * (k - (len(series) - 1) / 2)
        ax.errorbar(
            [slot[c] + dx for c, _, _ in s["points"]],
            [y for _, y, _ in s["points"]],
            yerr=error_bars(s["points"]),
            marker=s["marker"],
            ls=s["ls"],
            capsize=3,
            label=s["label"],
        )
    ax.set_xticks(range(len(cs)), cs)


def plot(res: dict, path: Path) -> bool:
    """The four panels; every ratio drawn with its 95% interval as error bars where one was recorded."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    models = res.get("models", {})
    series = ratio_series(res)
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    _draw_ratios(ax, series["hs"])
    ax.axhline(T.HS_THROUGHPUT_MIN, color="red", ls="--", lw=1, label=f"target {T.HS_THROUGHPUT_MIN:.2f}")
    ax.set_title("1. Hidden states on / off: throughput ratio (95% CI)")
    ax.set_xlabel("concurrency")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    _draw_ratios(ax, series["serve"])
    ax.axhline(T.SERVE_VS_VLLM_MIN, color="red", ls="--", lw=1, label=f"target ours/vLLM {T.SERVE_VS_VLLM_MIN:.2f}")
    ax.axhline(1.0, color="gray", ls=":", lw=1)
    ax.set_title("2. Serve layer: throughput ratio (req/s, 95% CI)")
    ax.set_xlabel("concurrency")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    pl = res.get("payload", {})
    if pl:
        ds = list(pl)
        x = range(len(ds))
        ax.bar([i - 0.2 for i in x], [pl[d]["float"]["total_ms"] for d in ds], 0.4, label="float list")
        ax.bar([i + 0.2 for i in x], [pl[d]["base64"]["total_ms"] for d in ds], 0.4, label="base64")
        ax.set_xticks(list(x), [f"D={d}" for d in ds])
        ax.set_yscale("log")
        ax.set_ylabel("build + parse, ms per response (log)")
        ax.set_title("3. Payload: time per vector")
        ax.legend(fontsize=8)
    ax = axes[1][1]
    for model, m in models.items():
        mem = m.get("memory")
        if mem and mem.get("series"):
            ax.plot(
                [t for t, _ in mem["series"]], [v / 2**20 for _, v in mem["series"]], label=f"{model} replica + engine"
            )
            a100 = list(mem["rss_bytes"].values())[1] / 2**20
            ax.axhline(a100 * (1 + T.MEMORY_GROWTH_MAX), color="red", ls="--", lw=1, label="after-100 + 5%")
            ax.axhline(a100, color="gray", ls=":", lw=1, label="after-100")
    ax.set_title("4. Replica resident memory (RSS, MiB) over the run")
    ax.set_xlabel("seconds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def write(res: dict, out: Path, quick: bool) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if quick else ""
    res["targets"] = target_rows(res)
    paths = []
    png = out / f"plot{suffix}.png"
    try:
        has_plot = plot(res, png)
    except Exception as e:  # the plot is a nicety
        res.setdefault("errors", []).append(f"plot failed: {type(e).__name__}: {e}")
        has_plot = False
    if has_plot:
        paths.append(png)
    js = out / f"results{suffix}.json"
    js.write_text(json.dumps(res, indent=1, default=str))
    paths.append(js)
    md = out / f"summary{suffix}.md"
    md.write_text(markdown(res, png.name if has_plot else None))
    paths.append(md)
    return paths


def command_line(module: str, args) -> str:
    """The command that produced a result, as the result's Markdown records it."""
    return (
        f"`.venv/bin/python -m {module} "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())
        + "`"
    )


def write_results(name: str, results, text: str) -> None:
    """Prints `text` and writes bench/results/<name>.json (the figures) and .md (`text`)."""
    from bench.procs import ROOT

    print(text)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / f"{name}.md").write_text(text)


def main(argv=None) -> int:
    """`python -m bench.report RESULTS_JSON ...`: each recorded run's plot drawn again from its results JSON
    (plot.png next to it, plot-quick.png for a --quick run), its summary untouched; nothing is run."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.report", description=main.__doc__)
    ap.add_argument(
        "results",
        nargs="+",
        type=Path,
        help="a `python -m bench` results JSON, e.g. bench/results/tiny-hs-long/results.json",
    )
    ap.add_argument("--out", type=Path, help="where to write the PNG (one results JSON only); default: next to it")
    args = ap.parse_args(argv)
    if args.out and len(args.results) > 1:
        ap.error("--out takes one results JSON")
    for js in args.results:
        res = json.loads(js.read_text())
        if not res.get("models") and not res.get("payload"):
            print(f"{js}: not a `python -m bench` results JSON (no models, no payload)")
            return 1
        png = args.out or js.with_name(f"plot{'-quick' if res.get('quick') else ''}.png")
        if not plot(res, png):
            print("matplotlib is not installed: `make bench` installs pyproject's bench extra")
            return 1
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
