"""Figures: paired ratio intervals, CPU time by process role."""

from __future__ import annotations

import os
import re
import time
from collections import defaultdict

import numpy as np
import psutil

CI_MIN_ROUNDS = 5  # fewer paired rounds give no interval worth printing


def paired_ratio_ci(
    a: list[tuple[int, float]], b: list[tuple[int, float]], level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float] | None:
    """Percentile-bootstrap interval (scipy.stats.bootstrap) of the pooled throughput ratio (sum done / sum
    wall of arm a over that of arm b), resampling whole rounds with their pairing kept. `a[i]` and `b[i]` are
    (requests or tokens done, wall seconds) of round i. None with fewer than CI_MIN_ROUNDS rounds."""
    from scipy.stats import bootstrap

    n = min(len(a), len(b))
    if n < CI_MIN_ROUNDS:
        return None
    cols = np.asarray([(*a[i], *b[i]) for i in range(n)], dtype=float).T

    def pooled(a_done, a_wall, b_done, b_wall, axis=-1):
        with np.errstate(divide="ignore", invalid="ignore"):
            return (a_done.sum(axis) / a_wall.sum(axis)) / (b_done.sum(axis) / b_wall.sum(axis))

    res = bootstrap(
        tuple(cols),
        pooled,
        paired=True,
        vectorized=True,
        n_resamples=resamples,
        confidence_level=level,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    lo, hi = res.confidence_interval
    return (float(lo), float(hi)) if np.isfinite(lo) and np.isfinite(hi) else None


def ci_text(ci) -> str:
    """A ratio's 95% interval, or '-' with too few rounds."""
    return f"{ci[0]:.3f}..{ci[1]:.3f}" if ci else "-"


# -- CPU time by role ----------------------------------------------------------

DEPLOYMENT_ROLE = {"Router": "router", "EngineReplica": "replica", "LLMServer": "server"}
ENGINE_TITLES = ("VLLM::", "EngineCore")


class CpuAccount:
    """Snapshots of every process's CPU seconds (psutil); deltas attributed to roles by process title.

    Roots: this process ("client"; its children "client: children") and each `add_root(pid, name)`: a Ray
    cluster's `ray start` or vLLM's server. Under a root, a Serve replica is `<app>: router|replica|server|ingress`
    (from its title `ServeReplica:<app>:<deployment>`), Serve's proxy and controller `<name>: proxy|controller`,
    HAProxy `<name>: haproxy`, anything else `<name>: daemons`; vLLM's engine processes (VLLM::EngineCore,
    VLLM::Worker) take their nearest titled ancestor's role with ": engine" (under vLLM's server `vllm: engine`,
    the rest `vllm: api server`). CPU the machine spent outside every root is "other (not ours)". `idle`: each
    role's cores with no load, from `measure_idle`.
    """

    def __init__(self):
        self.roots: dict[int, str] = {os.getpid(): "client"}
        self.idle: dict[str, float] = {}

    def add_root(self, pid: int, name: str) -> None:
        self.roots[pid] = name

    def snapshot(self) -> dict:
        procs = {}
        for p in psutil.process_iter(["pid", "ppid", "cmdline", "name", "cpu_times"]):
            info = p.info
            if (ct := info.get("cpu_times")) is not None:
                title = " ".join(info.get("cmdline") or []) or (info.get("name") or "")
                procs[info["pid"]] = (info["ppid"], title, ct.user + ct.system)
        sys_t = psutil.cpu_times()
        return {"t": time.perf_counter(), "procs": procs, "busy": sum(sys_t) - sys_t.idle - getattr(sys_t, "iowait", 0)}

    def role(self, pid: int, procs: dict) -> str | None:
        chain, cur = [], pid
        while cur in procs and cur not in self.roots and len(chain) < 64:
            chain.append(cur)
            cur = procs[cur][0]
        if cur not in self.roots:
            return None
        root, title = self.roots[cur], procs[pid][1] if pid in procs else ""
        if root == "client":
            return "client" if pid == cur else "client: children"
        engine = any(t in title for t in ENGINE_TITLES)
        if root == "vllm":
            return "vllm: engine" if engine else "vllm: api server"
        if os.path.basename(title.split(" ", 1)[0]) == "haproxy":
            return f"{root}: haproxy"
        for c in chain:
            t = procs[c][1]
            if m := re.search(r"ServeReplica:([\w.-]+):(\w+)", t):
                app, dep = m.groups()
                return f"{app}: {DEPLOYMENT_ROLE.get(dep, 'ingress')}" + (": engine" if engine and c != pid else "")
            if "ProxyActor" in t:
                return f"{root}: proxy"
            if "ServeController" in t:
                return f"{root}: controller"
        return f"{root}: daemons"

    def delta(self, a: dict, b: dict) -> dict:
        """{wall, busy, roles: CPU seconds by role} between two snapshots (a process started since: all of its)."""
        roles: dict[str, float] = defaultdict(float)
        for pid, (_, _, cpu) in b["procs"].items():
            if (role := self.role(pid, b["procs"])) is not None:
                prev = a["procs"].get(pid)
                roles[role] += max(0.0, cpu - (prev[2] if prev is not None else 0.0))
        busy = b["busy"] - a["busy"]
        roles["other (not ours)"] = max(0.0, busy - sum(roles.values()))
        return {"wall": b["t"] - a["t"], "busy": busy, "roles": dict(roles)}

    def measure_idle(self, seconds: float) -> None:
        a = self.snapshot()
        time.sleep(seconds)
        d = self.delta(a, self.snapshot())
        self.idle = {k: v / d["wall"] for k, v in d["roles"].items()}
