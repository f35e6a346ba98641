"""The work the server reports for a vector is counted by the engine core, and vLLM's own figure
agrees.

`computed_tokens` and `via` come from the positions the scheduler's steps scheduled for a
choice's final row (`CapturedRows.tail_positions`), not from a label. The cross-check is taken
outside our code: a `sitecustomize` module (on PYTHONPATH for the engine-core process only)
wraps vLLM's base `Scheduler.schedule` (not our subclass, which calls it) and sums
`SchedulerOutput.total_num_scheduled_tokens` over every step. A fixed workload (prefix caching
off, greedy (and n = 2 seeded), `max_tokens` and stop-token finishes, a chat prompt, a streamed request) runs
once with vectors and once without:

- synchronous scheduling, no drafter: the sums differ by exactly the number of tail-step vectors,
  and each of those reports 1 position;
- async scheduling (vLLM's own path on CPU, ledger point 12): a vector from the step in flight
  after a stop-token finish adds nothing (that step runs anyway); after a `max_tokens` finish the
  scheduler has the step after it run (vLLM's async scheduler skips it), 1 position;
- n-gram speculative decoding: per vector, the tail step's 1 position, and no other difference
  (the tail step runs the final token alone; the drafts, which depend only on the tokens, are the
  same).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

from hidden_states.params import spec_of
from tests.conftest import TEST_ENGINE_ARGS, TEST_MODEL, cpu_only, sampling

HOOK = """
import os
if os.environ.get("HS_TEST_SCHEDULED_TOKENS"):
    def _count_scheduled_tokens(folder):
        from vllm.v1.core.sched.scheduler import Scheduler

        schedule, path, total = Scheduler.schedule, os.path.join(folder, str(os.getpid())), [0, 0]

        def counted(self, *args, **kwargs):
            out = schedule(self, *args, **kwargs)
            total[0] += 1
            total[1] += out.total_num_scheduled_tokens
            with open(path + ".tmp", "w") as f:
                f.write(f"{total[0]} {total[1]}")
            os.replace(path + ".tmp", path)
            return out

        Scheduler.schedule = counted

    _count_scheduled_tokens(os.environ["HS_TEST_SCHEDULED_TOKENS"])
"""

PROMPTS = [
    "Hello! How are you today?",
    "The router sends every completion to a replica",
    "one two three one two three one two",
    "Code: def add(a, b):",
]


class Counted:
    """An engine whose engine core sums vLLM's scheduled tokens into `folder`."""

    def __init__(self, engine, folder: Path):
        self.engine, self.folder = engine, folder

    def scheduled(self) -> tuple[int, int]:
        """(steps, tokens) vLLM's base scheduler scheduled so far, over the engine-core process."""
        steps = tokens = 0
        for f in self.folder.iterdir():
            if f.name.isdigit():
                a, b = f.read_text().split()
                steps, tokens = steps + int(a), tokens + int(b)
        return steps, tokens


def start_counted(loop_thread, tmp: Path, env: dict | None = None, **args) -> Counted:
    from hidden_states.vllm.engine import HiddenStatesEngine

    hook, folder = tmp / "hook", tmp / "counts"
    hook.mkdir()
    folder.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "HS_TEST_SCHEDULED_TOKENS", *(env or {}))}
    os.environ.update(env or {})
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook), saved["PYTHONPATH"]) if p)
    os.environ["HS_TEST_SCHEDULED_TOKENS"] = str(folder)  # inherited by the engine core as it spawns
    try:
        eng = loop_thread.run(
            HiddenStatesEngine.start(
                TEST_MODEL, **{**TEST_ENGINE_ARGS, "enable_prefix_caching": False, "warm_up_s": 0, **args}
            ),
            timeout=600,
        )
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return Counted(eng, folder)


sp = sampling(max_tokens=12)  # greedy SamplingParams; keywords override


async def _streamed(eng, prompt_ids, params, hs: bool):
    """A streamed request (DELTA outputs), its vector from the collector; -> (tokens, stats or None)."""
    from vllm.sampling_params import RequestOutputKind

    params = params.clone()
    params.output_kind = RequestOutputKind.DELTA
    tokens = []
    if not hs:
        async for out in eng.llm.generate({"prompt_token_ids": prompt_ids}, params, f"s-{uuid.uuid4().hex}"):
            tokens += out.outputs[0].token_ids
        return tokens, None
    with eng.collecting(spec_of(enabled=True)) as col:
        params.extra_args = col.tagged()
        async for out in eng.llm.generate({"prompt_token_ids": prompt_ids}, params, f"s-{uuid.uuid4().hex}"):
            tokens += out.outputs[0].token_ids
    return tokens, col.choices[(0, 0)].stats


def workload(counted: Counted, loop_thread, stop_id: int, hs: bool):
    """The fixed workload; -> (tokens scheduled by vLLM over it, [(tokens, finish, stats)] per choice)."""
    eng = counted.engine
    chat = eng.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])

    async def run():
        outs = await asyncio.gather(
            *(eng.complete(p, sp(max_tokens=8 + 2 * i), return_hidden_states=hs) for i, p in enumerate(PROMPTS)),
            eng.complete(PROMPTS[2], sp(max_tokens=24, stop_token_ids=[stop_id]), return_hidden_states=hs),
            eng.complete(PROMPTS[1], sp(max_tokens=10, n=2, temperature=0.8, seed=3), return_hidden_states=hs),
            eng.complete(chat, sp(max_tokens=10), return_hidden_states=hs),
        )
        streamed = await _streamed(eng, eng.llm.tokenizer.encode(PROMPTS[3]), sp(max_tokens=9), hs)
        return outs, streamed

    before = counted.scheduled()[1]
    outs, (stream_tokens, stream_stats) = loop_thread.run(run(), timeout=600)
    choices = [(tuple(ch.token_ids), ch.finish_reason, ch.extraction) for c in outs for ch in c.choices]
    choices.append((tuple(stream_tokens), "streamed", stream_stats))
    return counted.scheduled()[1] - before, choices


def stop_token(counted: Counted, loop_thread) -> int:
    """A token id the greedy completion of PROMPTS[2] reaches mid-way: a stop-token (EOS-like) finish."""
    probe = loop_thread.run(counted.engine.complete(PROMPTS[2], sp(max_tokens=16), return_hidden_states=False))
    return probe.choices[0].token_ids[6]


def compare(counted: Counted, loop_thread):
    stop_id = stop_token(counted, loop_thread)
    plain_tokens, plain = workload(counted, loop_thread, stop_id, hs=False)
    vec_tokens, flagged = workload(counted, loop_thread, stop_id, hs=True)
    assert [c[:2] for c in flagged] == [c[:2] for c in plain]  # the same tokens and finishes
    assert "stop" in {c[1] for c in flagged} and "length" in {c[1] for c in flagged}
    return vec_tokens - plain_tokens, flagged


def test_tail_vectors_add_exactly_their_counted_positions(loop_thread, tmp_path):
    counted = start_counted(loop_thread, tmp_path)
    try:
        extra, flagged = compare(counted, loop_thread)
        stats = [s for _, _, s in flagged]
        assert all(s.via == "tail" and s.computed_tokens == 1 for s in stats), stats
        # vLLM's own count of scheduled positions agrees with the server's reported work.
        assert extra == sum(s.computed_tokens for s in stats) == len(stats), (extra, len(stats))
        print(f"\nsynchronous: {len(stats)} vectors, {extra} more positions scheduled by vLLM; 1 reported each")
    finally:
        counted.engine.shutdown()


def test_the_cross_check_fails_on_a_label(loop_thread, tmp_path):
    """The check above cannot pass on a label: with tail steps off (every vector from an extraction
    step), the same workload schedules whole sequences again, and the counts say so."""
    counted = start_counted(loop_thread, tmp_path, tail_step=False)
    try:
        extra, flagged = compare(counted, loop_thread)
        stats = [s for _, _, s in flagged]
        assert all(s.via == "extraction" for s in stats), stats
        assert extra == sum(s.computed_tokens for s in stats) > len(stats), (extra, len(stats))
    finally:
        counted.engine.shutdown()


@cpu_only
def test_async_step_in_flight_adds_nothing_after_a_stop_token(loop_thread, tmp_path):
    import hidden_states.vllm.worker.extension  # noqa: F401  (imported here without the shim)
    from hidden_states.vllm.patches.cpu_async_shim import CPU_ASYNC_ENV

    counted = start_counted(loop_thread, tmp_path, env={CPU_ASYNC_ENV: "1"})
    try:
        extra, flagged = compare(counted, loop_thread)
        stats = [s for _, _, s in flagged]
        assert all(s.via == "tail" and s.computed_tokens == 1 for s in stats), stats
        # The step after a stop-token finish runs anyway under async scheduling; after a max_tokens
        # finish vLLM would skip it, and the scheduler has it run: 1 position each.
        length_finishes = sum(1 for _, finish, _ in flagged if finish in ("length", "streamed"))
        assert extra == length_finishes, (extra, length_finishes, [f for _, f, _ in flagged])
        print(
            f"\nasync: {len(stats)} vectors, {extra} more positions scheduled by vLLM "
            f"({length_finishes} max_tokens finishes, 0 for the stop-token finish)"
        )
    finally:
        counted.engine.shutdown()


def test_speculative_decoding_per_vector(loop_thread, tmp_path):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    counted = start_counted(loop_thread, tmp_path, speculative_config=spec, async_scheduling=False)
    try:
        extra, flagged = compare(counted, loop_thread)
        stats = [s for _, _, s in flagged]
        assert all(s.via == "tail" and s.computed_tokens == 1 for s in stats), stats
        print(
            f"\nn-gram speculative decoding: {len(stats)} vectors, {extra} more positions scheduled by vLLM "
            f"({extra / len(stats):+.2f} per vector)"
        )
        # A held request's tail step runs its final token alone (its drafts cleared), and n-gram drafts
        # depend only on the tokens, which are the same: every other step is the same step.
        assert extra == len(stats), (extra, len(stats))
    finally:
        counted.engine.shutdown()
