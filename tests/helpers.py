"""Plumbing the test tiers share (no vLLM, no Ray at import): a free port, HTTP calls to a running
app or to an app in memory, and clients that hang up. What differs between callers (timeouts, headers,
a raw body, a path) is a parameter, said at the call."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Iterable
from typing import Any

import httpx


def free_port(ports: Iterable[int] | None = None) -> int:
    """A port free on 127.0.0.1: the first of `ports` that binds, or (None) one the OS picks."""
    if ports is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    ports = list(ports)
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in {ports[0]}..{ports[-1]}" if ports else "no port to try")


def post(
    base: str,
    path: str,
    body: dict | None = None,
    *,
    timeout: float = 120,
    headers: dict | None = None,
    raw: bytes | None = None,
) -> httpx.Response:
    """POST `body` as JSON to `base + path` (or `raw`, sent as it is, said to be JSON)."""
    if raw is not None:
        return httpx.post(
            f"{base}{path}",
            content=raw,
            timeout=timeout,
            headers={"content-type": "application/json", **(headers or {})},
        )
    return httpx.post(f"{base}{path}", json=body, timeout=timeout, headers=headers)


def completion_choices(r: Any, stream: bool) -> tuple[dict[int, dict], dict[int, list[int]]]:
    """An openai client's completion (`stream`: its chunks) as (index -> the choice's extra fields, its token ids
    concatenated, its vector and meta as the last chunk carrying them gave them; index -> its prompt's ids)."""
    choices: dict[int, dict] = {}
    prompts: dict[int, list[int]] = {}
    if not stream:
        for ch in r.choices:
            choices[ch.index], prompts[ch.index] = ch.model_extra, ch.model_extra["prompt_token_ids"]
        return choices, prompts
    for chunk in r:
        for ch in chunk.choices:
            got = choices.setdefault(ch.index, {"token_ids": []})
            extra = ch.model_extra or {}
            got["token_ids"] += extra.get("token_ids") or []
            if extra.get("prompt_token_ids"):
                prompts[ch.index] = extra["prompt_token_ids"]
            for key in ("hidden_states", "hidden_states_meta"):
                if extra.get(key) is not None:
                    got[key] = extra[key]
    return choices, prompts


def worker_faults(stats: dict) -> int:
    """Requests a hook failed in the engine's workers (`engine.stats()`), on every rank: under pipeline parallelism
    an earlier stage counts its own, which the last stage reports."""
    return sum(w.get("hook_faults", 0) for w in stats["workers"])


def run(coro, timeout: float = 30):
    """`coro` to its end on a new event loop, within `timeout` s."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def asgi_request(routes_app, instance, method: str, path: str, **kw) -> httpx.Response:
    """One request to `deployments.http.asgi_app(routes_app, instance)` in memory (httpx.ASGITransport, which
    has no timeouts of its own: callers bound the call, as `run`'s wait_for does)."""
    from deployments import http

    transport = httpx.ASGITransport(app=http.asgi_app(routes_app, instance))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.request(method, path, **kw)


async def give_up(call: Awaitable[Any], after: float) -> None:
    """Runs `call` and cancels it after `after` s: a client that hangs up (Serve cancels the handler when
    the HTTP client goes away), or, for a handle call, the Router cancelling it."""
    task = asyncio.ensure_future(call)
    await asyncio.sleep(after)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def hang_up_streamed(base: str, body: dict, chunks: int, *, timeout: float, path: str = "/v1/completions") -> int:
    """Streams `body` to `base + path`, reads `chunks` SSE events, then closes the connection: the events read."""
    got = 0
    async with httpx.AsyncClient(timeout=timeout) as client:
        async with client.stream("POST", f"{base}{path}", json={**body, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                got += line.startswith("data: ")
                if got == chunks:
                    break
    return got


HUNG_UP = "hung up"


async def hang_up_plain(base: str, body: dict, after_s: float, path: str = "/v1/completions") -> str:
    """POSTs `body` and gives up after `after_s` s (the client's timeout closes its connection): HUNG_UP, or
    what answered first."""
    async with httpx.AsyncClient(timeout=after_s) as client:
        try:
            r = await client.post(f"{base}{path}", json=body)
        except httpx.TimeoutException:
            return HUNG_UP
    return f"answered {r.status_code} before the client gave up"
