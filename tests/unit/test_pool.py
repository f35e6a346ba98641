"""hidden_states_pool's own logic, without an engine: the engine core's sum (`scheduler._Pool`: steps pooled
on the device and rows it sums itself, each position once, nothing past the end), the wire's check of a
pooled message, the frontend's mean (`HiddenStatesCollector._close_pool`) and the request's rules."""

from __future__ import annotations

import numpy as np
import pytest

from hidden_states.interface import HiddenStatesCollector, PooledSum, RowBatch
from hidden_states.params import HiddenStatesRequestError, Span, parse_fields
from hidden_states.protocol import CapturedRows, CaptureSpec, HiddenStatesProtocolError, RowBlock

D = 4


def rows(positions, layer: int = 0) -> np.ndarray:
    """Row p of layer l: p + l/10 + 0..D-1 (float32)."""
    return (np.asarray(positions, np.float32)[:, None] + layer / 10 + np.arange(D)).astype(np.float32)


def pooled_step(positions, layers=(1, -1)) -> tuple[np.ndarray, list[RowBlock]]:
    """A step's buffer as the worker packs a pooled entry: one float32 row per layer, the sum of its rows."""
    sums = [rows(positions, l).sum(axis=0) for l in layers]
    data = np.frombuffer(np.concatenate(sums).astype("<f4").tobytes(), np.uint8)
    blocks = [
        RowBlock(positions[-1] + 1, l, list(positions), "float32", D, 4 * D * j, -1, "", True)
        for j, l in enumerate(layers)
    ]
    return data, blocks


def plain_step(positions, layers=(1, -1)) -> tuple[np.ndarray, list[RowBlock]]:
    """A step's buffer of unpooled rows (a step with drafts)."""
    parts = [rows(positions, l) for l in layers]
    data = np.frombuffer(np.concatenate(parts).astype("<f4").tobytes(), np.uint8)
    n = len(positions) * D * 4
    return data, [RowBlock(positions[-1] + 1, l, list(positions), "float32", D, n * j) for j, l in enumerate(layers)]


def pool_acc(span=(5, None, 1)):
    from hidden_states.vllm.core.scheduler import _Pool, _StepRefs

    spec = CaptureSpec(span=list(span), layers=[1, -1], pool=True)
    return _Pool(_StepRefs(spec, Span(*span)))


def test_the_engine_core_adds_pooled_steps_and_rows_it_sums_itself_once_at_the_end():
    from hidden_states.vllm.core.scheduler import _file_into

    acc = pool_acc()
    for positions, step in [([5, 6, 7], pooled_step), ([8], pooled_step), ([9, 10], plain_step), ([11], pooled_step)]:
        data, blocks = step(positions)
        _file_into(acc, data, blocks, bound=positions[-1] + 1)
    assert acc.release(12) is None  # nothing before the end
    out = acc.release(12, total=12)
    assert out.pooled and out.positions == list(range(5, 12)) and out.layers == [1, -1]
    values, _ = out.arrays()
    assert values.shape == (2, 1, D)
    for j, layer in enumerate((1, -1)):
        np.testing.assert_allclose(values[j, 0], rows(range(5, 12), layer).sum(axis=0), rtol=1e-6)
    assert acc.release(12, total=12) is None  # sent once


def test_a_position_summed_twice_or_past_the_end_fails_the_request_not_the_mean():
    from hidden_states.vllm.core.scheduler import _file_into

    acc = pool_acc()
    for positions in ([5, 6], [6, 7]):  # 6 twice (a plan that pooled a recomputed row)
        _file_into(acc, *pooled_step(positions), bound=8)
    with pytest.raises(RuntimeError, match="summed twice"):
        acc.release(8, total=8)
    acc = pool_acc()
    _file_into(acc, *pooled_step([5, 6, 7]), bound=8)
    with pytest.raises(RuntimeError, match="past the request's end"):
        acc.trim(7)  # tokens accepted past a stop: a pooled step never holds them


def test_a_pooled_message_decodes_only_as_float32_sums():
    ok = CapturedRows("float32", 0, D, [1], [3, 4, 5], np.zeros(D, "<f4").tobytes(), pooled=True)
    assert CapturedRows.from_output(ok.to_output()).arrays()[0].shape == (1, 1, D)
    wrong = CapturedRows("float32", 0, D, [1], [3, 4, 5], np.zeros(3 * D, "<f4").tobytes(), pooled=True)
    with pytest.raises(HiddenStatesProtocolError):
        CapturedRows.from_output(wrong.to_output())
    half = CapturedRows("float16", 0, D, [1], [3], np.zeros(D, "<f2").tobytes(), pooled=True)
    with pytest.raises(HiddenStatesProtocolError, match="float32 sums"):
        CapturedRows.from_output(half.to_output())


def collector(dtype="float32") -> HiddenStatesCollector:
    spec = parse_fields(
        {
            "return_hidden_states": True,
            "hidden_states_pool": "mean",
            "hidden_states_position": "completion",
            "hidden_states_layers": [1, -1],
            "hidden_states_dtype": dtype,
        },
        enabled=True,
    )
    return HiddenStatesCollector.of("t", spec, (1, -1))


def total(positions) -> PooledSum:
    return PooledSum(
        np.asarray(positions, np.int64), {l: rows(positions, l).astype(np.float64).sum(0) for l in (1, -1)}
    )


def test_the_frontend_means_disjoint_sums_within_the_choice_and_drops_a_sum_past_its_end():
    col, key = collector(), (0, 0)
    col.add_rows(key, total([5, 6, 7, 8, 9]))  # the engine's sum, past a stop string the frontend cut at 8
    col.add_rows(key, total([5, 6, 7]))  # the extraction step's
    col.add_rows(key, RowBatch(np.array([8]), {l: rows([8], l) for l in (1, -1)}))  # and a row
    col.close_choice(key, [5, 6, 7, 8], None)
    st = col.state(key)
    assert st.pooled == 4 and not st.sums
    (batch,) = st.pending
    for layer in (1, -1):
        np.testing.assert_allclose(batch.values[layer][0], rows([5, 6, 7, 8], layer).mean(0), rtol=1e-6)


def test_a_choice_whose_rows_do_not_cover_it_has_no_mean():
    col, key = collector(), (0, 0)
    col.add_rows(key, total([5, 6]))
    col.close_choice(key, [5, 6, 7], None)
    assert col.state(key).pooled == 0 and not col.state(key).pending


def test_a_half_precision_mean_is_the_float32_mean_cast_once():
    from hidden_states.protocol import narrow

    col, key = collector("bfloat16"), (0, 0)
    col.add_rows(key, total([5, 6, 7]))
    col.close_choice(key, [5, 6, 7], None)
    (batch,) = col.state(key).pending
    assert batch.dtype == "bfloat16"
    np.testing.assert_array_equal(batch.values[-1][0], narrow(rows([5, 6, 7], -1).mean(0), "bfloat16"))


@pytest.mark.parametrize(
    "fields",
    [
        {"hidden_states_pool": "median"},
        {"hidden_states_pool": 1},
        {"hidden_states_pool": "mean", "hidden_states_topk": 3},
        {"hidden_states_pool": "mean", "hidden_states_heads": ["x"]},
        {"hidden_states_pool": "mean", "hidden_states_proof": {"scheme": "toploc"}, "return_hidden_states": False},
        {"hidden_states_pool": "mean", "return_hidden_states": False},
    ],
)
def test_bad_pools_name_the_field(fields):
    with pytest.raises(HiddenStatesRequestError) as e:
        parse_fields({"return_hidden_states": True, **fields}, enabled=True)
    assert e.value.param == "hidden_states_pool", e.value


def test_a_pool_is_one_vector_and_its_spec_crosses_processes():
    spec = parse_fields(
        {"return_hidden_states": True, "hidden_states_pool": "mean", "hidden_states_position": "all"}, enabled=True
    )
    assert type(spec).from_json(spec.to_json()).hidden_states_pool == "mean"
    col = HiddenStatesCollector.of("t", spec, (-1,))
    assert col.pool and not col.multi  # one vector: no rows on a stream's chunks
