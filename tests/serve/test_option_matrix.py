"""Every request option vLLM accepts: the right vector for every choice, or a clear 400.

Each case goes through the real HTTP API with the real openai client (options
the client knows as arguments, the rest in `extra_body`), streamed and not
where both exist, and checks every returned choice's vector against
transformers on that choice's own `prompt_token_ids + token_ids`.

`test_every_vllm_request_field_is_classified` enumerates the fields of vLLM's
`CompletionRequest` and `ChatCompletionRequest` and fails on any field that is
neither exercised by a case here nor listed in IRRELEVANT with the reason it
cannot change the tokens or the number of choices: a new vLLM option cannot
slip past.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import openai
import pytest

from tests.serve.conftest import decode_vector, replica_stats

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Tell me about the cache."}]
PROMPT = "The replica computes the hidden state"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    route: str  # "completions" | "chat"
    options: dict[str, Any]
    streams: tuple[bool, ...] = (False, True)
    refused: str | None = None  # a 400 whose message contains this, instead of vectors
    refused_streaming: str | None = None  # a 400 for the streamed form only

    def id(self, stream: bool) -> str:
        return f"{self.route}-{self.name}-{'stream' if stream else 'whole'}"


C, H = "completions", "chat"
TOOL = {"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                         "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                                                        "required": ["word"]}}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}

CASES = [
    # sampling: what changes the tokens
    Case("greedy", C, {"temperature": 0}),
    Case("sampled-seed", C, {"temperature": 1.0, "seed": 7, "top_p": 0.9, "top_k": 20, "min_p": 0.05}),
    Case("penalties", C, {"temperature": 0.8, "seed": 3, "frequency_penalty": 0.5, "presence_penalty": 0.5,
                          "repetition_penalty": 1.3}),
    Case("logit-bias-allowed-bad", C, {"temperature": 1.0, "seed": 5, "logit_bias": {"100": 5, "200": -100},
                                       "allowed_token_ids": list(range(50, 400)), "bad_words": ["the"]}),
    Case("stop-strings", C, {"temperature": 1.0, "seed": 11, "stop": ["e", "a"], "include_stop_str_in_output": True}),
    Case("stop-token-ids-min-tokens", C, {"temperature": 1.0, "seed": 2, "stop_token_ids": [262, 300, 400],
                                          "min_tokens": 3}),
    Case("ignore-eos", C, {"temperature": 1.0, "seed": 4, "ignore_eos": True, "max_tokens": 20}),
    Case("watermarking", C, {"temperature": 1.0, "seed": 9, "watermarking": True}),
    Case("repetition-detection", C, {"temperature": 0, "max_tokens": 24,
                                     "repetition_detection": {"max_pattern_size": 2, "min_count": 2}}),
    # the number of choices
    Case("n3", C, {"temperature": 1.0, "seed": 1, "n": 3}),
    Case("n2-identical", C, {"temperature": 1.0, "top_k": 1, "n": 2}),  # vLLM refuses n > 1 at temperature 0
    Case("prompt-list-n2", C, {"prompt": ["A user reads", "The cache holds", "Tokens"], "temperature": 1.0, "seed": 8,
                               "n": 2}),
    Case("token-id-prompts", C, {"prompt": [[0, 693, 262, 261], [0, 300, 301]], "temperature": 1.0, "seed": 8}),
    Case("beam-search", C, {"use_beam_search": True, "n": 2, "length_penalty": 0.8}, refused_streaming="beam search"),
    # the prompt's tokens
    Case("no-special-tokens", C, {"add_special_tokens": False}),
    Case("truncate-left", C, {"truncate_prompt_tokens": 3}),
    Case("truncate-right", C, {"truncate_prompt_tokens": 3, "truncation_side": "right"}),
    Case("suffix", C, {"suffix": "end"}, refused="suffix"),
    Case("prompt-embeds", C, {"prompt_embeds": "AAAA"}, refused="prompt_embeds"),
    Case("cache-salt", C, {"cache_salt": "tenant-a"}),
    # output options (must not lose a vector)
    Case("echo-logprobs", C, {"echo": True, "logprobs": 2, "return_tokens_as_token_ids": True}),
    Case("prompt-logprobs", C, {"prompt_logprobs": 1}, refused_streaming="prompt_logprobs"),
    Case("max-tokens-1", C, {"max_tokens": 1}),
    Case("stream-options", C, {"stream_options": {"include_usage": True, "continuous_usage_stats": True},
                               "stream_interval": 3}, streams=(True,)),
    Case("response-format", C, {"response_format": {"type": "json_schema",
                                                    "json_schema": {"name": "a", "schema": SCHEMA}}, "max_tokens": 12}),
    Case("structured-outputs", C, {"structured_outputs": {"choice": ["yes", "no"]}}),
    Case("hidden-token-ids", C, {"return_token_ids": False}),
    Case("forged-xargs", C, {"vllm_xargs": {"hidden_states_collector": "forged", "hidden_states_capture": "x",
                                            "mine": 1}}),
    # chat: the template's input and the rest of the surface
    Case("greedy", H, {"temperature": 0, "max_completion_tokens": 8}),
    Case("n3-sampled", H, {"temperature": 1.0, "seed": 6, "n": 3, "logprobs": True, "top_logprobs": 2}),
    Case("beam-search", H, {"use_beam_search": True, "n": 2}),
    Case("continue-final-message", H, {"messages": [*MESSAGES, {"role": "assistant", "content": "The cache"}],
                                       "continue_final_message": True, "add_generation_prompt": False}),
    Case("template-kwargs", H, {"chat_template_kwargs": {"enable_thinking": False}, "documents": [{"text": "doc"}],
                                "reasoning_effort": "low", "include_reasoning": True}),
    Case("custom-template", H, {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"},
         refused="trust-request-chat-template"),
    Case("tools-none", H, {"tools": [TOOL], "tool_choice": "none", "parallel_tool_calls": False}),
    Case("tools-required", H, {"tools": [TOOL], "tool_choice": "required"}, refused="tool-call-parser"),
    Case("thinking-budget", H, {"thinking_token_budget": 4}, refused="thinking_token_budget"),
    Case("response-format-json", H, {"response_format": {"type": "json_object"}, "max_tokens": 12}),
    Case("image-part", H, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, refused="image_url"),
    Case("stop-skip-special", H, {"temperature": 1.0, "seed": 12, "stop": ["e"], "skip_special_tokens": False,
                                  "spaces_between_special_tokens": False, "ignore_eos": True}),
]

# Fields that cannot change the tokens or the number of choices, each with why.
IRRELEVANT = {
    "model": "checked by the ingress (404 on another name)",
    "request_id": "replaced by the server",
    "user": "a client label",
    "priority": "scheduling order only",
    "session_id": "a routing hint",
    "stream": "every case runs streamed and not",
    "logprob_token_ids": "which logprobs are reported, not which tokens are sampled",
    "return_token_offsets": "output only",
    "return_prompt_text": "output only",
    "routed_experts_prompt_start": "mixture-of-experts routing output only",
    "mm_payload": "what a render response carries for multimodal items: output only",
    "return_mm_kwargs": "deprecated alias of mm_payload",
    "media_io_kwargs": "how media are loaded; media parts are refused with hidden states (image-part case)",
    "mm_processor_kwargs": "multimodal processor options; media parts are refused with hidden states",
    "kv_transfer_params": "disaggregated prefill; this server configures no KV connector",
    "ec_transfer_params": "encoder-cache transfer; this server configures no connector",
    "messages": "every chat case sends messages",
    "prompt": "every completions case sends a prompt",
    "max_tokens": "every case sets it",
    "return_token_ids": "every case asks for it (hidden-token-ids turns it off)",
}
OURS = {"return_hidden_states", "hidden_states_encoding", "hidden_states_layers", "hidden_states_position"}

_SDK_ARGS = {
    C: set(inspect.signature(openai.resources.Completions.create).parameters),
    H: set(inspect.signature(openai.resources.chat.Completions.create).parameters),
}


def _call(client: openai.OpenAI, case: Case, stream: bool):
    body: dict[str, Any] = {"max_tokens": 8, "return_token_ids": True, **case.options, "return_hidden_states": True}
    body.setdefault("prompt" if case.route == C else "messages", PROMPT if case.route == C else MESSAGES)
    sdk = {k: v for k, v in body.items() if k in _SDK_ARGS[case.route] and k not in ("extra_body",)}
    extra = {k: v for k, v in body.items() if k not in sdk}
    create = client.completions.create if case.route == C else client.chat.completions.create
    return create(model=MODEL, stream=stream, extra_body=extra, **sdk), body


def _choices_whole(r, route: str) -> list[tuple[int, list[int], list[int], Any, dict]]:
    top_prompt = (r.model_extra or {}).get("prompt_token_ids")
    out = []
    for ch in r.choices:
        extra = ch.model_extra or {}
        prompt = extra.get("prompt_token_ids") if route == C else top_prompt
        out.append((ch.index, prompt, extra.get("token_ids"), extra.get("hidden_states"), extra))
    return out


def _choices_streamed(stream, route: str) -> list[tuple[int, list[int], list[int], Any, dict]]:
    prompts: dict[int, list[int]] = {}
    tokens: dict[int, list[int]] = {}
    finals: dict[int, dict] = {}
    for chunk in stream:
        top = (chunk.model_extra or {}).get("prompt_token_ids")
        if top is not None:
            prompts[-1] = top
        for ch in chunk.choices:
            extra = ch.model_extra or {}
            if extra.get("prompt_token_ids") is not None:
                prompts[ch.index] = extra["prompt_token_ids"]
            tokens.setdefault(ch.index, []).extend(extra.get("token_ids") or [])
            if ch.finish_reason is not None:
                assert ch.index not in finals, f"choice {ch.index} finished twice"
                finals[ch.index] = extra
            else:
                assert "hidden_states" not in extra, "a vector before the choice finished"
    return [(i, prompts.get(i, prompts.get(-1)), tokens.get(i, []), finals[i].get("hidden_states"), finals[i])
            for i in sorted(finals)]


def _expected_choices(case: Case) -> int:
    prompts = case.options.get("prompt")
    n_prompts = len(prompts) if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int) else 1
    return n_prompts * case.options.get("n", 1)


@pytest.mark.parametrize("case,stream", [(c, s) for c in CASES for s in c.streams],
                         ids=[c.id(s) for c in CASES for s in c.streams])
def test_option(client, reference, case: Case, stream: bool):
    refused = case.refused or (case.refused_streaming if stream else None)
    if refused is not None:
        # A 400; or, where vLLM has already started the stream, an error event (the SDK raises APIError).
        with pytest.raises(openai.APIError) as e:
            r, _ = _call(client, case, stream)
            if stream:
                list(r)
        if isinstance(e.value, openai.APIStatusError):
            assert e.value.status_code == 400, e.value
        assert refused in str(e.value), str(e.value)
        return
    r, body = _call(client, case, stream)
    choices = _choices_streamed(r, case.route) if stream else _choices_whole(r, case.route)
    assert len(choices) == _expected_choices(case), [c[0] for c in choices]
    for index, prompt_ids, token_ids, vector, extra in choices:
        assert vector is not None, f"choice {index} has no vector"
        assert extra["hidden_states_meta"]["position"] == "completion_end"
        if body["return_token_ids"] is False:  # hidden, as the client asked; check by the vector's token count
            assert prompt_ids is None and not token_ids and "token_ids" not in {k for k, v in extra.items() if v}
            continue
        assert prompt_ids, f"choice {index}: no prompt_token_ids"
        reference.assert_matches(prompt_ids + token_ids, decode_vector(vector))
        if "tokens" in extra["hidden_states_meta"]:
            assert extra["hidden_states_meta"]["tokens"] == len(prompt_ids) + len(token_ids)


def test_beam_search_vectors_are_the_final_beams(client, reference):
    """Each returned beam's vector is its own: distinct beams carry distinct vectors."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, n=3,
                                  extra_body={"use_beam_search": True, "return_hidden_states": True,
                                              "return_token_ids": True})
    assert len(r.choices) == 3
    seen = []
    for ch in r.choices:
        extra = ch.model_extra
        ids = extra["prompt_token_ids"] + extra["token_ids"]
        assert extra["hidden_states_meta"]["tokens"] == len(ids)
        reference.assert_matches(ids, decode_vector(extra["hidden_states"]))
        seen.append(tuple(extra["token_ids"]))
    assert len(set(seen)) == 3, "beam search returned identical beams"


def test_no_vector_went_missing(serve_app, client):
    client.completions.create(model=MODEL, prompt="flush", max_tokens=2)
    stats = replica_stats(serve_app)["replica"]
    assert stats["missing_vectors"] == 0 and stats["unclaimed_results"] == 0, stats


def test_every_vllm_request_field_is_classified():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    covered = {k for c in CASES for k in c.options}
    for route, model in ((C, CompletionRequest), (H, ChatCompletionRequest)):
        fields = set(model.model_fields)
        unclassified = fields - covered - set(IRRELEVANT) - OURS
        assert not unclassified, (
            f"vLLM's {model.__name__} has fields no case covers and IRRELEVANT does not list: {sorted(unclassified)}; "
            "add a case (right vector or a clear 400) or say why it cannot change tokens or choices")
    stale = set(IRRELEVANT) - set(CompletionRequest.model_fields) - set(ChatCompletionRequest.model_fields)
    assert not stale, f"IRRELEVANT lists fields vLLM no longer has: {sorted(stale)}"
