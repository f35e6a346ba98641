"""The OpenAI layer inside a replica: vLLM's own serving classes over our engine.

vLLM's `OpenAIServingCompletion`/`OpenAIServingChat` (built by vLLM's own
`init_app_state`, as Ray Serve LLM does) parse requests, apply chat templates,
drive the engine and build responses, streaming or not. We add three request
fields and put each choice's vector into its final choice object:

- `return_hidden_states: bool` -> `choices[i].hidden_states`
- `hidden_states_encoding: "float" | "base64"` (base64 of little-endian float32)
- (vLLM's own) `return_token_ids: bool` -> `prompt_token_ids`, `choices[i].token_ids`

The vectors come from the engine's extraction step through a collector bound
to this request (hidden_states.engine.collect_hidden_states), so the step runs
on this replica's engine, right after the choice finished: its prefix cache.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Literal

import numpy as np
from pydantic import ValidationError

from hidden_states.engine import HiddenStatesCollector, HiddenStatesEngine, HiddenStatesRequestError
from hidden_states.side_channel import HiddenStatesTimeout

logger = logging.getLogger(__name__)

Route = Literal["completions", "chat"]


def encode_vector(vec: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(vec, dtype=np.float32).tolist()


def error_body(message: str, status: int, err_type: str | None = None, param: str | None = None) -> bytes:
    err_type = err_type or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return json.dumps({"error": {"message": message, "type": err_type, "param": param, "code": status}}).encode()


def _request_models():
    from pydantic import BaseModel, Field
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    class HiddenStatesFields(BaseModel):
        return_hidden_states: bool = Field(False, description="attach each choice's final-token hidden state")
        hidden_states_encoding: Literal["float", "base64"] = "float"
        hidden_states_layers: list[int] | None = Field(None, description="transformers numbering; -1 = last")
        hidden_states_position: Literal["completion_end", "prompt_end"] = "completion_end"

    class HiddenStatesCompletionRequest(CompletionRequest, HiddenStatesFields):
        pass

    class HiddenStatesChatCompletionRequest(ChatCompletionRequest, HiddenStatesFields):
        pass

    return HiddenStatesCompletionRequest, HiddenStatesChatCompletionRequest


class OpenAIFrontend:
    def __init__(self, engine: HiddenStatesEngine, state, replica_id: str):
        self.engine = engine
        self.state = state
        self.replica_id = replica_id
        self.completion_request, self.chat_request = _request_models()

    @classmethod
    async def create(cls, engine: HiddenStatesEngine, served_model_name: str, replica_id: str) -> "OpenAIFrontend":
        from starlette.datastructures import State
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        model_path = engine.llm.vllm_config.model_config.model
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(
            ["--model", model_path, "--served-model-name", served_model_name]
        )
        state = State()
        await init_app_state(engine.llm, state, args, supported_tasks=await engine.llm.get_supported_tasks())
        return cls(engine, state, replica_id)

    async def handle(self, route: Route, body: bytes) -> AsyncIterator[tuple[int, bytes] | bytes]:
        """Yields (status, first body bytes) for a whole response, or (200, b"") then SSE chunks."""
        serving = self.state.openai_serving_completion if route == "completions" else self.state.openai_serving_chat
        try:
            model = self.completion_request if route == "completions" else self.chat_request
            request = model.model_validate_json(body)
        except ValidationError as e:
            yield HTTPStatus.BAD_REQUEST, error_body(_validation_message(e), 400, "BadRequestError")
            return
        except Exception as e:  # vLLM's own validators raise VLLMValidationError (-> 400) and kin
            err = serving.create_error_response(e)
            yield err.error.code, err.model_dump_json().encode()
            return
        if request.return_hidden_states and not self.engine.enabled:
            yield 400, error_body("hidden states are disabled on this server", 400, "BadRequestError", "return_hidden_states")
            return
        # Our base id in every engine request id this request makes: the
        # engine files their vectors under it (a client's request_id is replaced).
        base = uuid.uuid4().hex
        request.request_id = base
        n = getattr(request, "n", 1) or 1

        def inject(choice: dict) -> None:
            key = _collector_key(route, collector, choice["index"], n)
            if key is None:
                return
            vecs, enc = collector.vectors[key], request.hidden_states_encoding
            if request.hidden_states_layers is None:
                choice["hidden_states"] = encode_vector(vecs[-1], enc)
            else:
                choice["hidden_states_by_layer"] = {str(layer): encode_vector(v, enc) for layer, v in vecs.items()}
            meta = {"position": collector.position, "replica": self.replica_id}
            if (st := collector.stats.get(key)) is not None:
                meta.update(tokens=st.tokens, cached_tokens=st.cached_tokens, extraction_seconds=round(st.seconds, 6))
            choice["hidden_states_meta"] = meta

        try:
            collecting = self.engine.collecting(
                base, request.hidden_states_layers or (-1,), request.hidden_states_position,
            ) if request.return_hidden_states else contextlib.nullcontext()
            collector = collecting.__enter__()
        except HiddenStatesRequestError as e:
            param = "hidden_states_position" if "position" in str(e) else "hidden_states_layers"
            yield 400, error_body(str(e), 400, "BadRequestError", param)
            return
        try:
            try:
                result = await serving.create_completion(request, None) if route == "completions" \
                    else await serving.create_chat_completion(request, None)
            except HiddenStatesTimeout as e:
                yield 504, error_body(str(e), 504, "TimeoutError")
                return
            except Exception as e:  # vLLM maps its own errors (validation -> 400 ...)
                err = serving.create_error_response(e)
                yield err.error.code, err.model_dump_json().encode()
                return
            if hasattr(result, "error"):
                yield result.error.code, result.model_dump_json().encode()
                return
            if not hasattr(result, "__aiter__"):
                if collector is None:
                    yield 200, result.model_dump_json().encode()
                    return
                payload = result.model_dump()
                for choice in payload["choices"]:
                    inject(choice)
                yield 200, json.dumps(payload, separators=(",", ":")).encode()
                return
            yield 200, b""
            async for chunk in result:
                if collector is not None and '"finish_reason":"' in chunk and chunk.startswith("data: {"):
                    data = json.loads(chunk[6:])
                    for choice in data.get("choices", ()):
                        if choice.get("finish_reason") is not None:
                            inject(choice)
                    chunk = "data: " + json.dumps(data, separators=(",", ":")) + "\n\n"
                yield chunk.encode()

        finally:
            collecting.__exit__(None, None, None)

def _collector_key(route: Route, collector: HiddenStatesCollector, choice_index: int, n: int):
    """Which (engine request id, output index) a response choice came from.

    vLLM's completion serving submits prompt i as request `{id}-{i}` and numbers
    its choices `i * n + output.index`; chat submits one request, choice = index.
    """
    for rid, idx in collector.vectors:
        if route == "chat":
            if idx == choice_index:
                return rid, idx
        elif int(rid.rsplit("-", 1)[1]) * n + idx == choice_index:
            return rid, idx
    return None


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)

