"""Rows over Python handles (deployments/wire.py, deployments/client.py) and the FakeEngine's positions,
dtypes and top-k: the replica's `complete` route on the FakeEngine (no vLLM, no Ray), decoded by the client."""

from __future__ import annotations

import asyncio
import base64

import msgspec
import numpy as np
import pytest

from deployments import client, wire
from deployments.wire import HandleCompletionRequest
from hidden_states.interface import SamplingOptions
from hidden_states.params import PositionRange
from hidden_states.protocol import widen
from hidden_states.testing import HIDDEN_SIZE, FakeEngine, fake_rows, fake_vector
from tests.helpers import run
from tests.unit.test_ingress import call, make

PROMPT = "Hi there"
IDS = list(PROMPT.encode())


def complete(replica_args: dict | None = None, **kw):
    async def go():
        r = await make(**(replica_args or {}))
        return client._result(await r.complete(client._request(PROMPT, None, max_tokens=5, **kw)))

    return run(go())


def expected(position_rows, layers=(-1,), dtype="float32", topk=None, index=0):
    """The fake rows of choice `index` at `position_rows`, as the engine cast them (float32 widened)."""
    seq = IDS + [(len(IDS) + index + i) % 256 for i in range(5)]
    return fake_rows(seq, position_rows, layers, dtype, topk)


def test_a_default_request_and_its_single_vector_are_as_they_were():
    # the request's bytes: its wire version, the prompt, and the hidden-states fields as over HTTP
    assert msgspec.msgpack.decode(wire.ENCODER.encode(HandleCompletionRequest(prompt="x"))) == {
        "wire": wire.WIRE,
        "prompt": "x",
        "hidden_states": {"return_hidden_states": True},
    }
    c = complete(n=2, hidden_states_layers=[0, -1])
    for ch in c.choices:
        seq = IDS + list(ch.token_ids)
        assert ch.hidden_states.dtype == np.float32 and ch.hidden_states.shape == (HIDDEN_SIZE,)
        np.testing.assert_array_equal(ch.hidden_states, fake_vector(seq))
        np.testing.assert_array_equal(ch.hidden_states_by_layer[0], fake_vector(seq, 0))
        assert ch.positions is None and ch.dtype == "float32" and ch.hidden_states_indices is None
        assert ch.extraction.tokens == len(seq)


@pytest.mark.parametrize(
    "position, wanted",
    [
        ("completion", range(8, 13)),
        ("all", range(13)),
        ({"start": 2, "end": -1, "stride": 3}, range(2, 12, 3)),
        (PositionRange(start=-4), range(9, 13)),
    ],
)
def test_rows_come_back_as_numpy_n_by_d_with_their_positions(position, wanted):
    c = complete(hidden_states_position=position, hidden_states_layers=[0, -1])
    (ch,) = c.choices
    assert ch.positions == tuple(wanted)
    want = expected(list(wanted), (0, -1))
    for layer in (0, -1):
        got = ch.hidden_states_by_layer[layer]
        assert got.dtype == np.float32 and got.shape == (len(wanted), HIDDEN_SIZE)
        np.testing.assert_array_equal(got, want.values[layer])
    assert ch.hidden_states is ch.hidden_states_by_layer[-1]


def test_float16_rows_are_numpy_float16_and_bfloat16_rows_float32_of_the_rounded_values():
    half = complete(hidden_states_position="completion", hidden_states_dtype="float16").choices[0]
    assert half.dtype == "float16" and half.hidden_states.dtype == np.float16
    np.testing.assert_array_equal(half.hidden_states, expected(range(8, 13), dtype="float16").values[-1])
    bf = complete(hidden_states_position="completion", hidden_states_dtype="bfloat16").choices[0]
    assert bf.dtype == "bfloat16" and bf.hidden_states.dtype == np.float32
    want = expected(range(8, 13), dtype="bfloat16").values[-1]
    np.testing.assert_array_equal(bf.hidden_states, widen(want, "bfloat16"))
    assert not np.array_equal(bf.hidden_states, expected(range(8, 13)).values[-1])  # rounded: 8 bits of mantissa


def test_topk_rows_are_indices_and_values_per_position_per_layer():
    ch = complete(
        hidden_states_position={"start": 3, "stride": 4},
        hidden_states_topk=3,
        hidden_states_dtype="float16",
        hidden_states_layers=[1, -1],
    ).choices[0]
    assert ch.positions == (3, 7, 11)
    want = expected([3, 7, 11], (1, -1), "float16", 3)
    for layer in (1, -1):
        assert ch.hidden_states_indices_by_layer[layer].dtype == np.int32
        assert ch.hidden_states_indices_by_layer[layer].shape == ch.hidden_states_by_layer[layer].shape == (3, 3)
        np.testing.assert_array_equal(ch.hidden_states_indices_by_layer[layer], want.indices[layer])
        np.testing.assert_array_equal(ch.hidden_states_by_layer[layer], want.values[layer])
    full = expected([3, 7, 11]).values[-1]
    np.testing.assert_array_equal(
        ch.hidden_states, np.take_along_axis(full, ch.hidden_states_indices, -1).astype(np.float16)
    )
    assert (np.diff(np.abs(ch.hidden_states.astype(np.float32)), axis=-1) <= 0).all()


def test_one_position_with_a_dtype_or_topk_stays_one_vector():
    ch = complete(hidden_states_dtype="float16").choices[0]
    assert ch.positions is None and ch.hidden_states.shape == (HIDDEN_SIZE,) and ch.hidden_states.dtype == np.float16
    np.testing.assert_array_equal(ch.hidden_states, expected([12], dtype="float16").values[-1][0])
    top = complete(hidden_states_position="prompt_end", hidden_states_topk=2).choices[0]
    assert top.hidden_states.shape == top.hidden_states_indices.shape == (2,)
    np.testing.assert_array_equal(top.hidden_states_indices, fake_rows(IDS, [7], topk=2).indices[-1][0])


def test_a_range_past_the_sequence_is_zero_rows_and_no_vectors_is_none():
    ch = complete(hidden_states_position={"start": 40}).choices[0]
    assert ch.positions == () and ch.hidden_states.shape == (0, HIDDEN_SIZE)
    off = complete(return_hidden_states=False, hidden_states_position="completion").choices[0]
    assert off.hidden_states is None and off.hidden_states_by_layer is None and off.extraction is None


def test_handle_rows_respect_max_hidden_states_bytes_and_the_field_rules():
    # 13 positions x 8 x 4 bytes = 416 > 400; in float16, 208 fits
    with pytest.raises(client.HandleRequestError, match="max_hidden_states_bytes") as e:
        complete({"max_hidden_states_bytes": 400}, hidden_states_position="all")
    assert e.value.status == 400
    assert complete(
        {"max_hidden_states_bytes": 400}, hidden_states_position="all", hidden_states_dtype="float16"
    ).choices[0].hidden_states.shape == (13, HIDDEN_SIZE)
    for kw, words in [
        ({"hidden_states_position": {"start": "a"}}, "start must be an integer"),
        ({"hidden_states_dtype": "int8"}, "hidden_states_dtype must be"),
        ({"hidden_states_topk": 0}, "positive integer"),
        ({"hidden_states_topk": HIDDEN_SIZE + 1}, "exceeds the model's hidden size"),
    ]:
        with pytest.raises(client.HandleRequestError, match=words) as e:
            complete(**kw)
        assert e.value.status == 400


def test_the_fake_engine_serves_positions_dtypes_and_topk_over_http():
    async def go(body):
        r = await make(max_hidden_states_bytes=400)
        return await call(
            r, "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "return_hidden_states": True, **body}
        )

    res = run(
        go(
            {
                "hidden_states_position": "completion",
                "hidden_states_dtype": "float16",
                "hidden_states_encoding": "base64",
            }
        )
    )
    ch = res.json()["choices"][0]
    meta = ch["hidden_states_meta"]
    assert meta["positions"] == list(range(8, 13)) and meta["shape"] == [5, HIDDEN_SIZE] and meta["dtype"] == "float16"
    got = np.frombuffer(base64.b64decode(ch["hidden_states"]), "<f2").reshape(5, HIDDEN_SIZE)
    np.testing.assert_array_equal(got, expected(range(8, 13), dtype="float16").values[-1])
    top = run(go({"hidden_states_position": {"start": -2}, "hidden_states_topk": 3})).json()["choices"][0]
    want = expected([11, 12], topk=3)
    assert [r["indices"] for r in top["hidden_states"]] == want.indices[-1].tolist()
    assert [r["values"] for r in top["hidden_states"]] == want.values[-1].tolist()
    big = run(go({"hidden_states_position": "all"}))
    assert big.status_code == 400 and "max_hidden_states_bytes" in big.json()["error"]["message"]


def test_the_fake_engine_casts_and_selects_as_the_engine_does():
    rows = fake_rows(IDS, [3, 7])
    np.testing.assert_array_equal(rows.values[-1], np.stack([fake_vector(IDS[:4]), fake_vector(IDS)]))
    half = fake_rows(IDS, [3, 7], dtype="float16")
    np.testing.assert_array_equal(half.floats(-1), rows.values[-1].astype(np.float16).astype(np.float32))
    top = fake_rows(IDS, [3, 7], dtype="bfloat16", topk=3)
    order = np.argsort(-np.abs(rows.values[-1]), axis=-1)[:, :3]
    np.testing.assert_array_equal(top.indices[-1], order)
    np.testing.assert_allclose(top.floats(-1), np.take_along_axis(rows.values[-1], order, -1), rtol=2**-8)
    c = asyncio.run(
        FakeEngine(True).complete(IDS, SamplingOptions(max_tokens=2, n=2), position="all", dtype="bfloat16", topk=2)
    )
    assert [ch.positions for ch in c.choices] == [tuple(range(10))] * 2
    assert c.choices[1].hidden_states.shape == (10, 2) and c.choices[1].dtype == "bfloat16"


def test_chat_messages_over_a_handle_are_the_chat_route_s_prompt():
    async def go():
        r = await make()
        chat = client._result(
            await r.complete(client._request(None, [{"role": "user", "content": PROMPT}], max_tokens=5))
        )
        return chat, client._result(await r.complete(client._request(PROMPT, None, max_tokens=5)))

    chat, plain = run(go())
    assert chat.prompt_token_ids == tuple(IDS)  # the fake's chat template: the contents joined
    assert chat.choices[0].token_ids == plain.choices[0].token_ids  # the fake renders chat as the joined text
    assert np.array_equal(chat.choices[0].hidden_states, plain.choices[0].hidden_states)
    with pytest.raises(TypeError, match="not both"):
        client._request(PROMPT, [{"role": "user", "content": PROMPT}])


def test_the_fake_engine_takes_a_model_s_width_and_its_bounds():
    """`hidden_size` (bench/payloads.py's 4,096): rows of that width, and the rows budget counts it."""
    from bench.payloads import HIDDEN, serve_config
    from deployments.config import AppArgs
    from hidden_states.params import HiddenStatesRequestError

    wide = FakeEngine(True, hidden_size=HIDDEN)
    c = asyncio.run(wide.complete(IDS, SamplingOptions(max_tokens=3), position="completion", dtype="float16"))
    assert c.choices[0].hidden_states.shape == (3, HIDDEN) and c.choices[0].dtype == "float16"
    tight = FakeEngine(True, max_hidden_states_bytes=2 * HIDDEN * 2, hidden_size=HIDDEN)  # two float16 rows
    with pytest.raises(HiddenStatesRequestError):
        asyncio.run(tight.complete(IDS, SamplingOptions(max_tokens=3), position="completion", dtype="float16"))
    for app in serve_config(8000, ("a", "b"), 2**20)["applications"]:  # the bench's apps are valid AppArgs
        assert AppArgs.model_validate(app["args"]).engine_args()["hidden_size"] == HIDDEN
