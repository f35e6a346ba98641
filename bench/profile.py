"""py-spy profiles of the Serve layer's processes during a run (and of vLLM's own API server).

`py-spy record --nonblocking --format raw` on each process at once while a
batch runs; the folded stacks go to bench/.work/profiles/ (not kept in git), and a summary (the
functions with the most samples, inclusive and self) goes into the results.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import psutil

from bench.procs import BIN

# Leaf frames where a thread waits in C (event loops, Ray's task loop, idle pool threads): py-spy
# --nonblocking cannot always tell these from work, so they are counted apart as "waiting".
IDLE_LEAVES = {"Worker.main_loop", "_run_user_code_event_loop", "_run_router_event_loop", "Thread.run", "_worker",
               "run_forever", "_run_once", "select", "wait", "sleep", "main_loop", "serve_forever", "Event.wait",
               "Condition.wait", "Queue.get", "_bootstrap_inner", "_bootstrap"}

IDLE_FRAMES = {"run (uvloop/__init__.py)", "Runner.run (asyncio/runners.py)"}


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Per thread: (name, CPU seconds). Ray's and vLLM's native threads show here, not in py-spy."""
    out = {}
    try:
        for t in psutil.Process(pid).threads():
            try:
                name = Path(f"/proc/{pid}/task/{t.id}/comm").read_text().strip()
            except OSError:
                name = "?"
            out[t.id] = (name, t.user_time + t.system_time)
    except psutil.Error:
        pass
    return out


def thread_delta(a: dict, b: dict, requests: int, top: int = 8) -> dict:
    by_name: Counter = Counter()
    for tid, (name, cpu) in b.items():
        by_name[name] += cpu - (a[tid][1] if tid in a else 0.0)
    total = sum(by_name.values())
    return {"cpu_s": total, "cpu_ms_per_request": 1e3 * total / max(1, requests),
            "threads_ms_per_request": [(n, 1e3 * v / max(1, requests)) for n, v in by_name.most_common(top) if v > 0]}


def record(pids: dict[str, int], out_dir: Path, duration: int, run_load, rate: int = 100) -> dict:
    """Profiles every pid for `duration` s while `run_load()` (returns its request count) is called repeatedly."""
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = {}
    for name, pid in pids.items():
        path = out_dir / f"{name}.folded.txt"
        procs[name] = (subprocess.Popen(
            [str(BIN / "py-spy"), "record", "--pid", str(pid), "--duration", str(duration), "--rate", str(rate),
             "--nonblocking", "--format", "raw", "--output", str(path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True), path)
    time.sleep(1.0)
    before = {name: thread_cpu(pid) for name, pid in pids.items()}
    deadline = time.monotonic() + duration - 1.0
    requests = 0
    while time.monotonic() < deadline:
        requests += run_load()
    after = {name: thread_cpu(pid) for name, pid in pids.items()}
    summaries = {}
    for name, (p, path) in procs.items():
        try:
            _, err = p.communicate(timeout=duration + 60)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        summaries[name] = summarize(path) if path.exists() else {"error": (err or b"").decode(errors="replace")[-500:]}
        summaries[name]["pid"] = pids[name]
        summaries[name]["requests"] = requests
        summaries[name]["threads"] = thread_delta(before[name], after[name], requests)
        summaries[name]["file"] = str(path)
    return summaries


def _short(frame: str) -> str:
    # "func (path/to/module.py:123)" -> "func (module.py)"
    m = re.match(r"^(.*?) \((.*?)(?::\d+)?\)$", frame)
    if not m:
        return frame
    fn, path = m.groups()
    parts = path.split("/")
    if "site-packages" in parts:
        parts = parts[parts.index("site-packages") + 1:]
    elif "main" in parts:
        parts = parts[parts.index("main") + 1:]
    return f"{fn} ({'/'.join(parts[-3:])})"


def summarize(path: Path, top: int = 12) -> dict:
    inclusive: Counter = Counter()
    self_: Counter = Counter()
    total = waiting = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_short(f) for f in stack.split(";") if f and not f.startswith("process ") and not f.startswith("thread ")]
        if not frames:
            continue
        total += n
        if frames[-1].split(" (")[0] in IDLE_LEAVES or frames[-1] in IDLE_FRAMES:
            waiting += n
            continue
        for f in set(frames):
            inclusive[f] += n
        self_[frames[-1]] += n
    busy = total - waiting
    # thread roots (in nearly every busy sample) say nothing: left out of the inclusive list
    skip = lambda f: (f.startswith("<module>") or f.split(" (")[0] in IDLE_LEAVES or f in IDLE_FRAMES
                      or inclusive[f] >= 0.8 * busy)
    return {
        "samples": total, "waiting_samples": waiting, "busy_samples": busy,
        # shares of the busy samples
        "top_inclusive": [(f, n, n / busy) for f, n in inclusive.most_common(top * 3) if not skip(f)][:top] if busy else [],
        "top_self": [(f, n, n / busy) for f, n in self_.most_common(top)] if busy else [],
    }
