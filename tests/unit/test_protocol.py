"""Unit tests for hidden_states.protocol: what rides vLLM's outputs, and its validation (no vLLM)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from hidden_states.protocol import (
    OUTPUT_KEY,
    SPEC_KEY,
    CapturedRows,
    CaptureSpec,
    EngineMessage,
    HiddenStatesProtocolError,
    RequestSpec,
    SteerEntry,
    captured_rows,
    widen,
)

D = 4096


def _over_the_wire(cr: CapturedRows) -> CapturedRows:
    """As the engine core sends it: inside an EngineCoreOutput's kv_transfer_params, msgpack-encoded."""
    frame = msgspec.msgpack.encode({OUTPUT_KEY: EngineMessage(rows=cr).to_output()})
    return EngineMessage.from_output(msgspec.msgpack.decode(frame)[OUTPUT_KEY]).rows


def _vector(dtype: str, layers: list[int], rows: np.ndarray, position: int = 16) -> CapturedRows:
    """A single vector as the scheduler sends it: the row of one position, per layer ([layers, D])."""
    return captured_rows(dtype, 0, layers, [position], rows[:, None], None)


def test_float32_roundtrip_exact_and_raw_bytes():
    rows = np.random.default_rng(0).standard_normal((2, D)).astype(np.float32)
    cr = _vector("float32", [12, 24], rows)
    wire = msgspec.msgpack.encode(cr.to_output())
    assert len(wire) < rows.nbytes + 100  # raw bytes on the wire, not base64 or a list of floats
    out = _over_the_wire(cr)
    assert (out.positions, out.layers, out.width, out.topk) == ([16], [12, 24], D, 0)
    values, indices = out.arrays()
    assert values.shape == (2, 1, D) and indices is None
    np.testing.assert_array_equal(widen(values, "float32")[:, 0], rows)


def test_float16_widens_exactly():
    rows = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float16)
    out = _over_the_wire(_vector("float16", [-1], rows))
    np.testing.assert_array_equal(widen(out.arrays()[0], "float16")[:, 0], rows.astype(np.float32))


def test_bfloat16_bit_exact_with_special_values():
    t = torch.tensor([[0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf"), 3.0e38, 1e-40]], dtype=torch.bfloat16)
    out = _over_the_wire(_vector("bfloat16", [2], t.view(torch.uint16).numpy()))
    got, want = widen(out.arrays()[0], "bfloat16")[:, 0], t.float().numpy()
    assert got.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()


def test_rows_of_many_positions_with_top_k_indices():
    values = np.random.default_rng(2).standard_normal((2, 3, 5)).astype(np.float16)
    indices = np.arange(30, dtype=np.int32).reshape(2, 3, 5)
    out = _over_the_wire(captured_rows("float16", 5, [0, 2], [4, 5, 6], values, indices))
    got_values, got_indices = out.arrays()
    np.testing.assert_array_equal(got_values, values)
    np.testing.assert_array_equal(got_indices, indices)


def test_non_contiguous_and_big_endian_inputs():
    base = np.random.default_rng(3).standard_normal((8, 6)).astype(np.float32)
    got = _over_the_wire(_vector("float32", list(range(6)), base.T)).arrays()[0][:, 0]
    np.testing.assert_array_equal(got, base.T)
    got = _over_the_wire(_vector("float32", [0], base[:1].astype(">f4"))).arrays()[0][:, 0]
    np.testing.assert_array_equal(got, base[:1])


def test_captured_rows_reject_unknown_or_mismatched_dtype():
    with pytest.raises(ValueError, match="unsupported dtype"):
        _vector("float64", [0], np.zeros((1, 4), np.float64))
    with pytest.raises(ValueError, match="cannot be sent as"):
        _vector("float16", [0], np.zeros((1, 4), np.float32))


@pytest.mark.parametrize(
    "raw",
    [
        None,
        "garbage",
        {"garbled": True},
        [1, 2, 3],
        ["k", "float64", 0, 4, [0], [1], b"\0" * 32],  # unknown dtype
        ["k", "float32", 0, 4, [0, 1], [1], b"\0" * 16],  # 16 bytes cannot hold 2 x 1 x 4 float32
        ["k", "float32", 0, 0, [0], [1], b""],  # empty
        ["k", "float16", 4, 4, [0], [1], b"\0" * 8],  # top-k without its indices
    ],
)
def test_malformed_rows_are_refused_with_what_was_wrong(raw):
    with pytest.raises(HiddenStatesProtocolError, match="malformed|unsupported dtype|do not hold"):
        CapturedRows.from_output(raw)


# ------------------------------------------------------------ extra_args


def test_request_spec_roundtrip():
    """A request's one value of ours in extra_args: its key, what it captures, its steering; what the scheduler and
    the workers decode is what the frontend wrote, over vLLM's msgpack."""
    steer = [SteerEntry(3, "add", "all", 2.0, np.ones(4, "<f4").tobytes())]
    spec = RequestSpec("tag.1", CaptureSpec(span=[-1, None, 1], layers=[-1, 10], reaches_final=True), steer)
    extra = spec.into({"something_else": 1})
    assert set(extra) == {SPEC_KEY, "something_else"}
    assert extra[SPEC_KEY]["capture"] == {"span": [-1, None, 1], "layers": [-1, 10], "reaches_final": True}
    back = RequestSpec.of(msgspec.msgpack.decode(msgspec.msgpack.encode(extra)))
    assert back == spec and back.steer[0].array().tolist() == [1.0] * 4


def test_request_spec_defaults_roundtrip():
    back = RequestSpec.of(RequestSpec("k", CaptureSpec(span=[4, 5, 1])).into(None))
    assert back.capture.layers == [-1] and not back.capture.reaches_final and back.steer == [] and not back.inject


def test_a_collector_tags_extra_args_keeping_the_rest():
    """The collector's tag becomes the spec's key; other keys, and a test's injected fault, stay."""
    from hidden_states.interface import HiddenStatesCollector

    extra = HiddenStatesCollector("t1").tagged(RequestSpec(inject="plan").into({"mine": 1}))
    assert extra["mine"] == 1 and RequestSpec.of(extra) == RequestSpec("t1", inject="plan")


def test_a_collector_s_capture_is_its_fields_over_a_span():
    """The one place a request's fields become what the engine captures: a pool's rows float32 sums."""
    import dataclasses

    from hidden_states.interface import HiddenStatesCollector

    col = HiddenStatesCollector("t", (1, -1), "all", dtype="float16", topk=3, heads=(("probe", 0),))
    c = col.capture([0, None, 1], reaches_final=True, every_step=False)
    assert (c.span, c.layers, c.dtype, c.topk, c.heads, c.pool) == (
        [0, None, 1],
        [1, -1],
        "float16",
        3,
        [["probe", 0]],
        False,
    )
    assert c.reaches_final and not c.every_step
    pooled = dataclasses.replace(col, pool=True, topk=None, heads=()).capture([4, None, 1], False, True)
    assert (pooled.dtype, pooled.pool, pooled.topk, pooled.every_step) == ("float32", True, 0, True)
    assert dataclasses.replace(col, rows_wanted=False).capture([0, None, 1], False, False).layers == []


@pytest.mark.parametrize("extra", [None, {}, {"other": {"key": "k"}}])
def test_request_spec_absent_is_empty(extra):
    assert RequestSpec.of(extra) == RequestSpec()


def test_request_spec_unknown_field_rejected():
    with pytest.raises(HiddenStatesProtocolError, match="unknown field"):
        RequestSpec.of({SPEC_KEY: {"key": "k", "evil": 1}})


@pytest.mark.parametrize(
    "raw",
    [{"key": 5}, {"capture": {}}, {"capture": {"span": [-1, None, 1], "layers": "all"}}, {"steer": [1]}, "k", None],
)
def test_request_spec_invalid_rejected(raw):
    with pytest.raises(HiddenStatesProtocolError):
        RequestSpec.of({SPEC_KEY: raw}) if raw is not None else RequestSpec.of({SPEC_KEY: []})


def test_released_rows_reach_msgpack_as_a_view_of_the_engine_core_s_array():
    """captured_rows copies nothing: the values msgpack writes out are a view of the rows the engine core
    released (one copy fewer per row than `tobytes`), and the frontend decodes the same bytes."""
    values = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    indices = np.arange(2 * 3 * 4, dtype=np.int32).reshape(2, 3, 4)
    cr = captured_rows("float32", 4, [0, 5], [7, 8, 9], values, indices)
    assert isinstance(cr.values, memoryview) and np.shares_memory(np.frombuffer(cr.values, np.float32), values)
    assert np.shares_memory(np.frombuffer(cr.indices, np.int32), indices)
    back = CapturedRows.from_output(msgspec.msgpack.decode(msgspec.msgpack.encode({"r": cr.to_output()}))["r"])
    got, got_indices = back.arrays()
    assert got.tobytes() == values.tobytes() and got_indices.tobytes() == indices.tobytes()


def test_one_typed_message_per_output_carries_every_part_over_msgpack():
    """rows, heads' outputs, the stop, where `when` entries applied and a fault: one value under one key,
    each part typed on arrival; a message that does not decode, or heads at other positions, is refused."""
    from hidden_states.protocol import HookFault, SteeredReport, StopReport

    rows = captured_rows("float32", 0, [1], [5, 6], np.ones((1, 2, 3), np.float32), None)
    head = captured_rows("float32", 0, [1], [5, 6], np.zeros((1, 2, 2), np.float32), None)
    msg = EngineMessage("k", rows, {"probe": head}, StopReport(6, 0, 1.5), SteeredReport([(0, [6])]))
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode({OUTPUT_KEY: msg.to_output()}))[OUTPUT_KEY]
    back = EngineMessage.from_output(raw)
    assert back.rows.positions == [5, 6] and back.heads["probe"].width == 2
    assert back.key == "k" and back.stop == StopReport(6, 0, 1.5) and back.steered == SteeredReport([(0, [6])])
    assert back.fault is None and bool(back) and not EngineMessage()
    fault = EngineMessage.from_output(EngineMessage(fault=HookFault.of("plan", ValueError("x"))).to_output())
    assert fault.fault == HookFault("plan", "ValueError: x") and fault.rows is None
    for bad in ({"garbled": True}, [rows.to_output(), {"probe": [1]}]):
        with pytest.raises(HiddenStatesProtocolError, match="malformed"):
            EngineMessage.from_output(bad)
    elsewhere = captured_rows("float32", 0, [1], [7, 8], np.zeros((1, 2, 2), np.float32), None)
    with pytest.raises(HiddenStatesProtocolError, match="other positions"):
        EngineMessage.from_output(EngineMessage(rows=rows, heads={"probe": elsewhere}).to_output())
