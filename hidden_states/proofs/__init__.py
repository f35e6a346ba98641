"""Proofs of inference, built on the server from the rows the engine computes anyway, and checked
by it: one module per scheme (`toploc.py`).

A `Scheme` says which rows it needs (`capture`), how they group (`chunks`), how a chunk becomes
a proof (`prove`) and how one is checked (`check`). `ProofBuilder` builds a choice's as rows arrive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from hidden_states.proofs import toploc
from hidden_states.proofs.toploc import ProofError, Thresholds, Verdict

Scheme = Literal["toploc"]
SCHEMES: dict[str, Any] = {"toploc": toploc}


class ProofRequest(BaseModel):
    """`hidden_states_proof`: the proofs each choice carries (TOPLOC's parameters by default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    scheme: Scheme = Field("toploc", description="the proof scheme: TOPLOC (arXiv 2501.16007)")
    topk: int = Field(128, ge=1, le=4096, description="entries of largest magnitude per chunk")
    decode_batching_size: int = Field(32, ge=1, description="decode positions per proof after the prefill's")

    # The rows the scheme reads: every fed position (the final token is never fed), bfloat16,
    # top-k per row (a chunk's top-k is among its rows' top-k).
    capture_position: ClassVar[dict] = {"start": 0, "end": -1}
    capture_dtype: ClassVar[str] = "bfloat16"


class ThresholdsField(BaseModel):
    model_config = ConfigDict(extra="forbid")
    exp_mismatches: int = Field(Thresholds.exp_mismatches, ge=0)
    mant_err_mean: float = Field(Thresholds.mant_err_mean, ge=0)
    mant_err_median: float = Field(Thresholds.mant_err_median, ge=0)


class ProofClaim(ProofRequest):
    """`compare.toploc` of POST /v1/hidden_states: a choice's proofs, as it carried them."""

    proofs: list[str] = Field(description="base64 proofs: the prefill's, then one per decode_batching_size tokens")
    thresholds: ThresholdsField = Field(
        default_factory=ThresholdsField, description="acceptance (TOPLOC's for top-128 by default)"
    )


class ProofBuilder:
    """One choice's proofs as its rows arrive (top-k rows of fed positions, in position order):
    the prefill's once its `prompt_len` rows are in, then each window of decode positions once
    full; `finish` proves the last window."""

    def __init__(self, spec: ProofRequest, prompt_len: int, width: int):
        self.spec, self.prompt_len, self.width = spec, prompt_len, width
        self.scheme = SCHEMES[spec.scheme]
        self.lo = 0  # the first position of the chunk being filled
        self.count = 0  # proofs made
        self._pos: list[np.ndarray] = []
        self._ind: list[np.ndarray] = []
        self._bits: list[np.ndarray] = []

    def _hi(self) -> int:
        return self.prompt_len if self.lo == 0 else self.lo + self.spec.decode_batching_size

    def add(self, positions: np.ndarray, indices: np.ndarray, bits: np.ndarray) -> list[str]:
        """Rows [n] with their per-row top-k indices and bfloat16 bits [n, k]; the proofs completed."""
        if len(positions):
            self._pos.append(np.asarray(positions, np.int64))
            self._ind.append(np.asarray(indices))
            self._bits.append(np.asarray(bits))
        out = []
        while self._pos and int(self._pos[-1][-1]) >= self._hi() - 1:
            out.append(self._prove(self._hi()))
        return out

    def finish(self) -> list[str]:
        """The last chunk (a partial window), if it has rows."""
        out = []
        while self._pos:
            out.append(self._prove(self._hi()))
        return out

    def _prove(self, hi: int) -> str:
        pos, ind, bits = (np.concatenate(a) for a in (self._pos, self._ind, self._bits))
        take = pos < hi
        proof = self.scheme.prove(pos[take], ind[take], bits[take], self.lo, self.width, self.spec.topk)
        rest = ~take
        self._pos, self._ind, self._bits = ([pos[rest]], [ind[rest]], [bits[rest]]) if rest.any() else ([], [], [])
        self.lo, self.count = hi, self.count + 1
        return proof


def check_claim(claim: ProofClaim, chunk_rows: Sequence[np.ndarray]) -> dict[str, Any]:
    """The claim's proofs against the validator's rows of each chunk (bfloat16 bits [n, D] each):
    per proof the scheme's figures and verdict, and the request's."""
    scheme = SCHEMES[claim.scheme]
    th = Thresholds(**claim.thresholds.model_dump())
    per = []
    for i, (proof, rows) in enumerate(zip(claim.proofs, chunk_rows)):
        v: Verdict = scheme.check(proof, rows, claim.topk, th, f"compare.toploc.proofs[{i}]")
        per.append(
            {
                "exp_mismatches": v.exp_mismatches,
                "mant_err_mean": v.mant_err_mean,
                "mant_err_median": v.mant_err_median,
                "ok": v.ok,
            }
        )
    return {
        "scheme": claim.scheme,
        "topk": claim.topk,
        "decode_batching_size": claim.decode_batching_size,
        "thresholds": claim.thresholds.model_dump(),
        "ok": all(p["ok"] for p in per),
        "proofs": per,
    }


__all__ = ["SCHEMES", "ProofBuilder", "ProofClaim", "ProofError", "ProofRequest", "check_claim"]
