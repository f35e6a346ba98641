"""Worker-side memory housekeeping: hand the allocator's free pages back to the OS.

A CPU engine's worker allocates activations of a different size at almost every
step (the batch changes as requests come and go). glibc keeps what they free in
its heaps, so the worker's resident memory climbs for the first few hundred
requests and stays up, though the memory is free: about +10% on the built-in
model's replica, the same with hidden states off (it is vLLM's worker, not the
extraction step). A daemon thread calls `malloc_trim(0)` every `interval_s`
seconds, which returns those pages. Each call takes a few milliseconds and
releases the GIL (ctypes), so the engine step running beside it is not blocked.
Started in the vLLM worker by `HiddenStatesWorkerExtension.hidden_states_start_trimmer`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time

logger = logging.getLogger(__name__)


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

    def start(self) -> "MallocTrimmer":
        if self.available and self.interval_s > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            t0 = time.perf_counter()
            try:
                self._trim(0)
            except Exception:  # never take the worker down for housekeeping
                logger.exception("malloc_trim failed; trimming stops")
                return
            self.seconds += time.perf_counter() - t0
            self.trims += 1

    def stats(self) -> dict:
        return {"interval_s": self.interval_s, "trims": self.trims, "seconds": round(self.seconds, 4),
                "running": self._thread.is_alive()}


def _libc_malloc_trim():
    """glibc's malloc_trim, or None (musl, macOS: nothing to trim this way)."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn
