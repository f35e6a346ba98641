"""The docs say what the code does: every AppArgs field in docs/configuration.md's table with the code's
default (the README's short table agrees where it names one), the metric names docs/operations.md
gives as deployments/metrics.py exports them and the Grafana dashboard queries them, and the `bench`
extra as pyproject.toml has it; the bench plot draws the intervals of the recorded runs the benchmark
page quotes. Each test lists every problem it finds, one line each. No vLLM, no Ray: AppArgs is
pydantic; metrics.py is read with `ast`.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from bench import report
from deployments.config import AppArgs, AutoscalingConfig
from tests.docs_metrics import dashboard_metric_names, documented_metric_names, exported_metric_names
from tests.scaffolding.test_docs import ROOT, readme

CONFIGURATION = ROOT / "docs" / "configuration.md"
RESULTS = ROOT / "bench" / "results"
UNREAD = object()  # a documented default that is not a plain value (prose: "CPU: float32, ...")
UNITS = {"": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
# The ratios bench/report.py's plot draws (hs, positions and serve rows); port/direct against ours or RSLLM are not.
DRAWN = {
    "ratio",
    "control_ratio",
    "f16_vs_off",
    "topk_vs_off",
    "ours_vs_vllm",
    "ours_vs_rsllm",
    "rsllm_vs_vllm",
    "port_vs_vllm",
    "direct_vs_vllm",
}


def cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def arg_rows(path: Path) -> list[tuple[list[str], str]]:
    """(arg names, default cell) of every row of the page's tables whose first column is `arg`."""
    rows, in_table = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        row = cells(line)
        if row[0] == "arg":
            in_table = True
        elif in_table and not set(row[0]) <= set("-: "):
            rows.append((re.findall(r"`([^`]+)`", row[0]), row[1]))
    return rows


def value(text: str):
    """A documented default as a value: `true`/`false`, none, a number (with KiB/MiB/GiB), a `string`;
    what follows a leading value in parentheses or after ': ' explains it. UNREAD for prose."""
    text = text.strip()
    if m := re.match(r"`([^`]*)`", text):
        word, code = m.group(1), True
    else:
        word, code = re.split(r" \(|: |; ", text)[0].strip(), False
    if word in ("true", "false"):
        return word == "true"
    if word in ("none", "null"):
        return None
    if m := re.fullmatch(r"(\d+(?:\.\d+)?) ?(KiB|MiB|GiB)?", word):
        number = float(m.group(1)) * UNITS[m.group(2) or ""]
        return int(number) if number.is_integer() else number
    return word if code else UNREAD


def default_problem(doc: str, name: str, written: str) -> str | None:
    """Where the documented default disagrees with the code's: scalars, none for an empty list or dict,
    `K=V` for each entry of a filled dict, MIN..MAX for autoscaling."""
    code = AppArgs.model_fields[name].get_default(call_default_factory=True)
    got = value(written)
    if isinstance(code, (list, dict)) and not code:
        ok = got is UNREAD or got is None  # prose for an empty default is fine ("CPU: float32, ..."); none is right
    elif code is None or isinstance(code, bool):
        ok = got is code
    elif isinstance(code, (int, float)):
        ok = isinstance(got, (int, float)) and not isinstance(got, bool) and float(got) == float(code)
    elif isinstance(code, str):
        ok = got == code
    elif isinstance(code, AutoscalingConfig):
        ok = written == f"{code.min_replicas}..{code.max_replicas}"
    elif isinstance(code, dict):
        ok = all(f"`{k}={v}`" in written for k, v in code.items())  # serve_env: each entry as `K=V`
    else:
        return None
    return None if ok else f"{doc}: `{name}` default written {written!r}; the code's is {code!r}"


def table_problems(path: Path, complete: bool) -> list[str]:
    doc = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    rows = arg_rows(path)
    if not rows:
        return [f"{doc}: no table with an `arg` column"]
    fields, problems, seen = AppArgs.model_fields, [], set()
    for names, written in rows:
        defaults = [written] if len(names) == 1 else [d.strip() for d in written.split(",")]
        if len(defaults) == 1:
            defaults *= len(names)
        if len(defaults) != len(names):
            problems.append(f"{doc}: {len(names)} args {names} but {len(defaults)} defaults {written!r}")
            continue
        for name, d in zip(names, defaults):
            seen.add(name)
            if name not in fields:
                problems.append(f"{doc}: `{name}` is no AppArgs field")
            elif p := default_problem(doc, name, d):
                problems.append(p)
    if complete:
        problems += [f"{doc}: AppArgs.{n} is in no table" for n in fields if n not in seen]
    return problems


def test_every_app_arg_is_documented_with_the_codes_default():
    problems = table_problems(CONFIGURATION, complete=True)
    assert not problems, f"{len(problems)} problems:\n  " + "\n  ".join(problems)


def test_the_readmes_args_agree_with_the_code():
    problems = table_problems(readme(), complete=False)
    assert not problems, f"{len(problems)} problems:\n  " + "\n  ".join(problems)


def test_every_app_arg_has_a_description():
    missing = [n for n, f in AppArgs.model_fields.items() if not f.description]
    assert not missing, f"AppArgs fields without a description: {missing}"


def test_documented_metrics_are_the_exported_ones():
    """docs/operations.md names each of our metrics as scraped (prefix, `_total`, histogram samples)
    and every metric the dashboard queries; vLLM's it names only as the dashboard queries them."""
    documented, exported, dashboard = documented_metric_names(), exported_metric_names(), dashboard_metric_names()
    assert documented and exported and dashboard, (documented, exported, dashboard)
    ours = "ray_hidden_states_"
    problems = [
        f"docs/operations.md names {n}: deployments/metrics.py exports no such sample"
        for n in documented
        if n.startswith(ours) and n not in exported
    ]
    problems += [
        f"docs/operations.md names {n}: not ours, and not a name the dashboard queries"
        for n in documented
        if not n.startswith(ours) and n not in dashboard
    ]
    problems += [
        f"deployments/metrics.py exports {n} ({kind}): docs/operations.md does not name it"
        for n, kind in exported.items()
        if n not in documented
    ]
    problems += [
        f"cluster/grafana-dashboard.json queries {n}: deployments/metrics.py exports no such sample"
        for n in sorted(dashboard)
        if n.startswith(ours) and n not in exported
    ]
    problems += [
        f"cluster/grafana-dashboard.json queries {n}: docs/operations.md does not name it"
        for n in sorted(dashboard)
        if n not in documented
    ]
    assert not problems, f"{len(problems)} problems:\n  " + "\n  ".join(problems)


def test_the_bench_extra_is_pyprojects():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]
    want = sorted(re.split(r"[<>=!~\[; ]", x)[0] for x in extra)
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    m = re.search(r"`bench` extra: ([^)]+)\)", " ".join(text.split()))
    assert m, "docs/benchmarks.md no longer says what the `bench` extra installs"
    written = sorted(re.split(r", | and ", m.group(1)))
    assert written == want, f"docs/benchmarks.md says the bench extra is {written}; pyproject.toml's is {want}"


def quoted_runs() -> list[Path]:
    """The `python -m bench` results JSONs of the runs docs/benchmarks.md quotes: bench/results/NAME/,
    and the full run (bench/results/summary.md, results.json)."""
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    dirs = {RESULTS / d for d in re.findall(r"bench/results/([\w-]+)", text)}
    return [RESULTS / "results.json", *sorted(js for d in dirs if d.is_dir() for js in d.glob("results*.json"))]


def test_the_plot_draws_the_quoted_intervals():
    """tiny-hs-long's 0.935x (0.891..0.981) at c=8, as docs/benchmarks.md quotes it, becomes that error bar."""
    series = report.ratio_series(json.loads((RESULTS / "tiny-hs-long" / "results.json").read_text()))
    by = {s["label"]: s["points"] for s in series["hs"]}
    c, y, ci = by["tiny-llama req/s"][0]
    assert (c, round(y, 3), tuple(round(x, 3) for x in ci)) == ("8", 0.935, (0.891, 0.981))
    low, high = report.error_bars(by["tiny-llama req/s"])
    assert (round(low[0], 4), round(high[0], 4)) == (round(y - ci[0], 4), round(ci[1] - y, 4))
    assert all(ci for _, _, ci in by["tiny-llama A/A control (off / off again)"])
    assert "tiny-llama tok/s (no 95% CI)" in by  # tok/s ratios carry no interval: said, not drawn as zero-width
    assert report.error_bars([("1", 1.0, None), ("8", 0.9, (0.95, 1.1))]) == ([0.0, 0.0], [0.0, pytest.approx(0.2)])


def test_every_quoted_run_is_drawable(tmp_path):
    """Each run docs/benchmarks.md quotes: every ratio with a recorded interval is drawn with it."""
    runs = quoted_runs()
    assert len(runs) >= 10, runs
    problems = []
    for js in runs:
        res = json.loads(js.read_text())
        drawn = [ci for ss in report.ratio_series(res).values() for s in ss for _, _, ci in s["points"]]
        recorded = [
            r["req_per_s_ci95"]
            for m in res.get("models", {}).values()
            for part in ("hs", "positions", "serve")
            for row in m.get(part, {}).get("by_concurrency", {}).values()
            for k, r in row.items()
            if k in DRAWN and r.get("req_per_s_ci95")
        ]
        if sorted(map(tuple, recorded)) != sorted(ci for ci in drawn if ci):
            problems.append(
                f"{js.relative_to(ROOT)}: {len(recorded)} intervals recorded, {sum(map(bool, drawn))} drawn"
            )
    assert not problems, f"{len(problems)} problems:\n  " + "\n  ".join(problems)
    assert_plots(tmp_path)


def assert_plots(tmp_path: Path) -> None:
    """The full run (every panel) and one with intervals, drawn to PNG files. matplotlib is the test extra's
    (and the bench extra's): missing, this fails, it does not skip."""
    import matplotlib  # noqa: F401  (an ImportError here names what `make test`'s set-up did not install)

    for js in (RESULTS / "results.json", RESULTS / "tiny-hs-long" / "results.json"):
        png = tmp_path / f"{js.parent.name}.png"
        assert report.plot(json.loads(js.read_text()), png), f"{js}: bench.report.plot drew nothing"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, png


def test_without_matplotlib_the_plot_check_fails(tmp_path, monkeypatch):
    """The breaking variant: matplotlib unimportable (as it was under `make test` before the test extra
    declared it) fails the check instead of skipping it; so does a plot that draws nothing."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.raises(ImportError):
        assert_plots(tmp_path)
    monkeypatch.undo()
    monkeypatch.setattr(report, "plot", lambda res, path: False)
    with pytest.raises(AssertionError, match="drew nothing"):
        assert_plots(tmp_path)


def test_the_checks_can_fail(tmp_path):
    assert value("`true`") is True and value("none (from `model`)") is None and value("64 MiB") == 64 * 2**20
    assert value("`router`") == "router" and value("60") == 60 and value("CPU: float32, eager") is UNREAD
    assert default_problem("d", "max_n", "16") is None and default_problem("d", "max_n", "17")
    assert default_problem("d", "access_log", "`true`") and default_problem("d", "warm_up_s", "`11`")
    assert default_problem("d", "api_key", "none") is None and default_problem("d", "api_key", "`k`")
    assert default_problem("d", "replica_env", "none") is None and default_problem("d", "engine", "CPU: x") is None
    assert default_problem("d", "replica_autoscaling", "1..1") is None
    assert default_problem("d", "router_autoscaling", "1..2")
    assert default_problem("d", "serve_env", "`RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0`") is None
    assert default_problem("d", "serve_env", "`RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=1`")
    page = tmp_path / "page.md"
    page.write_text(
        "| arg | default |\n| --- | --- |\n| `max_n`, `nope` | 16, 1 |\n\n"
        "`ray_a_total`, `ray_b_{bucket,sum}`, `ray_` and `grep '^ray_(a|b)_'`\n"
    )
    assert arg_rows(page) == [(["max_n", "nope"], "16, 1")]
    assert table_problems(page, complete=False) == ["page.md: `nope` is no AppArgs field"]
    assert "page.md: AppArgs.model is in no table" in table_problems(page, complete=True)
    assert documented_metric_names(page) == ["ray_a_total", "ray_b_bucket", "ray_b_sum"]
    code = tmp_path / "m.py"
    code.write_text('a = Counter("x", "d")\nb = Histogram("y", boundaries=[1])\nc = Gauge("z")\nd = Counter(name)\n')
    assert exported_metric_names(code) == {
        "ray_x_total": "Counter",
        "ray_y_bucket": "Histogram",
        "ray_y_sum": "Histogram",
        "ray_y_count": "Histogram",
        "ray_z": "Gauge",
    }
