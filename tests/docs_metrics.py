"""The metric names docs/operations.md gives, and the ones deployments/metrics.py exports, as scraped.

Text and `ast` only (no Ray): the unit tests compare the two and the Grafana dashboard;
tests/serve/test_metrics.py can compare them with a live scrape.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPERATIONS = ROOT / "docs" / "operations.md"
METRICS = ROOT / "deployments" / "metrics.py"
DASHBOARD = ROOT / "cluster" / "grafana-dashboard.json"

# A whole inline code span that is a metric name, `ray_x_total`, or a family of them, `ray_x_{bucket,sum,count}`.
NAME = re.compile(r"(?<!`)`(ray_[a-z0-9_]+?)(?:\{([a-z0-9_]+(?:,[a-z0-9_]+)*)\})?`(?!`)")
# What Prometheus shows for each kind of Ray metric (ray.util.metrics): the `ray_` prefix, plus these suffixes.
SUFFIXES = {"Counter": ("_total",), "Gauge": ("",), "Histogram": ("_bucket", "_sum", "_count")}


def documented_metric_names(path: Path = OPERATIONS) -> list[str]:
    """Every metric name the page writes in code, as scraped (`ray_...`, a `{a,b}` family expanded),
    in the page's order, each once: ours (`ray_hidden_states_*`) and vLLM's (`ray_vllm_*`)."""
    names: dict[str, None] = {}
    for m in NAME.finditer(path.read_text(encoding="utf-8")):
        base, family = m.groups()
        for suffix in family.split(",") if family else ("",):
            names[base + suffix] = None
    return list(names)


def exported_metric_names(path: Path = METRICS) -> dict[str, str]:
    """{scraped name: kind} for every Counter, Gauge and Histogram the module creates with a literal name."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in SUFFIXES
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            for suffix in SUFFIXES[node.func.id]:
                out[f"ray_{node.args[0].value}{suffix}"] = node.func.id
    return out


def dashboard_metric_names(path: Path = DASHBOARD) -> set[str]:
    """Every `ray_...` name the dashboard's panels query."""
    dash = json.loads(path.read_text(encoding="utf-8"))
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    return {n for e in exprs for n in re.findall(r"\bray_[a-z0-9_]+", e)}
