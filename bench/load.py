"""Closed-loop load: `concurrency` workers, each sending its next request when the last one returns."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Result:
    index: int
    prompt_tokens: int
    max_tokens: int
    latency: float = 0.0
    status: int = 0
    completion_tokens: int = 0
    hs_tokens: list[int] = field(default_factory=list)  # hidden_states_meta.tokens per choice
    hs_cached: list[int] = field(default_factory=list)  # hidden_states_meta.cached_tokens per choice
    hs_via: list[str] = field(default_factory=list)  # hidden_states_meta.via per choice: "tail" or "extraction"
    hs_dim: int = 0
    hs_rows: int = 0  # rows over the choices (hidden_states_meta.positions, or 1 per vector)
    hs_bytes: int = 0  # hidden_states_meta.bytes over the choices: the rows' payload before encoding
    body_bytes: int = 0  # the response body as received
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass
class Batch:
    results: list[Result]
    wall: float  # first send to last answer
    started: float  # time.time()

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.ok]


def _parse(r: Result, raw: bytes) -> None:
    doc = json.loads(raw)
    usage = doc.get("usage") or {}
    r.completion_tokens = int(usage.get("completion_tokens") or 0)
    for ch in doc.get("choices", ()):
        meta = ch.get("hidden_states_meta")
        if meta is not None:
            if "tokens" in meta:
                r.hs_tokens.append(int(meta["tokens"]))
                r.hs_cached.append(int(meta["cached_tokens"]))
                r.hs_via.append(str(meta.get("via")))
            hs = ch.get("hidden_states")
            r.hs_dim = len(hs) if isinstance(hs, list) else 0
            r.hs_rows += len(meta["positions"]) if "positions" in meta else 1
            r.hs_bytes += int(meta.get("bytes") or 0)


async def _run(
    url: str,
    bodies: list[tuple[Result, bytes]],
    concurrency: int,
    timeout: float,
    on_done: Callable[[Result], None] | None,
) -> Batch:
    queue: asyncio.Queue = asyncio.Queue()
    for item in bodies:
        queue.put_nowait(item)
    conn = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as session:

        async def worker():
            while True:
                try:
                    r, body = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                t0 = time.perf_counter()
                try:
                    async with session.post(url, data=body, headers=headers) as resp:
                        raw = await resp.read()
                        r.latency = time.perf_counter() - t0
                        r.status = resp.status
                    r.body_bytes = len(raw)
                    if r.status == 200:
                        _parse(r, raw)
                    else:
                        r.error = raw[:300].decode(errors="replace")
                except Exception as e:  # a failed request is counted, never dropped
                    r.latency = time.perf_counter() - t0
                    r.error = f"{type(e).__name__}: {e}"[:300]
                if on_done:
                    on_done(r)

        started = time.time()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return Batch([r for r, _ in bodies], wall, started)


def run_batch(
    url: str,
    bodies: list[tuple[Result, bytes]],
    concurrency: int,
    timeout: float = 600,
    on_done: Callable[[Result], None] | None = None,
) -> Batch:
    return asyncio.run(_run(url, bodies, concurrency, timeout, on_done))
