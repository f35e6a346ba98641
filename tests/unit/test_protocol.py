"""Unit tests for hidden_states.protocol: codec round trips and frame validation (no vLLM)."""

from __future__ import annotations

import os
import pickle

import msgspec
import numpy as np
import pytest
import torch

from hidden_states.protocol import (
    EXTRA_ARGS_KEY,
    HiddenStatesBatch,
    HiddenStatesExtractionRequest,
    HiddenStatesResult,
    SideChannelProtocolError,
    decode_batch,
    encode_batch,
    result_from_array,
)

D = 4096
SHAPES = [(D,), (3, 5, 7)]


def _roundtrip(*results: HiddenStatesResult) -> list[HiddenStatesResult]:
    frame = encode_batch(HiddenStatesBatch(results=list(results)))
    assert isinstance(frame, bytes)
    return decode_batch(frame).results


# --------------------------------------------------------------- round trips


@pytest.mark.parametrize("shape", SHAPES)
def test_float32_roundtrip_exact(shape):
    arr = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    (out,) = _roundtrip(result_from_array("k32", arr, "float32", layer=-1))
    assert (out.key, out.dtype, out.shape, out.layer) == ("k32", "float32", shape, -1)
    got = out.to_numpy()
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got, arr)


@pytest.mark.parametrize("shape", SHAPES)
def test_float16_roundtrip_exact_after_widening(shape):
    arr = np.random.default_rng(1).standard_normal(shape).astype(np.float16)
    (out,) = _roundtrip(result_from_array("k16", arr, "float16", layer=12))
    assert (out.dtype, out.shape, out.layer) == ("float16", shape, 12)
    assert len(out.data) == arr.size * 2
    got = out.to_numpy()
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got, arr.astype(np.float32))


@pytest.mark.parametrize("shape", SHAPES)
def test_bfloat16_roundtrip_matches_torch_exactly(shape):
    torch.manual_seed(2)
    t = torch.randn(shape, dtype=torch.bfloat16)
    bits = t.view(torch.uint16).numpy()
    (out,) = _roundtrip(result_from_array("kbf", bits, "bfloat16"))
    assert (out.dtype, out.shape) == ("bfloat16", shape)
    assert len(out.data) == t.numel() * 2
    got = out.to_numpy()
    want = t.float().numpy()
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got, want)
    # bit-exact, not merely numerically equal
    assert got.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()


def test_bfloat16_special_values():
    t = torch.tensor([0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf"), 3.0e38, 1e-40], dtype=torch.bfloat16)
    (out,) = _roundtrip(result_from_array("s", t.view(torch.uint16).numpy(), "bfloat16"))
    got, want = out.to_numpy(), t.float().numpy()
    assert got.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()
    assert np.signbit(got[1]) and np.isposinf(got[4]) and np.isneginf(got[5])


def test_non_contiguous_and_big_endian_inputs_roundtrip():
    base = np.random.default_rng(3).standard_normal((6, 8)).astype(np.float32)
    transposed = base.T  # non-contiguous view
    big_endian = base.astype(">f4")
    (a, b) = _roundtrip(result_from_array("t", transposed, "float32"), result_from_array("be", big_endian, "float32"))
    np.testing.assert_array_equal(a.to_numpy(), transposed)
    np.testing.assert_array_equal(b.to_numpy(), base)


def test_batch_keeps_order_keys_and_layers():
    rng = np.random.default_rng(4)
    arrs = [rng.standard_normal(16).astype(np.float32) for _ in range(3)]
    res = _roundtrip(*[result_from_array(f"key-{i}", a, "float32", layer=i - 1) for i, a in enumerate(arrs)])
    assert [r.key for r in res] == ["key-0", "key-1", "key-2"]
    assert [r.layer for r in res] == [-1, 0, 1]
    for r, a in zip(res, arrs):
        np.testing.assert_array_equal(r.to_numpy(), a)


def test_empty_batch_roundtrip():
    assert decode_batch(encode_batch(HiddenStatesBatch(results=[]))).results == []


def test_result_from_array_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="unsupported dtype"):
        result_from_array("k", np.zeros(4, np.float64), "float64")


# ------------------------------------------------------------ extra_args


def test_extraction_request_extra_args_roundtrip():
    req = HiddenStatesExtractionRequest(key="req-1", layers=[-1, 10])
    extra = req.to_extra_args()
    assert set(extra) == {EXTRA_ARGS_KEY}
    assert extra[EXTRA_ARGS_KEY] == {"key": "req-1", "layers": [-1, 10]}
    assert HiddenStatesExtractionRequest.from_extra_args(extra) == req


def test_extraction_request_default_layers_roundtrip():
    req = HiddenStatesExtractionRequest(key="req-2")
    back = HiddenStatesExtractionRequest.from_extra_args(req.to_extra_args())
    assert back == req and back.layers == [-1]


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


# ---------------------------------------------------------- malformed frames


def _valid_frame() -> bytes:
    return encode_batch(HiddenStatesBatch([result_from_array("k", np.arange(4, dtype=np.float32), "float32")]))


def test_random_bytes_rejected():
    rng = np.random.default_rng(5)
    for _ in range(2000):
        frame = rng.bytes(int(rng.integers(0, 96)))
        with pytest.raises(SideChannelProtocolError, match="malformed hidden-states frame"):
            decode_batch(frame)


def test_every_truncation_rejected():
    frame = _valid_frame()
    decode_batch(frame)  # the full frame is fine
    for n in range(len(frame)):
        with pytest.raises(SideChannelProtocolError, match=rf"malformed hidden-states frame \({n} bytes\)"):
            decode_batch(frame[:n])


def test_trailing_garbage_rejected():
    with pytest.raises(SideChannelProtocolError, match="malformed"):
        decode_batch(_valid_frame() + b"\x00")


def test_wrong_dtype_name_rejected():
    frame = msgspec.msgpack.encode([[["k", "float64", [4], bytes(32)]]])
    with pytest.raises(SideChannelProtocolError, match=r"unsupported dtype 'float64' for key 'k'"):
        decode_batch(frame)


@pytest.mark.parametrize(
    "dtype,shape,nbytes",
    [("float32", [4], 15), ("float32", [4], 17), ("float16", [2, 3], 14), ("bfloat16", [D], 2 * D - 2), ("float32", [], 0), ("float32", [-1, -4], 16)],
)
def test_data_length_not_matching_shape_rejected(dtype, shape, nbytes):
    frame = msgspec.msgpack.encode([[["k", dtype, shape, bytes(nbytes)]]])
    with pytest.raises(SideChannelProtocolError, match=rf"key 'k': {nbytes} bytes do not hold shape"):
        decode_batch(frame)


def test_second_result_invalid_rejects_whole_frame():
    good = ["a", "float32", [1], bytes(4)]
    bad = ["b", "float32", [2], bytes(4)]
    with pytest.raises(SideChannelProtocolError, match="key 'b'"):
        decode_batch(msgspec.msgpack.encode([[good, bad]]))


@pytest.mark.parametrize(
    "obj",
    [
        {"results": []},  # map instead of array_like
        [[{"key": "k", "dtype": "float32", "shape": [1], "data": b"\0\0\0\0"}]],
        [[["k", "float32", [1], "not-bytes"]]],
        [[["k", "float32", "1", bytes(4)]]],
        [["not-a-result"]],
        ["k", "float32", [1], bytes(4)],  # a bare result, not a batch
        {EXTRA_ARGS_KEY: {"key": "k"}},  # an extraction request
        [],
        None,
        42,
    ],
)
def test_other_msgpack_structure_rejected(obj):
    with pytest.raises(SideChannelProtocolError, match="malformed hidden-states frame"):
        decode_batch(msgspec.msgpack.encode(obj))


def test_extraction_request_struct_as_frame_rejected():
    frame = msgspec.msgpack.encode(HiddenStatesExtractionRequest(key="k"))
    with pytest.raises(SideChannelProtocolError, match="malformed"):
        decode_batch(frame)


_PWNED = {"hit": False}


def _pwn(*_args):
    _PWNED["hit"] = True
    return 0


class _Evil:
    def __reduce__(self):
        return (_pwn, ("side effect",))


class _EvilSystem:
    def __reduce__(self):
        return (os.system, ("touch /tmp/hidden_states_test_pwned_never",))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_payload_rejected_and_never_unpickled(protocol):
    _PWNED["hit"] = False
    marker = "/tmp/hidden_states_test_pwned_never"
    if os.path.exists(marker):
        os.unlink(marker)
    # sanity: unpickling these payloads WOULD have the side effect
    pickle.loads(pickle.dumps(_Evil(), protocol=protocol))
    assert _PWNED["hit"]
    _PWNED["hit"] = False

    for payload in (
        pickle.dumps(_Evil(), protocol=protocol),
        pickle.dumps(_EvilSystem(), protocol=protocol),
        pickle.dumps(HiddenStatesBatch([result_from_array("k", np.zeros(2, np.float32), "float32")]), protocol=protocol),
    ):
        with pytest.raises(SideChannelProtocolError, match="malformed hidden-states frame"):
            decode_batch(payload)
    assert _PWNED["hit"] is False
    assert not os.path.exists(marker)
