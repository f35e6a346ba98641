"""OpenAI response formatting of vectors and errors: no vLLM here.

`hidden_states` is 1-D for one position, 2-D (positions x D) for several, in the asked dtype;
`hidden_states_meta` has `dtype`, `bytes`, `shape` and, for several positions, `positions`.
Streaming: each chunk of a multi-position choice carries the rows received since its last one.
Used by the vLLM frontend (hidden_states/vllm/frontend/openai.py) and the fake engine.
"""

from __future__ import annotations

import base64
import json
import re
from http import HTTPStatus
from typing import Any, Literal, get_args

import numpy as np
from pydantic import ValidationError

from hidden_states.interface import CompletionChoice, HiddenStatesCollector, RowBatch, captured
from hidden_states.proofs import ProofBuilder
from hidden_states.shape import squeeze

Route = Literal["completions", "chat", "hidden_states", "tokenize", "detokenize"]
ROUTES: tuple[str, ...] = get_args(Route)


def encode_vector(vec: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(vec, dtype=np.float32).tolist()


def _b64(arr: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode("ascii")


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


def row_fields(choice: CompletionChoice, encoding: str, by_layer: bool, position, topk: int | None) -> dict:
    """A choice's rows as the response carries them: `hidden_states` (or `_by_layer`) and `hidden_states_meta`."""
    rows = {layer: encode_rows(choice, layer, encoding) for layer in choice.rows.values}
    out = (
        {"hidden_states_by_layer": {str(layer): v for layer, v in rows.items()}}
        if by_layer
        else {"hidden_states": rows[-1]}
    )
    meta = {"position": position, "dtype": choice.dtype}
    if topk:
        meta["topk"] = topk
    if choice.positions is not None:
        meta["positions"] = list(choice.positions)
    meta["shape"] = choice.shape
    meta["bytes"] = choice.rows.nbytes
    out["hidden_states_meta"] = meta
    return out


def chunk_choice(
    collector: HiddenStatesCollector, batch: RowBatch | None, width: int, registry: Any
) -> CompletionChoice:
    """The rows (and heads' outputs) a response choice carries in one chunk, as a CompletionChoice
    (interface.captured): the type the Python API and the handles get, read by `row_fields`."""
    rows, heads = captured(collector, batch, width, registry)
    return CompletionChoice(0, "", (), None, rows, multi=collector.multi, heads=heads)


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
        self.engine, self.collector, self.route, self.replica_id = engine, collector, route, replica_id
        self.adapter = adapter  # the LoRA adapter the request named (None: the base model)
        self.encoding = collector.spec.hidden_states_encoding
        self.by_layer = collector.spec.hidden_states_layers is not None
        self.n = (getattr(request, "n", None) or 1) if route == "completions" else 0
        self._sent_bytes: dict = {}  # payload bytes handed out per choice
        self._head_sent: dict = {}  # heads' output bytes and positions handed out per choice
        self._provers: dict = {}  # hidden_states_proof: each choice's proofs, built as its rows arrive

    def _row_fields(self, index: int, finishing: bool) -> dict | None:
        """A choice's rows received since its last chunk (all of them, unstreamed)."""
        col = self.collector
        key = divmod(index, self.n) if self.n else (0, index)
        if finishing and key not in col.done:
            raise self.engine.missing(f"choice {index}")
        batch = col.hand_out(key)
        if batch is None and not finishing:
            return None
        if not col.captures:  # it only steers or stops: the steering applied, the stop, nothing captured
            if not finishing:
                return None
            meta = {"steering": col.steering_meta(key)} if col.steering_echo else {}
            meta.update(adapter=self.adapter, replica=self.replica_id)
            if col.monitors:
                meta["stop"] = col.stops.get(key)
            return {"hidden_states_meta": meta}
        choice = chunk_choice(
            col, batch, col.topk or getattr(self.engine, "hidden_size", 0), getattr(self.engine, "heads", {})
        )
        if col.rows_wanted:
            out = row_fields(choice, self.encoding, self.by_layer, col.position, col.topk)
        else:  # heads alone: their outputs, no rows
            meta = {"position": col.position}
            if choice.positions is not None:
                meta["positions"] = list(choice.positions)
            out = {"hidden_states_meta": meta}
        meta = out["hidden_states_meta"]
        self._sent_bytes[key] = self._sent_bytes.get(key, 0) + meta.get("bytes", 0)
        if choice.heads is not None:
            out["hidden_states_heads"] = choice.heads
            meta["head_bytes"] = batch.head_nbytes if batch is not None else 0
            nbytes, positions = self._head_sent.get(key, (0, 0))
            self._head_sent[key] = (nbytes + meta["head_bytes"], positions + (len(batch) if batch is not None else 0))
        meta.update(adapter=self.adapter, replica=self.replica_id)
        if col.steering_echo:
            meta["steering"] = col.steering_meta(key) if finishing else col.steering_echo
        if finishing and col.monitors:  # the condition that finished the choice, or None
            meta["stop"] = col.stops.get(key)
        if key[0] in col.modalities:  # a multimodal prompt: which positions are images' (audio's) tokens
            meta["modalities"] = col.modalities[key[0]]
        if finishing:
            st = col.stats.get(key)
            if st is not None:
                meta.update(st.meta())
            head_bytes, positions = self._head_sent.pop(key, (0, 0))
            self.engine.vector_sent(
                col.position_label,
                st,
                self._sent_bytes.pop(key, 0),
                {name: positions for name, _ in col.heads},
                head_bytes,
            )
        return out

    def _proof_fields(self, index: int, finishing: bool) -> dict | None:
        """A proof choice's proofs completed since its last chunk: `hidden_states_proof` {scheme, topk,
        decode_batching_size, index, proofs}."""
        col = self.collector
        key = divmod(index, self.n) if self.n else (0, index)
        if finishing and key not in col.done:
            raise self.engine.missing(f"choice {index}")
        prover = self._provers.get(key)
        if prover is None:
            width = getattr(self.engine, "hidden_size", 0)
            prover = self._provers[key] = ProofBuilder(col.proof, col.prompt_lens[key[0]], width)
        first = prover.count
        batch = col.hand_out(key)
        proofs = [] if batch is None else prover.add(batch.positions, batch.indices[-1], batch.values[-1])
        if finishing:
            proofs += prover.finish()
            del self._provers[key]
        if not proofs and not finishing:
            return None
        spec = col.proof
        out = {
            "hidden_states_proof": {
                "scheme": spec.scheme,
                "topk": spec.topk,
                "decode_batching_size": spec.decode_batching_size,
                "index": first,
                "proofs": proofs,
            }
        }
        nbytes = sum(len(p) for p in proofs)
        self._sent_bytes[key] = self._sent_bytes.get(key, 0) + nbytes
        if finishing:
            meta = {
                "position": "proof",
                "adapter": self.adapter,
                "replica": self.replica_id,
                "proofs": first + len(proofs),
                "prompt_tokens": prover.prompt_len,
            }
            st = col.stats.get(key)
            if st is not None:
                meta.update(st.meta(timed=False))
            out["hidden_states_meta"] = meta
            self.engine.vector_sent("proof", st, self._sent_bytes.pop(key, 0))
        return out

    def fields(self, index: int) -> dict:
        """The vector fields of response choice `index`."""
        if self.collector.proof is not None:
            return self._proof_fields(index, finishing=True)
        return self._row_fields(index, finishing=True)

    def fill_response(self, response) -> None:
        """A whole response: a dict, or vLLM's pydantic response (its models allow extra fields)."""
        if isinstance(response, dict):
            for choice in response["choices"]:
                choice.update(self.fields(choice["index"]))
            return
        for choice in response.choices:
            for name, value in self.fields(choice.index).items():
                setattr(choice, name, value)

    def _partial(self, index: int) -> dict | None:
        if self.collector.proof is not None:
            return self._proof_fields(index, finishing=False)
        return self._row_fields(index, finishing=False)

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
            elif streams_rows and (rows := self._partial(choice.get("index", 0))) is not None:
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
