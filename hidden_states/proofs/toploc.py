"""TOPLOC proofs (PrimeIntellect-ai/toploc 0.1.6, arXiv 2501.16007), built and checked natively:
numpy only, no torch extension, no toploc at run time.

Per chunk of fed positions (the prefill, then `decode_batching_size` decode steps) of bfloat16
last-layer rows, the `topk` entries of largest magnitude (flat index p * D + d) are encoded as
the polynomial through (index mod m, bfloat16 bits) over GF(65497): m then the coefficients,
16-bit big-endian, base64; byte for byte toploc's `build_proofs_base64`. Ties at the k-th place
take the lowest flat index (torch.topk may differ; a validator accepts either). `check` is
toploc's `verify_proofs`, with indices reduced by the modulus as its C++ path does.
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


def _modpow(base: np.ndarray, exp: np.ndarray | int) -> np.ndarray:
    """base ** exp mod 65497, elementwise (square and multiply over the exponents' bits)."""
    out, b, e = np.ones(np.broadcast(base, exp).shape, np.int64), base % PRIME, np.asarray(exp, np.int64)
    while e.any():
        out = np.where(e & 1, out * b % PRIME, out)
        b, e = b * b % PRIME, e >> 1
    return out


_GENERATOR = 7  # a primitive root of GF(65497): 65496 = 2^3 * 3 * 2729, and 7^(65496/q) != 1 for each q
_TABLES: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


def _tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(exp, log, inverse) over GF(65497), built once; log laid out twice so differences index it unreduced."""
    global _TABLES
    if _TABLES is None:
        assert all(pow(_GENERATOR, (PRIME - 1) // q, PRIME) != 1 for q in (2, 3, 2729))
        k = np.arange(PRIME - 1, dtype=np.int64)
        exp = _modpow(np.int64(_GENERATOR), k)
        log = np.zeros(PRIME, np.int64)
        log[exp] = k
        inverse = np.zeros(PRIME, np.int64)
        inverse[exp] = exp[(-k) % (PRIME - 1)]
        _TABLES = exp, np.concatenate([log, log]), inverse
    return _TABLES


def _modulus(x: np.ndarray) -> int:
    """The largest m <= 65497 under which `x` stays injective (poly.cpp from_points)."""
    for m in range(PRIME, 0, -1):
        if len(np.unique(x % m)) == len(x):
            return m
    raise ProofError("no injective modulus")  # pragma: no cover - 128 distinct ints always have one


_SUMS: dict[tuple[int, int], np.ndarray] = {}


def _roots_polynomial(roots: np.ndarray) -> np.ndarray:
    """Ascending coefficients of prod_j (X - roots_j) over GF(65497), by a product tree (float64
    partial sums stay below 2^53: exact)."""
    n, size = len(roots), 1
    while size < n:
        size *= 2
    polys = np.zeros((size, 2), np.int64)
    polys[:, 0] = 1  # padding: the constant 1
    polys[:n, 0], polys[:n, 1] = (-roots) % PRIME, 1
    while len(polys) > 1:
        k, r = len(polys) // 2, polys.shape[1]
        if (k, r) not in _SUMS:
            i = np.arange(r)
            _SUMS[k, r] = ((i[:, None] + i[None, :])[None] + (np.arange(k) * (2 * r - 1))[:, None, None]).ravel()
        outer = polys[0::2, :, None] * polys[1::2, None, :]
        sums = np.bincount(_SUMS[k, r], weights=outer.ravel().astype(np.float64), minlength=k * (2 * r - 1))
        polys = (sums.astype(np.int64) % PRIME).reshape(k, 2 * r - 1)
    return polys[0, : n + 1]


def _powers(x: np.ndarray, n: int) -> np.ndarray:
    """[len(x), n]: x_i^t for t < n over GF(65497), through logs (0^0 = 1)."""
    exp, log, _ = _tables()
    powers = exp[log[x][:, None] * np.arange(n)[None, :] % (PRIME - 1)]
    zero = x == 0
    powers[zero] = 0
    powers[zero, 0] = 1
    return powers


def interpolate(x: Sequence[int], y: Sequence[int]) -> tuple[int, list[int]]:
    """(modulus, ascending coefficients) of the polynomial of degree < n through (x mod m, y) over
    GF(65497), ndd.cpp's integers, in Lagrange's form with a constant number of array passes."""
    exp, log, inverse = _tables()
    x = np.asarray(x, dtype=np.int64)
    m = _modulus(x)
    xm = x % m
    n = len(xm)
    diff_logs = log[xm[:, None] - xm[None, :] + PRIME]  # distinct residues: no difference is 0
    np.fill_diagonal(diff_logs, 0)
    c = np.asarray(y, dtype=np.int64) % PRIME * inverse[exp[diff_logs.sum(1) % (PRIME - 1)]] % PRIME
    s = c @ _powers(xm, n) % PRIME
    p = _roots_polynomial(xm)
    coeffs = np.convolve(p[1:][::-1], s)[:n][::-1] % PRIME  # sum_t P[j + 1 + t] * S_t
    return m, coeffs.tolist()


def evaluate(coeffs: Sequence[int], x: np.ndarray) -> np.ndarray:
    """The polynomial at points `x`, mod 65497 (ndd.cpp evaluate_polynomial's integers)."""
    x = np.asarray(x, dtype=np.int64) % PRIME
    return _powers(x.reshape(-1), len(coeffs)) @ np.asarray(coeffs, np.int64) % PRIME


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


def chunk_topk(
    positions: np.ndarray, indices: np.ndarray, bits: np.ndarray, lo: int, width: int, topk: int
) -> tuple[np.ndarray, np.ndarray]:
    """The chunk's top-k (flat indices, bfloat16 bits) from its rows' top-k (`indices`, `bits` [n, k]
    at `positions`, rows of `width`). Largest magnitude first; ties by lowest flat index."""
    flat = ((positions[:, None] - lo) * width + indices).reshape(-1).astype(np.int64)
    b = bits.reshape(-1).astype(np.int64)
    if len(b) > topk:  # only entries at or above the k-th magnitude can be in it
        keep = (b & 0x7FFF) >= np.partition(b & 0x7FFF, len(b) - topk)[len(b) - topk]
        flat, b = flat[keep], b[keep]
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


def check(
    proof: str, chunk_bits: np.ndarray, topk: int, thresholds: Thresholds = Thresholds(), what: str = "proof"
) -> Verdict:
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
    mean = float(np.mean(errs)) if errs else float(2**64)
    median = float(statistics.median(errs)) if errs else float(2**64)
    n = int(exp_mismatch.sum())
    ok = n <= thresholds.exp_mismatches and mean <= thresholds.mant_err_mean and median <= thresholds.mant_err_median
    return Verdict(n, mean, median, ok)
