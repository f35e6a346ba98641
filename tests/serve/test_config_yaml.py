"""`make serve` (scripts/serve.sh: `serve run config.yaml` with direct ingress on) answers a curl
request with a real answer and its vector, on Serve's proxy port and on the Router's own port, and
every example of the docs runs against it as written, each fenced block of them being an example or
listed as none (tests/docs_examples.py).

It starts its own local Ray cluster (independent of the serve suite's
session cluster) and stops everything it started by process group.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import Reference
from tests.serve.conftest import wait_http

ROOT = Path(__file__).resolve().parents[2]


def _curl(port: int) -> dict:
    out = subprocess.run(
        [
            "curl",
            "-s",
            "-m",
            "120",
            f"http://127.0.0.1:{port}/v1/chat/completions",
            "-H",
            "content-type: application/json",
            "-d",
            json.dumps(
                {
                    "model": "smollm2-135m-instruct",
                    "max_tokens": 16,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                    "return_hidden_states": True,
                    "return_token_ids": True,
                }
            ),
        ],
        capture_output=True,
        text=True,
        timeout=180,
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


def examples_env() -> dict:
    """The docs' examples' environment: a shell in the repo's venv, no RAY_ADDRESS (a Ray job on this machine
    finds `make serve`'s cluster with address="auto"; a batch starts a Ray of its own)."""
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "PYTHONPATH": str(ROOT)}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


class DocsBatches(threading.Thread):
    """The docs' batch commands, in order, as written, in a folder of their own, in the background: each
    `(example, exit status, stderr, seconds)` in `done`. `stop()` ends a command still running (its process group:
    the CLI and the Ray it started)."""

    def __init__(self, examples: list, folder: Path):
        super().__init__(daemon=True)
        self.examples, self.folder, self.done, self.proc, self.stopped = examples, folder, [], None, False
        folder.mkdir()
        (folder / ".venv").symlink_to(ROOT / ".venv")  # the commands name .venv/bin/python, as from the repo

    def run(self):
        for e in self.examples:
            t = time.monotonic()
            if self.stopped:
                return
            self.proc = subprocess.Popen(
                ["bash", "-c", e.code],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env=examples_env(),
                cwd=self.folder,
                start_new_session=True,
            )
            try:
                _, err = self.proc.communicate(timeout=900)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                _, err = self.proc.communicate()
                err += "\n(killed after 900 s)"
            self.done.append((e, self.proc.returncode, err, time.monotonic() - t))

    def stop(self):
        self.stopped = True
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            _assert_stopped_group(self.proc.pid)
        self.join(60)


@pytest.fixture(scope="module", autouse=True)
def docs_batches(request, tmp_path_factory):
    """The docs' batch commands, started with the module when its docs test is to run. They need no server
    and start a Ray of their own (as the docs say: never `make serve`'s), so they run beside the module's
    first tests (`serve run` without a config, `make serve`'s start and curl: one engine each, two engines
    at most), not after the docs' other examples; `test_the_docs_examples_run_as_written` waits for them
    before its own examples and checks them."""
    if not any(
        item.name == "test_the_docs_examples_run_as_written" and item.module is request.module
        for item in request.session.items
    ):
        yield None
        return
    from tests import docs_examples as dx

    runner = DocsBatches([e for e in dx.examples() if e.kind == "batch"], tmp_path_factory.mktemp("docs") / "batch")
    runner.start()
    try:
        yield runner
    finally:
        runner.stop()


def test_serve_run_without_a_config_file():
    """`serve run deployments.app:build_app model=...` (the docs' form without YAML: each key=value an
    arg) serves that model; stopping it leaves nothing running. First in the module: Serve's proxy
    takes port 8000 (`serve run` has no port flag), which `make_serve` then takes."""
    env = {**os.environ, "RAY_ADDRESS": "local"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    port = 8000
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "serve"),
            "run",
            "deployments.app:build_app",
            "model=builtin:tiny-llama",
            "served_model_name=tiny",
            "warm_up_s=0",  # a number as key=value (make_serve runs the default warm-up)
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 600)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["tiny"], models
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=120,
            json={"model": "tiny", "prompt": "no yaml", "max_tokens": 3, "return_hidden_states": True},
        ).json()
        assert len(r["choices"][0]["hidden_states"]) == 128, r
    finally:
        _stop(proc, port)


@pytest.fixture(scope="module")
def make_serve():
    """`make serve`'s script as a user runs it (no RAY_ADDRESS: it starts its own cluster with
    `ray start --head`, which other Ray jobs here join with address="auto"). Stopping it (SIGTERM to
    its process group) must leave nothing answering, no process running and no address file."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    proc = subprocess.Popen(
        ["bash", "scripts/serve.sh", "config.yaml"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_http("http://127.0.0.1:8000/health", 600)
        address = Path("/tmp/ray/ray_current_cluster").read_text().strip()
        yield address
    finally:
        _stop(proc)
    current = Path("/tmp/ray/ray_current_cluster")
    assert not (current.exists() and current.read_text().strip() == address), "a stale address file is left"


def test_serve_run_config_yaml_answers_curl(make_serve):
    """The README's first command: the built-in SmolLM2 answers a real question, with
    its vector (checked against transformers on the same folder, relative 1e-5)."""
    from hidden_states.models.builtin import resolve_model

    body = _curl(8000)  # Serve's proxy
    choice = body["choices"][0]
    assert "Paris" in choice["message"]["content"], choice
    assert len(choice["hidden_states"]) == 576
    reference = Reference(resolve_model("builtin:smollm2-135m-instruct"))
    err, scale = reference.assert_matches(
        body["prompt_token_ids"] + choice["token_ids"], choice["hidden_states"], atol=None
    )
    print(f"smollm2 via serve run: max abs error {err:.3g}, max|reference| {scale:.3g}")
    direct = _curl(_router_port())  # the Router's own port: no proxy hop, the same answer
    d = direct["choices"][0]
    assert d["token_ids"] == choice["token_ids"] and d["message"]["content"] == choice["message"]["content"]
    err, scale = reference.assert_matches(direct["prompt_token_ids"] + d["token_ids"], d["hidden_states"], atol=None)
    print(f"smollm2 via the Router's own port: max abs error {err:.3g}, max|reference| {scale:.3g}")


def test_the_docs_examples_run_as_written(make_serve, docs_batches, tmp_path):
    """Every fenced block of the README, docs/ and cluster/README.md is an example run here or is named
    in tests/docs_examples.py's LISTED (`dx.audit`: anything else is a problem before a thing runs).
    The examples run as written against `make serve`'s server: curl with bash, each doc's Python
    blocks in one process as another Ray job on this machine (ray.init(address="auto") finds `make
    serve`'s cluster), the batch commands in a folder of their own; each block's own `# ->` lines
    checked against what it printed, and every Python check must have run. Lists every problem. The batch
    commands, which need no server, started with the module (`docs_batches`): they are waited for first."""
    from tests import docs_examples as dx

    found, problems = dx.audit()
    kinds = {k: [e for e in found if e.kind == k] for k in dx.KINDS}
    print(
        f"docs examples: {len(found)} ({', '.join(f'{len(v)} {k}' for k, v in kinds.items())}) of "
        f"{len(dx.blocks())} fenced blocks, {len(dx.LISTED)} listed:"
    )
    for e in found:
        print(f"  {e.where} {e.kind}" + (" (set-up)" if e.set_up else ""))
    env = examples_env()
    took = []  # (seconds, what): printed at the end, slowest first
    t = time.monotonic()
    docs_batches.join(2 * 900 + 120)  # before the examples that deploy apps: two engines at most at once
    assert not docs_batches.is_alive(), "the docs' batch commands did not end"
    assert [e for e, *_ in docs_batches.done] == kinds["batch"], "not every batch command ran"
    print(f"docs examples: waited {time.monotonic() - t:.0f} s for the batch commands")
    for e, status, err, seconds in docs_batches.done:
        took.append((seconds, f"{e.where} (started with the module)"))
        if status != 0:
            problems.append(f"{e.where}: failed: {err[-1500:]}")
        else:
            problems += [f"{e.where}: {p}" for p in _batch_problems(e.code, docs_batches.folder)]
    for e in kinds["curl"]:
        t = time.monotonic()
        problems += dx.run_curl(e, env)
        took.append((time.monotonic() - t, e.where))
    for doc in sorted({e.doc for e in kinds["python"]}):
        t = time.monotonic()
        problems += dx.run_python([e for e in kinds["python"] if e.doc == doc], env, tmp_path)
        took.append((time.monotonic() - t, f"{doc} (Python)"))
    print("docs examples' times: " + ", ".join(f"{w} {s:.0f} s" for s, w in sorted(took, reverse=True)))
    assert not problems, "\n".join(problems)
    # the newcomer's paths are among them
    text = {k: "\n".join(e.code for e in v) for k, v in kinds.items()}
    assert "/v1/chat/completions" in text["curl"] and "get_app_handle" in text["python"]
    assert "messages=" in text["python"] and "/v1/hidden_states" in text["python"] and kinds["batch"]


def _batch_problems(code: str, cwd: Path) -> list[str]:
    """A batch command's output folder holds a row per input row, with the columns the docs list."""
    import pyarrow.parquet as pq

    rows = sum(1 for ln in (cwd / "prompts.jsonl").read_text().splitlines() if ln.strip())
    out = []
    for m in re.finditer(r"--output (\S+)", code):
        table = pq.read_table(cwd / m.group(1))
        want = {"id", "prompt_token_ids", "completion", "token_ids", "finish_reason", "hidden_states"}
        if "--position" in code:
            want.add("positions")
        if missing := want - set(table.column_names):
            out.append(f"{m.group(1)}: no column {sorted(missing)}")
        if table.num_rows != rows:
            out.append(f"{m.group(1)}: {table.num_rows} rows for {rows} prompts")
        first = table.column("hidden_states")[0].as_py() if "hidden_states" in table.column_names else None
        width = len(first[0]) if first and isinstance(first[0], list) else len(first or [])
        if width != 576:
            out.append(f"{m.group(1)}: hidden_states rows of {width} values, not SmolLM2's 576")
    return out


def _stop(proc: subprocess.Popen, port: int = 8000) -> None:
    """SIGTERM to the server's process group (SIGKILL after 60 s), then `_assert_stopped`."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    _assert_stopped(proc.pid, port)


def _assert_stopped_group(pgid: int) -> None:
    """No process of the group left running (Ray's daemons get a few seconds to exit; zombies have exited,
    only not reaped yet)."""
    deadline = time.monotonic() + 60
    while (left := _running_in_group(pgid)) and time.monotonic() < deadline:
        time.sleep(2)
    for p in left:
        p.kill()
    assert not left, f"processes left running in the group: {[(p.pid, p.name()) for p in left]}"


def _assert_stopped(pgid: int, port: int = 8000) -> None:
    """Stopped: nothing answers on the port, and no process of its group is left."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        except httpx.HTTPError:
            break
        time.sleep(2)
    else:
        raise AssertionError("serve run config.yaml still answers after SIGTERM")
    _assert_stopped_group(pgid)


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
