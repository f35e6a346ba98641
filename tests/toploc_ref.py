"""The real toploc library (PrimeIntellect-ai/toploc 0.1.6 from PyPI) as the proofs' reference.

Its wheel's compiled extensions were built against an older torch and do not import with this
one (`undefined symbol ... const_data_ptr`), but the wheel ships their C++ sources
(`toploc/C/csrc/{ndd,utils,poly}.cpp`). They are compiled here against the installed torch
with `torch.utils.cpp_extension.load` (a few minutes on 2 cores, once: the build is cached
beside the built-in models), installed as `toploc.C.csrc.*`, and then `toploc` imports as
published: `build_proofs_base64` and `verify_proofs_base64` are the library's own code.
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
        module = cpp_extension.load(name=name, sources=[str(src / f"{name}.cpp")], build_directory=str(build),
                                    extra_cflags=["-O2", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
        sys.modules[f"toploc.C.csrc.{name}"] = module
    import toploc

    return toploc


def fed_rows(model, ids: list[int], prompt_len: int) -> list:
    """transformers' float32 last-layer rows of every fed position (the final token never is), cast to
    bfloat16 as TOPLOC's validator casts them: the prefill [P, D], then one [1, D] per decode step."""
    import torch

    with torch.no_grad():
        rows = model(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states[-1][0].to(torch.bfloat16)
    return [rows[:prompt_len]] + [rows[p:p + 1] for p in range(prompt_len, len(ids) - 1)]


def library_ok(tl, acts, proofs, decode_batching_size: int, topk: int = 128) -> list[bool]:
    """toploc.verify_proofs_base64 per proof, under TOPLOC's thresholds (38, 10, 8)."""
    return [r.exp_mismatches <= 38 and r.mant_err_mean <= 10 and r.mant_err_median <= 8
            for r in tl.verify_proofs_base64(acts, proofs, decode_batching_size, topk)]
