"""EngineReplica: one Ray Serve replica hosting one engine (hidden_states/interface.py).

It answers OpenAI requests end to end, so each choice's extraction step runs on the engine that
generated it. Requests come from the Router (`openai`, `openai_unary`), Python handles
(`complete`, `hidden_states`), or with `ingress: replica` as HTTP (deployments/http.py).
A cancelled call closes its OpenAI generator, so vLLM aborts the engine request.
`check_health` fails once the engine has died.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import Response
from ray import serve

from deployments import http, metrics, wire
from deployments.config import AppArgs
from deployments.wire import HandleCompletion, HandleError, HandleReply, Reply, ResponseHead
from hidden_states.errors import Refused
from hidden_states.interface import Engine, SamplingOptions
from hidden_states.openai_format import ROUTES, error_body
from hidden_states.params import PARSED, HiddenStatesFields

logger = logging.getLogger(__name__)

app = FastAPI(title="hidden-states-serve", description="OpenAI-compatible completions with final-token hidden states")


class EngineReplica(http.ingress_routes(app, "replica")):
    async def __init__(self, args: dict, engine_cls: type | None = None):
        """`engine_cls`: the engine implementation; vLLM's by default."""
        self.args = AppArgs.model_validate(args)
        http.api_key(self.args)  # a conflicting key fails the start, with the reason
        if engine_cls is None:
            from hidden_states.vllm.engine import HiddenStatesEngine as engine_cls
        try:
            ctx = serve.get_replica_context()
            self.replica_id = ctx.replica_id.unique_id
        except Exception:
            self.replica_id = uuid.uuid4().hex[:8]
        self.engine: Engine = await engine_cls.start(
            self.args.model,
            enable_return_hidden_states=self.args.enable_return_hidden_states,
            extraction_timeout_s=self.args.extraction_timeout_s,
            max_hidden_states_bytes=self.args.max_hidden_states_bytes,
            heads=[h.model_dump(exclude_none=True) for h in self.args.heads],
            steering_vectors=[v.model_dump(exclude_none=True) for v in self.args.steering_vectors],
            prefault_kv_cache=self.args.prefault_kv_cache,
            warm_up_s=self.args.warm_up_s,
            malloc_trim_interval_s=self.args.malloc_trim_interval_s,
            ray_metrics=self.args.engine_metrics,
            **({"capture_layers": self.args.capture_layers} if self.args.capture_layers is not None else {}),
            **self.args.engine_args(),
        )
        self.engine.observers.append(metrics.vector)
        self._sampler = asyncio.get_running_loop().create_task(self._sample_stats())
        self.requests = 0  # OpenAI requests that reached this replica
        self.in_flight = 0  # handle calls (openai, openai_unary, complete, hidden_states) still running
        self.frontend = await self.engine.openai(
            self.args.model_name, self.replica_id, [m.model_dump() for m in self.args.lora_modules]
        )
        logger.info("replica %s ready (pid %d)", self.replica_id, os.getpid())

    async def _answer(
        self, route: str, body: bytes, spec: HiddenStatesFields | None = None
    ) -> AsyncIterator[ResponseHead | bytes]:
        """A ResponseHead, then the body: one JSON document, or SSE chunks."""
        if route not in ROUTES:
            yield ResponseHead(404, "application/json", self.replica_id)
            yield error_body(f"unknown route {route!r}", 404)
            return
        self.requests += 1
        async with contextlib.aclosing(self.frontend.handle(route, body, spec)) as parts:  # closed early: aborted
            head = await anext(parts)
            media = "application/json" if head.body is not None else "text/event-stream"
            yield ResponseHead(head.status, media, self.replica_id)
            if head.body:
                yield head.body
            async for part in parts:
                yield part

    async def openai(self, route: str, body: bytes, fields: bytes = b"", routing_key: str = "") -> AsyncIterator[bytes]:
        """For a streaming handle: a ResponseHead frame, then the body's frames. `fields`: the spec's JSON
        as the Router parsed it (empty: parsed here). `routing_key`: for the Router's request router."""
        self.in_flight += 1
        answer = self._answer(route, body, HiddenStatesFields.from_json(fields) if fields else None)
        try:
            yield wire.ENCODER.encode(await anext(answer))
            async for part in answer:
                yield part
        finally:  # cancelled or closed early too: the engine request is aborted with the generator
            self.in_flight -= 1
            await answer.aclose()

    async def openai_unary(self, route: str, body: bytes, fields: bytes = b"", routing_key: str = "") -> bytes:
        """A whole answer in one `Reply` (one return value instead of a generator's frames)."""
        self.in_flight += 1
        answer = self._answer(route, body, HiddenStatesFields.from_json(fields) if fields else None)
        try:
            head = await anext(answer)
            return wire.ENCODER.encode(Reply(head, b"".join([p async for p in answer])))
        finally:
            self.in_flight -= 1
            await answer.aclose()

    # -- HTTP, when this replica is the ingress (`ingress: replica`) ----------

    async def _replica_stats(self) -> dict:
        return {"replica": json.loads(await self.stats())}

    async def _engine_card(self) -> dict:
        return {
            "max_model_len": self.engine.max_model_len,
            "heads": [h.public() for h in self.engine.heads.values()],
            "steering_vectors": [
                {"name": name, "layers": sorted(layers)} for name, layers in self.engine.steering_vectors.items()
            ],
            "capture_layers": (self.engine.layer_capture or {}).get("capture_layers"),
        }

    async def model_card(self) -> bytes:
        """What /v1/models reports of the engine, for the Router: JSON bytes."""
        return json.dumps(await self._engine_card()).encode()

    async def _serve(self, route: str, body: bytes, req: dict, spec: HiddenStatesFields) -> Response:
        self.requests += 1
        self.pending += 1
        deadline = time.monotonic() + self.args.request_timeout_s
        parts = self.frontend.handle(route, body, spec)
        headers = {"x-replica-id": self.replica_id}
        how = http.CANCELLED  # unless it gets an answer: the client went away
        try:
            async with asyncio.timeout(self.args.request_timeout_s):
                head = await anext(parts)
            if head.body is not None:
                how = http.outcome(head.status)
                return Response(head.body, status_code=head.status, media_type="application/json", headers=headers)
            how = None  # the relay counts it from here
            return http.Stream(self._relay(parts, deadline), media_type="text/event-stream", headers=headers)
        except Exception as e:
            how = http.FAILED
            response = http.failure(e)
            response.headers.update(headers)
            return response
        finally:
            if how is not None:
                try:
                    await parts.aclose()  # done, failed or cancelled: the engine request ends with it
                finally:
                    self._finish(how)

    # -- Python handles -------------------------------------------------------

    async def complete(self, request: bytes, fields: bytes = b"", routing_key: str = "") -> bytes:
        """HandleCompletionRequest bytes -> HandleReply bytes (`fields`, `routing_key`: as openai's)."""
        try:
            req = wire.REQUEST_DECODER.decode(request)
            spec = HiddenStatesFields.from_json(fields) if fields else http.handle_spec(self.args, req)
            options = SamplingOptions(
                n=req.n,
                max_tokens=req.max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                seed=req.seed,
                stop=tuple(req.stop),
            )
        except Refused as e:
            return wire.ENCODER.encode(HandleReply(error=http.handle_failure(e)))
        except Exception as e:
            return wire.ENCODER.encode(HandleReply(error=HandleError(400, f"invalid request: {e}")))
        self.in_flight += 1
        try:
            prompt = req.prompt if req.messages is None else await self.engine.chat_input(req.messages)
            c = await self.engine.complete(prompt, options, model=req.model, spec=spec)
        except Exception as e:  # the one table: a bad request 400, a vector's timeout 504, ...
            return wire.ENCODER.encode(HandleReply(error=http.handle_failure(e)))
        finally:
            self.in_flight -= 1
        return wire.ENCODER.encode(
            HandleReply(
                ok=HandleCompletion(
                    request_id=c.request_id,
                    replica=self.replica_id,
                    prompt_token_ids=list(c.prompt_token_ids),
                    choices=[wire.to_wire(ch) for ch in c.choices],
                )
            )
        )

    async def hidden_states(self, body: bytes) -> bytes:
        """The Python-handle form of POST /v1/hidden_states (`deployments.client.verify`): JSON in, a Reply out."""
        return await self.openai_unary("hidden_states", body)

    async def _sample_stats(self, every_s: float = 5.0) -> None:
        """The vector-fault gauges (deployments/metrics.py), from the engine's stats."""
        while True:
            await asyncio.sleep(every_s)
            try:
                metrics.faults(await asyncio.wait_for(self.engine.stats(fresh_workers=False), 30))
            except Exception as e:  # a dead engine is check_health's to report
                logger.debug("stats for metrics failed: %s", e)

    async def stats(self) -> bytes:
        s = await self.engine.stats()
        s["replica"] = self.replica_id
        s["requests"] = self.requests
        s["in_flight"] = self.in_flight
        s["pid"] = os.getpid()
        s["specs_parsed"] = PARSED[0]  # requests whose fields this process parsed (params.parse_fields)
        # shows whether `serve_env` reached this process (a private name: patches/ray_internals.py lists it)
        from ray.serve._private import constants

        s["serve_user_code_in_separate_thread"] = bool(constants.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD)
        return json.dumps(s).encode()

    async def check_health(self) -> None:
        if not self.engine.healthy():
            raise RuntimeError(f"replica {self.replica_id}: the vLLM engine died")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:
                pass


# Serve allows one FastAPI ingress per application, so the HTTP routes above are
# attached only in the deployment that takes HTTP; both are named EngineReplica.
_OPTIONS = dict(
    name="EngineReplica", health_check_period_s=5, health_check_timeout_s=30, graceful_shutdown_timeout_s=10
)
EngineReplicaDeployment = serve.deployment(**_OPTIONS)(EngineReplica)
IngressEngineReplicaDeployment = serve.deployment(**_OPTIONS)(serve.ingress(app)(EngineReplica))
