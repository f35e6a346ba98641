"""The real toploc library (PrimeIntellect-ai/toploc 0.1.6 from PyPI) as the proofs' reference.

Its wheel's compiled extensions were built against an older torch and do not import with this
one (`undefined symbol ... const_data_ptr`), but the wheel ships their C++ sources
(`toploc/C/csrc/{ndd,utils,poly}.cpp`). They are compiled here against the installed torch
with `torch.utils.cpp_extension.load` (a few minutes on 2 cores, once: the build is cached
beside the built-in models), installed as `toploc.C.csrc.*`, and then `toploc` imports as
published: `build_proofs_base64` and `verify_proofs_base64` are the library's own code.

Also the proof tests' ways of tampering: a well-formed proof altered (`altered`), another model
(`perturbed`).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load_toploc():
    import torch
    from torch.utils import cpp_extension

    from hidden_states.models.builtin import cache_root

    if "toploc.poly" in sys.modules:
        return sys.modules["toploc"]
    spec = importlib.util.find_spec("toploc")
    assert spec is not None and spec.origin, "toploc is not installed (the test extra: pip install -e '.[test]')"
    src = Path(spec.origin).parent / "C" / "csrc"
    build = cache_root().parent / "toploc-build" / f"torch-{torch.__version__}"
    build.mkdir(parents=True, exist_ok=True)

    for name in ("ndd", "utils", "poly"):
        module = cpp_extension.load(
            name=name,
            sources=[str(src / f"{name}.cpp")],
            build_directory=str(build),
            extra_cflags=["-O2", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        sys.modules[f"toploc.C.csrc.{name}"] = module
    import toploc

    return toploc


def fed_rows(model, ids: list[int], prompt_len: int) -> list:
    """transformers' float32 last-layer rows of every fed position (the final token never is), cast to
    bfloat16 as TOPLOC's validator casts them: the prefill [P, D], then one [1, D] per decode step."""
    import torch

    with torch.no_grad():
        rows = model(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states[-1][0].to(torch.bfloat16)
    return [rows[:prompt_len]] + [rows[p : p + 1] for p in range(prompt_len, len(ids) - 1)]


def library_ok(tl, acts, proofs, decode_batching_size: int, topk: int = 128) -> list[bool]:
    """toploc.verify_proofs_base64 per proof, under TOPLOC's thresholds (38, 10, 8)."""
    return [
        r.exp_mismatches <= 38 and r.mant_err_mean <= 10 and r.mant_err_median <= 8
        for r in tl.verify_proofs_base64(acts, proofs, decode_batching_size, topk)
    ]


# How a well-formed proof is altered: it still decodes (the length, a non-zero modulus), its polynomial
# is another one. `linear`: the coefficient of X, plus one (every value it gives moves by its point,
# mod 65497: scrambled); `exponent`: the constant term plus 0x80 (every value's bfloat16 exponent one
# step up). `mantissa` is the one TOPLOC tolerates: the constant term plus one, every value's mantissa
# off by one unit (a mantissa error of 1 against a mean threshold of 10).
ALTERATIONS = {"linear": (1, 1), "exponent": (0, 0x80), "mantissa": (0, 1)}


def altered(proof: str, how: str, topk: int = 128) -> str:
    """`proof` with one coefficient changed (ALTERATIONS), re-encoded: a proof that decodes as one."""
    from hidden_states.proofs import toploc as ours

    at, delta = ALTERATIONS[how]
    modulus, coeffs = ours.decode(proof, topk)
    coeffs[at] = (coeffs[at] + delta) % ours.PRIME
    out = ours.encode(modulus, coeffs)
    assert out != proof and ours.decode(out, topk) == (modulus, coeffs)
    return out


def perturbed(model, scale: float = 0.05, seed: int = 0):
    """Another model: the same weights, each with noise of `scale` times its mean magnitude added."""
    import copy

    import torch

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g))
    return other
