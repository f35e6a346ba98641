"""Processes the benchmark starts: each in its own session, logged to bench/.work/logs, stopped by process
group (SIGTERM, then SIGKILL) and checked. Nothing here stops a process the benchmark did not start; Ray's
workers are found as descendants of the `ray start` process and stopped by pid. And the benches' one writer.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent  # /work/main
WORK = ROOT / "bench" / ".work"
LOGS = WORK / "logs"
BIN = ROOT / ".venv" / "bin"
PYTHON = BIN / "python"
RESULTS = ROOT / "bench" / "results"


class StartError(RuntimeError):
    pass


def free_port(preferred: int, host: str = "127.0.0.1") -> int:
    """The first port from `preferred` on that is free to bind."""
    port = preferred
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                return port
            except OSError:
                port += 1


class Proc:
    """One started command: its own session, a log file, stop by group + tree. `pipes`: its stdin and stdout are
    text pipes to this process, its log takes stderr."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None, cwd=ROOT, pipes: bool = False):
        LOGS.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = LOGS / f"{name}.log"
        self._log = open(self.log_path, "wb")
        io = {"stdout": self._log, "stderr": subprocess.STDOUT, "stdin": subprocess.DEVNULL}
        if pipes:
            io = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": self._log, "text": True, "bufsize": 1}
        env = {**os.environ, **(env or {})}
        self.popen = subprocess.Popen(self.argv, cwd=str(cwd), env=env, start_new_session=True, **io)
        self.pid = self.pgid = self.popen.pid
        self._known: dict[int, psutil.Process] = {}

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def tree(self) -> list[psutil.Process]:
        """The process, its descendants, and whatever is still in its process group (each remembered for stop)."""
        try:
            root = psutil.Process(self.pid)
            procs = {p.pid: p for p in [root, *root.children(recursive=True)]}
        except psutil.Error:
            procs = {}
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(p.pid) == self.pgid:
                    procs.setdefault(p.pid, p)
            except (ProcessLookupError, PermissionError, psutil.Error):
                pass
        self._known.update(procs)
        return list(procs.values())

    def stop(self, timeout: float = 30.0) -> list[int]:
        """SIGTERM the group and every known descendant, then SIGKILL; returns pids still alive (should be [])."""
        self.tree()
        procs = list(self._known.values())
        _signal_all(self.pgid, procs, signal.SIGTERM)
        _, left = psutil.wait_procs(procs, timeout=timeout)
        if left or self.alive():
            _signal_all(self.pgid, left, signal.SIGKILL)
            psutil.wait_procs(left, timeout=10)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
        return [p.pid for p in procs if p.is_running() and alive(p.pid)]


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal_all(pgid: int, procs, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def wait_until(
    check: Callable[[], bool],
    timeout: float,
    what: str,
    procs: list[Proc] = (),
    poll: float = 1.0,
) -> float:
    """Polls `check` until true; fails early with the log tail if one of `procs` died."""
    t0 = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - t0
        except Exception:
            pass
        for p in procs:
            if not p.alive():
                raise StartError(f"{what}: `{p.name}` exited with {p.popen.returncode}; log {p.log_path}:\n{p.tail()}")
        if time.monotonic() - t0 > timeout:
            tails = "\n".join(f"--- {p.name} ({p.log_path})\n{p.tail()}" for p in procs)
            raise StartError(f"{what}: not ready after {timeout:.0f}s\n{tails}")
        time.sleep(poll)


def table(rows: list[dict]) -> list[str]:
    """A Markdown table of flat rows, the first row's keys as its columns."""
    cols = list(rows[0]) if rows else []
    cell = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    return [f"| {' | '.join(cols)} |", f"|{'---|' * len(cols)}"] + [
        f"| {' | '.join(cell(r.get(k)) for k in cols)} |" for r in rows
    ]


def command_line(module: str, argv: list[str] | None = None) -> str:
    """The command line a result records: `.venv/bin/python -m MODULE ARGS` (this process's by default)."""
    return shlex.join([".venv/bin/python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def write_results(out: Path, name: str, results: dict, text: str | list[dict]) -> None:
    """The benches' one writer: prints `text` (or a table of `results["command"]` and these rows), writes
    OUT/<name>.json (`results`) and OUT/<name>.md (`text`)."""
    if not isinstance(text, str):
        text = "\n".join([f"`{results['command']}`", "", *table(text)]) + "\n"
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(text)
