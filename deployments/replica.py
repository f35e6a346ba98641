"""EngineReplica: one Ray Serve replica hosting one HiddenStatesEngine.

It answers OpenAI requests end to end (vLLM's serving code, plus the vectors),
so the extraction step of every choice runs on the engine that generated it:
locality by construction, with no second hop through the router. Serve's
health check calls `check_health`, which fails once the engine has died, so
Serve replaces the replica.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import AsyncIterator

import numpy as np
from ray import serve

from deployments import wire
from deployments.config import AppArgs
from deployments.openai_serving import OpenAIFrontend, error_body
from deployments.wire import HandleChoice, HandleCompletion, HandleError, HandleReply, ResponseHead
from hidden_states.engine import HiddenStatesEngine

logger = logging.getLogger(__name__)


@serve.deployment(health_check_period_s=5, health_check_timeout_s=30, graceful_shutdown_timeout_s=10)
class EngineReplica:
    async def __init__(self, args: dict):
        self.args = AppArgs.model_validate(args)
        try:
            ctx = serve.get_replica_context()
            self.replica_id = ctx.replica_id.unique_id
        except Exception:
            self.replica_id = uuid.uuid4().hex[:8]
        self.engine = await HiddenStatesEngine.start(
            self.args.model,
            enable_return_hidden_states=self.args.enable_return_hidden_states,
            extraction_timeout_s=self.args.extraction_timeout_s,
            **self.args.engine_args(),
        )
        self.requests = 0  # OpenAI requests that reached this replica
        self.frontend = await OpenAIFrontend.create(self.engine, self.args.model_name, self.replica_id)
        logger.info("replica %s ready (pid %d)", self.replica_id, os.getpid())

    async def openai(self, route: str, body: bytes) -> AsyncIterator[bytes]:
        """A ResponseHead frame, then the body: one JSON document, or SSE chunks."""
        if route not in ("completions", "chat"):
            yield wire.ENCODER.encode(ResponseHead(404, "application/json", self.replica_id))
            yield error_body(f"unknown route {route!r}", 404)
            return
        self.requests += 1
        first = True
        async for part in self.frontend.handle(route, body):
            if first:
                status, payload = part
                media = "text/event-stream" if status == 200 and not payload else "application/json"
                yield wire.ENCODER.encode(ResponseHead(int(status), media, self.replica_id))
                if payload:
                    yield payload
                first = False
            else:
                yield part

    async def complete(self, request: bytes) -> bytes:
        """The Python-handle route: HandleCompletionRequest bytes -> HandleReply bytes."""
        from vllm import SamplingParams

        try:
            req = wire.REQUEST_DECODER.decode(request)
            params = SamplingParams(
                n=req.n, max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                seed=req.seed, stop=req.stop or None,
            )
        except Exception as e:
            return wire.ENCODER.encode(HandleReply(error=HandleError(400, f"invalid request: {e}")))
        try:
            c = await self.engine.complete(req.prompt, params, return_hidden_states=req.return_hidden_states,
                                           layers=req.hidden_states_layers, position=req.hidden_states_position)
        except ValueError as e:  # HiddenStatesRequestError, vLLM's validation errors
            return wire.ENCODER.encode(HandleReply(error=HandleError(400, str(e))))
        except Exception as e:
            return wire.ENCODER.encode(HandleReply(error=HandleError(500, f"{type(e).__name__}: {e}")))
        return wire.ENCODER.encode(HandleReply(ok=HandleCompletion(
            request_id=c.request_id,
            replica=self.replica_id,
            prompt_token_ids=list(c.prompt_token_ids),
            choices=[
                HandleChoice(
                    ch.index, ch.text, list(ch.token_ids), ch.finish_reason,
                    None if ch.hidden_states is None else np.asarray(ch.hidden_states, "<f4").tobytes(),
                    ch.extraction.cached_tokens if ch.extraction else 0,
                    {layer: np.asarray(v, "<f4").tobytes() for layer, v in (ch.hidden_states_by_layer or {}).items()},
                )
                for ch in c.choices
            ],
        )))

    async def stats(self) -> bytes:
        s = await self.engine.stats()
        s["replica"] = self.replica_id
        s["requests"] = self.requests
        s["pid"] = os.getpid()
        return json.dumps(s).encode()

    async def check_health(self) -> None:
        if self.engine.llm.errored:
            raise RuntimeError(f"replica {self.replica_id}: the vLLM engine died")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:
                pass
