"""`python -m deployments.batch` on Ray Data, as a user runs it: 200 rows on the tiny model,
interrupted once and resumed, every vector checked against transformers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil

from tests.conftest import long_text

ROOT = Path(__file__).resolve().parents[2]
ROWS = 200


def start(inp: Path, out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "deployments.batch", "--input", str(inp), "--output", str(out),
           "--model", "builtin:tiny-llama", "--max-tokens", "6", "--batch-size", "10",
           "--engine", json.dumps({"kv_cache_memory_bytes": 128 * 2**20}), *extra]
    env = {**os.environ, "RAY_ADDRESS": "local"}  # its own Ray, as a user's job
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """The run's output once it ended successfully (its whole process group killed if it did not end)."""
    try:
        log, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    assert proc.returncode == 0, log[-3000:]
    return log


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


def test_batch_interrupted_and_resumed(tmp_path, reference):
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "out"
    with inp.open("w") as f:
        for i in range(ROWS):
            row = {"prompt": long_text(6, seed=1000 + i)} if i % 5 else \
                {"messages": [{"role": "user", "content": long_text(5, seed=1000 + i)}]}
            f.write(json.dumps(row) + "\n")

    first = start(inp, out)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not list(out.glob("*.parquet")):
        assert first.poll() is None, first.stdout.read()[-3000:]
        time.sleep(0.5)
    kill_group(first)  # interrupted as soon as its first rows are written
    written = {f: f.stat().st_mtime_ns for f in out.glob("*.parquet")}
    partial = rows(out)
    assert 0 < len(partial) < ROWS, len(partial)

    log = finish(start(inp, out), 900)
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


def test_batch_with_an_adapter(tmp_path, model_dir, reference):
    """`--lora-modules NAME=PATH --adapter NAME`: every row generated and its vector computed with the
    adapter (transformers + peft), not the base model."""
    import pytest

    from tests.conftest import Reference, build_lora

    adapter = build_lora(model_dir, "all", seed=2)
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "out"
    inp.write_text("".join(json.dumps({"prompt": long_text(6, seed=i)}) + "\n" for i in range(8)))
    finish(start(inp, out, "--lora-modules", f"lora-all={adapter}", "--adapter", "lora-all"), 600)
    peft = Reference(model_dir, adapter)
    final = rows(out)
    assert len(final) == 8
    for r in final:
        ids, vec = r["prompt_token_ids"] + r["token_ids"], np.asarray(r["hidden_states"], np.float32)
        peft.assert_matches(ids, vec)
        with pytest.raises(AssertionError):
            reference.assert_matches(ids, vec)


def test_batch_with_images_as_paths_and_data_urls(tmp_path):
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
    rows_in = [{"id": "path", "prompt": "What is this?", "images": ["one.png"]},
               {"id": "both", "prompt": "Compare them.", "images": ["two.png", data_url(image(3))]},
               {"id": "url", "prompt": "And this?", "images": [data_url(image(4))]},
               {"id": "text", "prompt": "No picture."}]
    seeds = {"path": [1], "both": [2, 3], "url": [4], "text": []}
    inp, out = tmp_path / "rows.jsonl", tmp_path / "out"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows_in))
    vlm = ["--model", model, "--engine", json.dumps({"kv_cache_memory_bytes": 128 * 2**20, "max_model_len": 1024,
                                                     "limit_mm_per_prompt": {"image": 2}})]
    finish(start(inp, out, *vlm), 600)
    final = {r["id"]: r for r in rows(out)}
    assert sorted(final) == sorted(seeds)
    for rid, r in final.items():
        ref = reference_hidden_states(folder, r["prompt_token_ids"], [image(s) for s in seeds[rid]], r["token_ids"])
        got, want = np.asarray(r["hidden_states"], np.float32), ref[-1][-1]
        assert np.abs(got - want).max() <= REL_TOL * np.abs(want).max(), rid

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "missing", "prompt": "x", "images": ["nowhere.png"]}) + "\n")
    proc = start(bad, tmp_path / "bad-out", *vlm)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0 and "row missing: images[0]:" in log and "nowhere.png cannot be read" in log, log[-2000:]


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


def test_batch_rows_of_positions_dtypes_and_topk(tmp_path, reference):
    """`--position`, `--dtype`, `--topk`: a strided range of float16 rows (Arrow halffloat) with their positions,
    then top-k of the completion's rows in bfloat16 (float32 of the rounded values), each against transformers on
    the row's prompt + completion, the reference cast and selected the same way."""
    import pyarrow.parquet as pq

    from tests.serve.test_positions import reference_rows

    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": long_text(6, seed=50 + i)}) + "\n" for i in range(4)))
    worst = {}
    for name, extra in {"range, float16": ("--position", '{"start": 2, "stride": 3}', "--dtype", "float16"),
                        "completion, top-5, bfloat16": ("--position", "completion", "--topk", "5",
                                                        "--dtype", "bfloat16")}.items():
        out = tmp_path / name.replace(", ", "-")
        finish(start(inp, out, *extra), 600)
        schema = pq.read_schema(next(out.glob("*.parquet")))
        final = rows(out)
        assert len(final) == 4
        for r in final:
            ids = r["prompt_token_ids"] + r["token_ids"]
            if "--topk" not in extra:
                assert str(schema.field("hidden_states").type) == \
                    "list<element: fixed_size_list<element: halffloat>[128]>"
                assert r["positions"] == list(range(len(ids)))[2::3]
                got, ref = np.asarray(r["hidden_states"], np.float32), reference_rows(reference, ids, r["positions"])
                cast = ref.astype(np.float16).astype(np.float32)  # within one float16 step of the cast reference
                assert (np.abs(got - cast) <= np.spacing(np.abs(cast).astype(np.float16)).astype(np.float32)).all()
            else:
                assert "hidden_states" not in schema.names and str(schema.field("topk_values").type) == \
                    "list<element: fixed_size_list<element: float>[5]>"
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


def test_batch_proofs_column(tmp_path, reference):
    """`--proof`: each row's TOPLOC proofs in a `proofs` column, accepted by the real toploc library on
    transformers' rows of the row's prompt + completion."""
    import pyarrow.parquet as pq

    from hidden_states.proofs import toploc as ours
    from tests.toploc_ref import fed_rows, load_toploc

    tl = load_toploc()
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": long_text(8, seed=70 + i)}) + "\n" for i in range(3)))
    out = tmp_path / "proofs"
    finish(start(inp, out, "--proof", '{"scheme": "toploc", "topk": 128, "decode_batching_size": 2}'), 600)
    schema = pq.read_schema(next(out.glob("*.parquet")))
    assert "hidden_states" not in schema.names and str(schema.field("proofs").type) == "list<element: string>"
    final = rows(out)
    assert len(final) == 3
    for r in final:
        ids, P = r["prompt_token_ids"] + r["token_ids"], len(r["prompt_token_ids"])
        assert len(r["proofs"]) == len(ours.chunk_bounds(P, len(ids), 2)) >= 2  # the prefill, then windows of 2
        results = tl.verify_proofs_base64(fed_rows(reference.model, ids, P), r["proofs"], 2, 128)
        assert all(x.exp_mismatches <= 38 and x.mant_err_mean <= 10 and x.mant_err_median <= 8 for x in results), results


def test_batch_heads_columns(tmp_path, reference):
    """`--heads` with `--no-rows`: a column per head, each row's outputs against SAELens and numpy on
    transformers' rows of its prompt + completion; no hidden_states column."""
    import pyarrow.parquet as pq

    from tests.heads_ref import TINY_TOPK_K, build_test_heads, check_heads

    heads = build_test_heads()
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": long_text(6, seed=90 + i)}) + "\n" for i in range(3)))
    out = tmp_path / "heads"
    finish(start(inp, out, "--heads", json.dumps(heads), "--no-rows", "--position", "completion"), 600)
    schema = pq.read_schema(next(out.glob("*.parquet")))
    assert "hidden_states" not in schema.names and {f"head_{h['name']}" for h in heads} <= set(schema.names)
    final = rows(out)
    assert len(final) == 3
    asked = {h["name"]: (0 if h["path"].endswith(".safetensors") else 64) for h in heads} | {"sae-topk": TINY_TOPK_K}
    for r in final:
        ids = r["prompt_token_ids"] + r["token_ids"]
        with reference.torch.no_grad():
            hs = [h[0].numpy() for h in reference.model(reference.torch.tensor([ids]),
                                                        output_hidden_states=True).hidden_states]
        outputs = {name: [{k: v for k, v in p.items() if v is not None} for p in r[f"head_{name}"]] for name in asked}
        assert r["positions"] == list(range(len(r["prompt_token_ids"]), len(ids)))
        check_heads("batch", outputs, hs, r["positions"], heads, asked)
