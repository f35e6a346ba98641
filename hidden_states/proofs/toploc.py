"""TOPLOC proofs (PrimeIntellect-ai/toploc 0.1.6, arXiv 2501.16007), built and checked natively:
numpy only, no torch extension, no toploc at run time.

What a proof is. A request's activations are the last layer's rows after the final norm, as
bfloat16, at every position that was fed: the prompt (one chunk, the prefill), then each decode
step's row, in chunks of `decode_batching_size` (the final token is never fed). Per chunk, the
`topk` entries of largest magnitude of the flattened chunk (row-major: element (p, d) of a chunk
of rows p is at p * D + d) are encoded as the polynomial through the points (index mod m, the
value's bfloat16 bit pattern) over GF(65497), m the largest modulus <= 65497 under which the
indices stay distinct; the proof is m then the coefficients, 16 bits big-endian each, in base64.
That is toploc's `ProofPoly.from_points_tensor(...).to_base64()`, byte for byte (its
`C/csrc/ndd.cpp` and `poly.cpp`), and `build_proofs_base64(activations, decode_batching_size,
topk)` chunk by chunk.

The top-k of a chunk needs only each row's top-k (the chunk's largest entries are among its
rows' largest), so the engine sends k entries per row. Where entries of equal magnitude straddle
the k-th place, any of them completes a top-k: this module takes the lowest flat indices first;
torch.topk takes whichever its selection algorithm leaves, so the two proofs can differ in those
points (both are top-k proofs of the same activations, and a validator accepts either).

Checking a proof (`check`) is toploc's `verify_proofs`: the validator's own activations of the
chunk, its top-k indices (torch.topk's), the proof evaluated there, and per proof the exponent
mismatches and the mantissa error mean and median (bfloat16 fields) where the exponents match,
against thresholds (TOPLOC's by default). Indices are reduced by the proof's modulus before
evaluation, as toploc's C++ path does (its Python path skips that, and misjudges chunks of more
than 65,497 entries whose modulus is smaller).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import statistics
from collections.abc import Sequence

import numpy as np

PRIME = 65497  # the field toploc interpolates in (ndd.cpp MOD_N)
_EXP, _MANT = 0x7F80, 0x007F  # bfloat16 exponent and mantissa bits


class ProofError(ValueError):
    """A proof that does not decode, or does not fit the request (the message says which)."""


def _modpow(base: np.ndarray, exp: int) -> np.ndarray:
    out, b = np.ones_like(base), base % PRIME
    while exp:
        if exp & 1:
            out = out * b % PRIME
        b, exp = b * b % PRIME, exp >> 1
    return out


_INVERSES: np.ndarray | None = None


def _inverse_table() -> np.ndarray:
    """1 / v in GF(65497) for every v (0 -> 0): one table, built once (a gather per proof after)."""
    global _INVERSES
    if _INVERSES is None:
        _INVERSES = _modpow(np.arange(PRIME, dtype=np.int64), PRIME - 2)
    return _INVERSES


def _modulus(x: np.ndarray) -> int:
    """The largest m <= 65497 under which `x` stays injective (poly.cpp from_points)."""
    for m in range(PRIME, 0, -1):
        if len(np.unique(x % m)) == len(x):
            return m
    raise ProofError("no injective modulus")  # pragma: no cover - 128 distinct ints always have one


def interpolate(x: Sequence[int], y: Sequence[int]) -> tuple[int, list[int]]:
    """(modulus, coefficients in ascending order) of the polynomial through (x mod m, y) over
    GF(65497): ndd.cpp's compute_newton_coefficients, vectorized (the same integers)."""
    x = np.asarray(x, dtype=np.int64)
    m = _modulus(x)
    xm = x % m
    n = len(xm)
    dd = np.asarray(y, dtype=np.int64) % PRIME
    inverses = _inverse_table()[(xm[:, None] - xm[None, :]) % PRIME]  # 1 / (x_i - x_j), all pairs at once
    rows = np.arange(n)
    for k in range(1, n):  # dd[i] = (dd[i] - dd[i-1]) / (x[i] - x[i-k]), i = n-1 .. k, old values
        dd[k:] = (dd[k:] - dd[k - 1:-1]) % PRIME * inverses[rows[k:], rows[:-k]] % PRIME
    coeffs, factor = np.zeros(n, np.int64), np.zeros(n + 1, np.int64)
    factor[0] = 1
    for i in range(n):  # coeffs += dd[i] * prod_{j<i} (X - x_j)
        coeffs[:i + 1] = (coeffs[:i + 1] + dd[i] * factor[:i + 1]) % PRIME
        if i + 1 < n:
            shifted = np.concatenate([[0], factor[:-1]])
            factor = (shifted + factor * ((-xm[i]) % PRIME)) % PRIME
    return m, coeffs.tolist()


def evaluate(coeffs: Sequence[int], x: np.ndarray) -> np.ndarray:
    """The polynomial at points `x` (Horner, mod 65497: ndd.cpp evaluate_polynomial)."""
    x = np.asarray(x, dtype=np.int64) % PRIME
    out = np.full(x.shape, coeffs[-1], np.int64)
    for c in coeffs[-2::-1]:
        out = (out * x + c) % PRIME
    return out


def encode(modulus: int, coeffs: Sequence[int]) -> str:
    """poly.cpp to_bytes + base64: modulus, then each coefficient, 16-bit big-endian."""
    return base64.b64encode(np.asarray([modulus, *coeffs], dtype=">u2").tobytes()).decode("ascii")


def decode(proof: str, topk: int, what: str = "proof") -> tuple[int, list[int]]:
    try:
        raw = base64.b64decode(proof, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ProofError(f"{what} is not base64") from None
    if len(raw) != 2 + 2 * topk:
        raise ProofError(f"{what} holds {len(raw)} bytes; a top-{topk} proof holds {2 + 2 * topk}")
    words = np.frombuffer(raw, dtype=">u2").astype(np.int64)
    if words[0] == 0:
        raise ProofError(f"{what} has modulus 0 (toploc's null proof: the prover failed)")
    return int(words[0]), words[1:].tolist()


def chunk_bounds(prompt_len: int, total: int, decode_batching_size: int) -> list[tuple[int, int]]:
    """The positions [lo, hi) of each proof of a sequence of `total` tokens whose prompt has
    `prompt_len`: the prefill, then windows of fed decode positions (prompt_len .. total-2)."""
    bounds = [(0, prompt_len)]
    for lo in range(prompt_len, total - 1, decode_batching_size):
        bounds.append((lo, min(lo + decode_batching_size, total - 1)))
    return bounds


def chunk_topk(positions: np.ndarray, indices: np.ndarray, bits: np.ndarray, lo: int, width: int,
               topk: int) -> tuple[np.ndarray, np.ndarray]:
    """The chunk's top-k (flat indices, bfloat16 bits) from its rows' top-k: `positions` [n] of
    the rows (absolute, from `lo`), `indices` [n, k] within each row of `width` entries, `bits`
    [n, k] uint16. Largest magnitude first; ties by lowest flat index."""
    flat = ((positions[:, None] - lo) * width + indices).reshape(-1).astype(np.int64)
    b = bits.reshape(-1).astype(np.int64)
    order = np.lexsort((flat, -(b & 0x7FFF)))[:topk]
    return flat[order], b[order]


def prove(positions: np.ndarray, indices: np.ndarray, bits: np.ndarray, lo: int, width: int, topk: int) -> str:
    """One chunk's proof from its rows' top-k entries (`chunk_topk`'s arguments)."""
    x, y = chunk_topk(positions, indices, bits, lo, width, topk)
    if len(x) < topk:
        raise ProofError(f"a chunk of {len(positions)} rows has {len(x)} entries, fewer than top-{topk}")
    return encode(*interpolate(x.tolist(), y.tolist()))


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """TOPLOC's acceptance (its vllm_validate_poly.py, for top-128): exponents match at >= 90 of
    the 128 points, and where they do, the mantissa error has mean <= 10 and median <= 8."""

    exp_mismatches: int = 38
    mant_err_mean: float = 10.0
    mant_err_median: float = 8.0


@dataclasses.dataclass(frozen=True)
class Verdict:
    exp_mismatches: int
    mant_err_mean: float
    mant_err_median: float
    ok: bool


def check(proof: str, chunk_bits: np.ndarray, topk: int, thresholds: Thresholds = Thresholds(),
          what: str = "proof") -> Verdict:
    """A proof against the validator's own activations of its chunk (`chunk_bits`: the rows as
    bfloat16 bit patterns, [n, D]): toploc's figures, and whether they pass `thresholds`."""
    import torch

    modulus, coeffs = decode(proof, topk, what)
    flat = torch.from_numpy(np.ascontiguousarray(chunk_bits, dtype=np.uint16).reshape(-1).view(np.int16))
    values = flat.view(torch.bfloat16)
    if values.numel() < topk:
        raise ProofError(f"{what}'s chunk has {values.numel()} entries, fewer than top-{topk}")
    idx = values.abs().topk(topk).indices.numpy()  # the validator's top-k, as toploc's verify takes it
    mine = np.asarray(chunk_bits, dtype=np.uint16).reshape(-1)[idx].astype(np.int64)
    claimed = evaluate(coeffs, idx % modulus)
    exp_mismatch = (claimed & _EXP) != (mine & _EXP)
    errs = np.abs((claimed & _MANT) - (mine & _MANT))[~exp_mismatch].tolist()
    mean = float(np.mean(errs)) if errs else float(2 ** 64)
    median = float(statistics.median(errs)) if errs else float(2 ** 64)
    n = int(exp_mismatch.sum())
    ok = n <= thresholds.exp_mismatches and mean <= thresholds.mant_err_mean and median <= thresholds.mant_err_median
    return Verdict(n, mean, median, ok)
