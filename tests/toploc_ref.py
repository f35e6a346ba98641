"""The real toploc library (PrimeIntellect-ai/toploc 0.1.6 from PyPI) as the proofs' reference.

Its wheel's compiled extensions were built against an older torch and do not import with this
one (`undefined symbol ... const_data_ptr`), but the wheel ships their C++ sources
(`toploc/C/csrc/{ndd,utils,poly}.cpp`). They are compiled here against the installed torch
with `torch.utils.cpp_extension.load` (a few minutes on 2 cores, once: the build is cached
beside the built-in models), installed as `toploc.C.csrc.*`, and then `toploc` imports as
published: `build_proofs_base64` and `verify_proofs_base64` are the library's own code.

Also the proof tests' ways of tampering: a well-formed proof altered (`altered`), another model
(`perturbed`), and the checks the engine and serve proof tests share (`ProofChoice` and the cases on it).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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


# The tampered cases both proof tests check (tests/engine/test_proofs.py on an engine's own routes,
# tests/serve/test_proofs.py over HTTP), each a function of a ProofChoice; REJECTIONS-style lists of them
# are the tests' own. Where the two tiers check differently, a field of the choice says how.


@dataclass(kw_only=True)
class ProofChoice:
    """One choice's tokens and proofs, and what the checks need.

    `validate(body)`: the server's `comparison` for a POST /v1/hidden_states body; `proof`: the request's
    hidden_states_proof (its windows and top-k); `model`, `other_model`: transformers models (this one, and
    another); `label`: said in failures (the engine's dtype). How the checks differ between callers:
    `exact`: the server's verdicts are the library's proof by proof (else only the request's verdict is
    compared); `other_prompt`: the tokens `another_prompt` sends; `every_proof_of_another_model_fails`:
    `another_model` also wants every proof rejected; `alterations`: the (how, index) pairs `altered_proof`
    tries (-1: the last proof); `min_exp_mismatches`: an altered proof's exponent mismatches on the server
    are more than this (None: not checked)."""

    validate: Callable[[dict], dict]
    tl: Any
    proof: dict
    model: Any
    other_model: Any
    prompt: list[int]
    completion: list[int]
    proofs: list[str]
    label: str | None = None
    exact: bool
    other_prompt: list[int] | None = None
    every_proof_of_another_model_fails: bool
    alterations: Sequence[tuple[str, int]]
    min_exp_mismatches: int | None

    def __post_init__(self):
        self.prompt, self.completion, self.proofs = list(self.prompt), list(self.completion), list(self.proofs)

    def body(self, prompt=None, completion=None, proofs=None) -> dict:
        return {
            "prompt": self.prompt if prompt is None else prompt,
            "completion": self.completion if completion is None else completion,
            "compare": {"toploc": {**self.proof, "proofs": self.proofs if proofs is None else proofs}},
        }

    def server(self, prompt: list[int], completion: list[int], proofs: list[str]) -> dict:
        return self.validate(self.body(prompt, completion, proofs))

    def library(self, model, prompt: list[int], completion: list[int], proofs: list[str]) -> list[bool]:
        return library_ok(
            self.tl,
            fed_rows(model, prompt + completion, len(prompt)),
            proofs,
            self.proof["decode_batching_size"],
            self.proof["topk"],
        )

    def library_proofs(self, model) -> list[str]:
        """The library's proofs of this choice's tokens on `model`'s rows."""
        ids, P = self.prompt + self.completion, len(self.prompt)
        return self.tl.build_proofs_base64(
            fed_rows(model, ids, P), self.proof["decode_batching_size"], self.proof["topk"]
        )


def honest(c: ProofChoice) -> None:
    comparison = c.validate(c.body())
    assert comparison["ok"] is True and len(comparison["proofs"]) == len(c.proofs), comparison


def rejected(c: ProofChoice, what: str, prompt: list[int], completion: list[int], proofs=None) -> list[bool]:
    """The choice's proofs (or `proofs`) on these tokens: the library rejects them on transformers' rows, and so
    does the server (proof by proof where `c.exact`); the library's verdicts."""
    proofs = c.proofs if proofs is None else proofs
    lib = c.library(c.model, prompt, completion, proofs)
    srv = c.server(prompt, completion, proofs)
    if c.exact:
        assert [p["ok"] for p in srv["proofs"]] == lib, (what, c.label, lib, srv)
    assert not all(lib) and srv["ok"] is False, (what, c.label, lib, srv)
    return lib


def another_completion(c: ProofChoice) -> None:
    """The same prompt and length, the completion's tokens reversed: its decode proofs fail."""
    other = c.completion[::-1]
    assert other != c.completion
    rejected(c, "another completion", c.prompt, other)


def another_prompt(c: ProofChoice) -> None:
    """Another prompt altogether (`c.other_prompt`) before the same completion."""
    assert c.other_prompt is not None and c.other_prompt != c.prompt
    rejected(c, "another prompt", c.other_prompt, c.completion)


def a_prompt_token_changed(c: ProofChoice) -> None:
    """One prompt token (the second) changed: the prefill's proof fails."""
    tampered = [c.prompt[0], (c.prompt[1] + 1) % 256, *c.prompt[2:]]
    assert not rejected(c, "a prompt token changed", tampered, c.completion)[0]


def another_model(c: ProofChoice) -> None:
    """Proofs of these tokens from another model (the library's, on the perturbed model's rows) sent to the
    server: rejected, as the library rejects them on this model's rows; the library's proofs from this model's
    rows pass (what fails is the model, not the library's proofs)."""
    assert c.server(c.prompt, c.completion, c.library_proofs(c.model))["ok"] is True, (
        "the library's proofs of this model"
    )
    lib = rejected(c, "another model", c.prompt, c.completion, c.library_proofs(c.other_model))
    if c.every_proof_of_another_model_fails:
        assert not any(lib), ("another model", c.label, lib)


def altered_proof(c: ProofChoice) -> None:
    """The choice's own tokens, one proof (for each of `c.alterations`) altered but well formed: the server
    rejects the request and that proof, and passes the others."""
    for how, at in c.alterations:
        i = at % len(c.proofs)
        proofs = [altered(p, how) if j == i else p for j, p in enumerate(c.proofs)]
        srv = c.server(c.prompt, c.completion, proofs)
        assert [p["ok"] for p in srv["proofs"]] == [j != i for j in range(len(proofs))], (how, i, srv)
        assert srv["ok"] is False, (how, i, srv)
        if c.min_exp_mismatches is not None:
            assert srv["proofs"][i]["exp_mismatches"] > c.min_exp_mismatches, (how, i, srv)
