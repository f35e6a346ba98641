"""Every request option vLLM accepts: the right vector for every choice, or a clear 400.

Each case goes through the real HTTP API with the real openai client (options
the client knows as arguments, the rest in `extra_body`), streamed and not
where both exist, and checks every returned choice's vector against
transformers on that choice's own `prompt_token_ids + token_ids`.

`test_parity` sends each case's body over raw HTTP with and without `return_hidden_states`
(same seed, same app) and requires the JSON to be the same but for the vectors, per-request ids and
the differences PARITY_DIFFERENCES names (streams: STREAM_NOT_COMPARED says what vLLM itself
varies between identical requests). Refused cases have nothing to compare.

`test_every_vllm_request_field_is_classified` enumerates the fields of vLLM's
`CompletionRequest` and `ChatCompletionRequest` and fails on any field that is
neither exercised by a case here nor listed in IRRELEVANT with the reason it
cannot change the tokens or the number of choices: a new vLLM option cannot
slip past.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import re
import uuid
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import TEST_ENGINE_ARGS
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
    finish: str | None = None  # every choice finishes so (test_parity checks): the case exists to reach it

    def id(self, stream: bool) -> str:
        return f"{self.route}-{self.name}-{'stream' if stream else 'whole'}"


C, H = "completions", "chat"
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "look a word up",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}

CASES = [
    # sampling: what changes the tokens
    Case("greedy", C, {"temperature": 0}),
    Case("sampled-seed", C, {"temperature": 1.0, "seed": 7, "top_p": 0.9, "top_k": 20, "min_p": 0.05}),
    Case(
        "penalties",
        C,
        {"temperature": 0.8, "seed": 3, "frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.3},
    ),
    Case(
        "logit-bias-allowed-bad",
        C,
        {
            "temperature": 1.0,
            "seed": 5,
            "logit_bias": {"100": 5, "200": -100},
            "allowed_token_ids": list(range(50, 400)),
            "bad_words": ["the"],
        },
    ),
    Case("stop-strings", C, {"temperature": 1.0, "seed": 11, "stop": ["e", "a"], "include_stop_str_in_output": True}),
    Case(
        "stop-token-ids-min-tokens",
        C,
        {"temperature": 1.0, "seed": 2, "stop_token_ids": [262, 300, 400], "min_tokens": 3},
    ),
    # the stop token is forced (biased, after min_tokens): its text must not reach the output
    Case(
        "stop-token-hit",
        C,
        {"temperature": 1.0, "seed": 2, "stop_token_ids": [262], "logit_bias": {"262": 100}, "min_tokens": 3},
        finish="stop",
    ),
    Case("ignore-eos", C, {"temperature": 1.0, "seed": 4, "ignore_eos": True, "max_tokens": 20}),
    Case("watermarking", C, {"temperature": 1.0, "seed": 9, "watermarking": True}),
    Case(
        "repetition-detection",
        C,
        {"temperature": 0, "max_tokens": 24, "repetition_detection": {"max_pattern_size": 2, "min_count": 2}},
    ),
    # the number of choices
    Case("n3", C, {"temperature": 1.0, "seed": 1, "n": 3}),
    Case("n2-identical", C, {"temperature": 1.0, "top_k": 1, "n": 2}),  # vLLM refuses n > 1 at temperature 0
    Case(
        "prompt-list-n2",
        C,
        {"prompt": ["A user reads", "The cache holds", "Tokens"], "temperature": 1.0, "seed": 8, "n": 2},
    ),
    Case("token-id-prompts", C, {"prompt": [[0, 693, 262, 261], [0, 300, 301]], "temperature": 1.0, "seed": 8}),
    Case("beam-search", C, {"use_beam_search": True, "n": 2, "length_penalty": 0.8}, refused_streaming="beam search"),
    Case(
        "prompt-list-beam-search",
        C,
        {"prompt": ["A user reads", "The cache holds"], "use_beam_search": True, "n": 2},
        refused_streaming="beam search",
    ),
    # the prompt's tokens
    Case("no-special-tokens", C, {"add_special_tokens": False}),
    Case("truncate-left", C, {"truncate_prompt_tokens": 3}),
    Case("truncate-right", C, {"truncate_prompt_tokens": 3, "truncation_side": "right"}),
    Case("suffix", C, {"suffix": "end"}, refused="suffix"),
    # this app's engine has no enable_prompt_embeds: vLLM refuses (with it: tests/engine/test_multimodal.py)
    Case("prompt-embeds", C, {"prompt_embeds": "AAAA"}, refused="prompt_embeds"),
    Case("cache-salt", C, {"cache_salt": "tenant-a"}),
    # output options (must not lose a vector)
    Case("echo-logprobs", C, {"echo": True, "logprobs": 2, "return_tokens_as_token_ids": True}),
    Case("prompt-logprobs", C, {"prompt_logprobs": 1}, refused_streaming="prompt_logprobs"),
    Case("max-tokens-1", C, {"max_tokens": 1}),
    Case(
        "stream-options",
        C,
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}, "stream_interval": 3},
        streams=(True,),
    ),
    Case(
        "response-format",
        C,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}, "max_tokens": 12},
    ),
    Case("structured-outputs", C, {"structured_outputs": {"choice": ["yes", "no"]}}),
    Case("hidden-token-ids", C, {"return_token_ids": False}),
    Case(
        "forged-xargs",
        C,
        {"vllm_xargs": {"hidden_states": "forged", "hidden_states_capture": "x", "mine": 1}},
    ),
    # chat: the template's input and the rest of the surface
    Case("greedy", H, {"temperature": 0, "max_completion_tokens": 8}),
    Case("n3-sampled", H, {"temperature": 1.0, "seed": 6, "n": 3, "logprobs": True, "top_logprobs": 2}),
    Case("beam-search", H, {"use_beam_search": True, "n": 2}),
    Case(
        "continue-final-message",
        H,
        {
            "messages": [*MESSAGES, {"role": "assistant", "content": "The cache"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    ),
    Case(
        "template-kwargs",
        H,
        {
            "chat_template_kwargs": {"enable_thinking": False},
            "documents": [{"text": "doc"}],
            "reasoning_effort": "low",
            "include_reasoning": True,
        },
    ),
    Case(
        "custom-template",
        H,
        {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"},
        refused="trust-request-chat-template",
    ),
    Case("tools-none", H, {"tools": [TOOL], "tool_choice": "none", "parallel_tool_calls": False}),
    Case("tools-required", H, {"tools": [TOOL], "tool_choice": "required"}, refused="tool-call-parser"),
    Case("thinking-budget", H, {"thinking_token_budget": 4}, refused="thinking_token_budget"),
    Case("response-format-json", H, {"response_format": {"type": "json_object"}, "max_tokens": 12}),
    Case(
        "image-part",
        H,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    ],
                }
            ]
        },
        refused="image_url",
    ),  # not an image
    Case(
        "stop-skip-special",
        H,
        {
            "temperature": 1.0,
            "seed": 12,
            "stop": ["e"],
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "ignore_eos": True,
        },
    ),
    # EOS (id 1) forced after min_tokens, special tokens kept: its text must not reach the content
    Case(
        "eos-skip-special",
        H,
        {"temperature": 1.0, "seed": 13, "logit_bias": {"1": 100}, "min_tokens": 2, "skip_special_tokens": False},
        finish="stop",
    ),
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
    "media_io_kwargs": "how media are loaded; this app's model is text-only (the image-part case: its image is "
    "refused by name; images on VLMs: tests/serve/test_multimodal.py)",
    "mm_processor_kwargs": "multimodal processor options; this app's model is text-only (image-part case)",
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


def _body(case: Case) -> dict[str, Any]:
    """The case's request body, without `model`, `stream` and `return_hidden_states`."""
    body: dict[str, Any] = {"max_tokens": 8, "return_token_ids": True, **case.options}
    body.setdefault("prompt" if case.route == C else "messages", PROMPT if case.route == C else MESSAGES)
    return body


def _call(client: openai.OpenAI, case: Case, stream: bool):
    body = {**_body(case), "return_hidden_states": True}
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
    return [
        (i, prompts.get(i, prompts.get(-1)), tokens.get(i, []), finals[i].get("hidden_states"), finals[i])
        for i in sorted(finals)
    ]


def _expected_choices(case: Case) -> int:
    prompts = case.options.get("prompt")
    n_prompts = len(prompts) if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int) else 1
    return n_prompts * case.options.get("n", 1)


@pytest.mark.parametrize(
    "case,stream", [(c, s) for c in CASES for s in c.streams], ids=[c.id(s) for c in CASES for s in c.streams]
)
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


# Parity: asking for hidden states changes nothing else in a response.
#
# Each case also runs without `return_hidden_states` (same body, same app, streamed or not
# as the case is), over raw HTTP so that nothing the openai SDK drops is missed. A whole
# response must be identical, key for key, but for what differs per request and the vectors
# themselves. A stream is compared as STREAM_NOT_COMPARED says: everything but what vLLM
# itself varies from one identical request to the next.

# A case without a seed gets this one, in both requests: the tiny model's default temperature is 1.0,
# so an unseeded case samples differently each time (harmless where it is greedy or beam search).
PARITY_SEED = 1234
PER_REQUEST = frozenset({"id", "created"})  # top-level keys of a response or chunk that differ per request
# (`system_fingerprint` is not among them: vLLM derives it from the engine's config, the same on every replica)
VECTOR_KEYS = frozenset({"hidden_states", "hidden_states_by_layer", "hidden_states_meta"})  # a choice's, with HS only

CAPPED = "completions-max-tokens-unset-whole"
CAP_WHY = (
    "max_tokens unset: with hidden states it is capped at max_model_len - 1 - prompt length (the final "
    "token needs one more position for its vector), without at max_model_len - prompt length: one token fewer"
)
# case -> field -> why: the only differences hidden states may make. Every field not listed must be
# identical; one listed field at least must differ (else the entry is stale and fails; the case's own
# test pins the exact difference). Refused cases (a 400 with hidden states: `refused`,
# `refused_streaming`) have no response to compare and are skipped, saying so.
PARITY_DIFFERENCES: dict[str, dict[str, str]] = {
    CAPPED: {
        "choices[0].text": CAP_WHY,
        "choices[0].token_ids": CAP_WHY,
        "choices[0].logprobs.text_offset": CAP_WHY,
        "choices[0].logprobs.token_logprobs": CAP_WHY,
        "choices[0].logprobs.tokens": CAP_WHY,
        "choices[0].logprobs.top_logprobs": CAP_WHY,
        "usage.completion_tokens": CAP_WHY,
        "usage.total_tokens": CAP_WHY,
    },
}


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()  # a key or list item one side does not have

# What a stream comparison leaves out, and why: each varies between two identical requests
# *without* hidden states on this server (seen with both arms plain), so identity cannot hold.
# Everything else of a stream is compared (`_stream_transcript`): per choice, the concatenation
# of its chunks in order (text or delta, token ids, logprobs, prompt_token_ids: each key), its
# finish_reason and stop_reason, whether the finish came in the chunk with the choice's last
# token and whether anything came after it; the chunks' own fields; the usage-only chunks
# exactly; the last chunk's usage; and the final [DONE].
STREAM_NOT_COMPARED = {
    "chunk boundaries (how many tokens one chunk carries)": "vLLM's per-request output collector merges the deltas "
    "its reader has not taken yet, so "
    "a chunk carries one token or several depending on timing",
    "interleaving of choices' chunks (n > 1, several prompts)": "each choice streams as its own engine request "
    "produces it; their order across choices is timing",
    "usage of each chunk but the last (continuous_usage_stats)": "cumulative counts as of each chunk, so they follow "
    "the chunk boundaries",
}


def _post(base: str, route: str, body: dict[str, Any], stream: bool) -> tuple[int, Any]:
    """(status, JSON body); for a 200 stream, the list of its `data:` events, "[DONE]" last if it came."""
    url = f"{base}/v1/{'completions' if route == C else 'chat/completions'}"
    payload = {"model": MODEL, **body, "stream": stream}
    with httpx.Client(timeout=120) as http:
        if not stream:
            r = http.post(url, json=payload)
            return r.status_code, r.json()
        with http.stream("POST", url, json=payload) as r:
            if r.status_code != 200:
                return r.status_code, json.loads(r.read())
            events: list[Any] = []
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    events.append(data)
                    break
                events.append(json.loads(data))
            return r.status_code, events


# HS_RECORD_MATRIX=DIR: test_parity writes each case's responses, ids and timestamps normalised, to
# DIR/<case>.json, so that two releases' answers can be compared byte for byte (scripts/compare_matrix.py).
RECORD = os.environ.get("HS_RECORD_MATRIX")


def _normalised(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: "<per-request>" if k in PER_REQUEST else _normalised(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_normalised(v) for v in x]
    return x


def _record(name: str, responses: dict[str, Any]) -> None:
    os.makedirs(RECORD, exist_ok=True)
    with open(os.path.join(RECORD, f"{name}.json"), "w") as f:
        json.dump(_normalised(responses), f, sort_keys=True, indent=1)


def _without_vectors(event: Any) -> Any:
    """A response or chunk with hidden states, without what legitimately differs: the
    per-request keys and each choice's vector keys."""
    if not isinstance(event, dict):
        return event
    out = {k: v for k, v in event.items() if k not in PER_REQUEST}
    if isinstance(out.get("choices"), list):
        out["choices"] = [
            {k: v for k, v in ch.items() if k not in VECTOR_KEYS} if isinstance(ch, dict) else ch
            for ch in out["choices"]
        ]
    return out


def _first_difference(a: Any, b: Any, path: str = "", skip: frozenset[str] = frozenset()):
    """(path, a's value, b's value) where `a` and `b` first differ, or None; paths in `skip` are not compared."""
    if path in skip:
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            d = _first_difference(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{path}.{k}" if path else str(k), skip)
            if d is not None:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i in range(max(len(a), len(b))):
            d = _first_difference(
                a[i] if i < len(a) else _ABSENT, b[i] if i < len(b) else _ABSENT, f"{path}[{i}]", skip
            )
            if d is not None:
                return d
        return None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    if type(a) is not type(b) or a != b:  # 1 and True, 1 and 1.0 differ in JSON
        return path or "<root>", a, b
    return None


def _at(obj: Any, path: str) -> Any:
    for key, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path):
        obj = obj[int(index)] if index else obj[key]
    return obj


def _short(value: Any, limit: int = 600) -> str:
    text = repr(value) if isinstance(value, (str, _Absent)) else json.dumps(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


class _Changed(list):
    """A scalar that took several values across one choice's chunks: the values in order."""


def _merge(acc: Any, new: Any) -> Any:
    """One choice's chunks in order, folded into one: strings concatenate, lists extend, dicts
    merge by key, a repeated equal scalar stays one (a changing one becomes a _Changed)."""
    if acc is _ABSENT or acc is None:
        return new
    if new is None:
        return acc
    if isinstance(acc, _Changed):
        return acc if type(acc[-1]) is type(new) and acc[-1] == new else _Changed([*acc, new])
    if isinstance(acc, str) and isinstance(new, str):
        return acc + new
    if isinstance(acc, list) and isinstance(new, list):
        return acc + new
    if isinstance(acc, dict) and isinstance(new, dict):
        return {**acc, **{k: _merge(acc.get(k, _ABSENT), v) for k, v in new.items()}}
    if type(acc) is type(new) and acc == new:
        return acc
    return _Changed([acc, new])


def _stream_transcript(events: list[Any]) -> dict[str, Any]:
    """A stream without what STREAM_NOT_COMPARED names, everything else kept."""
    chunks = [e for e in events if isinstance(e, dict)]
    per_choice: dict[int, list[dict]] = {}
    for e in chunks:
        for ch in e.get("choices") or ():
            per_choice.setdefault(ch.get("index"), []).append(ch)
    choices = {}
    for index, entries in sorted(per_choice.items(), key=lambda kv: str(kv[0])):
        merged: Any = _ABSENT
        for ch in entries:
            merged = _merge(merged, ch)
        finished = [i for i, ch in enumerate(entries) if ch.get("finish_reason") is not None]
        last = entries[finished[0]] if finished else None
        choices[str(index)] = {
            "merged": merged,
            "finishes": len(finished),
            "entries_after_finish": len(entries) - 1 - finished[0] if finished else None,
            # token ids shown: the finish must come with the choice's last token, not on its own
            "finish_with_its_token": bool(last.get("token_ids")) if last is not None and "token_ids" in last else None,
        }
    with_choices = [e for e in chunks if e.get("choices")]

    def fields(e: dict) -> str:
        return json.dumps({k: v for k, v in e.items() if k not in ("choices", "usage")}, sort_keys=True)

    # vLLM stamps system_fingerprint on a choice's terminal chunk only; whether a choice streams as one chunk
    # (terminal) or several is a chunk boundary (timing), so the other chunks' fields are compared as the
    # terminal ones' without it, not by whether any such chunk came.
    terminal = [e for e in chunks if not e.get("choices") or any(c.get("finish_reason") for c in e["choices"])]
    plain = {fields({k: v for k, v in e.items() if k != "system_fingerprint"}) for e in terminal}
    return {
        "chunk_fields": sorted({fields(e) for e in terminal}),
        "other_chunks_fields_as_terminal_ones": all(fields(e) in plain for e in chunks if e not in terminal),
        "choices": choices,
        "usage_chunks": [e.get("usage", _ABSENT) for e in chunks if not e.get("choices")],
        "usage_on_choice_chunks": sorted({e.get("usage") is not None for e in with_choices}),
        "last_choice_chunk_usage": with_choices[-1].get("usage", _ABSENT) if with_choices else _ABSENT,
        "non_chunk_events": [e for e in events if not isinstance(e, dict)],  # "[DONE]", last
    }


def _assert_parity(name: str, off: Any, on: Any, stream: bool) -> None:
    """`off` (without hidden states) and `on` (with) identical but for PER_REQUEST, the vectors,
    for streams what STREAM_NOT_COMPARED names, and the fields PARITY_DIFFERENCES lists for
    `name` (of which one at least must differ, else the entry is stale)."""
    allowed = PARITY_DIFFERENCES.get(name, {})
    # without hidden states nothing is removed but the per-request keys: a vector there is a difference
    if stream:
        a = _stream_transcript(
            [{k: v for k, v in e.items() if k not in PER_REQUEST} if isinstance(e, dict) else e for e in off]
        )
        b = _stream_transcript([_without_vectors(e) for e in on])
    else:
        a, b = {k: v for k, v in off.items() if k not in PER_REQUEST}, _without_vectors(on)
    d = _first_difference(a, b, "stream" if stream else "", frozenset(allowed))
    assert d is None, (
        f"{name}: asking for hidden states changed the response; first difference at {d[0]}:\n"
        f"  without hidden states: {_short(d[1])}\n  with hidden states:    {_short(d[2])}"
    )
    if allowed:
        assert any(_at(a, path) != _at(b, path) for path in allowed), (
            f"{name}: PARITY_DIFFERENCES lists {sorted(allowed)} as differing, but none does: a stale entry"
        )


def _assert_vectors_present(on: Any, stream: bool) -> None:
    """The hidden-states request did get its vectors: every finished choice carries one
    (else the comparison would be between two plain responses)."""
    events = on if stream else [on]
    finished = [
        ch
        for e in events
        if isinstance(e, dict)
        for ch in e.get("choices") or ()
        if ch.get("finish_reason") is not None
    ]
    assert finished, "no choice finished"
    for ch in finished:
        assert ch.keys() & {"hidden_states", "hidden_states_by_layer"} and "hidden_states_meta" in ch, (
            f"choice {ch.get('index')} finished without its vector: {sorted(ch)}"
        )


@pytest.mark.parametrize(
    "case,stream", [(c, s) for c in CASES for s in c.streams], ids=[c.id(s) for c in CASES for s in c.streams]
)
def test_parity(serve_app, case: Case, stream: bool):
    refused = case.refused or (case.refused_streaming if stream else None)
    if refused is not None:
        if RECORD:
            _record(
                case.id(stream),
                {
                    "with": _post(
                        serve_app,
                        case.route,
                        {**_body(case), "return_hidden_states": True, "seed": PARITY_SEED},
                        stream,
                    )
                },
            )
        pytest.skip(
            f"exempt from parity: refused with hidden states (a 400 naming {refused!r}), "
            "so there is no response to compare"
        )
    body = _body(case)
    body.setdefault("seed", PARITY_SEED)
    status_off, off = _post(serve_app, case.route, body, stream)
    status_on, on = _post(serve_app, case.route, {**body, "return_hidden_states": True}, stream)
    if RECORD:
        _record(case.id(stream), {"without": (status_off, off), "with": (status_on, on)})
    assert (status_off, status_on) == (200, 200), f"without: {status_off} {_short(off)}; with: {status_on} {_short(on)}"
    _assert_vectors_present(on, stream)
    if case.finish is not None:
        events = off if stream else [off]
        finishes = [
            ch["finish_reason"]
            for e in events
            if isinstance(e, dict)
            for ch in e.get("choices") or ()
            if ch.get("finish_reason") is not None
        ]
        assert finishes and set(finishes) == {case.finish}, f"the case exists to finish by {case.finish}: {finishes}"
    if stream:
        assert off and off[-1] == "[DONE]", f"the stream without hidden states did not end with [DONE]: {_short(off)}"
    _assert_parity(case.id(stream), off, on, stream)


def test_parity_max_tokens_unset(serve_app):
    """The one difference hidden states make on purpose: with `max_tokens` unset (null), a prompt
    near the context gets one token fewer (PARITY_DIFFERENCES[CAPPED]), and nothing else changes."""
    max_model_len = TEST_ENGINE_ARGS["max_model_len"]
    room = 5  # tokens left without hidden states; 4 with
    prompt = [0] + [50 + (7 * i) % 600 for i in range(max_model_len - room - 1)]  # the vocabulary has 715
    body = {
        "prompt": prompt,
        "max_tokens": None,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "return_token_ids": True,
    }
    # A prompt this long fills KV blocks, which the prefix cache keeps: a request that reads them gets
    # logprobs a float32 ulp away from one that computed them (other chunk shapes), with or without
    # hidden states. A fresh cache_salt (it only keys the prefix cache) gives both requests a cold
    # cache. (The matrix's prompts are shorter than one 32-token block: no request of theirs reads the cache.)
    status_off, off = _post(serve_app, C, {**body, "cache_salt": uuid.uuid4().hex}, False)
    status_on, on = _post(serve_app, C, {**body, "cache_salt": uuid.uuid4().hex, "return_hidden_states": True}, False)
    assert (status_off, status_on) == (200, 200), f"without: {status_off} {_short(off)}; with: {status_on} {_short(on)}"
    _assert_vectors_present(on, False)
    _assert_parity(CAPPED, off, on, False)
    # ... and the listed fields differ by exactly the one token
    a, b = off["choices"][0], on["choices"][0]
    assert len(a["token_ids"]) == room and b["token_ids"] == a["token_ids"][:-1], (a["token_ids"], b["token_ids"])
    assert a["finish_reason"] == "length"
    for key in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
        assert b["logprobs"][key] == a["logprobs"][key][:-1], (key, a["logprobs"][key], b["logprobs"][key])
    assert a["text"].startswith(b["text"]), (a["text"], b["text"])
    assert on["usage"] == {**off["usage"], "completion_tokens": room - 1, "total_tokens": max_model_len - 1}, (
        off["usage"],
        on["usage"],
    )


def test_parity_differences_name_real_cases():
    ids = {c.id(s) for c in CASES for s in c.streams} | {CAPPED}
    assert set(PARITY_DIFFERENCES) <= ids, sorted(set(PARITY_DIFFERENCES) - ids)


def test_beam_search_vectors_are_the_final_beams(client, reference):
    """Each returned beam's vector is its own: distinct beams carry distinct vectors."""
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=10,
        n=3,
        extra_body={"use_beam_search": True, "return_hidden_states": True, "return_token_ids": True},
    )
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
    assert stats["missing_vectors"] == 0 and stats["malformed_vectors"] == 0, stats


def test_every_vllm_request_field_is_classified():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    covered = {k for c in CASES for k in c.options}
    for _route, model in ((C, CompletionRequest), (H, ChatCompletionRequest)):
        fields = set(model.model_fields)
        unclassified = fields - covered - set(IRRELEVANT) - OURS
        assert not unclassified, (
            f"vLLM's {model.__name__} has fields no case covers and IRRELEVANT does not list: {sorted(unclassified)}; "
            "add a case (right vector or a clear 400) or say why it cannot change tokens or choices"
        )
    stale = set(IRRELEVANT) - set(CompletionRequest.model_fields) - set(ChatCompletionRequest.model_fields)
    assert not stale, f"IRRELEVANT lists fields vLLM no longer has: {sorted(stale)}"
