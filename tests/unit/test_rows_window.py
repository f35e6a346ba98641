"""The scheduler's held rows of a span request (`scheduler._Rows`): every wanted row sent once, in order,
whatever the step sizes; the rows held at once bounded by what is still undecided."""

from __future__ import annotations

import numpy as np
import pytest

from hidden_states.params import Span
from hidden_states.protocol import HiddenStatesExtractionRequest
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


@pytest.mark.parametrize("topk", [False, True])
@pytest.mark.parametrize("start, end, stride", RANGES)
def test_every_wanted_row_once_in_order(start, end, stride, topk):
    from hidden_states.vllm.scheduler import _Rows

    span = Span(start, end, stride)
    for prompt, total, chunk in [(5, 14, 2), (1, 9, 9), (7, 40, 3)]:
        flag = HiddenStatesExtractionRequest(key="k", layers=[-1], span=[start, end, stride], topk=D if topk else 0)
        acc, sent, held = _Rows(flag, span), [], 0
        known = 0
        while known < total:  # prefill in chunks, then one position per step
            stop = min(total, known + chunk) if known < prompt else known + 1
            _step(acc, span, known, stop, topk)
            known = stop
            held = max(held, acc.hi - acc.lo)
            if known < total and (rows := acc.take(known)) is not None:
                sent.append(rows)
        if (rows := acc.take(total, total=total)) is not None:
            sent.append(rows)
        positions = [p for r in sent for p in r.positions]
        assert positions == list(span.positions(total)), (prompt, total, chunk)
        for r in sent:
            values, indices = r.arrays()
            assert np.array_equal(values[0], np.asarray(r.positions)[:, None] * 10.0 + np.arange(D))
            assert (indices is not None) == topk
        if start < 0:  # held: the last -start positions and one step's worth
            assert held <= -start + chunk, held
