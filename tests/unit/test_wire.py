"""The handle's wire during a rolling upgrade (deployments/wire.py): a message of another wire
version is refused by name, never decoded into the wrong fields."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from deployments import wire
from deployments.wire import (
    HandleChoice,
    HandleCompletion,
    HandleCompletionRequest,
    HandleReply,
    Reply,
    ResponseHead,
    WireVersionError,
)
from hidden_states.interface import CompletionChoice, ExtractionStats, RowBatch

NEXT = f"hidden-states-wire/{wire.WIRE_VERSION + 1}"  # a later release's


class OldRequest(msgspec.Struct, omit_defaults=True):  # the request as releases before wire versions sent it
    prompt: str | None = None
    max_tokens: int = 16


class OldHead(msgspec.Struct, array_like=True):  # the head before wire versions: no tag
    status: int
    media_type: str
    replica: str


class NextHead(
    msgspec.Struct, array_like=True, tag=f"hidden-states-wire/{wire.WIRE_VERSION + 1}", tag_field="wire"
):  # a later release
    replica: str  # fields reordered: an untagged decoder would misread them
    status: int
    media_type: str


def test_the_same_version_round_trips():
    reply = HandleReply(ok=HandleCompletion("r", "replica-1", [1, 2], [HandleChoice(0, "hi", [3], "stop", None)]))
    assert wire.REPLY_DECODER.decode(wire.ENCODER.encode(reply)) == reply
    head = Reply(ResponseHead(200, "application/json", "replica-1"), b"{}")
    assert wire.REPLY_BODY_DECODER.decode(wire.ENCODER.encode(head)) == head
    req = HandleCompletionRequest(prompt="x", max_tokens=3)
    assert wire.REQUEST_DECODER.decode(wire.ENCODER.encode(req)) == req
    assert wire.wire_version(wire.ENCODER.encode(req)) == wire.WIRE == wire.wire_version(wire.ENCODER.encode(head))


@pytest.mark.parametrize(
    "raw, theirs",
    [
        (msgspec.msgpack.encode(OldRequest(prompt="x", max_tokens=3)), "a release from before wire versions"),
        (msgspec.msgpack.encode({"wire": NEXT, "prompt": "x"}), NEXT),
    ],
)
def test_a_request_of_another_version_is_refused_by_name(raw, theirs):
    with pytest.raises(WireVersionError, match=f"HandleCompletionRequest of {theirs}.*speaks {wire.WIRE}"):
        wire.REQUEST_DECODER.decode(raw)


def test_a_reordered_head_of_another_release_is_refused_not_misread():
    later = msgspec.msgpack.encode(NextHead("replica-9", 200, "application/json"))
    with pytest.raises(WireVersionError, match=NEXT):
        wire.HEAD_DECODER.decode(later)
    old = msgspec.msgpack.encode(OldHead(200, "application/json", "replica-1"))
    with pytest.raises(WireVersionError, match="before wire versions"):
        wire.HEAD_DECODER.decode(old)


def test_without_versions_the_reordered_head_would_be_misread():
    """What the versions guard against: an untagged head decodes a same-shaped message of another
    layout into the wrong fields (here both fields that swapped are strings), silently."""

    class Untagged(msgspec.Struct, array_like=True):
        status: int
        media_type: str
        replica: str

    class Swapped(msgspec.Struct, array_like=True):
        status: int
        replica: str
        media_type: str

    misread = msgspec.msgpack.decode(
        msgspec.msgpack.encode(Swapped(200, "replica-9", "application/json")), type=Untagged
    )
    assert misread.media_type == "replica-9"  # no error: the wrong field
    tagged = msgspec.msgpack.encode(Swapped(200, "replica-9", "application/json"))
    with pytest.raises(WireVersionError):  # the versioned decoder refuses the untagged sender instead
        wire.HEAD_DECODER.decode(tagged)


def test_a_malformed_message_is_not_called_another_version():
    for raw in (b"\xc1", msgspec.msgpack.encode("just a string")):
        with pytest.raises(msgspec.MsgspecError) as e:
            wire.REQUEST_DECODER.decode(raw)
        assert not isinstance(e.value, WireVersionError)


@pytest.mark.parametrize(
    "stats",
    [
        ExtractionStats(12, 11, 0.0, via="tail"),
        ExtractionStats(12, 4, 0.031, via="extraction"),
        ExtractionStats(12, 11, 0.0, via="generation"),
        None,
    ],
)
def test_a_choice_s_work_crosses_the_handle_as_the_engine_counted_it(stats):
    """via, tokens, cached tokens and seconds reach a handle caller as the engine reported them (None:
    no step computed a row for it, as for prompt_end), not relabelled on the way."""
    vec = np.arange(4, dtype=np.float32)
    ch = CompletionChoice(0, "hi", (3, 4), "stop", RowBatch(np.array([4]), {-1: vec[None]}), stats)
    raw = wire.ENCODER.encode(HandleReply(ok=HandleCompletion("r", "replica-1", [1, 2], [wire.to_wire(ch)])))
    back = wire.from_wire(wire.REPLY_DECODER.decode(raw).ok.choices[0])
    assert back.extraction == stats
    np.testing.assert_array_equal(back.hidden_states, vec)


def test_the_handle_choice_carries_every_field_of_the_one_choice():
    """HandleChoice is CompletionChoice field for field: its fields past the first six (text, tokens, rows, work)
    are CompletionChoice's by name, type and default, and a choice of every field round-trips; another shape of
    those fields names another wire version."""
    import dataclasses
    import typing

    ours = dataclasses.fields(CompletionChoice)[6:]
    handle = msgspec.structs.fields(wire.HandleChoice)[6:]
    hints = typing.get_type_hints(CompletionChoice)
    assert [(f.name, hints[f.name], f.default) for f in ours] == [(f.name, f.type, f.default) for f in handle]
    assert [f.name for f in ours] == list(wire.SHARED)
    full = CompletionChoice(
        1, "t", (5,), "length", None, ExtractionStats(3, 1, 0.5, "tail"), True, ("p",), {"h": [1.0]},
        [{"op": "add"}], {"condition": 0}, True, "all", 4, [{"m": "image"}], 2, 7, 16, False, 3,
    )  # fmt: skip
    back = wire.from_wire(wire.REPLY_DECODER.decode(wire.ENCODER.encode(
        HandleReply(ok=HandleCompletion("r", "x", [1], [wire.to_wire(full)]))
    )).ok.choices[0])  # fmt: skip
    assert back == full
    fields = [(f.name, hints[f.name], f.default) for f in ours]
    assert wire.WIRE.endswith(wire.shape_digest(fields))
    assert wire.shape_digest(fields + [("more", int, 0)]) != wire.shape_digest(fields)
