"""The side channel: captured vectors from the model runner to the caller.

One zmq PUSH socket per sending worker, one PULL socket per engine, on local IPC
(or loopback TCP, never another interface). The caller registers a key before
it submits the flagged request and waits for that key with a timeout; a result
whose key nobody waits for (its waiter timed out or was cancelled) is dropped on
arrival and counted, so memory stays flat. A malformed frame is dropped, logged
and counted; it is decoded by msgspec only, never unpickled.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import tempfile
import uuid

import zmq
import zmq.asyncio

from hidden_states.protocol import HiddenStatesBatch, HiddenStatesResult, SideChannelProtocolError, decode_batch, encode_batch

logger = logging.getLogger(__name__)


class HiddenStatesTimeout(TimeoutError):
    """The vector for a request did not arrive in time."""


def check_local_address(address: str) -> str:
    if address.startswith("ipc://") or address.startswith("tcp://127.0.0.1:"):
        return address
    raise ValueError(f"side channel address {address!r} must be ipc:// or tcp://127.0.0.1:PORT (local only)")


def new_ipc_address() -> str:
    # Unix socket paths are limited to ~107 bytes: keep the name short.
    return f"ipc://{tempfile.gettempdir()}/hs-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"


class HiddenStatesReceiver:
    """Caller side. Create and use inside one asyncio event loop."""

    def __init__(self, address: str | None = None):
        self.address = check_local_address(address or new_ipc_address())
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)
        self._pending: dict[str, asyncio.Future[list[HiddenStatesResult]]] = {}
        self._task: asyncio.Task | None = None
        self.malformed_frames = 0
        self.unclaimed_results = 0
        self.expected = 0  # keys ever registered: a worker's counters move only after one
        # n > 1 with prompt_end captures: every child request sends the same key.
        self._resolved: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.duplicate_results = 0

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="hidden-states-receiver")

    def expect(self, key: str) -> None:
        """Registers `key` before its request is submitted, so its result cannot be missed."""
        if key in self._pending:
            raise ValueError(f"hidden-states key {key!r} is already pending")
        self._pending[key] = asyncio.get_running_loop().create_future()
        self.expected += 1

    def discard(self, key: str) -> None:
        fut = self._pending.pop(key, None)
        if fut is not None and not fut.done():
            fut.cancel()

    async def wait(self, key: str, timeout_s: float) -> list[HiddenStatesResult]:
        fut = self._pending.get(key)
        if fut is None:
            raise KeyError(f"hidden-states key {key!r} was never registered with expect()")
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise HiddenStatesTimeout(
                f"hidden states for request {key!r} did not arrive within {timeout_s:g}s "
                "(engine overloaded or its worker died); raise extraction_timeout_s if the engine is just slow"
            ) from None
        finally:
            self._pending.pop(key, None)

    async def _run(self) -> None:
        while True:
            frame = await self._sock.recv(copy=True)
            self.deliver(frame)

    def deliver(self, frame: bytes) -> None:
        try:
            batch = decode_batch(frame)
        except SideChannelProtocolError as e:
            self.malformed_frames += 1
            logger.warning("dropped a frame on the hidden-states side channel: %s", e)
            return
        by_key: dict[str, list[HiddenStatesResult]] = {}
        for r in batch.results:
            by_key.setdefault(r.key, []).append(r)
        for key, results in by_key.items():
            fut = self._pending.get(key)
            if fut is None or fut.done():
                if key in self._resolved:
                    self.duplicate_results += 1
                else:
                    self.unclaimed_results += 1
                continue
            fut.set_result(results)
            self._resolved[key] = None
            if len(self._resolved) > 4096:
                self._resolved.popitem(last=False)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for key in list(self._pending):
            self.discard(key)
        self._sock.close(linger=0)
        self._ctx.term()
        if self.address.startswith("ipc://"):
            try:
                os.unlink(self.address[len("ipc://"):])
            except OSError:
                pass


class HiddenStatesSender:
    """Worker side: never blocks the engine step; a full queue drops and logs."""

    def __init__(self, address: str):
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 10_000)
        self._sock.connect(check_local_address(address))
        self.dropped = 0

    def send(self, batch: HiddenStatesBatch) -> None:
        try:
            self._sock.send(encode_batch(batch), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.dropped += 1
            logger.error("hidden-states side channel full: dropped %d results", len(batch.results))

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
