"""OpenAI response formatting of vectors and errors: no vLLM here.

`hidden_states` is 1-D for one position, 2-D (positions x D) for several, in the asked dtype;
`hidden_states_meta` has `dtype`, `bytes`, `shape` and, for several positions, `positions`.
Streaming: each chunk of a multi-position choice carries the rows received since its last one.
Used by the vLLM frontend (hidden_states/vllm/frontend/openai.py) and the fake engine.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from http import HTTPStatus
from typing import Any, Literal, get_args

import numpy as np
from pydantic import ValidationError

from hidden_states.interface import CompletionChoice, HiddenStatesCollector
from hidden_states.shape import squeeze

Route = Literal["completions", "chat", "hidden_states", "tokenize", "detokenize"]
ROUTES: tuple[str, ...] = get_args(Route)


def encode_vector(vec: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(vec, dtype=np.float32).tolist()


def _b64(arr: np.ndarray) -> str:
    """base64 of the array's bytes, read in place (no `tobytes` copy)."""
    return base64.b64encode(np.ascontiguousarray(arr)).decode("ascii")


def encode_rows(choice: CompletionChoice, layer: int, encoding: str) -> list | dict | str:
    """One layer's rows of a choice, shaped as it carries them (shape.squeeze: 1-D for one position):
    floats as a list (of lists), or base64 of the row-major little-endian array of the dtype (bfloat16:
    the high 16 bits of float32); top-k as {"indices", "values"} (int32 indices, largest magnitude
    first; floats: one per row)."""
    indices = (choice.hidden_states_indices_by_layer or {}).get(layer)
    if encoding == "base64":  # the bytes as cast (no widening)
        raw = _b64(choice.raw(layer))
        return raw if indices is None else {"indices": _b64(indices.astype("<i4")), "values": raw}
    values = choice.hidden_states_by_layer[layer]
    if indices is None:
        return values.tolist()
    rows = [
        {"indices": i.tolist(), "values": v.tolist()} for i, v in zip(np.atleast_2d(indices), np.atleast_2d(values))
    ]
    return squeeze(rows, choice.multi)


@dataclasses.dataclass(frozen=True)
class ResponseForm:
    """How one request's choices are written out: its encoding and layout, the adapter and replica that
    served it, and (hidden_states_proof) the proof scheme it asked for."""

    encoding: str = "float"  # hidden_states_encoding
    by_layer: bool = False  # hidden_states_layers asked: `hidden_states_by_layer`
    adapter: str | None = None
    replica: str | None = None
    proof: Any = None  # proofs.ProofRequest


def choice_fields(choice: CompletionChoice, form: ResponseForm, verify: bool = False) -> dict:
    """The one place a response's vector fields and `hidden_states_meta` are written, from a CompletionChoice
    (HiddenStatesCollector.choice): on a completion's choice, or a chunk of it (`choice.final` False: rows
    since its last chunk), and (`verify`) on the answer of POST /v1/hidden_states, whose meta keeps its
    order: the work before the adapter, and no stop."""
    out: dict[str, Any] = {}
    if choice.proofs is not None:
        if not verify:
            out["hidden_states_proof"] = {
                "scheme": form.proof.scheme,
                "topk": form.proof.topk,
                "decode_batching_size": form.proof.decode_batching_size,
                "index": choice.proof_index,
                "proofs": list(choice.proofs),
            }
        if choice.final:
            meta = {"position": "proof"}
            if verify:
                meta.update(prompt_tokens=choice.prompt_tokens, **_work(choice, True))
            meta.update(adapter=form.adapter, replica=form.replica)
            if not verify:
                meta.update(proofs=choice.proof_index + len(choice.proofs), prompt_tokens=choice.prompt_tokens)
                meta.update(_work(choice, False))
            out["hidden_states_meta"] = meta
        return out
    if choice.rows is None:  # it only steers or stops: what applied, and the stop
        meta = {} if choice.steering is None else {"steering": choice.steering}
        meta.update(adapter=form.adapter, replica=form.replica)
        if choice.stop_asked:
            meta["stop"] = choice.stop
        return {"hidden_states_meta": meta}
    meta = {"position": choice.position}
    if choice.pool is not None:  # hidden_states_pool: the mean of this many rows (none: null vectors)
        meta.update(pool="mean", pooled_rows=choice.pool)
    if choice.rows.values:
        rows = {
            layer: encode_rows(choice, layer, form.encoding) if len(choice.rows) or choice.multi else None
            for layer in choice.rows.values
        }
        if form.by_layer:
            out["hidden_states_by_layer"] = {str(layer): v for layer, v in rows.items()}
        else:
            out["hidden_states"] = rows[-1]
        meta["dtype"] = choice.dtype
        if choice.topk:
            meta["topk"] = choice.topk
    if choice.positions is not None:
        meta["positions"] = list(choice.positions)
    if choice.rows.values:
        meta.update(shape=choice.shape, bytes=choice.rows.nbytes)
    out["hidden_states_meta"] = meta
    if choice.heads is not None:
        out["hidden_states_heads"] = choice.heads
        meta["head_bytes"] = choice.head_bytes
    if verify:
        meta.update(_work(choice, True))
    meta.update(adapter=form.adapter, replica=form.replica)
    if choice.steering is not None:
        meta["steering"] = choice.steering
    if choice.stop_asked:
        meta["stop"] = choice.stop
    if choice.modalities is not None:
        meta["modalities"] = choice.modalities
    if not verify:
        meta.update(_work(choice, True))
    return out


def _work(choice: CompletionChoice, timed: bool) -> dict:
    """The work for the choice's final row (ExtractionStats.meta), on its final part."""
    return choice.extraction.meta(timed) if choice.final and choice.extraction is not None else {}


def error_body(message: str, status: int, err_type: str | None = None, param: str | None = None) -> bytes:
    err_type = err_type or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return json.dumps({"error": {"message": message, "type": err_type, "param": param, "code": status}}).encode()


_FINISHING = re.compile(r'"finish_reason":\s*"')  # an SSE chunk that finishes a choice (else it passes untouched)


class ChoiceVectors:
    """Puts each finished choice's vector into the response, found by (prompt ordinal, index) =
    divmod(response index, n) for completions, (0, index) for chat; fails the request if one has
    none."""

    def __init__(
        self,
        engine,
        collector: HiddenStatesCollector,
        request,
        route: Route,
        replica_id: str,
        adapter: str | None = None,
    ):
        self.engine, self.collector = engine, collector
        spec = collector.spec
        self.form = ResponseForm(
            spec.hidden_states_encoding, spec.hidden_states_layers is not None, adapter, replica_id, collector.proof
        )
        self.n = (getattr(request, "n", None) or 1) if route == "completions" else 0

    def _fields(self, index: int, final: bool) -> dict | None:
        key = divmod(index, self.n) if self.n else (0, index)
        choice = self.collector.choice(key, self.engine, final, index)
        return None if choice is None else choice_fields(choice, self.form)

    def fields(self, index: int) -> dict:
        """The vector fields of response choice `index`."""
        return self._fields(index, True)

    def fill_response(self, response) -> None:
        """A whole response: a dict, or vLLM's pydantic response (its models allow extra fields)."""
        if isinstance(response, dict):
            for choice in response["choices"]:
                choice.update(self.fields(choice["index"]))
            return
        for choice in response.choices:
            for name, value in self.fields(choice.index).items():
                setattr(choice, name, value)

    def fill_chunk(self, chunk: str) -> str:
        """One SSE event: vectors put on the choices it finishes (rows of several positions on
        every chunk of their choice, as they arrive); any other event unchanged."""
        streams_rows = self.collector.multi
        if not streams_rows and not _FINISHING.search(chunk):
            return chunk
        data = json.loads(chunk[6:])
        changed = False
        for choice in data.get("choices") or ():
            if choice.get("finish_reason") is not None:
                choice.update(self.fields(choice.get("index", 0)))
                changed = True
            elif streams_rows and (rows := self._fields(choice.get("index", 0), False)) is not None:
                choice.update(rows)
                changed = True
        if not changed:
            return chunk
        return "data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False) + "\n\n"


def validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)
