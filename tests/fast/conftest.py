"""The fast tier: the real Serve app (Router, replicas, relay, Serve's proxy over real HTTP)
on `hidden_states.testing.FakeEngine`, in seconds, without vLLM.

Its Ray cluster runs in a child process (tests/fast/fake_app.py), not in pytest's:
the serve suite starts its own cluster in this process (tests/serve/conftest.py),
and one process holds one Ray connection, so the two tiers never meet whatever
order they run in. The child is stopped after the module that uses it, so it
holds no memory while the vLLM suites run.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.fast.fake_app import REPLICA_PREFIX
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: the real Serve app on the FakeEngine (Ray, no vLLM): seconds")


@pytest.fixture(scope="module")
def fake_serve():
    """{"router": base URL of the Router app, "replica": base URL of the `ingress: replica` app}."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="fake-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fast.fake_app", str(port)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def output() -> str:
        return Path(log.name).read_text()[-4000:]

    try:
        deadline = time.monotonic() + 180
        while "READY" not in Path(log.name).read_text():
            if proc.poll() is not None:
                raise RuntimeError(f"the fake app exited ({proc.returncode}):\n{output()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fake app was not ready within 180 s:\n{output()}")
            time.sleep(0.2)
        print(
            next(line for line in Path(log.name).read_text().splitlines() if line.startswith("READY"))
        )  # start-up time
        base = f"http://127.0.0.1:{port}"
        for url in (f"{base}/health", f"{base}{REPLICA_PREFIX}/health"):
            assert httpx.get(url, timeout=30).status_code == 200, output()
        yield {"router": base, "replica": base + REPLICA_PREFIX}
    finally:
        proc.stdin.close()  # the child shuts Serve and Ray down
        for stop, wait_s in ((None, 60), (signal.SIGINT, 30), (signal.SIGKILL, 10)):  # still starting: interrupt it
            if stop is not None:
                proc.send_signal(stop)
            try:
                proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                pass
        log.close()
        Path(log.name).unlink(missing_ok=True)
