"""`make serve` (scripts/serve.sh: `serve run config.yaml` with direct ingress on) answers a curl
request with a real answer and its vector, on Serve's proxy port and on the Router's own port.

It starts its own local Ray cluster (independent of the serve suite's
session cluster) and stops everything it started by process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from tests.conftest import Reference
from tests.serve.conftest import wait_http

ROOT = Path(__file__).resolve().parents[2]


def _curl(port: int) -> dict:
    out = subprocess.run(
        ["curl", "-s", "-m", "120", f"http://127.0.0.1:{port}/v1/chat/completions", "-H",
         "content-type: application/json", "-d", json.dumps({
             "model": "smollm2-135m-instruct", "max_tokens": 16, "temperature": 0,
             "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
             "return_hidden_states": True, "return_token_ids": True})],
        capture_output=True, text=True, timeout=180,
    )
    return json.loads(out.stdout)


def _router_port() -> int:
    """The Router replica's own HTTP port (direct ingress: 8001 or the next free one)."""
    for port in range(8001, 8021):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return port
        except httpx.HTTPError:
            pass
    raise AssertionError("no Router replica answers on ports 8001-8020 (direct ingress)")


def test_serve_run_config_yaml_answers_curl():
    """The README's first command: the built-in SmolLM2 answers a real question, with
    its vector (checked against transformers on the same folder, relative 1e-5)."""
    from hidden_states.models.builtin import resolve_model

    env = {**os.environ, "RAY_ADDRESS": "local"}  # its own cluster, whatever else runs here
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    proc = subprocess.Popen(["bash", "scripts/serve.sh", "config.yaml"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http("http://127.0.0.1:8000/health", 600)
        body = _curl(8000)  # Serve's proxy
        choice = body["choices"][0]
        assert "Paris" in choice["message"]["content"], choice
        assert len(choice["hidden_states"]) == 576
        reference = Reference(resolve_model("builtin:smollm2-135m-instruct"))
        err, scale = reference.assert_matches(body["prompt_token_ids"] + choice["token_ids"], choice["hidden_states"],
                                              atol=None)
        print(f"smollm2 via serve run: max abs error {err:.3g}, max|reference| {scale:.3g}")
        direct = _curl(_router_port())  # the Router's own port: no proxy hop, the same answer
        d = direct["choices"][0]
        assert d["token_ids"] == choice["token_ids"] and d["message"]["content"] == choice["message"]["content"]
        err, scale = reference.assert_matches(direct["prompt_token_ids"] + d["token_ids"], d["hidden_states"], atol=None)
        print(f"smollm2 via the Router's own port: max abs error {err:.3g}, max|reference| {scale:.3g}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    # Stopped: nothing answers on the port, and no process of its group is left.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get("http://127.0.0.1:8000/health", timeout=2)
        except httpx.HTTPError:
            break
        time.sleep(2)
    else:
        raise AssertionError("serve run config.yaml still answers after SIGTERM")
    # Ray's daemons get a few seconds to exit; zombies have exited (only not reaped yet).
    deadline = time.monotonic() + 60
    while (left := _running_in_group(proc.pid)) and time.monotonic() < deadline:
        time.sleep(2)
    for p in left:
        p.kill()
    assert not left, f"processes left running in the serve run group: {[(p.pid, p.name()) for p in left]}"


def _running_in_group(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid", "status"]):
        if _pgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p)
    return out


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None
