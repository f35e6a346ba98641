"""The worker's malloc_trim thread (hidden_states/malloc_trim.py), in this process."""

import threading
import time

import pytest

from hidden_states.malloc_trim import MallocTrimmer


def wait_for(cond, seconds=10):
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_trims_once_per_idle_period_never_under_load_and_stops():
    t = MallocTrimmer(0.1)
    if not t.available:
        pytest.skip("no glibc malloc_trim here")
    t.start()
    assert wait_for(lambda: t.trims == 1)  # idle: one trim
    time.sleep(0.5)
    assert t.trims == 1  # still the same idle period: no more

    stop = threading.Event()

    def burn():  # load: this process busy on a core
        while not stop.is_set():
            sum(range(10_000))

    worker = threading.Thread(target=burn)
    worker.start()
    try:
        time.sleep(0.6)
        assert t.trims == 1  # never under load
    finally:
        stop.set()
        worker.join(timeout=5)
    assert wait_for(lambda: t.trims == 2)  # idle again: trimmed again
    assert t.stats()["running"] and t.stats()["seconds"] > 0
    t.stop()
    t._thread.join(timeout=5)
    assert not t.stats()["running"]


def test_interval_zero_starts_nothing():
    t = MallocTrimmer(0).start()
    assert not t.stats()["running"] and t.trims == 0
