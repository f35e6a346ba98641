"""Metrics on Ray's Prometheus endpoint (the session's node exports on METRICS_PORT): vLLM's
engine metrics and this server's own, with values that move by what this test sent."""

from __future__ import annotations

import re
import time

import httpx

from tests.serve.conftest import METRICS_PORT, METRICS_REPORT_INTERVAL_S

SCRAPE = f"http://127.0.0.1:{METRICS_PORT}/metrics"


def scrape() -> dict[str, float]:
    """Sum of every sample of each metric name (over tags, replicas, apps)."""
    sums: dict[str, float] = {}
    for line in httpx.get(SCRAPE, timeout=30).text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+([0-9.eE+-]+|NaN)$", line)
        if m and m.group(3) != "NaN":
            sums[m.group(1)] = sums.get(m.group(1), 0.0) + float(m.group(3))
    return sums


def family(sums: dict[str, float], name: str) -> float:
    """One metric's samples: the name as exported, or with the `_total` a counter may carry. Never a
    prefix: `..._accepted_tokens` must not also sum `..._accepted_tokens_per_pos`."""
    return sums.get(name, 0.0) + sums.get(f"{name}_total", 0.0)


REPORT_INTERVAL_S = METRICS_REPORT_INTERVAL_S  # the session's metrics_report_interval_ms: counts arrive this late


def settled() -> dict[str, float]:
    """A scrape after earlier tests' counts have all been exported: unchanged for longer than
    Ray's report interval (two equal reads closer than that can both fall inside one interval)."""
    last, since = scrape(), time.monotonic()
    deadline = since + 120
    while time.monotonic() < deadline:
        time.sleep(REPORT_INTERVAL_S / 2)
        now = scrape()
        if family(now, "ray_hidden_states_vectors") != family(last, "ray_hidden_states_vectors"):
            since = time.monotonic()
        elif time.monotonic() - since > 2 * REPORT_INTERVAL_S + 2:
            return now
        last = now
    return last


def test_vllm_and_our_metrics_count_what_was_sent(serve_app, client):
    before = settled()
    sent = 5
    for i in range(sent):
        client.completions.create(
            model="tiny-llama", prompt=f"metrics {i}", max_tokens=4, extra_body={"return_hidden_states": True}
        )
    # and one that reads a head alone (the app registers the test heads): its outputs counted, no rows
    client.completions.create(
        model="tiny-llama",
        prompt="metrics heads",
        max_tokens=4,
        extra_body={"hidden_states_heads": ["probe"], "hidden_states_position": "all"},
    )
    sent += 1
    refused = httpx.post(
        f"{serve_app}/v1/completions", timeout=30, json={"prompt": "x", "hidden_states_encoding": "hex"}
    )
    assert refused.status_code == 400
    deadline, after = time.monotonic() + 90, before  # Ray exports every few seconds
    while time.monotonic() < deadline:
        after = scrape()
        done = (
            family(after, "ray_hidden_states_vectors") - family(before, "ray_hidden_states_vectors") >= sent
            and family(after, "ray_hidden_states_requests_refused")
            - family(before, "ray_hidden_states_requests_refused")
            >= 1
            and family(after, "ray_vllm_request_success") - family(before, "ray_vllm_request_success") >= sent
        )
        if done:
            break
        time.sleep(REPORT_INTERVAL_S / 2)
    vectors = family(after, "ray_hidden_states_vectors") - family(before, "ray_hidden_states_vectors")
    assert vectors == sent, (vectors, sorted(n for n in after if "hidden_states" in n))
    assert (
        family(after, "ray_hidden_states_requests_refused") - family(before, "ray_hidden_states_requests_refused") == 1
    )
    assert family(after, "ray_vllm_request_success") - family(before, "ray_vllm_request_success") >= sent
    # Histograms and the engine's gauges are there too.
    assert (
        family(after, "ray_hidden_states_computed_tokens_count")
        - family(before, "ray_hidden_states_computed_tokens_count")
        == sent
    )
    head = family(after, "ray_hidden_states_head_outputs") - family(before, "ray_hidden_states_head_outputs")
    assert head >= 5, head  # every position of prompt + completion: at least 4 + 1
    # the probe's 3 float32 scores per position
    assert family(after, "ray_hidden_states_head_bytes") - family(before, "ray_hidden_states_head_bytes") == head * 12
    for name in (
        "ray_hidden_states_vector_bytes",
        "ray_hidden_states_extraction_seconds_count",
        "ray_hidden_states_vector_faults",
        "ray_vllm_num_requests_running",
        "ray_vllm_kv_cache_usage_perc",
    ):
        assert any(n.startswith(name) for n in after), (name, sorted(n for n in after if n.startswith("ray_vllm"))[:40])
    # docs/operations.md names each metric as this scrape shows it, exactly
    from tests.docs_metrics import documented_metric_names

    named = documented_metric_names()
    assert len(named) >= 10 and not [n for n in named if n not in after], (
        [n for n in named if n not in after],
        sorted(n for n in after if n.startswith("ray_hidden")),
    )


def test_the_dashboard_plots_metrics_that_exist(serve_app, client):
    """Every metric cluster/grafana-dashboard.json queries is on the endpoint (after some traffic)."""
    import json
    from pathlib import Path

    client.completions.create(
        model="tiny-llama", prompt="dashboard", max_tokens=2, extra_body={"return_hidden_states": True}
    )
    dash = json.loads((Path(__file__).resolve().parents[2] / "cluster" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    wanted = {re.sub(r"_(bucket|count|sum)$", "", n) for e in exprs for n in re.findall(r"\bray_[a-z_]+", e)}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        names = scrape()
        missing = sorted(w for w in wanted if not any(n.startswith(w) for n in names))
        if not missing:
            return
        time.sleep(REPORT_INTERVAL_S / 2)
    raise AssertionError(f"the dashboard queries metrics the endpoint does not export: {missing}")
