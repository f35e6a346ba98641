"""bench/parity.py's own logic: the corpus is the same on every tree and covers every route and field;
normalising removes only ids, timestamps and timings; a stream compares by its events, not its chunk
boundaries; `compare` fails on one differing response. (Its real run, two trees against one engine
each, is recorded in bench/NOTES.md.)"""

from __future__ import annotations

import json

from bench import parity


def test_the_corpus_is_fixed_and_covers_every_route_and_field():
    a, b = parity.corpus(1000), parity.corpus(1000)
    assert a == b and len(a) == 1000
    routes = {(r["route"], r["stream"]) for r in a}
    assert {
        ("completions", False),
        ("completions", True),
        ("chat", False),
        ("chat", True),
        ("hidden_states", False),
    } <= routes
    fields = {k for r in a for k in r["body"]}
    for field in (
        "return_hidden_states",
        "hidden_states_layers",
        "hidden_states_position",
        "hidden_states_dtype",
        "hidden_states_encoding",
        "hidden_states_topk",
        "hidden_states_heads",
        "hidden_states_stop",
        "hidden_states_steering",
        "hidden_states_proof",
        "n",
        "logprobs",
        "stop",
        "seed",
        "stream_options",
        "completion",
    ):
        assert field in fields, field


def test_normalising_drops_ids_timestamps_and_timings_only():
    raw = (
        b'{"id":"cmpl-1a","created":1765,"choices":[{"text":"id","hidden_states_meta":{"extraction_seconds":0.0123}}]}'
    )
    assert parity.normalised(raw) == (
        b'{"id":"-","created":0,"choices":[{"text":"id","hidden_states_meta":{"extraction_seconds":0}}]}'
    )


def test_a_stream_is_compared_by_its_events_not_its_chunks():
    events = [
        {"id": "x1", "created": 1, "choices": [{"index": 0, "text": "a", "finish_reason": None}]},
        {"id": "x1", "created": 1, "choices": [{"index": 0, "text": "b", "finish_reason": None}]},
        {"id": "x1", "created": 1, "choices": [{"index": 0, "text": "c", "finish_reason": "length"}]},
    ]
    sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    whole = parity.stream_events([sse])
    cut = parity.stream_events([sse[:10], sse[10:77], sse[77:]])
    assert whole == cut and whole[0] == {"0": {"text": "abc", "token_ids": [], "logprobs": []}}
    other = dict(events[2], id="-", created=0)
    assert whole[1] == [other, "[DONE]"]


def test_compare_fails_on_one_differing_response(tmp_path, capsys):
    def write(path, text):
        line = {"k": 0, "status": 200, "response": text}
        line["sha256"] = str(hash(json.dumps(line, sort_keys=True)))
        path.write_text(json.dumps({**line, "request": {"route": "chat", "stream": False, "body": {}}}) + "\n")

    write(tmp_path / "a", "same")
    write(tmp_path / "b", "same")
    assert parity.compare(str(tmp_path / "a"), str(tmp_path / "b")) == 0
    write(tmp_path / "b", "other")
    assert parity.compare(str(tmp_path / "a"), str(tmp_path / "b")) == 1
    assert "1 differ" in capsys.readouterr().out


def test_choices_interleaved_otherwise_compare_equal_and_a_vector_does_not():
    """n = 2 streams: the order vLLM interleaves choices in does not count; a vector's value does."""
    fin = [
        {"id": "-", "choices": [{"index": 0, "text": "a", "finish_reason": "length", "hidden_states": [1.0]}]},
        {"id": "-", "choices": [{"index": 1, "text": "b", "finish_reason": "length", "hidden_states": [2.0]}]},
    ]
    merged = {"0": {"text": "a"}, "1": {"text": "b"}}
    one = parity.canonical([merged, [*fin, "[DONE]"]])
    assert one == parity.canonical([merged, [fin[1], fin[0], "[DONE]"]])
    other = [fin[0], {"id": "-", "choices": [{**fin[1]["choices"][0], "hidden_states": [2.5]}]}, "[DONE]"]
    assert one != parity.canonical([merged, other])


def test_rows_streamed_in_other_chunks_compare_equal_and_a_changed_row_does_not():
    """A stream of several positions' rows: which chunk carries which position is timing; each row is not."""
    import base64

    import numpy as np

    rows = np.arange(12, dtype="<f4").reshape(3, 4)

    def chunk(positions, finish=None, values=rows):
        b64 = base64.b64encode(values[[p - 5 for p in positions]].tobytes()).decode()
        meta = {"position": "completion", "positions": positions, "bytes": 16 * len(positions)}
        return {"index": 0, "finish_reason": finish, "hidden_states": b64, "hidden_states_meta": meta}

    def stream(*choices):
        return parity.canonical([{}, [{"id": "-", "choices": [c]} for c in choices]])

    one = stream(chunk([5, 6]), chunk([7], "length"))
    assert one == stream(chunk([5]), chunk([6]), chunk([7], "length"))
    changed = rows.copy()
    changed[1, 2] += 1
    assert one != stream(chunk([5, 6], values=changed), chunk([7], "length", values=changed))


def test_a_choice_s_logprobs_and_prompt_ids_compare_joined_however_the_chunks_were_cut():
    """vLLM cuts a stream's chunks by timing: the logprobs of two chunks are those of one, and the prompt's
    token ids count wherever the choice's first chunk put them; a changed logprob does not compare equal."""

    def stream(*chunks):
        merged = {"text": "", "token_ids": [], "logprobs": []}
        for c in chunks:
            merged["logprobs"].append(c)
        merged["prompt_token_ids"] = [1, 2]
        return parity.canonical([{"0": merged}, ["[DONE]"]])

    a = {"tokens": ["x"], "token_logprobs": [-1.0]}
    b = {"tokens": ["y"], "token_logprobs": [-2.0]}
    one = stream(a, b)
    assert one == stream({"tokens": ["x", "y"], "token_logprobs": [-1.0, -2.0]})
    assert one != stream(a, {**b, "token_logprobs": [-2.5]})
