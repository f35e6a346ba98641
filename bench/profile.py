"""py-spy profiles of the Serve layer's processes during a run (and of vLLM's own API server).

`py-spy record --nonblocking --format raw` on each process at once while a
batch runs; the folded stacks go to bench/results/profiles/, and a summary (the
functions with the most samples, inclusive and self) goes into the results.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections import Counter
from pathlib import Path

from bench.procs import BIN

IDLE = re.compile(r"^(select|poll|epoll_wait|_run_once|run_forever|wait|_worker|sleep|recv|accept)\b")


def record(pids: dict[str, int], out_dir: Path, duration: int, run_load, rate: int = 50) -> dict:
    """Profiles every pid for `duration` s while `run_load()` is called repeatedly."""
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = {}
    for name, pid in pids.items():
        path = out_dir / f"{name}.folded.txt"
        procs[name] = (subprocess.Popen(
            [str(BIN / "py-spy"), "record", "--pid", str(pid), "--duration", str(duration), "--rate", str(rate),
             "--nonblocking", "--format", "raw", "--output", str(path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True), path)
    time.sleep(1.0)
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        run_load()
    summaries = {}
    for name, (p, path) in procs.items():
        try:
            _, err = p.communicate(timeout=duration + 60)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        summaries[name] = summarize(path) if path.exists() else {"error": (err or b"").decode(errors="replace")[-500:]}
        summaries[name]["pid"] = pids[name]
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
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_short(f) for f in stack.split(";") if f and not f.startswith("process ") and not f.startswith("thread ")]
        if not frames:
            continue
        total += n
        for f in set(frames):
            inclusive[f] += n
        self_[frames[-1]] += n
    return {
        "samples": total,
        "top_inclusive": [(f, n, n / total) for f, n in inclusive.most_common(top * 3)
                          if not f.startswith("<module>") and "_bootstrap" not in f][:top] if total else [],
        "top_self": [(f, n, n / total) for f, n in self_.most_common(top)] if total else [],
    }
