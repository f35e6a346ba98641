"""vLLM's engine arguments with hidden states (hidden_states/vllm/engine_args.py).

`test_every_engine_argument_is_classified` enumerates `dataclasses.fields(AsyncEngineArgs)`
and fails on any field that is neither EXERCISED (by a named test that exists), REFUSED
at start, nor IRRELEVANT with a reason: a new vLLM argument cannot slip past.

The refusals are checked without starting vLLM. The exercised arguments run on real
engines, one configuration at a time (`_Slot`: the engine of the previous configuration
is shut down first, so the module never holds two), each checked against transformers:

- `small`: no prefix caching, 64-token prefill chunks, 2 sequences at a time, fcfs
  scheduling, async scheduling asked for (the CPU turns it off), a 512-token context;
- `bf16`: dtype bfloat16, against transformers in bfloat16 at a derived tolerance;
- `fp8`: an fp8 KV cache and no chunked prefill, exact against transformers whose
  attention reads K and V rounded as the CPU kernel stores them.

A configuration is skipped only where vLLM's CPU engine refuses it for an instruction set this
CPU lacks, saying so (CPU_FEATURES: fp8 without AVX-512 or AMX); any other failure to start fails.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import os
import threading
import time
import types

import numpy as np
import pytest

from tests.conftest import TEST_ENGINE_ARGS, TEST_MODEL, Reference, cpu_only, long_text
from tests.engine.test_engine import PROMPTS, sp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = {
    "small": {
        **TEST_ENGINE_ARGS,
        "enable_prefix_caching": False,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 2,
        "scheduling_policy": "fcfs",
        "async_scheduling": True,
        "max_model_len": 512,
    },
    "bf16": {**TEST_ENGINE_ARGS, "dtype": "bfloat16"},
    "fp8": {
        **TEST_ENGINE_ARGS,
        "kv_cache_dtype": "fp8",
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 4096,
    },
}


# -- the classification --------------------------------------------------------------------


def _engine_arg_fields() -> dict[str, dataclasses.Field]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return {f.name: f for f in dataclasses.fields(AsyncEngineArgs)}


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else None


def _test_exists(node_id: str) -> bool:
    path, _, name = node_id.partition("::")
    try:
        with open(os.path.join(ROOT, path)) as f:
            tree = ast.parse(f.read())
    except OSError:
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in tree.body)


def test_every_engine_argument_is_classified():
    from hidden_states.vllm.engine_args import ACCEPTED, EXERCISED, IRRELEVANT, REFUSED

    fields = set(_engine_arg_fields())
    tables = {"EXERCISED": EXERCISED, "REFUSED": REFUSED, "IRRELEVANT": IRRELEVANT}
    unclassified = fields - set().union(*tables.values())
    assert not unclassified, (
        f"vLLM's AsyncEngineArgs has fields engine_args.py does not classify: {sorted(unclassified)}; exercise "
        "each in a test (exact vectors), refuse it at start, or say why it cannot change a vector"
    )
    for a, b in ((a, b) for a in tables for b in tables if a < b):
        both = set(tables[a]) & set(tables[b])
        assert not both, f"in both {a} and {b}: {sorted(both)}"
    stale = set().union(*tables.values()) - fields
    assert not stale, f"engine_args.py classifies fields vLLM no longer has: {sorted(stale)}"
    missing = {name: test for name, test in EXERCISED.items() if not _test_exists(test)}
    assert not missing, f"EXERCISED names tests that do not exist: {missing}"
    assert set(ACCEPTED) == set(REFUSED)
    assert all(reason.strip() for t in (REFUSED, IRRELEVANT) for reason in t.values())


# A value that asks for each refused feature (the rest: True for flags, 2 for sizes, a name for the others).
BAD = {
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
    "spec_method": "ngram",
    "spec_model": "org/draft",
    "spec_tokens": 2,
    "diffusion_config": {"steps": 4},
    "kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
    "kv_offloading_size": 1.0,
    "max_num_queued_reqs": 8,
    "max_num_queued_tokens": 4096,
    "aux_output_config": {"enable_return_routed_experts": True},
    "runner": "pooling",
    "convert": "embed",
    "worker_cls": "my.Worker",
    "worker_extension_cls": "my.Extension",
    "scheduler_cls": "vllm.v1.core.sched.scheduler.Scheduler",
    "ubatch_size": 2,
}


def _bad(name: str, default):
    if name in BAD:
        return BAD[name]
    if isinstance(default, bool) or default is None:
        return True
    assert isinstance(default, int), (name, default)
    return default + 1


def test_every_refused_argument_is_refused_by_name_and_its_default_passes():
    from hidden_states.preflight import EngineStartupError
    from hidden_states.vllm.engine_args import REFUSED, refuse

    fields = _engine_arg_fields()
    for name in REFUSED:
        default = _default(fields[name])
        refuse({name: default})  # vLLM's default never asks for the feature
        with pytest.raises(EngineStartupError, match=rf"engine argument {name}=") as e:
            refuse({name: _bad(name, default)})
        assert REFUSED[name] in str(e.value)
    refuse({"model": "x", "dtype": "bfloat16", "tensor_parallel_size": 2, "seed": 3})


@pytest.mark.parametrize(
    "arg",
    [
        {"data_parallel_size": 2},
        {"pipeline_parallel_size": 2, "async_scheduling": True},
        {"scheduler_cls": BAD["scheduler_cls"]},
        {"kv_offloading_size": 1.0},
    ],
    ids=lambda a: next(iter(a)),
)
def test_refused_arguments_stop_the_engine_before_vllm_starts(loop_thread, arg):
    """HiddenStatesEngine.start() refuses them with the argument named, before any vLLM process
    starts (no engine start costs under a second); without hidden states they reach vLLM."""
    import time

    from hidden_states.preflight import EngineStartupError
    from hidden_states.vllm.engine import HiddenStatesEngine

    name = list(arg)[-1]
    t0 = time.monotonic()
    with pytest.raises(EngineStartupError, match=rf"engine argument {name}=.*cannot be combined with .*hidden states"):
        loop_thread.run(HiddenStatesEngine.start(TEST_MODEL, **{**TEST_ENGINE_ARGS, **arg}), timeout=60)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize(
    "name, value",
    [
        ("async_scheduling", True),
        ("speculative_config", {"method": "ngram", "num_speculative_tokens": 3}),
        ("distributed_executor_backend", "external_launcher"),
        ("multimodal", True),
    ],
)
def test_what_pipeline_parallelism_does_not_serve_yet_is_refused_by_name(name, value):
    """Each argument PIPELINE_REFUSED names stops a pipeline-parallel start, named with why; one stage takes it,
    and so do the values that turn it off."""
    from hidden_states.preflight import EngineStartupError
    from hidden_states.vllm.engine_args import PIPELINE_REFUSED, pipeline_refusal, refuse

    e = pipeline_refusal(2, 2, {name: value})
    assert e is not None and f"engine argument {name}={value!r}" in str(e) and PIPELINE_REFUSED[name] in str(e)
    assert pipeline_refusal(1, 2, {name: value}) is None
    off = {"async_scheduling": False, "speculative_config": None,
           "distributed_executor_backend": "mp", "multimodal": False}  # fmt: skip
    assert pipeline_refusal(2, 2, off) is None
    if name != "multimodal":  # (resolved from the model, never an engine argument)
        with pytest.raises(EngineStartupError, match=rf"engine argument {name}="):
            refuse({"pipeline_parallel_size": 2, name: value})


def test_the_compiled_engine_is_served_under_pipeline_parallelism():
    """enforce_eager: false with pipeline_parallel_size 2 starts (each stage traces its own capture_layers:
    tests/engine/test_pipeline_compiled.py)."""
    from hidden_states.vllm.engine_args import PIPELINE_REFUSED, pipeline_refusal, refuse

    assert "enforce_eager" not in PIPELINE_REFUSED
    assert pipeline_refusal(2, 2, {"enforce_eager": False}) is None
    refuse({"pipeline_parallel_size": 2, "enforce_eager": False})


def test_more_stages_than_layers_is_refused_with_what_is_possible():
    from hidden_states.vllm.engine_args import pipeline_refusal

    e = pipeline_refusal(3, 2, {})
    assert "pipeline_parallel_size=3" in str(e) and "1..2" in str(e), e
    assert pipeline_refusal(2, 2, {}) is None


def test_speculative_decoding_under_async_scheduling_is_refused():
    """Speculative decoding is served (tests/engine/test_spec_decode.py), synchronously: asked
    together with async scheduling, or resolved to it (vLLM's GPU default), it is refused by name."""
    import types

    from hidden_states.preflight import EngineStartupError
    from hidden_states.vllm.engine_args import refuse

    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    refuse({"speculative_config": spec})
    refuse({"speculative_config": spec, "async_scheduling": False})
    with pytest.raises(EngineStartupError, match="speculative_config and async_scheduling=True"):
        refuse({"speculative_config": spec, "async_scheduling": True})
    resolved = types.SimpleNamespace(
        speculative_config=object(), scheduler_config=types.SimpleNamespace(async_scheduling=True)
    )
    with pytest.raises(EngineStartupError, match="async_scheduling: false"):
        refuse({}, resolved)
    refuse(
        {},
        types.SimpleNamespace(
            speculative_config=object(), scheduler_config=types.SimpleNamespace(async_scheduling=False)
        ),
    )


def test_the_resolved_configuration_is_checked_too(model_dir):
    """vLLM's resolved VllmConfig is refused however it came to ask for a refused feature:
    kv_offloading_size (refused by name too) turns into a KV connector; the worker's guard
    (worker.check_engine_config) refuses with the same message, not one of its own."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from hidden_states.preflight import EngineStartupError
    from hidden_states.vllm.engine_args import refuse
    from hidden_states.vllm.worker.extension import check_engine_config

    cfg = AsyncEngineArgs(model=model_dir, **TEST_ENGINE_ARGS).create_engine_config()
    refuse({}, cfg)
    check_engine_config(cfg)
    offloading = AsyncEngineArgs(model=model_dir, kv_offloading_size=0.5, **TEST_ENGINE_ARGS).create_engine_config()
    assert offloading.kv_transfer_config is not None
    with pytest.raises(EngineStartupError, match="engine argument kv_transfer_config=") as by_config:
        refuse({}, offloading)
    with pytest.raises(EngineStartupError) as by_worker:
        check_engine_config(offloading)
    assert str(by_worker.value) == str(by_config.value)

    def fake(**change):
        parallel = dict(
            pipeline_parallel_size=1,
            data_parallel_size=1,
            prefill_context_parallel_size=1,
            decode_context_parallel_size=1,
        )
        model = dict(runner_type="generate", is_diffusion=False)
        top = dict(speculative_config=None, kv_transfer_config=None)
        for key, value in change.items():
            (parallel if key in parallel else model if key in model else top)[key] = value
        return types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(**parallel), model_config=types.SimpleNamespace(**model), **top
        )

    refuse({}, fake())
    for change, name in (
        ({"data_parallel_size": 2}, "data_parallel_size"),
        ({"decode_context_parallel_size": 2}, "decode_context_parallel_size"),
        ({"runner_type": "pooling"}, "runner"),  # e.g. `runner: auto` on an embedding model
        ({"is_diffusion": True}, "diffusion_config"),
    ):
        with pytest.raises(EngineStartupError, match=rf"engine argument {name}="):
            refuse({}, fake(**change))


# -- real engines, one configuration at a time ------------------------------------------------


# The configurations vLLM's CPU engine refuses on a CPU without an instruction set: what it needs,
# the message vLLM's worker logs then (vllm/v1/attention/backends/cpu_attn.py `_get_attn_isa`, vLLM
# 0.32), and vLLM's own test of the CPU. Found on an x86_64 CPU with AVX2 and without AVX-512 or AMX
# (this machine with torch's CPU queries answering so and ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2):
# the fp8 KV cache is refused so, and only so; bfloat16 starts and runs there (vLLM's AVX2 kernels
# carry it), so it has no entry: it never skips.
CPU_FEATURES = {
    "fp8": (
        "AVX-512 or AMX",
        "FP8 KV cache on CPU requires x86 with AVX-512 or AMX.",
        lambda cpu: not (cpu._is_avx512_supported() or cpu._is_amx_tile_supported()),
    ),
}


def missing_cpu_feature(name: str, error: BaseException, engine_output: str) -> str | None:
    """Why `name`'s tests are skipped on this machine, or None (the error is a failure): only an
    EngineStartupError of a configuration in CPU_FEATURES, on a CPU that lacks what it needs as vLLM
    tests it, whose engine said so in vLLM's words (`engine_output`: what its processes logged)."""
    import torch

    from hidden_states.preflight import EngineStartupError

    if name not in CPU_FEATURES or not isinstance(error, EngineStartupError):
        return None
    feature, message, lacks = CPU_FEATURES[name]
    if not lacks(torch.cpu) or message not in engine_output:
        return None
    return f"vLLM's CPU engine cannot run {name} on this CPU (no {feature}): {message!r}"


class _Output:
    """File descriptors 1 and 2 through pipes while an engine starts: vLLM's engine-core and worker
    processes inherit them and log there (the cause of a failed start reaches this process only as
    "Engine core initialization failed"). A thread per pipe copies everything on to where it went
    before, for as long as those processes live, and keeps the text written during the start."""

    def __init__(self):
        self.chunks: list[bytes] = []
        self.recording, self.last = True, time.monotonic()

    def _copy(self, read_fd: int, to_fd: int) -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while data := pipe.read(65536):
                if self.recording:
                    self.chunks.append(data)
                    self.last = time.monotonic()
                view = memoryview(data)
                while view:
                    view = view[os.write(to_fd, view) :]
        os.close(to_fd)

    @contextlib.contextmanager
    def during(self):
        import sys

        saved = {}
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            stream.flush()
            read_fd, write_fd = os.pipe()
            saved[fd] = os.dup(fd)
            threading.Thread(target=self._copy, args=(read_fd, os.dup(fd)), daemon=True).start()
            os.dup2(write_fd, fd)
            os.close(write_fd)
        try:
            yield self
        finally:
            for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
                stream.flush()
                os.dup2(saved[fd], fd)
                os.close(saved[fd])
            deadline = time.monotonic() + 5  # what the processes wrote before this one heard of it
            while time.monotonic() < deadline and time.monotonic() - self.last < 0.5:
                time.sleep(0.1)
            self.recording = False

    def text(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")


class _Slot:
    """Starts the engine of a configuration, shutting down the one before it."""

    def __init__(self, loop_thread):
        self.loop_thread, self.name, self.engine = loop_thread, None, None

    def use(self, name: str):
        """A configuration of CPU_FEATURES that vLLM refuses here for the instruction set it names
        skips its test, saying why; any other failure to start fails it."""
        from hidden_states.vllm.engine import HiddenStatesEngine

        if self.name != name:
            self.close()
            output = _Output()
            try:
                with output.during() if name in CPU_FEATURES else contextlib.nullcontext():
                    self.engine = self.loop_thread.run(
                        HiddenStatesEngine.start(TEST_MODEL, warm_up_s=0, **CONFIGS[name]), timeout=600
                    )
            except Exception as e:
                reason = missing_cpu_feature(name, e, output.text())
                if reason is None:
                    raise
                pytest.skip(reason)
            self.name = name
        return self.engine

    def close(self):
        if self.engine is not None:
            engine, self.engine, self.name = self.engine, None, None
            engine.shutdown()


class _Here:
    """A loop thread that runs the coroutine on the spot (no engine starts)."""

    def run(self, coro, timeout=None):
        return asyncio.run(coro)


@pytest.mark.parametrize(
    "name,lacks,logged,fails",
    [
        ("fp8", True, CPU_FEATURES["fp8"][1], None),  # vLLM's refusal, on a CPU without AVX-512 or AMX: skipped
        (
            "fp8",
            True,
            "AttributeError: 'NoneType' object has no attribute 'hidden_states_install'",
            "EngineStartupError",
        ),
        ("fp8", False, CPU_FEATURES["fp8"][1], "EngineStartupError"),  # the CPU has them: not the reason
        ("fp8", True, CPU_FEATURES["fp8"][1], "TimeoutError"),  # not a refusal to start
        ("bf16", True, CPU_FEATURES["fp8"][1], "EngineStartupError"),  # bfloat16 runs on AVX2: never skipped
        ("small", True, CPU_FEATURES["fp8"][1], "EngineStartupError"),
    ],
    ids=["fp8-refused-for-the-cpu", "fp8-broken", "fp8-cpu-has-it", "fp8-timeout", "bf16", "small"],
)
def test_an_engine_that_fails_to_start_fails_its_tests_unless_the_cpu_lacks_what_vllm_names(
    monkeypatch, name, lacks, logged, fails
):
    """The breaking variant of the bf16 and fp8 tests: their engine fails to start (start() stands in,
    logging to the inherited file descriptors as vLLM's engine-core process does, then raising what
    start() raises). The test then fails, unless vLLM named the instruction set this CPU lacks."""
    import torch

    from hidden_states.preflight import EngineStartupError
    from hidden_states.vllm.engine import HiddenStatesEngine

    async def start(*args, **kwargs):
        os.write(1, f"(Worker pid=1) ERROR ... {logged}\n".encode())
        if fails == "TimeoutError":
            raise TimeoutError("the engine did not start in 600 s")
        raise EngineStartupError(
            "the vLLM engine for builtin:tiny-llama failed to start (RuntimeError: Engine "
            "core initialization failed. See root cause above. Failed core proc(s): {})"
        )

    monkeypatch.setattr(HiddenStatesEngine, "start", start)
    for query in ("_is_avx512_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, query, lambda: not lacks)
    if fails is None:
        with pytest.raises(pytest.skip.Exception, match=r"cannot run fp8 on this CPU \(no AVX-512 or AMX\)"):
            _Slot(_Here()).use(name)
        return
    try:
        _Slot(_Here()).use(name)
    except pytest.skip.Exception as e:  # a skip is what hid the failure: it must not be one
        pytest.fail(f"{name} was skipped, not failed: {e}")
    except (EngineStartupError, TimeoutError) as e:
        assert type(e).__name__ == fails
    else:
        pytest.fail(f"{name} started")


@pytest.fixture(scope="module")
def slot(loop_thread):
    s = _Slot(loop_thread)
    yield s
    s.close()


@pytest.fixture
def small(slot):
    return slot.use("small")


def _run(loop_thread, *coros, timeout: float = 300):
    async def run():
        return await asyncio.gather(*coros)

    return loop_thread.run(run(), timeout=timeout)


def test_without_prefix_caching_the_extraction_step_recomputes_everything(small, loop_thread, reference):
    assert small.llm.vllm_config.cache_config.enable_prefix_caching is False
    prompt = long_text(150, seed=31)  # longer than a 64-token chunk and several 32-token blocks
    stopped, tail = _run(
        loop_thread, small.complete(prompt, sp(max_tokens=30, stop=["e"])), small.complete(prompt, sp(max_tokens=12))
    )
    st, ch = stopped.choices[0].extraction, stopped.choices[0]
    total = len(stopped.prompt_token_ids) + len(ch.token_ids)
    assert total > 2 * 64 and ch.finish_reason == "stop"
    # nothing comes from a prefix cache: the extraction step computes every position
    assert st.via == "extraction" and st.tokens == total and st.cached_tokens == 0 and st.computed_tokens == total, st
    reference.assert_matches(stopped.prompt_token_ids + ch.token_ids, ch.hidden_states)
    # the tail step needs no prefix cache: the request's own K/V are in place
    t = tail.choices[0]
    assert t.extraction.via == "tail" and t.extraction.computed_tokens == 1, t.extraction
    reference.assert_matches(tail.prompt_token_ids + t.token_ids, t.hidden_states)


def test_small_chunks_and_two_sequences_queue_requests_and_stay_exact(small, loop_thread, reference):
    """Six requests on an engine that runs 2 sequences at a time in 64-token steps, with
    prompts of 90-400 tokens: 4 of them wait at first, prompts prefill over several steps
    next to other requests' decodes, extraction steps (stop strings) queue first-come
    first-served (fcfs: no priority) behind generation. Every vector exact, and the
    tokens are those the same requests get without hidden states."""
    sc = small.llm.vllm_config.scheduler_config
    assert (sc.max_num_batched_tokens, sc.max_num_seqs, sc.policy) == (64, 2, "fcfs")
    assert small.extraction.extraction_priority == 0
    prompts = [long_text(60 + 45 * i, seed=40 + i) for i in range(6)]
    params = [sp(max_tokens=12 + 2 * i, stop=["e"] if i % 2 else None) for i in range(6)]
    flagged = _run(loop_thread, *(small.complete(p, s) for p, s in zip(prompts, params)))
    plain = _run(loop_thread, *(small.complete(p, s, return_hidden_states=False) for p, s in zip(prompts, params)))
    vias = []
    for c, u in zip(flagged, plain):
        ch = c.choices[0]
        assert 64 < len(c.prompt_token_ids) and ch.token_ids == u.choices[0].token_ids
        reference.assert_matches(c.prompt_token_ids + ch.token_ids, ch.hidden_states)
        vias.append(ch.extraction.via)
    assert set(vias) == {"tail", "extraction"}, vias
    stats = loop_thread.run(small.stats(), timeout=60)
    assert stats["pending"] == 0 and stats["missing_vectors"] == 0 and stats["timeouts"] == 0, stats


@cpu_only
def test_async_scheduling_is_off_on_cpu_and_vectors_take_the_tail_step(small, loop_thread, reference):
    """async_scheduling=True reaches vLLM, whose CPU platform turns it off: the engine runs
    synchronously, so the TailScheduler (not the AsyncVectorScheduler) and the tail step."""
    assert small.startup["async_scheduling"] is False and small.extraction.tail_enabled
    assert small.llm.vllm_config.scheduler_config.scheduler_cls.endswith("TailScheduler")
    c = loop_thread.run(small.complete(PROMPTS[1], sp(max_tokens=9)), timeout=120)
    assert c.choices[0].extraction.via == "tail"
    reference.assert_matches(c.prompt_token_ids + c.choices[0].token_ids, c.choices[0].hidden_states)


def test_a_completion_that_reaches_max_model_len(small, loop_thread, reference):
    """A completion filling all but the last position of a 512-token context: its tail step
    computes position 511, the last one there is."""
    max_len = small.llm.vllm_config.model_config.max_model_len
    assert max_len == 512
    ids = small.llm.tokenizer.encode(long_text(200, seed=33))
    room = max_len - 1 - len(ids)
    assert 20 < room < 400
    c = loop_thread.run(small.complete(ids, sp(max_tokens=room, ignore_eos=True)), timeout=300)
    ch = c.choices[0]
    assert len(c.prompt_token_ids) + len(ch.token_ids) == max_len - 1 and ch.finish_reason == "length"
    assert ch.extraction.via == "tail" and ch.extraction.computed_tokens == 1, ch.extraction
    reference.assert_matches(c.prompt_token_ids + ch.token_ids, ch.hidden_states)


# -- bfloat16 ---------------------------------------------------------------------------------

BF16_U = 2.0**-8  # bfloat16's unit roundoff: 8 significant bits (7 stored)
BF16_TOL = 6 * BF16_U  # of max|reference|: derived in the test's docstring


@pytest.fixture(scope="module")
def bf16_reference(model_dir):
    import torch

    ref = Reference(model_dir)
    ref.model = ref.model.to(torch.bfloat16)  # the same float32 weights, rounded as vLLM rounds them
    return ref


def test_bfloat16_vectors_within_the_derived_tolerance(slot, loop_thread, reference, bf16_reference):
    """dtype bfloat16: the vector is computed in bfloat16 and widened to float32 exactly.

    Tolerance, derived: bfloat16 keeps 8 significant bits, so each rounding of an entry
    moves it by up to u/2 = 2^-9 of itself (u = 2^-8), at most u/2 of max|v|. vLLM and
    transformers run the same bfloat16 model (the float32 weights rounded once, the same
    way) with different kernels (vLLM fuses the residual add into its RMSNorm and uses
    oneDNN GEMMs; transformers runs eager torch ops), so their roundings differ and their
    errors add. On this 2-layer model the residual stream is rounded after each attention
    and MLP block and at the final norm: about five roundings per side, each within u/2
    of max|v|, so about 5u if all ten point the same way (independent ones give about
    1.6u). Bound: 6u = 0.0234 of max|reference|, 5u rounded up for the norms, which
    rescale an error with the stream. Measured on this machine (AMX): 1.1u-2.6u against
    transformers in bfloat16, 1.4u-2.5u against float32. The bound is meaningful: the
    vector must be further than 1e-4 from float32 (it really is bfloat16: a float32
    engine is within 1e-6), and the vector of the wrong token (the sequence without its
    final token) must miss it (measured: 117u-343u)."""
    engine = slot.use("bf16")
    assert str(engine.llm.vllm_config.model_config.dtype) == "torch.bfloat16", engine.llm.vllm_config.model_config
    prompts = PROMPTS + [long_text(60, seed=1), long_text(300, seed=3), long_text(700, seed=5)]
    outs = _run(
        loop_thread,
        *(engine.complete(p, sp(max_tokens=16)) for p in prompts),
        *(engine.complete(p, sp(max_tokens=16, stop=["e"])) for p in prompts),
    )
    worst = {"bf16": 0.0, "f32": 0.0}
    vias = set()
    for c in outs:
        ch = c.choices[0]
        ids = c.prompt_token_ids + ch.token_ids
        vias.add(ch.extraction.via)
        v = ch.hidden_states
        assert v.dtype == np.float32 and not (v.view(np.uint32) & 0xFFFF).any(), "not a widened bfloat16"
        b16, f32 = bf16_reference.last_hidden(ids), reference.last_hidden(ids)
        scale = float(np.abs(b16).max())
        rel16, rel32 = float(np.abs(v - b16).max()) / scale, float(np.abs(v - f32).max()) / scale
        wrong = float(np.abs(v - bf16_reference.last_hidden(ids[:-1])).max()) / scale
        print(
            f"{ch.extraction.via}, {len(ids)} tokens: vs bfloat16 {rel16 / BF16_U:.2f}u, vs float32 "
            f"{rel32 / BF16_U:.2f}u, wrong token {wrong / BF16_U:.1f}u (bound {BF16_TOL / BF16_U:g}u)"
        )
        assert rel16 <= BF16_TOL, f"{rel16:.4g} of max|ref| > {BF16_TOL:.4g} over {len(ids)} tokens"
        assert rel32 <= BF16_TOL, f"{rel32:.4g} of max|ref| > {BF16_TOL:.4g} over {len(ids)} tokens (float32)"
        assert rel32 > 1e-4, "as close to float32 as a float32 engine: not computed in bfloat16?"
        assert wrong > BF16_TOL, f"the bound does not tell the final token from the one before ({wrong:.4g})"
        worst = {"bf16": max(worst["bf16"], rel16), "f32": max(worst["f32"], rel32)}
    assert vias == {"tail", "extraction"}, vias
    print(f"worst: {worst['bf16'] / BF16_U:.2f}u vs bfloat16, {worst['f32'] / BF16_U:.2f}u vs float32")


# -- an fp8 KV cache --------------------------------------------------------------------------

E4M3_MAX = 448.0  # float8 e4m3's largest finite value


def truncate_to_e4m3(x):
    """float32 -> float8 e4m3 -> float32, rounded toward zero: 3 mantissa bits, normals down
    to 2^-6, subnormals in steps of 2^-9. (Measured: vLLM's CPU KV cache stores "fp8" so;
    round-to-nearest-even, torch's own float8_e4m3fn cast, misses by 0.1 on the tiny model.)"""
    import torch

    f = x.float()
    normal = torch.bitwise_and(f.view(torch.int32), -(1 << 20)).view(torch.float32)  # keep 3 of 23 mantissa bits
    subnormal = torch.trunc(f * 2.0**9) / 2.0**9
    return torch.where(f.abs() < 2.0**-6, subnormal, normal).to(x.dtype)


@pytest.fixture(scope="module")
def fp8_reference(model_dir):
    """transformers whose attention reads K (after RoPE) and V as an fp8 KV cache holds them
    (k_scale = v_scale = 1, vLLM's default without calibrated scales); queries stay float32."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    largest = []

    def attention(module, query, key, value, *args, **kwargs):
        largest.append(float(max(key.abs().max(), value.abs().max())))
        return sdpa_attention_forward(module, query, truncate_to_e4m3(key), truncate_to_e4m3(value), *args, **kwargs)

    AttentionInterface.register("hs_test_fp8_kv", attention)
    ref = Reference(model_dir)
    ref.model.set_attn_implementation("hs_test_fp8_kv")
    ref.largest_kv = largest
    return ref


def test_truncate_to_e4m3():
    import torch

    x = torch.tensor([1.0, 1.0624, 1.1249, -1.99, 0.0157, 2.0**-7 + 2.0**-9 * 0.9, 300.0, 0.0])
    want = torch.tensor([1.0, 1.0, 1.0, -1.875, 0.015625, 2.0**-7, 288.0, 0.0])
    assert torch.equal(truncate_to_e4m3(x), want), truncate_to_e4m3(x)
    # every e4m3 value is kept as it is
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[torch.isfinite(e4m3)]
    assert torch.equal(truncate_to_e4m3(e4m3), e4m3)


@cpu_only  # the reference rounds K/V as vLLM's CPU kernel does
def test_fp8_kv_cache_vectors_exact_against_truncated_kv(slot, loop_thread, reference, fp8_reference):
    """kv_cache_dtype fp8 (e4m3): the vector is exact (the fidelity rule: 1e-5 of max|ref|,
    1e-4 absolute) against transformers reading the same fp8 K/V, and 1e-2 away from plain
    float32 (so the fp8 cache is in effect and the check can fail). With
    enable_chunked_prefill false, a 900-token prompt prefills in one step."""
    engine = slot.use("fp8")
    cfg = engine.llm.vllm_config
    assert cfg.cache_config.cache_dtype == "fp8" and not cfg.scheduler_config.enable_chunked_prefill
    prompts = PROMPTS + [long_text(300, seed=3), long_text(700, seed=5)]
    outs = _run(
        loop_thread,
        *(engine.complete(p, sp(max_tokens=16)) for p in prompts),
        *(engine.complete(p, sp(max_tokens=24, stop=["e"])) for p in prompts),
    )
    vias = set()
    for c in outs:
        ch = c.choices[0]
        ids = c.prompt_token_ids + ch.token_ids
        vias.add(ch.extraction.via)
        err, scale = fp8_reference.assert_matches(ids, ch.hidden_states)
        off = float(np.abs(ch.hidden_states - reference.last_hidden(ids)).max())
        print(
            f"{ch.extraction.via}, {len(ids)} tokens: max abs error {err:.3g} (fp8 K/V reference), "
            f"{off:.3g} from float32 K/V, max|ref| {scale:.3g}"
        )
        assert off > 1e-2 * scale, off
    assert vias == {"tail", "extraction"}, vias
    assert max(len(c.prompt_token_ids) for c in outs) > 800
    assert max(fp8_reference.largest_kv) < E4M3_MAX  # no value saturates: the rounding is all there is
