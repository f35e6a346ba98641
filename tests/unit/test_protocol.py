"""Unit tests for hidden_states.protocol: what rides vLLM's outputs, and its validation (no vLLM)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from hidden_states.protocol import (EXTRA_ARGS_KEY, CapturedVector, HiddenStatesExtractionRequest,
                                    HiddenStatesProtocolError, captured_vector)

D = 4096


def _over_the_wire(cv: CapturedVector) -> CapturedVector:
    """As the engine core sends it: inside an EngineCoreOutput's kv_transfer_params, msgpack-encoded."""
    frame = msgspec.msgpack.encode({"hidden_states": cv.to_output()})
    return CapturedVector.from_output(msgspec.msgpack.decode(frame)["hidden_states"])


def test_float32_roundtrip_exact_and_raw_bytes():
    rows = np.random.default_rng(0).standard_normal((2, D)).astype(np.float32)
    cv = captured_vector("k", "tail", 17, "float32", [12, 24], rows)
    wire = msgspec.msgpack.encode(cv.to_output())
    assert len(wire) < rows.nbytes + 100  # raw bytes on the wire, not base64 or a list of floats
    out = _over_the_wire(cv)
    assert (out.key, out.via, out.num_tokens, out.layers, out.hidden_size) == ("k", "tail", 17, [12, 24], D)
    got = out.to_numpy()
    assert got.dtype == np.float32 and got.shape == (2, D)
    np.testing.assert_array_equal(got, rows)


def test_float16_widens_exactly():
    rows = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float16)
    out = _over_the_wire(captured_vector("k", "prefill", 3, "float16", [-1], rows))
    np.testing.assert_array_equal(out.to_numpy(), rows.astype(np.float32))


def test_bfloat16_bit_exact_with_special_values():
    t = torch.tensor([[0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf"), 3.0e38, 1e-40]], dtype=torch.bfloat16)
    out = _over_the_wire(captured_vector("k", "tail", 1, "bfloat16", [2], t.view(torch.uint16).numpy()))
    got, want = out.to_numpy(), t.float().numpy()
    assert got.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()


def test_non_contiguous_and_big_endian_inputs():
    base = np.random.default_rng(3).standard_normal((8, 6)).astype(np.float32)
    np.testing.assert_array_equal(_over_the_wire(captured_vector("t", "tail", 1, "float32", list(range(6)),
                                                                 base.T)).to_numpy(), base.T)
    np.testing.assert_array_equal(_over_the_wire(captured_vector("b", "tail", 1, "float32", [0],
                                                                 base[:1].astype(">f4"))).to_numpy(), base[:1])


def test_captured_vector_rejects_unknown_or_mismatched_dtype():
    with pytest.raises(ValueError, match="unsupported dtype"):
        captured_vector("k", "tail", 1, "float64", [0], np.zeros((1, 4), np.float64))
    with pytest.raises(ValueError, match="cannot be sent as"):
        captured_vector("k", "tail", 1, "float16", [0], np.zeros((1, 4), np.float32))


@pytest.mark.parametrize("raw", [
    None, "garbage", {"garbled": True}, [1, 2, 3],
    ["k", "tail", 1, "float64", [0], 4, b"\0" * 32],  # unknown dtype
    ["k", "tail", 1, "float32", [0, 1], 4, b"\0" * 16],  # 16 bytes cannot hold 2 x 4 float32
    ["k", "tail", 1, "float32", [0], 0, b""],  # empty
])
def test_malformed_vectors_are_refused_with_what_was_wrong(raw):
    with pytest.raises(HiddenStatesProtocolError, match="malformed|unsupported dtype|do not hold"):
        CapturedVector.from_output(raw)


# ------------------------------------------------------------ extra_args


def test_extraction_request_extra_args_roundtrip():
    req = HiddenStatesExtractionRequest(key="req-1", layers=[-1, 10], tail=True)
    extra = req.to_extra_args()
    assert set(extra) == {EXTRA_ARGS_KEY}
    assert extra[EXTRA_ARGS_KEY] == {"key": "req-1", "layers": [-1, 10], "tail": True}
    assert HiddenStatesExtractionRequest.from_extra_args(extra) == req


def test_extraction_request_default_layers_roundtrip():
    req = HiddenStatesExtractionRequest(key="req-2")
    back = HiddenStatesExtractionRequest.from_extra_args(req.to_extra_args())
    assert back == req and back.layers == [-1] and not back.tail


def test_extraction_request_survives_other_extra_args():
    extra = {"something_else": 1, **HiddenStatesExtractionRequest(key="k").to_extra_args()}
    assert HiddenStatesExtractionRequest.from_extra_args(extra).key == "k"


@pytest.mark.parametrize("extra", [None, {}, {"other": {"key": "k"}}, {EXTRA_ARGS_KEY: None}])
def test_extraction_request_absent_is_none(extra):
    assert HiddenStatesExtractionRequest.from_extra_args(extra) is None


def test_extraction_request_unknown_field_rejected():
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        HiddenStatesExtractionRequest.from_extra_args({EXTRA_ARGS_KEY: {"key": "k", "evil": 1}})


@pytest.mark.parametrize("raw", [{}, {"key": 5}, {"key": "k", "layers": "all"}, "k"])
def test_extraction_request_invalid_rejected(raw):
    with pytest.raises(msgspec.ValidationError):
        HiddenStatesExtractionRequest.from_extra_args({EXTRA_ARGS_KEY: raw})
