"""Figures: percentiles, paired ratio intervals, CPU time by process role."""

from __future__ import annotations

import os
import time
from collections import defaultdict

import numpy as np
import psutil


def pct(values, q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


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

ROLE_TITLES = [
    # (substring of the process title, role suffix) for Ray workers
    ("ServeReplica:hidden-states:Router", "ours: router"),
    ("ServeReplica:hidden-states:EngineReplica", "ours: replica"),
    ("ServeReplica:hs-direct:EngineReplica", "direct: replica"),
    ("ServeReplica:rsllm:LLMServer", "rsllm: server"),
    ("ServeReplica:rsllm:", "rsllm: ingress"),
    ("ProxyActor", "serve: proxy"),
    ("ServeController", "serve: controller"),
]


class CpuAccount:
    """Snapshots of every process's CPU seconds; deltas are attributed to roles.

    Roots: the bench process itself ("client"), the Ray cluster's `ray start`,
    vLLM's server. Engine-core processes (VLLM::EngineCore / VLLM::Worker) take
    the role of their nearest titled ancestor with ": engine". Everything the
    benchmark did not start is "other (not ours)" (system CPU busy minus ours).
    """

    def __init__(self):
        self.roots: dict[int, str] = {os.getpid(): "client"}

    def add_root(self, pid: int, role: str) -> None:
        self.roots[pid] = role

    def snapshot(self) -> dict:
        procs = {}
        for p in psutil.process_iter(["pid", "ppid", "cmdline", "name", "cpu_times"]):
            info = p.info
            ct = info.get("cpu_times")
            if ct is None:
                continue
            title = " ".join(info.get("cmdline") or []) or (info.get("name") or "")
            procs[info["pid"]] = (info["ppid"], title, ct.user + ct.system)
        sys_t = psutil.cpu_times()
        busy = sum(sys_t) - sys_t.idle - getattr(sys_t, "iowait", 0.0)
        return {"t": time.perf_counter(), "procs": procs, "busy": busy}

    def _role(self, pid: int, procs: dict) -> str | None:
        chain = []
        cur = pid
        for _ in range(64):
            if cur not in procs:
                break
            chain.append(cur)
            if cur in self.roots:
                break
            cur = procs[cur][0]
        else:
            return None
        if not chain or chain[-1] not in self.roots:
            return None
        root_role = self.roots[chain[-1]]
        if root_role == "client":
            return "client" if pid == chain[-1] else "client: children"
        engine = any(t in procs[pid][1] for t in ("VLLM::EngineCore", "VLLM::Worker", "EngineCore", "VLLM::"))
        for c in chain:
            title = procs[c][1]
            for needle, role in ROLE_TITLES:
                if needle in title:
                    return role + (": engine" if engine and c != pid else "")
        if root_role == "vllm":
            return "vllm: engine" if engine else "vllm: api server"
        return f"{root_role}: {_short_name(procs[pid][1])}"  # e.g. "ray: raylet"

    @staticmethod
    def group(role: str) -> str:
        """'ray: raylet' -> 'ray' (the daemons, the driver and idle workers of the Ray cluster)."""
        return "ray: system" if role.startswith("ray: ") else role

    def delta(self, a: dict, b: dict) -> dict:
        roles: dict[str, float] = defaultdict(float)
        for pid, (_ppid, _title, cpu) in b["procs"].items():
            prev = a["procs"].get(pid)
            base = prev[2] if prev is not None else 0.0  # started during the window: all its CPU is in it
            role = self._role(pid, b["procs"])
            if role is None:
                continue
            roles[role] += max(0.0, cpu - base)
        ours = sum(roles.values())
        busy = b["busy"] - a["busy"]
        roles["other (not ours)"] = max(0.0, busy - ours)
        grouped: dict[str, float] = defaultdict(float)
        for k, v in roles.items():
            grouped[self.group(k)] += v
        return {
            "wall": b["t"] - a["t"],
            "busy": busy,
            "roles": dict(grouped),
            "ray_system_detail": {k: v for k, v in roles.items() if k.startswith("ray: ")},
        }


def _short_name(title: str) -> str:
    words = title.split()
    if not words:
        return "?"
    if words[0].startswith("ray::"):
        return words[0][5:]
    if "serve" in words[0].rsplit("/", 1)[-1] and len(words) > 1 and words[1] == "run":
        return "serve run (driver)"
    for w in words[1:]:
        if w.endswith(".py"):
            return w.rsplit("/", 1)[-1]
        if w == "-m":
            continue
    if len(words) > 2 and words[1] == "-m":
        return words[2]
    return words[0].rsplit("/", 1)[-1]
