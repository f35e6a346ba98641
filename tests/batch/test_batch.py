"""`python -m deployments.batch` on Ray Data, as a user runs it: 200 rows on the tiny model,
interrupted once and resumed, every vector checked against transformers.

The runs join one Ray cluster of the module's (`ray_cluster`: `ray start --head`, named by
`RAY_ADDRESS` as a user names a cluster), but for the resumed run, which starts a Ray of its own as
the CLI does without `RAY_ADDRESS` (`RAY_ADDRESS=local`). The cluster ends with the module, and
everything it started with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.conftest import long_text

ROOT = Path(__file__).resolve().parents[2]
ROWS = 200
OWN_RAY = "local"  # RAY_ADDRESS for a run that starts a Ray of its own, as the CLI does without RAY_ADDRESS


# Ray Data's actors of a cluster's lifetime (detached: created by the first job, used by every later one)
RAY_DATA_DETACHED = (
    "ray::_StatsActor",
    "ray::ActorLocationTracker",
    "ray::_AutoscalingCoordinatorActor",
    "ray::_UsageCollectionActor",
)


class RayCluster:
    """A Ray cluster of the module's own: `ray start --head --block` in a session of its own, its files under
    a temporary folder (the address file too: not /tmp/ray's, which `ray.init(address="auto")` reads)."""

    def __init__(self):
        import tempfile

        from tests.helpers import free_port

        self.temp = Path(tempfile.mkdtemp(prefix="hs-batch-ray-", dir="/tmp"))  # short: Ray's socket paths
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        # No token authentication on this private cluster (Ray 2.60 turns it on where ~/.ray/auth_token
        # exists; a job naming the cluster by address must then say RAY_AUTH_MODE=token): its jobs say `disabled`.
        self.env = {"RAY_ADDRESS": "", "RAY_AUTH_MODE": "disabled"}
        env["RAY_AUTH_MODE"] = "disabled"
        # 4 logical CPUs on any machine: two runs at once each hold one for their engine actor and one for
        # their read and write tasks (on 2 CPUs the second's tasks could wait for the first's engine)
        cmd = [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            "--block",
            "--disable-usage-stats",
            f"--port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            f"--temp-dir={self.temp}",
            "--num-cpus=4",
            "--include-dashboard=false",
        ]
        self.log = open(self.temp / "ray-start.log", "w+")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        address_file = self.temp / "ray_current_cluster"
        deadline = time.monotonic() + 180
        while not (address_file.exists() and address_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                self.log.seek(0)
                raise AssertionError(f"ray start --head: no address in 180 s: {self.log.read()[-3000:]}")
            time.sleep(0.5)
        self.address = self.env["RAY_ADDRESS"] = address_file.read_text().strip()
        self.daemons = {p.pid for p in self.processes()}  # the cluster's own (GCS, raylet, agents, ...)

    def processes(self) -> list[psutil.Process]:
        """`ray start` and every process under it (daemons, workers, and what workers started)."""
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def job_processes(self) -> list[psutil.Process]:
        """Processes under the cluster that are not its daemons nor Ray Data's detached actors (one each for
        the cluster, kept after the job that started them): jobs' workers and what they started."""
        out = []
        for p in self.processes():
            try:
                if (
                    p.pid not in self.daemons
                    and p.status() != psutil.STATUS_ZOMBIE
                    and not " ".join(p.cmdline()).startswith(RAY_DATA_DETACHED)
                ):
                    out.append(p)
            except psutil.Error:  # ended meanwhile
                pass
        return out

    def stop(self) -> None:
        """The `ray start` group ended (its processes end with it), and every process it ever had under it gone."""
        import shutil

        started = self.processes()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # `ray start` and its daemons
            # SIGTERM's graceful shutdown of GCS, raylet and agents takes some 30 s here, for a cluster whose
            # state nothing keeps: killed after 5 s
            wait_gone(started[:1], 5)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        # its workers end when they find their raylet gone; those still there after a few seconds are ended
        left: list = []
        for sig, grace in ((None, 5), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            if sig is not None:
                for p in left:
                    with contextlib.suppress(psutil.Error):
                        p.send_signal(sig)
            if not (left := wait_gone(started, grace)):
                break
        self.log.close()
        shutil.rmtree(self.temp, ignore_errors=True)
        assert not left, f"processes of the batch tests' Ray cluster left running: {[(p.pid, p.name()) for p in left]}"


def title(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:80]
    except psutil.Error:
        return "(ended)"


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of `procs` still running (zombies have ended) after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = RayCluster()
    try:
        yield cluster
    finally:
        cluster.stop()


def start(ray: RayCluster | str, inp: Path, out: Path, *extra: str) -> subprocess.Popen:
    """The CLI on the tiny model, a job on `ray` (the module's cluster), or with `OWN_RAY` on a Ray of its own."""
    cmd = [
        sys.executable,
        "-m",
        "deployments.batch",
        "--input",
        str(inp),
        "--output",
        str(out),
        "--model",
        "builtin:tiny-llama",
        "--max-tokens",
        "6",
        "--batch-size",
        "10",
        "--engine",
        json.dumps({"kv_cache_memory_bytes": 128 * 2**20}),
        *extra,
    ]
    env = {**os.environ, **({"RAY_ADDRESS": ray} if isinstance(ray, str) else ray.env)}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """The run's output once it ended successfully (its whole process group killed if it did not end)."""
    try:
        log, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    assert proc.returncode == 0, log[-3000:]
    return log


def outputs(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Runs at once: each one's output, all read at the same time (a pipe nobody reads stalls its run); any run
    still going at the end (after `timeout`) killed with its group."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            return [f.result() for f in [pool.submit(lambda p: p.communicate(timeout=timeout)[0], p) for p in procs]]
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_group(proc)


def kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = [p for p in psutil.process_iter() if _pgid(p.pid) == proc.pid]
        if not left:
            return
        time.sleep(1)
    for p in left:
        p.kill()


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def rows(out: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return [r for f in sorted(out.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]


def test_batch_interrupted_and_resumed(tmp_path, reference, ray_cluster):
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "out"
    with inp.open("w") as f:
        for i in range(ROWS):
            row = (
                {"prompt": long_text(6, seed=1000 + i)}
                if i % 5
                else {"messages": [{"role": "user", "content": long_text(5, seed=1000 + i)}]}
            )
            f.write(json.dumps(row) + "\n")

    first = start(ray_cluster, inp, out)  # a job on the module's cluster
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not list(out.glob("*.parquet")):
        assert first.poll() is None, first.stdout.read()[-3000:]
        time.sleep(0.5)
    job = ray_cluster.job_processes()  # its engine actor and the engine's processes, its tasks' workers
    assert any("MapWorker" in title(p) for p in job), [title(p) for p in job]
    kill_group(first)  # interrupted as soon as its first rows are written: the driver, not the cluster
    # the job ends with its driver: every process it had on the cluster ends (none writes any more)
    job += [p for p in ray_cluster.job_processes() if p.pid not in {q.pid for q in job}]
    t = time.monotonic()
    left = wait_gone(job, 120)
    assert not left, f"the killed job's processes still run: {[(p.pid, title(p)) for p in left]}"
    print(f"batch: the killed job's {len(job)} processes ended {time.monotonic() - t:.1f} s after its driver")
    written = {f: f.stat().st_mtime_ns for f in out.glob("*.parquet")}
    partial = rows(out)
    assert 0 < len(partial) < ROWS, len(partial)

    log = finish(start(OWN_RAY, inp, out), 900)  # resumed as a user reruns it: on a Ray of its own
    assert f"{len({r['id'] for r in partial})} rows already in" in log  # resumed, not restarted
    # a successful run ends cleanly: no traceback, and one closing line saying how many rows went where
    assert "Traceback" not in log, log[-3000:]
    assert log.rstrip().splitlines()[-1].startswith("batch: ") and f"{ROWS} rows in {out}" in log, log[-1000:]
    for f, mtime in written.items():  # the first run's files are kept as they were
        assert not f.exists() or f.stat().st_mtime_ns == mtime
    final = rows(out)
    ids = [r["id"] for r in final]
    assert len(ids) == len(set(ids)) == ROWS, (len(ids), len(set(ids)))
    worst = 0.0
    for r in final:
        vec = np.asarray(r["hidden_states"], np.float32)
        assert vec.shape == (128,) and r["finish_reason"] in ("length", "stop")
        err, scale = reference.assert_matches(r["prompt_token_ids"] + r["token_ids"], vec)
        worst = max(worst, err / scale)
    print(f"batch: {ROWS} vectors, worst relative error {worst:.2e}")


def test_batch_with_an_adapter(tmp_path, model_dir, reference, ray_cluster):
    """`--lora-modules NAME=PATH --adapter NAME`: every row generated and its vector computed with the
    adapter (transformers + peft), not the base model."""
    from tests.conftest import Reference, build_lora

    adapter = build_lora(model_dir, "all", seed=2)
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "out"
    inp.write_text("".join(json.dumps({"prompt": long_text(6, seed=i)}) + "\n" for i in range(8)))
    finish(start(ray_cluster, inp, out, "--lora-modules", f"lora-all={adapter}", "--adapter", "lora-all"), 600)
    peft = Reference(model_dir, adapter)
    final = rows(out)
    assert len(final) == 8
    for r in final:
        ids, vec = r["prompt_token_ids"] + r["token_ids"], np.asarray(r["hidden_states"], np.float32)
        peft.assert_matches(ids, vec)
        with pytest.raises(AssertionError):
            reference.assert_matches(ids, vec)


def test_batch_with_images_as_paths_and_data_urls(tmp_path, ray_cluster):
    """A VLM's rows with `images`: a path (relative to the input file), two images (a path and a data
    URL), a data URL, and a row without images; each row's vector against transformers
    on the same images and the row's own tokens (tests/vlm_ref.py). A path that does not exist stops
    the job naming the row."""
    from hidden_states.models.builtin import resolve_model
    from tests.engine.test_multimodal import REL_TOL, data_url, image
    from tests.vlm_ref import reference_hidden_states

    model = "builtin:tiny-llava"
    folder = resolve_model(model)
    image(1).save(tmp_path / "one.png")
    image(2).save(tmp_path / "two.png")
    rows_in = [
        {"id": "path", "prompt": "What is this?", "images": ["one.png"]},
        {"id": "both", "prompt": "Compare them.", "images": ["two.png", data_url(image(3))]},
        {"id": "url", "prompt": "And this?", "images": [data_url(image(4))]},
        {"id": "text", "prompt": "No picture."},
    ]
    seeds = {"path": [1], "both": [2, 3], "url": [4], "text": []}
    inp, out = tmp_path / "rows.jsonl", tmp_path / "out"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows_in))
    vlm = [
        "--model",
        model,
        "--engine",
        json.dumps({"kv_cache_memory_bytes": 128 * 2**20, "max_model_len": 1024, "limit_mm_per_prompt": {"image": 2}}),
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "missing", "prompt": "x", "images": ["nowhere.png"]}) + "\n")
    good, failing = start(ray_cluster, inp, out, *vlm), start(ray_cluster, bad, tmp_path / "bad-out", *vlm)  # at once
    good_log, log = outputs([good, failing], 600)
    assert failing.returncode != 0 and "row missing: images[0]:" in log and "nowhere.png cannot be read" in log, log[
        -2000:
    ]
    assert good.returncode == 0, good_log[-3000:]
    final = {r["id"]: r for r in rows(out)}
    assert sorted(final) == sorted(seeds)
    for rid, r in final.items():
        ref = reference_hidden_states(folder, r["prompt_token_ids"], [image(s) for s in seeds[rid]], r["token_ids"])
        got, want = np.asarray(r["hidden_states"], np.float32), ref[-1][-1]
        assert np.abs(got - want).max() <= REL_TOL * np.abs(want).max(), rid


def test_an_engine_actor_ends_cleanly_without_being_deleted():
    """The batch's engine actor exits cleanly even when Ray Data never deletes it: stopped by vLLM's exit hooks
    alone, the engine core dies under a live output handler, which logs an `EngineDeadError` traceback."""
    script = (
        "import numpy as np\n"
        "from deployments.batch import EngineWorker\n"
        "w = EngineWorker('builtin:tiny-llama', 2, {'kv_cache_memory_bytes': 128 * 2**20})\n"
        "out = w({'id': np.array(['a']), 'prompt': np.array(['Hello there'])})\n"
        "print('rows', out.num_rows, 'width', len(out['hidden_states'][0]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "rows 1 width 128" in proc.stdout, log[-3000:]
    assert "Traceback" not in log and "output_handler failed" not in log, log[-3000:]


def test_batch_rows_of_positions_dtypes_and_topk(tmp_path, reference, ray_cluster):
    """`--position`, `--dtype`, `--topk`: a strided range of float16 rows (Arrow halffloat) with their positions,
    then top-k of the completion's rows in bfloat16 (float32 of the rounded values), each against transformers on
    the row's prompt + completion, the reference cast and selected the same way."""
    import pyarrow.parquet as pq

    from tests.serve.test_positions import reference_rows

    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": long_text(6, seed=50 + i)}) + "\n" for i in range(4)))
    worst = {}
    cases = {
        "range, float16": ("--position", '{"start": 2, "stride": 3}', "--dtype", "float16"),
        "completion, top-5, bfloat16": ("--position", "completion", "--topk", "5", "--dtype", "bfloat16"),
    }
    runs = {
        name: start(ray_cluster, inp, tmp_path / name.replace(", ", "-"), *extra)  # both jobs at once
        for name, extra in cases.items()
    }
    for proc, log in zip(runs.values(), outputs(list(runs.values()), 600)):
        assert proc.returncode == 0, log[-3000:]
    for name, extra in cases.items():
        out = tmp_path / name.replace(", ", "-")
        schema = pq.read_schema(next(out.glob("*.parquet")))
        final = rows(out)
        assert len(final) == 4
        for r in final:
            ids = r["prompt_token_ids"] + r["token_ids"]
            if "--topk" not in extra:
                assert (
                    str(schema.field("hidden_states").type) == "list<element: fixed_size_list<element: halffloat>[128]>"
                )
                assert r["positions"] == list(range(len(ids)))[2::3]
                got, ref = np.asarray(r["hidden_states"], np.float32), reference_rows(reference, ids, r["positions"])
                cast = ref.astype(np.float16).astype(np.float32)  # within one float16 step of the cast reference
                assert (np.abs(got - cast) <= np.spacing(np.abs(cast).astype(np.float16)).astype(np.float32)).all()
            else:
                assert (
                    "hidden_states" not in schema.names
                    and str(schema.field("topk_values").type) == "list<element: fixed_size_list<element: float>[5]>"
                )
                assert r["positions"] == list(range(len(r["prompt_token_ids"]), len(ids)))
                indices, got = np.asarray(r["topk_indices"]), np.asarray(r["topk_values"], np.float32)
                assert indices.shape == got.shape == (len(r["token_ids"]), 5)
                full = reference_rows(reference, ids, r["positions"])
                ref = np.take_along_axis(full, indices, axis=-1)
                assert (np.abs(got - ref) <= 2**-8 * np.abs(ref) + 1e-4).all()  # bfloat16: 8 significant bits
                rest = np.abs(full)
                np.put_along_axis(rest, indices, -np.inf, axis=-1)
                assert (np.abs(ref).min(axis=-1) >= rest.max(axis=-1) - 1e-4).all()  # no larger entry left out
            worst[name] = max(worst.get(name, 0.0), float(np.abs(got - ref).max() / np.abs(ref).max()))
    print("batch rows: worst relative error " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))


def test_batch_proofs_column(tmp_path, reference, ray_cluster):
    """`--proof`: each row's TOPLOC proofs in a `proofs` column, accepted by the real toploc library on
    transformers' rows of the row's prompt + completion."""
    import pyarrow.parquet as pq

    from hidden_states.proofs import toploc as ours
    from tests.toploc_ref import fed_rows, load_toploc

    tl = load_toploc()
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": long_text(8, seed=70 + i)}) + "\n" for i in range(3)))
    out = tmp_path / "proofs"
    finish(start(ray_cluster, inp, out, "--proof", '{"scheme": "toploc", "topk": 128, "decode_batching_size": 2}'), 600)
    schema = pq.read_schema(next(out.glob("*.parquet")))
    assert "hidden_states" not in schema.names and str(schema.field("proofs").type) == "list<element: string>"
    final = rows(out)
    assert len(final) == 3
    for r in final:
        ids, P = r["prompt_token_ids"] + r["token_ids"], len(r["prompt_token_ids"])
        assert len(r["proofs"]) == len(ours.chunk_bounds(P, len(ids), 2)) >= 2  # the prefill, then windows of 2
        results = tl.verify_proofs_base64(fed_rows(reference.model, ids, P), r["proofs"], 2, 128)
        assert all(x.exp_mismatches <= 38 and x.mant_err_mean <= 10 and x.mant_err_median <= 8 for x in results), (
            results
        )


def test_batch_heads_columns(tmp_path, reference, ray_cluster):
    """`--heads` with `--no-rows`, `--steering` (a clamp of an SAE feature) and `--stop` (the "mid" probe above a
    threshold): a column per head, each row's outputs against SAELens and numpy on the rows of transformers
    with SAELens's clamp in the same hook, of its prompt + completion; no hidden_states column; each row
    stops at the first completion position whose reference score crosses (none earlier), its `stop` column
    saying where, or null where it ran to max_tokens and never crossed."""
    import pyarrow.parquet as pq
    import torch
    from sae_lens import SAE

    from tests.heads_ref import TINY_TOPK_K, build_test_heads, check_heads, head_scorer
    from tests.steer_ref import steered_states

    heads = build_test_heads()
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": long_text(6, seed=90 + i)}) + "\n" for i in range(3)))
    out = tmp_path / "heads"
    clamp = [{"op": "clamp", "head": "sae-std", "feature": 11, "value": 6.0}]
    stop = [{"head": "mid", "feature": 0, "above": 0.5145}]  # (its scores here rise slowly through 0.51..0.52)
    finish(
        start(
            ray_cluster,
            inp,
            out,
            "--heads",
            json.dumps(heads),
            "--no-rows",
            "--position",
            "completion",
            "--steering",
            json.dumps(clamp),
            "--stop",
            json.dumps(stop),
        ),
        600,
    )
    schema = pq.read_schema(next(out.glob("*.parquet")))
    assert "hidden_states" not in schema.names and {f"head_{h['name']}" for h in heads} <= set(schema.names)
    final = rows(out)
    assert len(final) == 3
    asked = {h["name"]: (0 if h["path"].endswith(".safetensors") else 64) for h in heads} | {"sae-topk": TINY_TOPK_K}
    sae = SAE.load_from_disk({h["name"]: h for h in heads}["sae-std"]["path"], device="cpu")
    with torch.no_grad():
        entries = [(1, ("clamp", sae, 11, 6.0), "all", 1.0, sae.W_dec[11].numpy())]
    mid = head_scorer("mid", 0)
    assert {r["finish_reason"] for r in final} == {"stop", "length"}, [r["stop"] for r in final]  # both kinds of row
    for r in final:
        ids, P = r["prompt_token_ids"] + r["token_ids"], len(r["prompt_token_ids"])
        states = steered_states(reference.model, ids, entries, P)
        hs = [states[layer] for layer in range(3)]
        outputs = {name: [{k: v for k, v in p.items() if v is not None} for p in r[f"head_{name}"]] for name in asked}
        assert r["positions"] == list(range(P, len(ids)))
        check_heads("batch", outputs, hs, r["positions"], heads, asked)
        scores = np.asarray([mid(states[1][q]) for q in range(P, len(ids))])
        band = 1e-5 * np.abs(scores).max()
        if r["stop"] is not None:  # the first position that crossed (the last token's row), none before
            assert (
                r["finish_reason"] == "stop" and r["stop"]["position"] == len(ids) - 1 and r["stop"]["condition"] == 0
            )
            assert scores[-1] > 0.5145 - band and np.all(scores[:-1] <= 0.5145 + band), scores
        else:  # the last token's row is computed by no step: only the others were judged
            assert r["finish_reason"] == "length" and np.all(scores[:-1] <= 0.5145 + band), scores
