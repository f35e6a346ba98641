"""The fixed, seeded request mix.

Prompt lengths log-uniform over 32..1500 tokens, completions uniform over
16..256 tokens, exact thanks to `ignore_eos`. Prompts are token-id lists, so
their lengths are exact on every server (no tokenizer in the way).

Every arm of a comparison gets the same lengths in a round (paired requests),
but its own token contents: a later arm never finds an earlier arm's prompts
in the prefix cache of the same engine.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

PROMPT_MIN, PROMPT_MAX = 32, 1500
COMPLETION_MIN, COMPLETION_MAX = 16, 256
SEED = 20261129
# name -> (prompt tokens min..max, completion tokens min..max, what it is)
WORKLOADS = {
    "mix": ((32, 1500), (16, 256), "prompts 32-1500 tokens (log-uniform), completions 16-256 (the default)"),
    "short-out": ((100, 900), (48, 48), "prompts 100-900 tokens, 48 out: issue 22's held-out on/off workload"),
}


def use(name: str) -> None:
    """Selects the shapes `shapes()` draws from (`python -m bench --workload NAME`)."""
    global PROMPT_MIN, PROMPT_MAX, COMPLETION_MIN, COMPLETION_MAX
    (PROMPT_MIN, PROMPT_MAX), (COMPLETION_MIN, COMPLETION_MAX), _ = WORKLOADS[name]


@dataclass(frozen=True)
class Shape:
    prompt_tokens: int
    max_tokens: int


def shapes(n: int, seed: int = SEED, completion_max: int = COMPLETION_MAX) -> list[Shape]:
    """The first n shapes of the seeded mix (a prefix of the same sequence for any n)."""
    rng = random.Random(seed)
    out = []
    lo, hi = math.log(PROMPT_MIN), math.log(PROMPT_MAX)
    for _ in range(n):
        p = int(round(math.exp(rng.uniform(lo, hi))))
        c = rng.randint(COMPLETION_MIN, COMPLETION_MAX)
        out.append(Shape(p, min(c, completion_max)))
    return out


def body(model: str, shape: Shape, vocab: int, content_seed: str, extra: dict | None = None) -> bytes:
    """A /v1/completions body (bytes): random token ids in [2, vocab) (0 and 1 are bos/eos)."""
    rng = random.Random(content_seed)
    prompt = [rng.randrange(2, vocab) for _ in range(shape.prompt_tokens)]
    req = {"model": model, "prompt": prompt, "max_tokens": shape.max_tokens, "temperature": 0.0, "ignore_eos": True}
    if extra:
        req.update(extra)
    return json.dumps(req, separators=(",", ":")).encode()
