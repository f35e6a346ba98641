"""The docs say what the code does: every AppArgs field in docs/configuration.md's table with the code's
default (the README's short table agrees where it names one), the metric names docs/operations.md
gives as deployments/metrics.py exports them and the Grafana dashboard queries them, and the `bench`
extra as pyproject.toml has it. Each test lists every problem it finds, one line each. No vLLM, no Ray: AppArgs is
pydantic; metrics.py is read with `ast`.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from deployments.config import AppArgs, AutoscalingConfig
from tests.docs_metrics import dashboard_metric_names, documented_metric_names, exported_metric_names
from tests.scaffolding.test_docs import ROOT, readme

CONFIGURATION = ROOT / "docs" / "configuration.md"
UNREAD = object()  # a documented default that is not a plain value (prose: "CPU: float32, ...")
UNITS = {"": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


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
