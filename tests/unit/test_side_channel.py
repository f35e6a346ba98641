"""Unit tests for hidden_states.side_channel over real zmq sockets (no vLLM).

Async code runs through asyncio.run inside plain sync tests.
"""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
import socket
import time
import tracemalloc

import numpy as np
import pytest
import zmq

from hidden_states.protocol import HiddenStatesBatch, encode_batch, result_from_array
from hidden_states.side_channel import (
    HiddenStatesReceiver,
    HiddenStatesSender,
    HiddenStatesTimeout,
    check_local_address,
    new_ipc_address,
)

D = 4096


def _vec(seed: int, n: int = D) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def _ipc_path(address: str) -> str:
    assert address.startswith("ipc://")
    return address[len("ipc://"):]


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _RawPush:
    """A raw zmq PUSH socket, to put arbitrary bytes on the wire."""

    def __init__(self, address: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, frame: bytes) -> None:
        self.sock.send(frame, flags=zmq.NOBLOCK)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


# ------------------------------------------------------------ addresses


@pytest.mark.parametrize(
    "address",
    ["tcp://0.0.0.0:5555", "tcp://10.0.0.1:1", "tcp://*:5555", "tcp://localhost:5555", "tcp://127.0.0.2:5555",
     "tcp://[::]:5555", "inproc://x", "", "ipc:/tmp/x.sock"],
)
def test_check_local_address_refuses_non_local(address):
    with pytest.raises(ValueError, match="local only"):
        check_local_address(address)


@pytest.mark.parametrize("address", ["ipc:///tmp/hs-test.sock", "tcp://127.0.0.1:5555", "tcp://127.0.0.1:1"])
def test_check_local_address_accepts_local(address):
    assert check_local_address(address) == address


def test_new_ipc_address_is_local_and_short_and_unique():
    a, b = new_ipc_address(), new_ipc_address()
    assert a != b
    for addr in (a, b):
        assert check_local_address(addr) == addr
        assert len(_ipc_path(addr).encode()) < 100  # Unix socket path limit


def test_receiver_and_sender_refuse_non_local_address():
    with pytest.raises(ValueError, match="local only"):
        HiddenStatesReceiver("tcp://0.0.0.0:5555")
    with pytest.raises(ValueError, match="local only"):
        HiddenStatesSender("tcp://10.0.0.1:1")


# ------------------------------------------------------------ delivery


def test_sender_delivers_two_keys_in_one_batch():
    a, b = _vec(1), _vec(2)

    async def main():
        rx = HiddenStatesReceiver()
        rx.start()
        tx = HiddenStatesSender(rx.address)
        try:
            rx.expect("req-a")
            rx.expect("req-b")
            assert rx.num_pending == 2
            tx.send(HiddenStatesBatch([result_from_array("req-a", a, "float32"), result_from_array("req-b", b, "float32")]))
            ra, rb = await asyncio.gather(rx.wait("req-a", 5.0), rx.wait("req-b", 5.0))
            assert [r.key for r in ra] == ["req-a"] and [r.key for r in rb] == ["req-b"]
            np.testing.assert_array_equal(ra[0].to_numpy(), a)
            np.testing.assert_array_equal(rb[0].to_numpy(), b)
            assert rx.num_pending == 0
            assert rx.malformed_frames == 0 and rx.unclaimed_results == 0
            assert tx.dropped == 0
        finally:
            tx.close()
            rx.close()

    asyncio.run(main())


def test_multiple_layers_for_one_key_delivered_together():
    v0, v1 = _vec(3, 64), _vec(4, 64)

    async def main():
        rx = HiddenStatesReceiver()
        rx.start()
        tx = HiddenStatesSender(rx.address)
        try:
            rx.expect("k")
            tx.send(HiddenStatesBatch([result_from_array("k", v0, "float32", layer=5),
                                       result_from_array("k", v1, "float32", layer=-1)]))
            res = await rx.wait("k", 5.0)
            assert [r.layer for r in res] == [5, -1]
            np.testing.assert_array_equal(res[0].to_numpy(), v0)
            np.testing.assert_array_equal(res[1].to_numpy(), v1)
        finally:
            tx.close()
            rx.close()

    asyncio.run(main())


def test_loopback_tcp_delivery():
    v = _vec(5)
    address = f"tcp://127.0.0.1:{_free_loopback_port()}"

    async def main():
        rx = HiddenStatesReceiver(address)
        assert rx.address == address
        rx.start()
        tx = HiddenStatesSender(address)
        try:
            rx.expect("k")
            tx.send(HiddenStatesBatch([result_from_array("k", v, "float32")]))
            (r,) = await rx.wait("k", 5.0)
            np.testing.assert_array_equal(r.to_numpy(), v)
        finally:
            tx.close()
            rx.close()

    asyncio.run(main())


def test_unregistered_key_counted_and_not_stored():
    a = _vec(6)

    async def main():
        rx = HiddenStatesReceiver()
        rx.start()
        tx = HiddenStatesSender(rx.address)
        try:
            rx.expect("mine")
            tx.send(HiddenStatesBatch([result_from_array("mine", a, "float32"),
                                       result_from_array("ghost", _vec(7), "float32")]))
            (r,) = await rx.wait("mine", 5.0)
            np.testing.assert_array_equal(r.to_numpy(), a)
            assert rx.unclaimed_results == 1
            assert rx.num_pending == 0
            assert "ghost" not in rx._pending
            # not buffered for a late registrant either: registering now gets nothing
            rx.expect("ghost")
            with pytest.raises(HiddenStatesTimeout):
                await rx.wait("ghost", 0.2)
            assert rx.num_pending == 0
        finally:
            tx.close()
            rx.close()

    asyncio.run(main())


def test_result_after_timeout_is_unclaimed():
    async def main():
        rx = HiddenStatesReceiver()
        rx.start()
        tx = HiddenStatesSender(rx.address)
        try:
            rx.expect("late")
            with pytest.raises(HiddenStatesTimeout):
                await rx.wait("late", 0.05)
            tx.send(HiddenStatesBatch([result_from_array("late", _vec(8, 8), "float32")]))
            deadline = time.monotonic() + 5.0
            while rx.unclaimed_results == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert rx.unclaimed_results == 1
            assert rx.num_pending == 0
        finally:
            tx.close()
            rx.close()

    asyncio.run(main())


def test_discard_then_delivery_is_unclaimed():
    rx_holder = {}

    async def main():
        rx = HiddenStatesReceiver()
        rx_holder["rx"] = rx
        try:
            rx.expect("gone")
            rx.discard("gone")
            rx.discard("never-registered")  # no-op, no error
            assert rx.num_pending == 0
            rx.deliver(encode_batch(HiddenStatesBatch([result_from_array("gone", _vec(9, 4), "float32")])))
            assert rx.unclaimed_results == 1 and rx.num_pending == 0
        finally:
            rx.close()

    asyncio.run(main())


def test_expect_twice_rejected_and_wait_unregistered_rejected():
    async def main():
        rx = HiddenStatesReceiver()
        try:
            rx.expect("k")
            with pytest.raises(ValueError, match="already pending"):
                rx.expect("k")
            with pytest.raises(KeyError, match="never registered"):
                await rx.wait("nobody", 1.0)
            assert rx.num_pending == 1
        finally:
            rx.close()
        assert rx.num_pending == 0

    asyncio.run(main())


def test_wait_timeout_within_bound_and_nothing_pending():
    timeout = 0.3

    async def main():
        rx = HiddenStatesReceiver()
        rx.start()
        try:
            rx.expect("slow")
            t0 = time.monotonic()
            with pytest.raises(HiddenStatesTimeout, match=r"'slow'.*within 0.3s"):
                await rx.wait("slow", timeout)
            elapsed = time.monotonic() - t0
            assert timeout * 0.9 <= elapsed < timeout + 1.0, elapsed
            assert rx.num_pending == 0
        finally:
            rx.close()

    asyncio.run(main())


def test_hidden_states_timeout_is_a_timeout_error():
    assert issubclass(HiddenStatesTimeout, TimeoutError)


def test_malformed_raw_frames_counted_and_channel_keeps_delivering():
    v = _vec(10)

    async def main():
        rx = HiddenStatesReceiver()
        rx.start()
        raw = _RawPush(rx.address)
        try:
            rx.expect("after")
            # same socket -> in-order delivery: the garbage is processed first
            raw.send(b"\x00\x01garbage\xff")
            raw.send(pickle.dumps({"x": 1}))
            raw.send(b"")
            raw.send(encode_batch(HiddenStatesBatch([result_from_array("after", v, "float32")])))
            (r,) = await rx.wait("after", 5.0)
            np.testing.assert_array_equal(r.to_numpy(), v)
            assert rx.malformed_frames == 3
            assert rx.unclaimed_results == 0
            assert rx.num_pending == 0
            # and again, once more after another bad frame
            rx.expect("again")
            raw.send(b"\x91\x91\x94\xa1k")  # truncated
            raw.send(encode_batch(HiddenStatesBatch([result_from_array("again", v[:8], "float32")])))
            (r2,) = await rx.wait("again", 5.0)
            np.testing.assert_array_equal(r2.to_numpy(), v[:8])
            assert rx.malformed_frames == 4
        finally:
            raw.close()
            rx.close()

    asyncio.run(main())


def test_malformed_frame_logged(caplog):
    async def main():
        rx = HiddenStatesReceiver()
        try:
            rx.deliver(b"not msgpack at all")
            assert rx.malformed_frames == 1
        finally:
            rx.close()

    with caplog.at_level("WARNING", logger="hidden_states.side_channel"):
        asyncio.run(main())
    assert any("dropped a frame" in rec.getMessage() for rec in caplog.records)


# ------------------------------------------------------------ lifecycle


def test_close_removes_ipc_socket_file():
    async def main():
        rx = HiddenStatesReceiver()
        rx.start()
        path = _ipc_path(rx.address)
        assert os.path.exists(path)
        rx.expect("k")
        rx.close()
        assert not os.path.exists(path)
        assert rx.num_pending == 0
        await asyncio.sleep(0)  # let the cancelled receive task settle

    asyncio.run(main())


def test_close_cancels_waiters():
    async def main():
        rx = HiddenStatesReceiver()
        rx.start()
        rx.expect("k")
        waiter = asyncio.ensure_future(rx.wait("k", 10.0))
        await asyncio.sleep(0.01)
        t0 = time.monotonic()
        rx.close()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert time.monotonic() - t0 < 1.0
        assert rx.num_pending == 0

    asyncio.run(main())


def test_many_timeouts_leave_nothing_pending_and_memory_flat():
    async def cycles(rx, n, start):
        timeouts = 0
        for i in range(start, start + n):
            rx.expect(f"k-{i}")
            try:
                await rx.wait(f"k-{i}", 0.0005)
            except HiddenStatesTimeout:
                timeouts += 1
        return timeouts

    async def main():
        rx = HiddenStatesReceiver()
        rx.start()
        try:
            assert await cycles(rx, 200, 0) == 200  # warm-up
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.take_snapshot()
            assert await cycles(rx, 1000, 200) == 1000
            gc.collect()
            after = tracemalloc.take_snapshot()
            tracemalloc.stop()
            assert rx.num_pending == 0
            assert rx._pending == {}
            grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
            # a leaked future + key per cycle would be well over 100 KB for 1000 cycles
            assert grown < 64 * 1024, grown
        finally:
            rx.close()

    asyncio.run(main())
