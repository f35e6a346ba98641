"""TOPLOC proofs built and checked natively (hidden_states/proofs), against the real toploc
library (0.1.6, its C++ rebuilt against this torch: tests/toploc_ref.py). No vLLM."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hidden_states.proofs as server
from hidden_states.proofs import ProofBuilder, ProofClaim, ProofRequest, check_claim
from hidden_states.proofs import toploc as ours
from tests.toploc_ref import altered, load_toploc

D, K, B = 576, 128, 32  # SmolLM2's width, TOPLOC's top-k and decode batching


@pytest.fixture(scope="module")
def tl():
    return load_toploc()


def bits(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def distinct_activations(rng, P: int, C: int) -> list[torch.Tensor]:
    """A prefill [P, D] and C - 1 decode rows [1, D] in bfloat16 whose magnitudes are all distinct
    within each chunk (no tie at the k-th place: one top-k, so one proof)."""
    magnitudes = rng.permutation(np.arange(0x0100, 0x7F00, dtype=np.uint16))  # finite bfloat16 patterns
    signs = rng.integers(0, 2, magnitudes.size).astype(np.uint16) << 15

    def rows(n: int, at: int) -> torch.Tensor:
        raw = (magnitudes[at : at + n * D] | signs[at : at + n * D]).astype(np.uint16)
        return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).reshape(n, D)

    acts, at = [rows(P, 0)], 0
    for i in range(C - 1):
        at = (P * D + (i % B) * D) % (magnitudes.size - D)  # a window's rows never repeat magnitudes
        acts.append(rows(1, at))
    return acts


def row_topk(rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Each row's top-k as the engine sends it: indices by magnitude, bfloat16 bits."""
    idx = rows.float().abs().topk(K, dim=-1).indices
    return idx.numpy().astype(np.int32), bits(torch.gather(rows, 1, idx))


def server_proofs(acts: list[torch.Tensor], spec: ProofRequest, pieces: int = 3, seed: int = 0) -> list[str]:
    """The server's proofs of these activations, its rows arriving in `pieces` uneven parts (a stream)."""
    rows = torch.cat(acts)
    idx, vals = row_topk(rows)
    positions = np.arange(len(rows))
    builder, out = ProofBuilder(spec, acts[0].shape[0], D), []
    cuts = sorted(np.random.default_rng(seed).choice(np.arange(1, len(rows)), pieces - 1, replace=False))
    for lo, hi in zip([0, *cuts], [*cuts, len(rows)]):
        out += builder.add(positions[lo:hi], idx[lo:hi], vals[lo:hi])
    return out + builder.finish()


def test_the_polynomial_is_toplocs_byte_for_byte(tl):
    """Interpolation is ours (Lagrange's form, through logs), toploc's is Newton's: the same
    integers on every shape of input, the index 0 (no log) and a modulus that steps down included."""
    rng = np.random.default_rng(0)
    cases = [(128, 20_000), (128, 200_000), (7, 40), (64, 65_497 * 3), (1, 3), (2, 3), (3, 3), (128, 128)]
    cases += [(int(rng.integers(1, 200)), int(rng.choice([300, 30_000, 70_000]))) for _ in range(40)]
    for case, (n, span) in enumerate(cases):
        x = rng.choice(span, n, replace=False)
        if case % 3 == 0 and 0 not in x:
            x[-1] = 0
        if span > 65_497 and n > 1:  # two indices equal mod 65497: the modulus must step down
            x[0] = x[0] % (span - 65_497)
            x[1] = x[0] + 65_497
            x = np.unique(x)
        y = torch.from_numpy(rng.standard_normal(len(x)).astype(np.float32)).to(torch.bfloat16)
        theirs = tl.ProofPoly.from_points_tensor(torch.from_numpy(x.astype(np.int64)), y)
        modulus, coeffs = ours.interpolate(x.tolist(), bits(y).tolist())
        assert (modulus, coeffs) == (theirs.modulus, list(theirs.coeffs))
        assert ours.encode(modulus, coeffs) == theirs.to_base64()
        assert (ours.evaluate(coeffs, x % modulus) == bits(y).astype(np.int64) % ours.PRIME).all()


@pytest.mark.parametrize("P,C", [(20, 70), (9, 33), (5, 1), (3, 2)])
def test_proofs_from_each_row_s_top_k_equal_build_proofs_base64(tl, P, C):
    """The server sends each row's top-k; the chunk's top-k, and so the proof, is the library's
    on the whole activations: byte for byte, however the rows arrive."""
    acts = distinct_activations(np.random.default_rng(P * 100 + C), P, C)
    want = tl.build_proofs_base64(acts, B, K)
    assert len(want) == len(ours.chunk_bounds(P, P + C, B))
    for pieces in (1, 2, 5):
        assert server_proofs(acts, ProofRequest(), pieces=min(pieces, P + C - 1)) == want


def test_ties_at_the_k_th_place_give_another_valid_top_k(tl):
    """Real-looking rows in bfloat16 tie often: any of the tied entries completes a top-k. The
    proof then takes the lowest indices; its values are the library's top-k values, and the
    library's own validator accepts it on the same activations."""
    g = torch.Generator().manual_seed(1)
    acts = [torch.randn(12, D, generator=g).to(torch.bfloat16)] + [
        torch.randn(1, D, generator=g).to(torch.bfloat16) for _ in range(40)
    ]
    mine = server_proofs(acts, ProofRequest())
    for proof, (lo, hi) in zip(mine, ours.chunk_bounds(12, 53, B)):
        flat = torch.cat(acts)[lo:hi].reshape(-1)
        m, coeffs = ours.decode(proof, K)
        top = flat.abs().topk(K).values.float().numpy()
        idx, _ = ours.chunk_topk(*_rows_of(acts, lo, hi), lo, D, K)
        assert sorted(np.abs(flat[torch.from_numpy(idx)].float().numpy())) == sorted(top)  # the same top-k values
    results = tl.verify_proofs_base64(acts, mine, B, K)
    assert all(r.exp_mismatches <= 2 and r.mant_err_median == 0 for r in results), results


def _rows_of(acts, lo, hi):
    rows = torch.cat(acts)[lo:hi]
    idx, vals = row_topk(rows)
    return np.arange(lo, hi), idx, vals


def test_the_check_gives_toplocs_figures_on_honest_and_tampered_rows(tl):
    g = torch.Generator().manual_seed(2)
    acts = [torch.randn(20, D, generator=g) * 3] + [torch.randn(1, D, generator=g) * 3 for _ in range(45)]
    honest = [a.to(torch.bfloat16) for a in acts]
    proofs = tl.build_proofs_base64(honest, B, K)
    bounds = ours.chunk_bounds(20, 66, B)
    for name, rows in (
        ("honest", honest),
        ("recomputed", [(a + 0.01 * torch.randn(a.shape, generator=g)).to(torch.bfloat16) for a in acts]),
        ("other", [torch.randn(a.shape, generator=g).to(torch.bfloat16) for a in acts]),
    ):
        theirs = tl.verify_proofs_base64(rows, proofs, B, K)
        flat = torch.cat(rows)
        claim = ProofClaim(proofs=proofs)
        mine = check_claim(claim, [bits(flat[lo:hi]) for lo, hi in bounds])["proofs"]
        assert [(p["exp_mismatches"], p["mant_err_mean"], p["mant_err_median"]) for p in mine] == [
            (r.exp_mismatches, r.mant_err_mean, r.mant_err_median) for r in theirs
        ], name
        passes = [r.exp_mismatches <= 38 and r.mant_err_mean <= 10 and r.mant_err_median <= 8 for r in theirs]
        assert [p["ok"] for p in mine] == passes, name
        assert all(passes) == (name != "other"), (name, theirs)


def figures(verdicts) -> list[tuple]:
    return [(v["exp_mismatches"], v["mant_err_mean"], v["mant_err_median"], v["ok"]) for v in verdicts]


def library_figures(results) -> list[tuple]:
    return [
        (
            r.exp_mismatches,
            r.mant_err_mean,
            r.mant_err_median,
            r.exp_mismatches <= 38 and r.mant_err_mean <= 10 and r.mant_err_median <= 8,
        )
        for r in results
    ]


def altered_proofs_are_rejected(tl) -> None:
    """Honest rows, honest proofs with one of them altered but well formed (tests/toploc_ref.py
    ALTERATIONS: a coefficient changed, it still decodes). The server's validation (`check_claim`,
    what POST /v1/hidden_states answers with) rejects the request and that proof, passes the others,
    and gives the library's figures; the one alteration TOPLOC tolerates (every value one mantissa
    unit off) passes both, and so does a modulus that still exceeds every index (the same points)."""
    g = torch.Generator().manual_seed(3)
    acts = [(torch.randn(20, D, generator=g) * 3).to(torch.bfloat16)] + [
        (torch.randn(1, D, generator=g) * 3).to(torch.bfloat16) for _ in range(45)
    ]
    honest = tl.build_proofs_base64(acts, B, K)
    flat = torch.cat(acts)
    rows = [bits(flat[lo:hi]) for lo, hi in ours.chunk_bounds(20, 66, B)]
    assert server.check_claim(ProofClaim(proofs=honest), rows)["ok"] is True
    for how in ("linear", "exponent", "mantissa"):
        for i in range(len(honest)):
            proofs = [altered(p, how) if j == i else p for j, p in enumerate(honest)]
            verdict = server.check_claim(ProofClaim(proofs=proofs), rows)
            assert figures(verdict["proofs"]) == library_figures(tl.verify_proofs_base64(acts, proofs, B, K)), how
            tolerated = how == "mantissa"
            assert [p["ok"] for p in verdict["proofs"]] == [j != i or tolerated for j in range(len(proofs))], (how, i)
            assert verdict["ok"] is tolerated, (how, i, verdict)
            if not tolerated:
                assert verdict["proofs"][i]["exp_mismatches"] > 100, (how, i, verdict["proofs"][i])
    # The modulus only reduces indices: any value above the chunk's largest index gives the same points.
    modulus, coeffs = ours.decode(honest[0], K)
    assert modulus == ours.PRIME and rows[0].size < modulus - 1
    moved = [ours.encode(modulus - 1, coeffs)] + honest[1:]
    assert server.check_claim(ProofClaim(proofs=moved), rows) == server.check_claim(ProofClaim(proofs=honest), rows)


def exponents_beyond_the_threshold_are_rejected(tl) -> None:
    """A proof through the chunk's true top-k indices with n of its values' exponents changed: n exponent
    mismatches exactly, accepted up to TOPLOC's 38 (one changed value passes: it is a tolerance, not a
    signature), rejected from 39, by the server's validation and the library alike."""
    acts = distinct_activations(np.random.default_rng(4), 20, 1)
    positions, idx, vals = _rows_of(acts, 0, 20)
    x, y = ours.chunk_topk(positions, idx, vals, 0, D, K)
    for n, ok in ((0, True), (1, True), (38, True), (39, False), (K, False)):
        claimed = y.copy()
        claimed[:n] ^= 0x0080  # the exponent's lowest bit of the n largest values
        proof = ours.encode(*ours.interpolate(x.tolist(), claimed.tolist()))
        verdict = server.check_claim(ProofClaim(proofs=[proof]), [bits(acts[0])])
        assert figures(verdict["proofs"]) == library_figures(tl.verify_proofs_base64(acts, [proof], B, K)), n
        assert verdict["proofs"][0]["exp_mismatches"] == n and verdict["ok"] is ok, (n, verdict)


def test_a_well_formed_altered_proof_is_rejected(tl):
    altered_proofs_are_rejected(tl)


def test_exponents_changed_beyond_toplocs_threshold_are_rejected(tl):
    exponents_beyond_the_threshold_are_rejected(tl)


def accept_every_proof(monkeypatch):
    """The breaking variant: the scheme's check passes any proof (figures of an honest one)."""
    monkeypatch.setattr(
        ours, "check", lambda proof, rows, topk, thresholds=None, what="proof": ours.Verdict(0, 0.0, 0.0, True)
    )


def skip_the_compare(monkeypatch):
    """The breaking variant: the request's check never looks at the rows."""
    monkeypatch.setattr(
        server,
        "check_claim",
        lambda claim, chunk_rows: {
            "scheme": claim.scheme,
            "ok": True,
            "proofs": [{"exp_mismatches": 0, "mant_err_mean": 0.0, "mant_err_median": 0.0, "ok": True}]
            * len(claim.proofs),
        },
    )


def ignore_the_thresholds(monkeypatch):
    """The breaking variant: the figures are right, the request's thresholds are not applied."""
    monkeypatch.setattr(server, "Thresholds", lambda **given: ours.Thresholds(10**6, 1e9, 1e9))


BROKEN_VALIDATION = {
    "accepts-every-proof": accept_every_proof,
    "skips-the-compare": skip_the_compare,
    "ignores-the-thresholds": ignore_the_thresholds,
}


@pytest.mark.parametrize("broken", sorted(BROKEN_VALIDATION))
@pytest.mark.parametrize(
    "check",
    [altered_proofs_are_rejected, exponents_beyond_the_threshold_are_rejected],
    ids=["altered-proof", "exponents"],
)
def test_the_checks_fail_when_validation_is_broken(tl, monkeypatch, broken, check):
    """Each check above, with the server's validation broken: it fails."""
    BROKEN_VALIDATION[broken](monkeypatch)
    with pytest.raises(AssertionError):
        check(tl)


@pytest.mark.parametrize(
    "proof,words", [("not base64!", "not base64"), ("AAAA", "holds 3 bytes"), ("A" * 344, "modulus 0")]
)
def test_malformed_proofs_say_what_is_wrong(proof, words):
    with pytest.raises(ours.ProofError, match=words):
        ours.decode(proof, K)
