"""Ledger point 12, tests only, CPU: vLLM's async scheduling path run on the CPU engine.

Why: vLLM's CPU platform turns async scheduling off, and its async path calls CUDA streams and events; the
AsyncVectorScheduler (point 9) and the capture under async scheduling (point 2) are tested on CPU this way.
How: with `HIDDEN_STATES_TEST_CPU_ASYNC=1` (`CPU_ASYNC_ENV`), `config` (frontend, after
`create_engine_config`) sets `scheduler_config.async_scheduling = True`, and `imported` (each worker, at the
worker extension's import, before the runner is built) replaces `torch.cuda.Stream`, `torch.cuda.Event`,
`torch.Event`, `torch.cuda.current_stream` and `torch.cuda.stream` with CPU stand-ins: CPU ops run in order on
the calling thread, so streams are the current thread and events no-ops. Never set in production.
Relies on: `SchedulerConfig.async_scheduling`; Model Runner V1's async path calling only those CUDA names.
Remove when: vLLM's CPU platform allows async scheduling.
"""

from __future__ import annotations

import os
from typing import Any

CPU_ASYNC_ENV = "HIDDEN_STATES_TEST_CPU_ASYNC"  # "1": the engine runs vLLM's async scheduling on CPU


def config(vllm_config: Any, **_: Any) -> bool:
    if os.environ.get(CPU_ASYNC_ENV) == "1":  # tests only: vLLM's async path on CPU
        vllm_config.scheduler_config.async_scheduling = True
        return True
    return False


def imported(**_: Any) -> bool:
    if os.environ.get(CPU_ASYNC_ENV) == "1":  # tests only: before the runner is built
        install_cpu_async_shim()
        return True
    return False


def install_cpu_async_shim() -> None:
    """Ledger point 12 (tests only): CPU stand-ins for Model Runner V1's CUDA stream and event calls.
    CPU ops run in order on the calling thread, so streams are the current thread and events
    no-ops."""
    import contextlib

    import torch

    class _Stream:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            pass

        def synchronize(self):
            pass

        def record_event(self, event=None):
            return event or _Event()

    class _Event:
        def __init__(self, *a, **k):
            pass

        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

        def wait(self, stream=None):
            pass

        def query(self):
            return True

    torch.cuda.Stream, torch.cuda.Event, torch.Event = _Stream, _Event, _Event
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
