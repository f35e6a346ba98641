"""The scheduler's held rows of a span request (`scheduler._Rows`): every wanted row sent once, in order,
whatever the step sizes; the rows held at once bounded by what is still undecided."""

from __future__ import annotations

import numpy as np
import pytest

from hidden_states.params import Span
from hidden_states.protocol import CaptureSpec
from tests.unit.test_positions import RANGES

D = 3


def _step(acc, span, first: int, stop: int, topk: bool) -> None:
    """What `_file` does with the rows of positions first..stop-1 computed in one step."""
    positions = np.arange(first, stop)
    wanted, undecided = span.classify(positions, stop)
    keep = wanted | undecided
    if keep.any():
        acc.layers = [-1]
        values = (positions[keep, None] * 10.0 + np.arange(D))[None].astype(np.float32)  # row p: p*10 + 0..D-1
        indices = np.tile(np.arange(D, dtype=np.int32), (1, int(keep.sum()), 1)) if topk else None
        acc.add(positions[keep], values, indices)


@pytest.mark.parametrize("every_output", [True, False])
@pytest.mark.parametrize("topk", [False, True])
@pytest.mark.parametrize("start, end, stride", RANGES)
def test_every_wanted_row_once_in_order(start, end, stride, topk, every_output):
    """Rows taken on every output (a stream), or pruned per step and all taken at the finish."""
    from hidden_states.vllm.core.scheduler import _Rows

    span = Span(start, end, stride)
    for prompt, total, chunk in [(5, 14, 2), (1, 9, 9), (7, 40, 3)]:
        spec = CaptureSpec(layers=[-1], span=[start, end, stride], topk=D if topk else 0)
        acc, sent, held = _Rows(spec, span), [], 0
        known = 0
        while known < total:  # prefill in chunks, then one position per step
            stop = min(total, known + chunk) if known < prompt else known + 1
            _step(acc, span, known, stop, topk)
            known = stop
            held = max(held, acc.hi - acc.lo)
            if known < total and every_output and (rows := acc.release(known)) is not None:
                sent.append(rows)
            elif not every_output:
                acc.prune(known)
        if (rows := acc.release(total, total=total)) is not None:
            sent.append(rows)
        positions = [p for r in sent for p in r.positions]
        assert positions == list(span.positions(total)), (prompt, total, chunk)
        for r in sent:
            values, indices = r.arrays()
            assert np.array_equal(values[0], np.asarray(r.positions)[:, None] * 10.0 + np.arange(D))
            assert (indices is not None) == topk
        if start < 0:  # held: the last -start positions and one step's worth
            assert held <= -start + chunk, held


@pytest.mark.parametrize("topk", [False, True])
def test_step_references_send_every_row_once_at_the_end_or_per_output(topk):
    """`scheduler._StepRefs` (spans whose every captured row is wanted, e.g. "completion"): rows
    referenced per step, copied once when sent; a resumed request's recomputed rows dropped; two
    layers kept apart."""
    from hidden_states.protocol import RowBlock
    from hidden_states.vllm.core.scheduler import _StepRefs

    def step(first: int, stop: int, base: float):
        """A step buffer holding rows first..stop-1 of layers 2 and 5 (row p of layer l: p*10 + l + 0..D-1),
        and its blocks, as the worker lays them out."""
        pos = list(range(first, stop))
        layers = []
        for layer in (2, 5):
            layers.append((np.asarray(pos)[:, None] * 10.0 + layer + base + np.arange(D)).astype(np.float32))
        raw = [l.tobytes() for l in layers]
        ind = [np.tile(np.arange(D, dtype=np.int32), (len(pos), 1)).tobytes() for _ in layers] if topk else []
        data = np.frombuffer(b"".join(raw + ind), np.uint8)
        n = len(raw[0])
        blocks = [
            RowBlock(stop, layer, pos, "float32", D, i * n, (2 * n + i * len(ind[0])) if topk else -1)
            for i, layer in enumerate((2, 5))
        ]
        return data, blocks

    spec = CaptureSpec(layers=[2, 5], span=[4, None, 1], topk=D if topk else 0)
    for every_output in (False, True):
        acc, sent = _StepRefs(spec, Span(4, None, 1)), []
        for first, stop in [(4, 7), (7, 8), (8, 9), (6, 10), (10, 11)]:  # (6, 10): resumed, recomputes 6..8
            data, blocks = step(first, stop, base=0.0)
            acc.add(data, blocks, blocks[0].positions, stop)
            if every_output and (rows := acc.release(stop)) is not None:
                sent.append(rows)
        if (rows := acc.release(11, total=11)) is not None:
            sent.append(rows)
        assert acc.release(11, total=11) is None  # nothing twice
        assert [p for r in sent for p in r.positions] == list(range(4, 11))
        _check_values(sent, topk)

    # Speculative decoding: a step computes its drafts' rows too; those past `bound` (rejected) never
    # count, the next step recomputes from the bound, and a stop inside accepted drafts trims the rest.
    for every_output in (False, True):
        acc, sent = _StepRefs(spec, Span(4, None, 1)), []
        for first, stop, bound in [(4, 8, 8), (8, 12, 10), (10, 14, 14), (14, 18, 17)]:
            data, blocks = step(first, stop, base=0.0)
            acc.add(data, blocks, blocks[0].positions, bound)
            if every_output and stop != 18 and (rows := acc.release(bound)) is not None:
                sent.append(rows)
        acc.trim(16)  # the stop token is position 15: positions 16 (accepted past it) go
        data, blocks = step(15, 16, base=0.0)  # the tail step recomputes the final token: not twice
        acc.add(data, blocks, blocks[0].positions, 16)
        if (rows := acc.release(16, total=16)) is not None:
            sent.append(rows)
        assert [p for r in sent for p in r.positions] == list(range(4, 16))
        _check_values(sent, topk)


def _check_values(sent, topk: bool) -> None:
    for r in sent:
        values, indices = r.arrays()
        assert r.layers == [2, 5] and (indices is not None) == topk
        for j, layer in enumerate((2, 5)):
            assert np.array_equal(values[j], np.asarray(r.positions)[:, None] * 10.0 + layer + np.arange(D))
