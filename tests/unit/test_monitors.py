"""Stop conditions in the engine core's scheduler (hidden_states/vllm/core/scheduler.py), their own logic
on stand-ins: which row triggers (`_judge`: the first not judged yet, below the step's accepted bound,
conditions in order) and what the request keeps (`_update_request_with_output`: its tokens up to the
trigger, under speculative decoding too; an ordinary stop before it stands). The real engine runs them
in tests/engine/test_heads.py and tests/serve/test_heads.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from vllm.v1.request import RequestStatus

from hidden_states.protocol import MONITOR_BLOCK, STOP_REASON, CaptureSpec, Monitor, RowBlock, Span, StopReport
from hidden_states.vllm.core.scheduler import _Capture, _HiddenStatesScheduling, _Record, _Rows

STOP_TOKEN = 2


@dataclasses.dataclass
class FakeRequest:
    """What vLLM's `_update_request_with_output` reads and writes of a request (its tokens and status)."""

    request_id: str
    tokens: list
    status: object = RequestStatus.RUNNING
    stop_reason: object = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class FakeScheduler:
    """vLLM's `_update_request_with_output`: append, stop at STOP_TOKEN (its `check_stop`), trim."""

    def _update_request_with_output(self, request, new_token_ids):
        for n, t in enumerate(new_token_ids, 1):
            request.tokens.append(t)
            if t == STOP_TOKEN:
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, t
                del new_token_ids[n:]
                return new_token_ids, True
        return new_token_ids, False


class Monitored(_HiddenStatesScheduling, FakeScheduler):
    def __init__(self, monitors):  # the mixin's state only (its __init__ needs a vLLM Scheduler)
        self._records, self.monitor_stops = {}, 0
        self.spec = CaptureSpec(span=[-1, None, 1], layers=[], monitors=monitors)

    def watch(self, rid: str) -> _Record:
        rec = self._records[rid] = _Record(capture=_Capture(self.spec, False, _Rows(self.spec, Span(-1))))
        return rec


def block(positions, scores) -> tuple[RowBlock, np.ndarray]:
    data = np.ascontiguousarray(np.asarray(scores, "<f4")).view(np.uint8).reshape(-1)
    return RowBlock(positions[-1] + 1, 0, list(positions), "float32", len(scores[0]), 0, -1, MONITOR_BLOCK), data


ABOVE = Monitor("probe", 0, True, 0.5)
BELOW = Monitor("sae", 3, False, -1.0)


@pytest.mark.parametrize(
    "positions,scores,bound,want",
    [
        ([9], [[0.4, 0.0]], 10, None),  # neither holds
        ([9], [[0.6, 0.0]], 10, (9, 0, 0.6)),  # above, strictly
        ([9], [[0.5, 0.0]], 10, None),  # at the threshold: not above it
        ([9, 10, 11], [[0.1, 0.0], [0.1, -2.0], [0.9, 0.0]], 12, (10, 1, -2.0)),  # the first position, whichever holds
        ([9, 10, 11], [[0.1, 0.0], [0.7, -2.0], [0.9, 0.0]], 12, (10, 0, 0.7)),  # at one position: in order
        ([9, 10, 11], [[0.1, 0.0], [0.2, 0.0], [0.9, 0.0]], 11, None),  # past the bound: a rejected draft's row
        ([9], [[float("nan"), float("nan")]], 10, None),  # NaN holds nothing
    ],
)
def test_the_first_row_that_holds_triggers(positions, scores, bound, want):
    s = Monitored([ABOVE, BELOW])
    rec = s.watch("r")
    cap = rec.capture
    blk, data = block(positions, scores)
    s._judge(rec, blk, data, bound)
    got = rec.trigger
    assert (got if got is None else (got[0], got[1], pytest.approx(got[2]))) == want
    assert cap.judged == (bound if want is not None else min(positions[-1] + 1, bound))


def test_a_row_judged_once_is_not_judged_again():
    """A recomputed row (a resumed request) below `judged` never triggers, whatever its score."""
    s = Monitored([ABOVE])
    rec = s.watch("r")
    cap = rec.capture
    cap.judged = 11
    blk, data = block([9, 10, 11], [[0.9], [0.9], [0.1]])
    s._judge(rec, blk, data, 12)
    assert rec.trigger is None and cap.judged == 12


@pytest.mark.parametrize(
    "tokens,new,trigger,want_tokens,want_reason",
    [
        # decode: row p = T - 1 (the last token's) fires: the token sampled from it is dropped
        ([5, 6, 7], [8], (2, 0, 0.9), [5, 6, 7], STOP_REASON.format(0)),
        # drafts: rows 2..4 computed, tokens 3 and 4 accepted + a bonus; row 3 fires: token 3 kept, 4 and 5 dropped
        ([5, 6, 7], [8, 9, 10], (3, 1, -3.0), [5, 6, 7, 8], STOP_REASON.format(1)),
        # an ordinary stop token before the trigger stands
        ([5, 6, 7], [STOP_TOKEN, 9, 10], (4, 0, 0.9), [5, 6, 7, STOP_TOKEN], STOP_TOKEN),
    ],
)
def test_the_request_keeps_its_tokens_up_to_the_trigger(tokens, new, trigger, want_tokens, want_reason):
    s = Monitored([ABOVE, BELOW])
    rec = s.watch("r")
    req = FakeRequest("r", list(tokens))
    rec.trigger = trigger
    kept, stopped = s._update_request_with_output(req, list(new))
    assert stopped and req.tokens == want_tokens and kept == want_tokens[len(tokens) :]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == want_reason
    assert rec.trigger is None
    assert (rec.stop == StopReport(trigger[0], trigger[1], trigger[2])) == (want_reason != STOP_TOKEN)


SAE_D, SAE_F = 16, 128


def _sae(tmp_path, arch: str, seed: int, m: int) -> tuple:
    """An SAE of `arch` (SAELens, random weights), its spec, `m` random rows and SAELens's encode of them."""
    from hidden_states.heads import load_heads
    from tests.heads_ref import make_sae, sae_reference

    folder = make_sae(str(tmp_path / arch), arch, SAE_D, SAE_F, "blocks.1.hook_resid_post", seed=seed, k=12)
    (spec,) = load_heads([{"name": "sae", "path": folder}], 4, SAE_D)
    rows = np.random.default_rng(seed).normal(size=(m, SAE_D)).astype(np.float32) * 3
    return spec, rows, sae_reference(folder, rows)


def _score(spec, rows, spans: list, conditions: list) -> tuple:
    """The worker's monitor scores (capture._run_monitors) of one request a span of `rows`, each with its
    conditions, in one step: (the worker, {request: float32 scores [its rows, its conditions]})."""
    import torch

    from hidden_states.heads import DeviceHead
    from hidden_states.vllm.worker.capture import _Block, _Entry, _RunnerHook

    hook = _RunnerHook.__new__(_RunnerHook)  # the scoring's state only (its __init__ needs a vLLM runner)
    hook.heads = {"sae": DeviceHead(spec, "cpu")}
    hook._inject, hook._faults = {}, {}
    hook.head_products = hook.head_rows = hook.ranked_rows = hook.head_column_rows = 0
    plan = [
        _Entry(
            f"r{j}",
            [],
            list(range(s, e)),
            list(range(s, e)),
            e,
            None,
            0,
            [],
            [[m.head, m.index, m.above, m.threshold] for m in conditions[j]],
        )
        for j, (s, e) in enumerate(spans)
    ]
    src = torch.tensor(rows)
    blocks = [_Block(j, spec.layer, src, s, e) for j, (s, e) in enumerate(spans)]
    out = hook._run_monitors(plan, list(range(len(spans))), blocks, {(j, spec.layer): j for j in range(len(spans))})
    assert all(name == MONITOR_BLOCK for _, _, name, _, _ in out)
    return hook, {j: scores.numpy() for j, _, _, scores, _ in out}


def _between(values, q: float) -> float:
    """A threshold clear of every value: halfway between the two around their quantile q."""
    v = np.sort(values)
    k = int(q * (len(v) - 2))
    return float(v[k] + v[k + 1]) / 2


def _verdicts(ref, spans: list, conditions: list, scores: dict) -> int:
    """Every (row, condition) judged on the worker's score as on SAELens's; the score is SAELens's where
    the condition holds (relative 1e-5): the number that hold."""
    held = 0
    for j, (s, e) in enumerate(spans):
        assert scores[j].shape == (e - s, len(conditions[j]))
        for c, m in enumerate(conditions[j]):
            for r in range(s, e):
                got, want = float(scores[j][r - s, c]), float(ref[r, m.index])
                assert m.holds(got) == m.holds(want), (j, m, r, got, want)
                if m.holds(want):
                    held += 1
                    assert abs(got - want) <= 1e-5 * np.abs(ref).max()
    return held


@pytest.mark.parametrize("arch", ["topk", "standard"])
def test_the_worker_scores_a_feature_from_its_columns_and_ranks_only_where_it_decides(tmp_path, arch):
    """The worker's monitor scores of three requests' rows decide every condition as SAELens's encode of
    the same rows does, and equal it wherever a condition holds (the score reported). A top-k SAE's full
    encode runs only on rows whose feature is positive and whose condition it could change
    (`ranked_rows`); other SAEs' never. One product over every request's rows."""
    spec, rows, ref = _sae(tmp_path, arch, seed=5, m=14)
    a, b = (int(f) for f in np.argsort(-(ref > 0).sum(0), kind="stable")[:2])  # the two features firing most
    mid = _between(ref[:, a][ref[:, a] > 0], 0.5)
    # requests 0 and 2 (rows 0..4, 12..13): a above an unreachable bound (never holds), one block together;
    # request 1 (rows 5..11): a above its median activation, b below a positive bound (0 holds it)
    never, held_by = [Monitor("sae", a, True, 1e9)], [Monitor("sae", a, True, mid), Monitor("sae", b, False, 0.25)]
    spans, conditions = [(0, 5), (5, 12), (12, 14)], [never, held_by, never]
    hook, scores = _score(spec, rows, spans, conditions)
    assert _verdicts(ref, spans, conditions, scores) >= 3
    assert hook.head_products == 1 and hook.head_rows == 14  # one product over every request's rows
    # its work: two encoder columns a row, and every column of the rows ranked
    assert hook.head_column_rows == 14 * 2 + hook.ranked_rows * SAE_F
    if arch == "topk":  # ranked: some of request 1's rows (its `below` holds at 0), none of the others'
        assert 0 < hook.ranked_rows <= 7
    else:
        assert hook.ranked_rows == 0


def test_the_worker_s_verdicts_are_the_reference_s_for_any_threshold(tmp_path):
    """A top-k SAE's conditions with thresholds on either side of 0 and at the features' own values,
    above and below, several requests a step, two of them with the same conditions: every verdict is
    the one SAELens's encode gives, and every score where a condition holds is its value."""
    spec, rows, ref = _sae(tmp_path, "topk", seed=7, m=24)
    rng = np.random.default_rng(2)
    features = [int(f) for f in np.argsort(-(ref > 0).sum(0))[:4]]
    values = ref[:, features][ref[:, features] > 0]
    thresholds = [-1.0, 0.0, 1e-3, _between(values, 0.3), _between(values, 0.7), 1e9]
    spans = [(0, 3), (3, 9), (9, 12), (12, 20), (20, 24)]
    conditions = [
        [
            Monitor("sae", int(rng.choice(features)), bool(rng.integers(2)), float(rng.choice(thresholds)))
            for _ in range(int(rng.integers(1, 4)))
        ]
        for _ in spans
    ]
    conditions[3] = conditions[0]  # a group of two requests
    hook, scores = _score(spec, rows, spans, conditions)
    assert _verdicts(ref, spans, conditions, scores) and hook.ranked_rows < 24
