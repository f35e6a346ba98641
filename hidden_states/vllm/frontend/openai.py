"""The OpenAI layer inside a replica: vLLM's own serving classes over our engine.

vLLM's `OpenAIServingCompletion`/`OpenAIServingChat` (from its `init_app_state`) parse, apply
chat templates, drive the engine and build responses. We add the hidden-states fields
(params.HiddenStatesFields) and put each choice's vector on its final choice object
(`openai_format.ChoiceVectors`), through a collector bound to the request
(`HiddenStatesEngine.collecting`, tag in `vllm_xargs`). Nothing else is asked of vLLM, so the
response is the one without hidden states plus the vector fields; a choice without its vector
fails the request (500). A request above `max_hidden_states_bytes` is a 400 even when
streaming (its first chunk is awaited before the answer starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic import ValidationError

from hidden_states import errors, proofs, steering, verify
from hidden_states.interface import (
    STREAM,
    CompletionChoice,
    Head,
    HiddenStatesCollector,
    HiddenStatesTimeout,
    HookFaultError,
    MissingHiddenStatesError,
)
from hidden_states.openai_format import (
    ChoiceVectors,
    ResponseForm,
    Route,
    choice_fields,
    error_body,
    validation_message,
)
from hidden_states.params import (
    HiddenStatesDisabledError,
    HiddenStatesFields,
    HiddenStatesRequestError,
    Span,
    UnknownModelError,
    check_proof_width,
    check_room,
    check_rows_budget,
    given_span,
    parse_fields,
    request_error,
    resolve_heads,
)
from hidden_states.protocol import RESERVED_EXTRA_ARGS_PREFIX
from hidden_states.shape import several
from hidden_states.vllm.frontend.extraction import Origin
from hidden_states.vllm.patches import install

logger = logging.getLogger(__name__)

# A claim belongs to the tokens generated, not to a text: text re-tokenizes without the end-of-turn token
# (EOS) a chat completion ends on, where its vector sits, and need not tokenize back to the same ids.
TEXT_CLAIM = (
    "`compare` needs the completion as the token ids it was generated as: send `completion` as the "
    "choice's `token_ids` (ask with `return_token_ids: true`); its text re-tokenizes without the "
    "end-of-sequence token a completion that stopped ends on, and may split into other tokens"
)


def _request_models():
    """vLLM's own request models: our fields stay in `model_extra`, read once (params.parse_fields)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest, ChatCompletionRequest


class OpenAIFrontend:
    def __init__(self, engine, state, replica_id: str):
        self.engine = engine
        self.state = state
        self.replica_id = replica_id
        self.completion_request, self.chat_request = _request_models()

    @classmethod
    async def create(
        cls, engine, served_model_name: str, replica_id: str, lora_modules: Sequence[dict] = ()
    ) -> OpenAIFrontend:
        from starlette.datastructures import State
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        model_path = engine.llm.vllm_config.model_config.model
        # usage.prompt_tokens_details.cached_tokens (OpenAI's field): the prompt tokens the prefix cache held,
        # on every completion, with hidden states or without (vLLM's server reports it only when asked)
        argv = ["--model", model_path, "--served-model-name", served_model_name, "--enable-prompt-tokens-details"]
        if lora_modules:  # vLLM's server's own flag (JSON form: any path); its serving loads them at start
            argv += [
                "--lora-modules",
                *(
                    json.dumps({"name": m["name"], "path": m["path"], "base_model_name": served_model_name})
                    for m in lora_modules
                ),
            ]
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        state = State()
        await init_app_state(engine.llm, state, args, supported_tasks=await engine.llm.get_supported_tasks())
        # A request names an adapter by `model`, as in vLLM's server: the engine resolves names in the same registry.
        engine.served_model_name, engine.adapters = served_model_name, state.openai_serving_models.lora_requests
        for serving in (state.openai_serving_completion, state.openai_serving_chat):
            if serving is not None and engine.enabled:
                _wrap_beam_search(serving, engine)
        return cls(engine, state, replica_id)

    async def handle(
        self, route: Route, body: bytes, spec: HiddenStatesFields | None = None
    ) -> AsyncIterator[Head | bytes]:
        """Yields a Head: the status and whole body, or STREAM, then SSE chunks.
        `spec`: the body's hidden-states fields as the ingress parsed them; None: parsed here."""
        if route == "hidden_states":
            yield Head(*await self._hidden_states(body))
            return
        if route in ("tokenize", "detokenize"):
            yield Head(*await self._tokenization(route, body))
            return
        serving = self.state.openai_serving_completion if route == "completions" else self.state.openai_serving_chat
        try:
            model = self.completion_request if route == "completions" else self.chat_request
            request = model.model_validate_json(body)
        except ValidationError as e:
            yield Head(400, error_body(validation_message(e), 400, "BadRequestError"))
            return
        except Exception as e:  # vLLM's own validators raise VLLMValidationError (-> 400) and kin
            err = serving.create_error_response(e)
            yield Head(err.error.code, err.model_dump_json().encode())
            return
        try:  # the ingress checked it; a handle caller's unknown model gets the same 404 naming what is served
            self.engine.lora_request(request.model)
        except UnknownModelError as e:
            yield Head(*errors.error_response(e))
            return
        if spec is None:  # this replica is the first to read the body (a direct caller)
            try:
                spec = parse_fields(request.model_extra or {}, enabled=self.engine.enabled)
            except HiddenStatesRequestError as e:
                yield Head(*errors.error_response(e))
                return
        wants = spec.wants
        # A client's request_id is replaced; a letter first, so vLLM's `{id}-{i}` per prompt is unambiguous.
        request.request_id = "hs" + uuid.uuid4().hex
        if request.vllm_xargs:  # our extra_args keys are ours alone: no forged capture, no joined collector
            request.vllm_xargs = {
                k: v for k, v in request.vllm_xargs.items() if not k.startswith(RESERVED_EXTRA_ARGS_PREFIX)
            } or None
        if not wants:
            async for part in self._serve(serving, route, request, None):
                yield part
            return
        with contextlib.ExitStack() as stack:
            try:  # the spec against the model: a 400 before any engine work
                collector = stack.enter_context(self.engine.collecting(spec))
            except HiddenStatesRequestError as e:
                yield Head(*errors.error_response(e))
                return
            # Its spec (the collector's tag) rides in vllm_xargs -> SamplingParams.extra_args of every engine
            # request vLLM makes for this request.
            request.vllm_xargs = collector.tagged(request.vllm_xargs)
            if route == "chat/completions":  # its media, rendered again if the processor cache lost them
                messages = list(request.messages)
                collector.rerender = functools.partial(self.engine.chat_input, messages)
            adapter = request.model if request.model in self.engine.adapters else None
            choices = ChoiceVectors(self.engine, collector, request, route, self.replica_id, adapter)
            async for part in self._serve(serving, route, request, collector, choices):
                yield part

    async def _serve(
        self,
        serving,
        route: Route,
        request,
        collector: HiddenStatesCollector | None,
        choices: ChoiceVectors | None = None,
    ) -> AsyncIterator[Head | bytes]:
        create = serving.create_completion if route == "completions" else serving.create_chat_completion
        try:
            if collector is None:
                result = await create(request, None)
            else:  # vLLM's beam search (wrapped in create()) reads the collector when it is called
                context = contextvars.copy_context()
                context.run(_BEAM_COLLECTOR.set, collector)
                result = await asyncio.create_task(create(request, None), context=context)
        except (HiddenStatesTimeout, MissingHiddenStatesError, HiddenStatesRequestError, HookFaultError) as e:
            yield Head(*errors.error_response(e))
            return
        except Exception as e:  # vLLM maps its own errors (validation -> 400 ...)
            err = serving.create_error_response(e)
            yield Head(err.error.code, err.model_dump_json().encode())
            return
        if collector is not None and collector.refusal is not None:  # the memory bound (extraction._flag_rows)
            yield Head(*errors.error_response(collector.refusal))
            return
        if hasattr(result, "error"):
            yield Head(result.error.code, result.model_dump_json().encode())
            return
        if not hasattr(result, "__aiter__"):
            if choices is None:
                yield Head(200, result.model_dump_json().encode())
                return
            try:
                choices.fill_response(result)
            except MissingHiddenStatesError as e:
                yield Head(*errors.error_response(e))
                return
            yield Head(200, result.model_dump_json().encode())
            return
        first = None
        if collector is not None:
            # The memory bound is checked as the engine requests start, inside vLLM's stream: its
            # first chunk tells whether they did, so a refusal is a 400, not an error event.
            try:
                first = await anext(result)
            except StopAsyncIteration:
                pass
            except Exception as e:  # noqa: BLE001 - answered through the one table, as a whole answer
                yield Head(*errors.error_response(e))
                return
            if collector.refusal is not None:
                await result.aclose()
                yield Head(*errors.error_response(collector.refusal))
                return
        yield STREAM
        async for chunk in _prepend(first, result):
            if choices is not None and chunk.startswith("data: {"):
                try:
                    chunk = choices.fill_chunk(chunk)
                except MissingHiddenStatesError as e:
                    yield errors.sse_error(e)
                    return
            yield chunk.encode()

    async def _tokenization(self, route: Route, body: bytes) -> tuple[int, bytes]:
        """POST /tokenize and /detokenize: vLLM's own (prompt or messages -> ids, with `count` and
        `max_model_len`; ids -> text)."""
        from pydantic import TypeAdapter
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest

        serving = self.state.serving_tokenization
        try:
            request = TypeAdapter(TokenizeRequest if route == "tokenize" else DetokenizeRequest).validate_json(body)
            create = serving.create_tokenize if route == "tokenize" else serving.create_detokenize
            result = await create(request, None)
        except ValidationError as e:
            return 400, error_body(validation_message(e), 400, "BadRequestError")
        except Exception as e:  # vLLM maps its own errors (an unknown model, a template that fails ...)
            err = serving.create_error_response(e)
            return err.error.code, err.model_dump_json().encode()
        if hasattr(result, "error"):
            return result.error.code, result.model_dump_json().encode()
        return 200, result.model_dump_json().encode()

    async def _hidden_states(self, body: bytes) -> tuple[int, bytes]:
        """POST /v1/hidden_states (hidden_states/verify.py): tokenize, one extraction, compare."""
        try:
            req = verify.VerifyRequest.model_validate_json(body)
        except ValidationError as e:
            if (ours := request_error(e)) is not None:
                return errors.error_response(ours)
            return 400, error_body(validation_message(e), 400, "BadRequestError")
        eng, by_layer, encoding = self.engine, req.hidden_states_layers is not None, req.hidden_states_encoding
        dtype, topk, position = req.hidden_states_dtype, req.hidden_states_topk, req.position
        try:
            if not eng.enabled:
                raise HiddenStatesDisabledError()
            layers = eng.check_spec(req)
            lora = eng.lora_request(req.model)
            if req.compare is not None and isinstance(req.completion, str):
                raise HiddenStatesRequestError(TEXT_CLAIM, "completion")
            ids, completion_start, mm = await self._token_ids(req)
            check_room(
                len(ids),
                eng.llm.model_config.max_model_len,
                "prompt" if req.prompt is not None else "messages",
                completing=False,
            )
            if req.compare is not None and req.compare.toploc is not None:
                return await self._check_proofs(req, ids, completion_start, lora, mm)
            span = given_span(position, len(ids), completion_start)
            positions, multi = list(span.positions(len(ids))), several(position)
            check_rows_budget(
                span, len(ids), None, 1, len(layers), eng.hidden_size, dtype, topk, eng.max_hidden_states_bytes
            )
            # A malformed claim is a 400 before any engine work.
            claim = None if req.compare is None else verify.claims(req.compare, len(positions), eng.hidden_size)
            # Only the tokens up to the last position asked for: the rows before it are the same.
            seq, origin = ids[: positions[-1] + 1], Origin(lora_request=lora, mm=mm)
            entries, echo = eng.steering_of(req)
            if entries:  # recomputed under the choice's steering (its prompt: up to `completion`), salted alike
                entries, digest = steering.anchor(entries, len(ids) if completion_start is None else completion_start)
                origin = dataclasses.replace(origin, cache_salt=f"|steer-{digest}", steering=tuple(entries))
            heads = resolve_heads(req, eng.heads) if req.heads else ()
            batch, stats = await eng.extraction.extract_rows(seq, positions, layers, dtype, topk, origin, heads)
            col = HiddenStatesCollector(
                "verify", tuple(layers), position, dtype=dtype, topk=topk, heads=heads, steering_echo=list(echo or ())
            )
            if mm is not None:
                col.modalities[0] = origin.modalities()
            col.add_rows((0, 0), batch)
            col.close_choice((0, 0), positions, stats)
            choice = col.choice((0, 0), eng, True)
            true = choice.rows.floats(-1) if claim is not None else None
        except (HiddenStatesRequestError, HiddenStatesTimeout, MissingHiddenStatesError, UnknownModelError) as e:
            return errors.error_response(e)
        adapter = lora.lora_name if lora is not None else None
        out = choice_fields(choice, ResponseForm(encoding, by_layer, adapter, self.replica_id), verify=True)
        model = lora.lora_name if lora is not None else self.state.openai_serving_models.base_model_paths[0].name
        comparison = None if claim is None else verify.compared(claim, true, positions, req.compare.tolerance, multi)
        return 200, verify.response(model, ids, out, comparison)

    async def _check_proofs(
        self, req: verify.VerifyRequest, ids: list[int], prompt_len: int, lora: Any, mm: Any = None
    ) -> tuple[int, bytes]:
        """compare.toploc: one bfloat16 prefill of every fed position, each proof against its chunk's rows;
        a 400 for proofs that do not fit the tokens."""
        eng, claim = self.engine, req.compare.toploc
        if len(ids) - prompt_len < 1:
            raise HiddenStatesRequestError(
                "`completion` is empty: a proof covers a prompt and its completion", "completion"
            )
        check_proof_width(claim, eng.hidden_size)
        bounds = proofs.SCHEMES[claim.scheme].chunk_bounds(prompt_len, len(ids), claim.decode_batching_size)
        if len(claim.proofs) != len(bounds):
            raise HiddenStatesRequestError(
                f"compare.toploc.proofs has {len(claim.proofs)} proofs; a prompt of {prompt_len} tokens and a "
                f"completion of {len(ids) - prompt_len} have {len(bounds)} (the prefill's, then one per "
                f"{claim.decode_batching_size} fed decode positions)",
                "compare.toploc.proofs",
            )
        fed = list(range(len(ids) - 1))  # the final token is never fed
        check_rows_budget(
            Span(0, len(ids) - 1), len(ids), None, 1, 1, eng.hidden_size, "bfloat16", None, eng.max_hidden_states_bytes
        )
        batch, stats = await eng.extraction.extract_rows(
            ids[:-1], fed, (-1,), "bfloat16", None, Origin(lora_request=lora, mm=mm)
        )
        bits = batch.values[-1]
        try:
            comparison = proofs.check_claim(claim, [bits[lo:hi] for lo, hi in bounds])
        except proofs.ProofError as e:
            raise HiddenStatesRequestError(str(e), "compare.toploc.proofs") from None
        eng.vector_sent("proof", stats, 0)
        answer = CompletionChoice(0, "", (), None, extraction=stats, proofs=(), prompt_tokens=prompt_len)
        adapter = lora.lora_name if lora is not None else None
        fields = choice_fields(answer, ResponseForm(adapter=adapter, replica=self.replica_id), verify=True)
        model = lora.lora_name if lora is not None else self.state.openai_serving_models.base_model_paths[0].name
        return 200, verify.response(model, ids, fields, comparison)

    async def _token_ids(self, req: verify.VerifyRequest) -> tuple[list[int], int | None, Any]:
        """The given tokens, where the `completion` starts in them (None: no completion), and the
        messages' processed multimodal inputs (Origin.mm; None for text)."""
        tok = self.engine.llm.tokenizer
        vocab = self.engine.llm.model_config.get_vocab_size()

        def checked(ids: list[int], field: str) -> list[int]:
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise HiddenStatesRequestError(
                    f"{field} holds token ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}", field
                )
            return ids

        if req.prompt is not None:
            if isinstance(req.prompt, str):
                ids = list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
            else:
                ids = checked(list(req.prompt), "prompt")
            mm = None
        else:
            prompt = await self.engine.chat_input(req.messages)
            ids, mm = list(prompt["prompt_token_ids"]), Origin.of(prompt, {}).mm
        if req.completion is None:
            return ids, None, mm
        if isinstance(req.completion, str):
            return ids + list(tok.encode(req.completion, add_special_tokens=False)), len(ids), mm
        return ids + checked(list(req.completion), "completion"), len(ids), mm


async def _prepend(first: str | None, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    if first is not None:
        yield first
    async for chunk in rest:
        yield chunk


_BEAM_COLLECTOR: contextvars.ContextVar[HiddenStatesCollector | None] = contextvars.ContextVar(
    "hidden_states_beam_collector", default=None
)


def _wrap_beam_search(serving, engine) -> None:
    """Beam search's per-step engine requests carry no tag: its final beams are extracted instead, one
    vector per returned beam, with room left for it."""
    import msgspec

    original = serving.beam_search

    def beam_search(prompt, request_id, params, *args, **kwargs):
        collector = _BEAM_COLLECTOR.get()  # read now: the generator runs in another task
        if collector is None:
            return original(prompt, request_id, params, *args, **kwargs)
        if collector.steering:  # its per-step engine requests carry no tag: they could not be steered
            collector.refusal = HiddenStatesRequestError(
                "hidden_states_steering does not apply to beam search: send the request without use_beam_search",
                "hidden_states_steering",
            )
            raise collector.refusal
        if collector.monitors:  # nor judged: a beam's tokens are chosen across beams, outside the engine core
            collector.refusal = HiddenStatesRequestError(
                "hidden_states_stop does not apply to beam search: send the request without use_beam_search",
                "hidden_states_stop",
            )
            raise collector.refusal
        prompt_len = len(prompt.get("prompt_token_ids") or ())
        extraction = engine.extraction
        params = msgspec.structs.replace(params, max_tokens=extraction.beam_search_room(prompt_len, params.max_tokens))
        extraction.check_beam_rows(collector, prompt_len, params.max_tokens, params.beam_width)
        origin = Origin.of(prompt, {"lora_request": kwargs.get("lora_request", args[0] if args else None)})
        # vLLM's completions serving passes beam search the request's id without its per-prompt
        # `-{i}`, calling it for prompt 0, 1, ... in order: the calls are counted instead.
        ordinal, collector.beam_calls = collector.beam_calls, collector.beam_calls + 1
        if origin.mm is not None:  # hidden_states_meta.modalities, as a generating request's
            collector.modalities[ordinal] = origin.modalities()
        beams = original(prompt, request_id, params, *args, **kwargs)
        return extraction.extract_beams(beams, collector, ordinal, origin)

    install("frontend", "serving", serving=serving, beam_search=beam_search)  # ledger point 21 (patches/)
