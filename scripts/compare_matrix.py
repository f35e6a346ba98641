"""Compares two recordings of the option matrix: every case's responses, byte for byte.

    HS_RECORD_MATRIX=DIR pytest tests/serve/test_option_matrix.py -k parity   # once per release
    python scripts/compare_matrix.py BEFORE_DIR AFTER_DIR

The recordings have ids and timestamps normalised (`<per-request>`); this script also
normalises what differs between two runs of one release: `extraction_seconds` (a timing) and
`replica` (a replica's random id). A stream that differs is compared again as the matrix's parity
test compares streams (`_stream_transcript`): without what STREAM_NOT_COMPARED names, which vLLM
itself varies between identical requests (chunk boundaries, the interleaving of choices' chunks),
and reported as "identical but for chunking". Exit status 1 on any other difference.
"""

from __future__ import annotations

import difflib
import json
import pathlib
import re
import sys
from typing import Any

_VARYING = [
    (re.compile(r'"extraction_seconds": [0-9.e-]+'), '"extraction_seconds": "<timing>"'),
    (re.compile(r'"replica": "[^"]*"'), '"replica": "<replica>"'),
]


def _text(path: pathlib.Path) -> str:
    t = path.read_text()
    for pattern, repl in _VARYING:
        t = pattern.sub(repl, t)
    return t


def _per_choice(recording: dict[str, Any]) -> str:
    """A recording with each stream as the parity test's transcript of it (non-streams unchanged)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from tests.serve.test_option_matrix import _stream_transcript

    out = {
        arm: [status, _stream_transcript(body) if isinstance(body, list) else body]
        for arm, (status, body) in recording.items()
    }
    return json.dumps(out, sort_keys=True, indent=1, default=repr)


def main(before: str, after: str) -> int:
    a, b = pathlib.Path(before), pathlib.Path(after)
    names = sorted({p.name for p in a.glob("*.json")} | {p.name for p in b.glob("*.json")})
    same = interleaved = 0
    for name in names:
        x, y = a / name, b / name
        if not (x.exists() and y.exists()):
            print(f"{name}: only in {'before' if x.exists() else 'after'}")
            continue
        tx, ty = _text(x), _text(y)
        if tx == ty:
            same += 1
            continue
        px, py = _per_choice(json.loads(tx)), _per_choice(json.loads(ty))
        if px == py:
            interleaved += 1
            print(f"{name}: identical but for chunking (STREAM_NOT_COMPARED)")
            continue
        diff = list(difflib.unified_diff(px.splitlines(), py.splitlines(), lineterm="", n=1))
        print(f"{name}: differs\n  " + "\n  ".join(diff[2:14]))
    differ = len(names) - same - interleaved
    print(
        f"{len(names)} cases: {same} identical byte for byte, {interleaved} identical but for chunking, {differ} differ"
    )
    return 1 if differ or not names else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
