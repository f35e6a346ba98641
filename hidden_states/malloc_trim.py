"""Worker-side memory housekeeping: when the engine goes idle, hand the allocator's free pages back to the OS.

glibc keeps freed activations in its heaps, so a CPU worker's RSS stays at its high-water mark.
A daemon thread calls `malloc_trim(0)` once after a whole `interval_s` under 10% of a core;
never under load, where the pages would fault straight back. Started by
`HiddenStatesWorkerExtension.hidden_states_start_trimmer`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time

logger = logging.getLogger(__name__)

IDLE_FRACTION = 0.1  # idle: the process used under this share of one core over an interval


class MallocTrimmer:
    def __init__(self, interval_s: float):
        self.interval_s = float(interval_s)
        self.trims = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._trim = _libc_malloc_trim()
        self._thread = threading.Thread(target=self._run, name="hidden-states-malloc-trim", daemon=True)

    @property
    def available(self) -> bool:
        return self._trim is not None

    def start(self) -> MallocTrimmer:
        if self.available and self.interval_s > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        last_cpu, trimmed = time.process_time(), False
        while not self._stop.wait(self.interval_s):
            cpu = time.process_time()
            idle = cpu - last_cpu < IDLE_FRACTION * self.interval_s
            last_cpu = cpu
            if not idle:
                trimmed = False  # busy again: trim at the next idle interval
                continue
            if trimmed:
                continue
            t0 = time.perf_counter()
            try:
                self._trim(0)
            except Exception:  # never take the worker down for housekeeping
                logger.exception("malloc_trim failed; trimming stops")
                return
            self.seconds += time.perf_counter() - t0
            self.trims += 1
            trimmed = True
            last_cpu = time.process_time()  # the trim's own CPU does not count as load

    def stats(self) -> dict:
        return {
            "interval_s": self.interval_s,
            "trims": self.trims,
            "seconds": round(self.seconds, 4),
            "running": self._thread.is_alive(),
        }


def _libc_malloc_trim():
    """glibc's malloc_trim, or None (musl, macOS: nothing to trim this way)."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn
