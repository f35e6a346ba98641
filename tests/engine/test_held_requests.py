"""Held requests under pressure (the tail step, scheduler.py): preempted while held, aborted
while held, and a KV cache small enough that vLLM preempts on its own. Every vector is
checked against transformers, every output against the same request without hidden states.

The engine core runs in this process (vLLM's in-process client), so a test can step it
one engine step at a time and look at its scheduler: which requests are held, and
when."""

from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest

from tests.conftest import ON_GPU, sampling

pytestmark = pytest.mark.skipif(ON_GPU, reason="steps an in-process CPU engine core")

PROMPTS = [
    "The replica computes the hidden state of",
    "A user reads the cache and then",
    "Tokens flow from the router to",
    "Hello! How are you today?",
]


@pytest.fixture(scope="module")
def core(model_dir):
    """A tail-step engine with a KV cache of a few blocks, stepped by hand."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from hidden_states.vllm import ENGINE_ENV, WORKER_EXTENSION
    from hidden_states.vllm.patches.scheduler_cls import TAIL_SCHEDULER

    saved = {k: os.environ.get(k) for k in (*ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING")}
    os.environ.update(ENGINE_ENV, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    try:
        # 12 blocks of 32 tokens (the tiny model: 2 layers x K+V x 64 x float32 = 1 KiB per token)
        args = EngineArgs(
            model=model_dir,
            dtype="float32",
            enforce_eager=True,
            max_model_len=256,
            kv_cache_memory_bytes=12 * 32 * 1024,
            block_size=32,
            max_num_batched_tokens=256,
            max_num_seqs=8,
            enable_prefix_caching=True,
            scheduler_cls=TAIL_SCHEDULER,
            worker_extension_cls=WORKER_EXTENSION,
        )
        eng = LLMEngine.from_engine_args(args)
        eng.collective_rpc("hidden_states_install")
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    yield eng
    eng.engine_core.shutdown()


def scheduler(core):
    return core.engine_core.engine_core.scheduler


sp = sampling(max_tokens=40, ignore_eos=True)  # greedy SamplingParams; keywords override


def params(flagged: bool, span: list | None = None, every_step: bool = False, **kw):
    from hidden_states.protocol import CaptureSpec, RequestSpec

    extra = (
        RequestSpec(
            uuid.uuid4().hex, CaptureSpec(reaches_final=True, span=span or [-1, None, 1], every_step=every_step)
        ).into(None)
        if flagged
        else None
    )
    return [sp(extra_args=extra, **kw)]


def run(core, prompts, flagged: bool, on_step=None, timeout_s: float = 300, **kw) -> dict:
    """Each prompt to its final RequestOutput; `on_step(step)` before each engine step."""
    ids = {}
    for p in prompts:
        rid = f"r-{uuid.uuid4().hex}"
        core.add_request(rid, {"prompt_token_ids": core.get_tokenizer().encode(p)}, params(flagged, **kw)[0])
        ids[rid] = p
    done, deadline, step = {}, time.monotonic() + timeout_s, 0
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish in time"
        if on_step is not None:
            on_step(step)
        for out in core.step():
            if out.finished:
                done[ids[out.request_id]] = out
        step += 1
    return done


def captured(out):
    from hidden_states.protocol import OUTPUT_KEY, EngineMessage

    return EngineMessage.from_output((out.kv_transfer_params or {})[OUTPUT_KEY]).rows


def vector(out):
    from hidden_states.protocol import widen

    cr = captured(out)
    assert cr.positions == [len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1]  # the final token's
    return widen(cr.arrays()[0], cr.dtype)[0, 0]


def assert_same_outputs(a, b):
    x, y = a.outputs[0], b.outputs[0]
    assert (x.text, list(x.token_ids), x.finish_reason, x.stop_reason) == (
        y.text,
        list(y.token_ids),
        y.finish_reason,
        y.stop_reason,
    )


def held(s) -> list[str]:
    """The requests whose finish the scheduler holds for their tail step."""
    return [rid for rid, rec in s._records.items() if rec.held is not None]


def assert_nothing_left(core):
    s = scheduler(core)
    assert not s._records, s._records  # every request's one record went with it
    assert not core.has_unfinished_requests()


def test_a_held_request_preempted_then_resumed_keeps_its_exact_vector(core, reference):
    """vLLM's own preemption routine (`_preempt_request`: blocks freed, recompute on resume)
    applied to a request in the step it is held: its tail row comes from the resumed
    prefill's last chunk instead of a one-token decode."""
    s = scheduler(core)
    original, preempted = s.schedule, []

    def schedule(*a, **k):
        for rid in held(s):
            req = s.requests[rid]
            if rid not in preempted and req in s.running:
                s.running.remove(req)
                s._preempt_request(req, time.monotonic())
                preempted.append(rid)
        return original(*a, **k)

    s.schedule = schedule
    try:
        flagged = run(core, PROMPTS[:2], True, max_tokens=12)
    finally:
        s.schedule = original
    assert len(preempted) == 2
    plain = run(core, PROMPTS[:2], False, max_tokens=12)
    for p, out in flagged.items():
        assert_same_outputs(out, plain[p])
        reference.assert_matches(list(out.prompt_token_ids) + list(out.outputs[0].token_ids), vector(out))
        # The work is counted, not labelled: the resumed prefill recomputed more than the final token.
        total = len(out.prompt_token_ids) + len(out.outputs[0].token_ids)
        assert 1 < captured(out).tail_positions <= total, (captured(out).tail_positions, total)
    again = run(core, PROMPTS[:2], True, max_tokens=12)  # not preempted: the tail step's one position
    assert [captured(out).tail_positions for out in again.values()] == [1, 1]
    assert_nothing_left(core)


def test_a_request_aborted_while_held_leaves_nothing(core):
    s = scheduler(core)
    rid = f"r-{uuid.uuid4().hex}"
    core.add_request(rid, {"prompt_token_ids": core.get_tokenizer().encode(PROMPTS[2])}, params(True, max_tokens=6)[0])
    outs, deadline = [], time.monotonic() + 120
    while not held(s):
        assert time.monotonic() < deadline and core.has_unfinished_requests(), "never held"
        outs += core.step()
    assert not any(o.finished for o in outs)
    core.abort_request([rid])
    for _ in range(3):
        outs += core.step()
    assert not any(o.finished and o.kv_transfer_params for o in outs)
    assert_nothing_left(core)
    (worker,) = core.collective_rpc("hidden_states_stats")


def test_under_a_small_kv_cache_vllm_preempts_and_every_vector_is_exact(core, reference):
    """Eight requests of up to 150 tokens in 12 blocks of 32: vLLM preempts on its own
    (held requests among them when the timing falls so: the first test forces that case)."""

    prompts = [f"{p} {' '.join(PROMPTS)}" * (1 + i % 2) for i, p in enumerate(PROMPTS * 2)]
    s = scheduler(core)
    preempt, preemptions = s._preempt_request, []

    def counting(request, *a, **k):
        preemptions.append(request.request_id in held(s))
        return preempt(request, *a, **k)

    s._preempt_request = counting
    try:
        flagged = run(core, prompts, True, max_tokens=48)
    finally:
        s._preempt_request = preempt
    assert len(preemptions) > 0, "the KV cache was not small enough to preempt"
    plain = run(core, prompts, False, max_tokens=48)
    for p, out in flagged.items():
        assert_same_outputs(out, plain[p])
        reference.assert_matches(list(out.prompt_token_ids) + list(out.outputs[0].token_ids), vector(out))
    assert_nothing_left(core)


def test_rows_of_every_position_come_once_even_when_preempted_and_an_abort_leaves_nothing(core, reference):
    """Span requests (hidden_states_position "all"): rows ride every output of a request whose
    outputs stream (`every_step`), the finishing output of one that is final-only; a request preempted
    mid-generation recomputes its positions on resume, and each position is still sent once,
    exact. An aborted one leaves nothing in the scheduler or the runner."""
    from hidden_states.protocol import OUTPUT_KEY, EngineMessage

    s = scheduler(core)
    sent: dict[str, list] = {}
    outputs_with_rows: dict[str, int] = {}
    update, schedule, preempted = s.update_from_output, s.schedule, []

    def capturing(*a, **k):  # every output's rows, as the engine core sends them
        outs = update(*a, **k)
        for batch in outs.values():
            for eco in batch.outputs:
                raw = (eco.kv_transfer_params or {}).pop(OUTPUT_KEY, None)
                rows = None if raw is None else EngineMessage.from_output(raw).rows
                if rows is not None:
                    sent.setdefault(eco.request_id, []).append(rows)
                    outputs_with_rows[eco.request_id] = outputs_with_rows.get(eco.request_id, 0) + 1
        return outs

    def preempting(*a, **k):  # each request once, a few tokens into its decode (its rows partly sent)
        for req in list(s.running):
            if req.request_id not in preempted and req.num_output_tokens >= 4:
                s.running.remove(req)
                s._preempt_request(req, time.monotonic())
                preempted.append(req.request_id)
        return schedule(*a, **k)

    s.update_from_output, s.schedule = capturing, preempting
    try:
        ids, done, every = {}, {}, {}
        for i, p in enumerate(PROMPTS[:2]):
            rid = f"r-{uuid.uuid4().hex}"
            core.add_request(
                rid,
                {"prompt_token_ids": core.get_tokenizer().encode(p)},
                params(True, span=[0, None, 1], every_step=i == 0, max_tokens=12)[0],
            )
            ids[rid], every[rid] = p, i == 0
        deadline = time.monotonic() + 120
        while core.has_unfinished_requests():
            assert time.monotonic() < deadline, "the engine did not finish in time"
            for out in core.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        s.update_from_output, s.schedule = update, schedule
    assert len(preempted) == len(done) == 2, (preempted, list(done))
    for rid, out in done.items():
        (core_id,) = [r for r in sent if r.startswith(rid)]  # the engine core's id: the request's, suffixed
        assert core_id in preempted
        seq = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        positions = [p for rows in sent[core_id] for p in rows.positions]
        assert positions == list(range(len(seq))), positions  # each once, in order: none resent on resume
        if every[rid]:
            assert outputs_with_rows[core_id] >= 8  # on the outputs as they went, not all at the end
        else:
            assert outputs_with_rows[core_id] == 1  # all on the finishing output
        values = np.concatenate([rows.arrays()[0][0] for rows in sent[core_id]])
        with reference.torch.no_grad():
            ref = reference.model(reference.torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]
        diff, scale = float(np.abs(values - ref.numpy()).max()), float(ref.abs().max())
        assert diff <= 1e-5 * scale and diff <= 1e-4, (diff, scale)
    # aborted mid-generation, rows pending
    rid = f"r-{uuid.uuid4().hex}"
    core.add_request(
        rid,
        {"prompt_token_ids": core.get_tokenizer().encode(PROMPTS[3])},
        params(True, span=[-4, None, 1], max_tokens=30)[0],
    )
    for _ in range(4):
        core.step()
    (window,) = [r.capture.rows for r in s._records.values()]
    assert 0 < window.hi - window.lo <= 4  # a window kept for the end, no longer than the range
    core.abort_request([rid])
    for _ in range(3):
        core.step()
    assert_nothing_left(core)
    (worker,) = core.collective_rpc("hidden_states_stats")
