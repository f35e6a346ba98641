"""The worker's malloc_trim thread (hidden_states/malloc_trim.py), in this process."""

import time

import pytest

from hidden_states.malloc_trim import MallocTrimmer


def test_trimmer_trims_on_its_interval_and_stops():
    t = MallocTrimmer(0.05)
    if not t.available:
        pytest.skip("no glibc malloc_trim here")
    t.start()
    deadline = time.monotonic() + 10
    while t.trims < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert t.trims >= 3 and t.stats()["running"]
    t.stop()
    t._thread.join(timeout=5)
    assert not t.stats()["running"]
    assert t.stats()["seconds"] > 0


def test_interval_zero_starts_nothing():
    t = MallocTrimmer(0).start()
    assert not t.stats()["running"] and t.trims == 0
