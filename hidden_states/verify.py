"""`POST /v1/hidden_states`: the true vectors of given tokens, and a comparison with claimed ones.

One prefill (no generation) of `prompt` (text or ids), or `messages` plus an optional assistant
`completion`: exactly a chat completion's `prompt_token_ids + token_ids`. Position, dtype, top-k
and layers as on the completion routes (default: the final token's vector).

`compare`: a dense claim matches if max |claimed - true| <= tolerance x max |true| per row; a
top-k claim if its indices are the true top-k (ties either way) and values within tolerance.
`compare.toploc`: each proof checked against a bfloat16 prefill of its chunk (rows not returned).
The engine's frontend (hidden_states/vllm/frontend/openai.py) tokenizes and extracts.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hidden_states.params import (
    HeadAsk,
    HiddenStatesRequestError,
    SteeringAsk,
    VectorFields,
    check_heads,
    check_steering,
    refuse_unknown,
)
from hidden_states.proofs import ProofClaim


class TopkClaim(BaseModel):
    model_config = ConfigDict(extra="forbid")
    indices: list[int]
    values: list[float]


class Compare(BaseModel):
    model_config = ConfigDict(extra="forbid")
    vector: list[float] | list[list[float]] | str | None = Field(
        None,
        description="the claimed vector: floats, or base64 of little-endian float32; with several positions "
        "one row per position (a list of lists, or base64 of the row-major [n, D] array)",
    )
    vectors: list[list[float]] | str | None = Field(None, description="one claimed row per position, as `vector`")
    topk: list[TopkClaim] | None = Field(
        None, description="per position the claimed largest-magnitude entries {indices, values} (TOPLOC-style)"
    )
    toploc: ProofClaim | None = Field(
        None,
        description="a choice's TOPLOC proofs (its hidden_states_proof): checked against the rows one "
        "prefill of the given tokens computes, under TOPLOC's thresholds or the given ones",
    )
    tolerance: float = Field(1e-5, gt=0, description="largest relative error that still matches")

    @model_validator(mode="after")
    def _one_claim(self) -> Compare:
        if sum(x is not None for x in (self.vector, self.vectors, self.topk, self.toploc)) != 1:
            raise ValueError(
                "send exactly one of `compare.vector`, `compare.vectors`, `compare.topk` and `compare.toploc`"
            )
        return self


class VerifyRequest(VectorFields):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _our_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse_unknown(data, frozenset(k for k in cls.model_fields if k.startswith("hidden_states")))
        return data

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    completion: str | list[int] | None = Field(None, description="with messages: the assistant's answer")
    add_special_tokens: bool = Field(True, description="for a text prompt, as /v1/completions")
    compare: Compare | None = None
    hidden_states_heads: list[HeadAsk] | None = Field(
        None,
        description="registered heads run over the same positions: `hidden_states_heads` {name: outputs} "
        "beside the rows (the true outputs of the given tokens)",
    )

    hidden_states_steering: list[SteeringAsk] | None = Field(
        None,
        description="the steering the choice was generated under (docs/steering.md): its rows recomputed "
        "under the same steering",
    )

    _heads = field_validator("hidden_states_heads", mode="before")(lambda cls, v: check_heads(v))
    _steering = field_validator("hidden_states_steering", mode="before")(lambda cls, v: check_steering(v))

    @property
    def heads(self) -> tuple[tuple[str, int | None], ...]:
        return tuple((h.name, h.topk) for h in self.hidden_states_heads or ())

    @model_validator(mode="after")
    def _one_input(self) -> VerifyRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of `prompt` and `messages`")
        proofs = self.compare is not None and self.compare.toploc is not None
        if self.completion is not None and self.messages is None and not proofs and not self.hidden_states_steering:
            raise ValueError(
                "`completion` goes with `messages` (with `prompt`, append it to the prompt; with "
                "hidden_states_steering, `prompt` and `completion` say where the prompt ends)"
            )
        if proofs and self.completion is None:
            raise ValueError(
                "`compare.toploc` needs the `completion` (its token ids): the proofs' chunks start where it does"
            )
        if self.prompt is not None and len(self.prompt) == 0:
            raise ValueError("`prompt` is empty")
        if self.compare is not None and self.hidden_states_layers not in (None, [-1]):
            raise ValueError("`compare` checks the last layer: leave hidden_states_layers unset")
        if self.compare is not None and self.hidden_states_topk is not None:
            raise ValueError(
                "`compare` checks against the whole rows: leave hidden_states_topk unset "
                "(compare.topk checks top-k claims)"
            )
        return self


def decode_rows(value: list[float] | list[list[float]] | str, n: int, dim: int, field: str) -> np.ndarray:
    """A dense claim as float32 [n, dim]: a 400 naming `field` for another count of rows or width."""

    def refuse(message: str):
        raise HiddenStatesRequestError(f"{field} {message}", field)

    positions = f"hidden_states_position selects {n} position(s)"
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except ValueError:
            refuse("is not valid base64")
        if len(raw) % 4:
            refuse("is base64 of float32: it needs a multiple of 4 bytes")
        flat = np.frombuffer(raw, "<f4")
        if flat.size != n * dim:
            refuse(
                f"has {flat.size} values; this model's vectors have {dim}"
                if n == 1
                else f"has {flat.size} values; {positions} x {dim} values (the row-major [n, D] array)"
            )
        return flat.reshape(n, dim)
    if value and isinstance(value[0], list):
        if len(value) != n:
            refuse(f"has {len(value)} rows; {positions}")
        bad = next((i for i, row in enumerate(value) if len(row) != dim), None)
        if bad is not None:
            refuse(f"row {bad} has {len(value[bad])} values; this model's vectors have {dim}")
        return np.asarray(value, np.float32)
    if len(value) != dim:
        refuse(f"has {len(value)} values; this model's vectors have {dim}")
    if n != 1:
        refuse(f"is one vector; {positions}: send one row per position")
    return np.asarray(value, np.float32)[None]


def decode_claimed(value: list[float] | str, dim: int) -> np.ndarray:
    """One claimed vector, float32 [dim]."""
    return decode_rows(value, 1, dim, "compare.vector")[0]


def claims(compare: Compare, n: int, dim: int) -> np.ndarray | list[tuple[np.ndarray, np.ndarray]]:
    """The claim of `n` positions: dense rows float32 [n, dim], or per position (indices, values);
    a 400 naming the field for a count of rows other than `n` or entries that do not fit `dim`."""
    if compare.topk is None:
        field = "compare.vector" if compare.vector is not None else "compare.vectors"
        return decode_rows(compare.vector if compare.vector is not None else compare.vectors, n, dim, field)
    if len(compare.topk) != n:
        raise HiddenStatesRequestError(
            f"compare.topk has {len(compare.topk)} rows; hidden_states_position selects {n} position(s)", "compare.topk"
        )
    out = []
    for i, c in enumerate(compare.topk):
        k = len(c.indices)
        why = (
            f"has {k} indices and {len(c.values)} values"
            if k != len(c.values)
            else "is empty"
            if k == 0
            else f"has {k} entries; this model's vectors have {dim}"
            if k > dim
            else f"indices must lie in 0..{dim - 1}"
            if not all(0 <= j < dim for j in c.indices)
            else "repeats an index"
            if len(set(c.indices)) != k
            else None
        )
        if why is not None:
            raise HiddenStatesRequestError(f"compare.topk[{i}] {why}", "compare.topk")
        out.append((np.asarray(c.indices, np.int64), np.asarray(c.values, np.float32)))
    return out


def _relative(diff: float, scale: float) -> float:
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def comparison(claimed: np.ndarray, true: np.ndarray, tolerance: float) -> dict[str, Any]:
    diff = float(np.abs(claimed.astype(np.float64) - true).max())
    scale = float(np.abs(true).max())
    norm = float(np.linalg.norm(claimed) * np.linalg.norm(true))
    rel = _relative(diff, scale)
    return {
        "max_abs_error": diff,
        "max_abs_reference": scale,
        "relative_error": rel,
        "cosine_similarity": float(np.dot(claimed.astype(np.float64), true) / norm) if norm > 0 else None,
        "tolerance": tolerance,
        "match": bool(rel <= tolerance),
    }


def topk_comparison(indices: np.ndarray, values: np.ndarray, true: np.ndarray, tolerance: float) -> dict[str, Any]:
    """A top-k claim on one row: `index_overlap` (fraction of its indices among the true top-k) and
    value error relative to max |true row|; a match needs every index and values within tolerance."""
    mag = np.abs(true)
    kth = np.partition(mag, mag.size - indices.size)[mag.size - indices.size]
    overlap = float(np.count_nonzero(mag[indices] >= kth)) / indices.size
    diff, scale = float(np.abs(values.astype(np.float64) - true[indices]).max()), float(mag.max())
    rel = _relative(diff, scale)
    return {
        "index_overlap": overlap,
        "max_abs_error": diff,
        "max_abs_reference": scale,
        "relative_error": rel,
        "tolerance": tolerance,
        "match": bool(overlap == 1.0 and rel <= tolerance),
    }


def compared(
    claim: np.ndarray | list[tuple[np.ndarray, np.ndarray]],
    true: np.ndarray,
    positions: Sequence[int],
    tolerance: float,
    multi: bool,
) -> dict[str, Any]:
    """A claim against the true rows [n, D]: one comparison, or per position with the worst."""
    if isinstance(claim, np.ndarray):
        rows = [comparison(c, t, tolerance) for c, t in zip(claim, true)]
    else:
        rows = [topk_comparison(i, v, t, tolerance) for (i, v), t in zip(claim, true)]
    if not multi:
        return rows[0]
    per = [{"position": int(p), **{k: v for k, v in r.items() if k != "tolerance"}} for p, r in zip(positions, rows)]
    worst = max(per, key=lambda r: (1.0 - r.get("index_overlap", 1.0), r["relative_error"]))
    out = {
        "match": all(r["match"] for r in per),
        "tolerance": tolerance,
        "worst_position": worst["position"],
        "worst_relative_error": worst["relative_error"],
    }
    if "index_overlap" in worst:
        out["worst_index_overlap"] = worst["index_overlap"]
    return {**out, "per_position": per}


def response(model: str, token_ids: list[int], fields: dict[str, Any], comparison: dict[str, Any] | None) -> bytes:
    """The answer: the token ids, the vector fields as on a choice (openai_format), the comparison."""
    out: dict[str, Any] = {"object": "hidden_states", "model": model, "token_ids": token_ids, **fields}
    if comparison is not None:
        out["comparison"] = comparison
    return json.dumps(out, separators=(",", ":")).encode()
