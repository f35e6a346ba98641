"""One choice type (hidden_states.interface.CompletionChoice) for the Python API, the handle wire and
the HTTP formatter: the squeeze decided once, the dtype asked on every path, the wire bit for bit.
The FakeEngine, the replica's routes in process (no vLLM, no Ray)."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from deployments import client, wire
from hidden_states.interface import CompletionChoice, ExtractionStats, RowBatch
from hidden_states.openai_format import ResponseForm, choice_fields
from hidden_states.params import SINGLE_POSITIONS
from hidden_states.protocol import narrow, numpy_dtype, widen
from hidden_states.shape import several, squeeze
from hidden_states.testing import HIDDEN_SIZE, FakeEngine, fake_rows
from tests.helpers import run
from tests.unit.test_ingress import call, make

PROMPT = "Hi there"
IDS = list(PROMPT.encode())
POSITIONS = ["completion_end", "prompt_end", "completion", "all", {"start": 2, "stride": 3}, {"start": 40}]


def three_paths(**fields):
    """The same request on the Python engine API, over a handle (the replica's route, decoded by the
    client) and over HTTP (base64, so the bytes are the dtype's): (choice, choice, JSON choice)."""
    position, dtype = (
        fields.get("hidden_states_position", "completion_end"),
        fields.get("hidden_states_dtype", "float32"),
    )

    async def go():
        py = await FakeEngine(True).complete(
            IDS, None, position=position, dtype=dtype, topk=fields.get("hidden_states_topk")
        )
        r = await make()
        handle = client._result(await r.complete(client._request(PROMPT, None, **fields)))
        http = await call(
            r,
            "POST",
            "/v1/completions",
            json={
                "prompt": PROMPT,
                "max_tokens": 16,
                "return_hidden_states": True,
                "hidden_states_encoding": "base64",
                **fields,
            },
        )
        return py.choices[0], handle.choices[0], http.json()["choices"][0]

    return run(go())


@pytest.mark.parametrize("position", POSITIONS)
def test_the_squeeze_is_decided_once(position):
    """One position: a vector [D] on every path; several: [n, D] with their positions, on every path."""
    multi = several(position)
    assert multi == (position not in SINGLE_POSITIONS)
    py, handle, http = three_paths(hidden_states_position=position)
    meta = http["hidden_states_meta"]
    for ch in (py, handle):
        assert ch.multi is multi and list(ch.hidden_states.shape) == ch.shape == meta["shape"]
        assert ch.positions == (tuple(meta["positions"]) if multi else None)
        assert ch.hidden_states.tobytes() == base64.b64decode(http["hidden_states"])
    assert ("positions" in meta) is multi
    if multi:
        assert py.hidden_states.ndim == 2
    else:
        assert py.hidden_states.shape == (HIDDEN_SIZE,)
    assert squeeze([], False, {}) == {} and squeeze([1, 2], False) == 1 and squeeze([1, 2], True) == [1, 2]


@pytest.mark.parametrize("position", ["completion_end", "completion"])
def test_float16_is_float16_on_every_path(position):
    py, handle, http = three_paths(hidden_states_position=position, hidden_states_dtype="float16")
    for ch in (py, handle):
        assert ch.dtype == "float16" and ch.hidden_states.dtype == np.float16
        assert ch.hidden_states_by_layer[-1].dtype == np.float16
    assert http["hidden_states_meta"]["dtype"] == "float16"
    assert py.hidden_states.tobytes() == handle.hidden_states.tobytes() == base64.b64decode(http["hidden_states"])
    # bfloat16 (no numpy dtype): float32 of its values on both Python paths, exactly
    py, handle, http = three_paths(hidden_states_position=position, hidden_states_dtype="bfloat16")
    bits = np.frombuffer(base64.b64decode(http["hidden_states"]), "<u2")
    for ch in (py, handle):
        assert ch.dtype == "bfloat16" and ch.hidden_states.dtype == np.float32
        np.testing.assert_array_equal(ch.hidden_states.reshape(-1), widen(bits, "bfloat16"))


def test_the_vectors_are_views_of_the_rows():
    c = asyncio.run(
        FakeEngine(True).complete(IDS, None, position="completion", dtype="float16", layers=(0, -1), topk=3)
    )
    ch = c.choices[0]
    assert ch.hidden_states is ch.hidden_states_by_layer[-1]
    assert np.shares_memory(ch.hidden_states, ch.rows.values[-1])
    assert np.shares_memory(ch.hidden_states_indices, ch.rows.indices[-1])
    assert ch.hidden_states_indices.dtype == np.int32 and ch.hidden_states.shape == ch.hidden_states_indices.shape
    # an empty range: zero rows of the dtype asked
    empty = asyncio.run(FakeEngine(True).complete(IDS, None, position={"start": 99}, dtype="float16")).choices[0]
    assert empty.hidden_states.shape == (0, HIDDEN_SIZE) and empty.hidden_states.dtype == np.float16
    assert empty.positions == ()


SPECIAL = np.array([0x7FC1, 0xFF80, 0x0001, 0x8000, 0x7F80, 0x3F80], "<u2")  # NaN payload, -inf, subnormal, -0, inf, 1


def rows_of(dtype, multi, topk=None, layers=(-1,), heads=False):
    n = 4 if multi else 1
    batch = fake_rows(IDS, list(range(8 - n, 8)), layers, dtype, topk)
    if dtype == "bfloat16":  # bit patterns numpy would not keep through float32
        batch.values[-1][0, : len(SPECIAL)] = SPECIAL[: batch.width]
    return batch


CASES = {
    "float32 one vector": dict(rows=rows_of("float32", False)),
    "float32 rows, layers": dict(rows=rows_of("float32", True, layers=(0, 3, -1)), multi=True),
    "float16 rows": dict(rows=rows_of("float16", True), multi=True),
    "float16 one vector": dict(rows=rows_of("float16", False)),
    "bfloat16 rows, special values": dict(rows=rows_of("bfloat16", True), multi=True),
    "top-k bfloat16 rows": dict(rows=rows_of("bfloat16", True, topk=3), multi=True),
    "top-k one vector": dict(rows=rows_of("float32", False, topk=2)),
    "heads alone, rows' positions": dict(
        rows=RowBatch(np.array([3, 5]), {}, "float16"),
        multi=True,
        heads={"probe": [{"scores": [0.25, 0.75], "label": "yes"}] * 2},
    ),
    "heads and rows": dict(rows=rows_of("float32", False), heads={"sae": {"indices": [7, 1], "values": [2.5, 0.5]}}),
    "proofs": dict(proofs=("AAEC", "AwQF")),
    "steering only": dict(steering=[{"vector": "happy", "layer": 4, "scale": 2.0}]),
    "a stop condition finished it": dict(
        stop={"head": "probe", "feature": 2, "above": 0.5, "condition": 0, "position": 17, "score": 0.75},
        stop_asked=True,
    ),
    "stop conditions that never held": dict(stop=None, stop_asked=True),
    "nothing asked": dict(),
    "zero rows of a range": dict(rows=RowBatch.empty((-1,), 3, "float16", 3), multi=True),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stats", [ExtractionStats(12, 11, 0.5, via="tail"), None])
def test_the_wire_carries_the_one_type_bit_for_bit(case, stats):
    ch = CompletionChoice(1, "é x", (3, 4, 5), "stop", extraction=stats, **CASES[case])
    raw = wire.ENCODER.encode(wire.HandleReply(ok=wire.HandleCompletion("r", "replica-1", [1, 2], [wire.to_wire(ch)])))
    back = wire.from_wire(wire.REPLY_DECODER.decode(raw).ok.choices[0])
    assert (back.index, back.text, back.token_ids, back.finish_reason, back.extraction, back.multi) == (
        ch.index,
        ch.text,
        ch.token_ids,
        ch.finish_reason,
        ch.extraction,
        ch.multi,
    )
    assert (back.proofs, back.heads, back.steering, back.dtype, back.positions, back.shape if ch.rows else None) == (
        ch.proofs,
        ch.heads,
        ch.steering,
        ch.dtype,
        ch.positions,
        ch.shape if ch.rows else None,
    )
    assert (back.stop, back.stop_asked) == (ch.stop, ch.stop_asked)
    if ch.rows is None:
        assert back.rows is None and back.hidden_states is None and back.hidden_states_by_layer is None
        return
    assert back.rows.positions.tolist() == ch.rows.positions.tolist()
    assert list(back.rows.values) == list(ch.rows.values)
    for layer, v in ch.rows.values.items():
        assert back.rows.values[layer].dtype == numpy_dtype(ch.dtype)
        assert back.rows.values[layer].tobytes() == v.tobytes()  # bit for bit (bfloat16 NaN payloads too)
        assert back.hidden_states_by_layer[layer].tobytes() == ch.hidden_states_by_layer[layer].tobytes()
        assert back.hidden_states_by_layer[layer].flags.writeable
    assert (back.rows.indices is None) == (ch.rows.indices is None)
    for layer, i in (ch.rows.indices or {}).items():
        assert back.rows.indices[layer].dtype == np.int32 and back.rows.indices[layer].tobytes() == i.tobytes()
        np.testing.assert_array_equal(
            back.hidden_states_indices_by_layer[layer], ch.hidden_states_indices_by_layer[layer]
        )


def test_the_http_formatter_reads_the_choice_as_the_python_api_does():
    """choice_fields: floats are the Python arrays' values, base64 the rows' bytes as cast, the meta their shape."""
    for dtype, multi in [("float32", False), ("float16", True), ("bfloat16", True)]:
        position = "all" if multi else "completion_end"
        ch = CompletionChoice(0, "", (), None, rows_of(dtype, multi, layers=(0, -1)), multi=multi, position=position)
        floats = choice_fields(ch, ResponseForm("float", by_layer=True))
        b64 = choice_fields(ch, ResponseForm("base64"))
        for layer in (0, -1):
            got = floats["hidden_states_by_layer"][str(layer)]
            np.testing.assert_array_equal(np.asarray(got, np.float32), ch.hidden_states_by_layer[layer])
        assert base64.b64decode(b64["hidden_states"]) == ch.raw(-1).tobytes()
        meta = b64["hidden_states_meta"]
        assert meta["shape"] == ch.shape and meta["dtype"] == dtype and meta["bytes"] == ch.rows.nbytes
        assert meta.get("positions") == (list(ch.positions) if multi else None)
    half = narrow(np.array([[1 / 3, -2.0]], np.float32), "float16")
    ch = CompletionChoice(0, "", (), None, RowBatch(np.array([7]), {-1: half}, "float16"))
    assert (
        choice_fields(ch, ResponseForm())["hidden_states"] == widen(half, "float16")[0].tolist()
    )  # float16 floats are the float32-widened values, as ever
