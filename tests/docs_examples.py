"""The docs' examples, found and checked as written (tests/serve/test_config_yaml.py runs them).

An example is a fenced block of the README, `docs/*.md` or `cluster/README.md` that talks to the
server: `curl` to `localhost:8000` (sh), Python that uses the openai SDK, httpx or
`deployments.client` against it, and the batch command (`python -m deployments.batch`). Blocks
that start or provision something (`make serve`, `ray up`, `ray start`, `docker build`) are not
examples of talking to it; `SET_UP` names what they are.

What an example says it answers is its `# ->` comments, checked against what it printed:
- after curl, `"key": value` pairs: the key must be in the JSON answer (anywhere in it) and its
  value as written: a JSON value equal, `[N floats]` a list of N numbers, `[a, ..., b]` a list
  from a to b, `"<base64 of DTYPE [d0, d1]>"` base64 of that many values, `{...}` the same rules
  inside, a `...` element anything more;
- after a Python expression statement, the expression's value: equal to the comment if that is a
  Python literal, else its `str()` must match the comment with `...` standing for anything.
A Python doc's blocks run in one process, in order (a later block may use an earlier one's
`client`), as another Ray job would: `RAY_ADDRESS` names the server's cluster.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.S | re.M)
SET_UP = ("make serve", "ray up", "ray start", "docker build", "make bench")


@dataclasses.dataclass(frozen=True)
class Example:
    doc: str  # repository-relative path
    line: int  # of the opening fence
    kind: str  # "curl", "python" or "batch"
    code: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "cluster" / "README.md"]


def kind_of(lang: str, code: str) -> str | None:
    if any(code.lstrip().startswith(s) or f"\n{s}" in code for s in SET_UP):
        return None
    if lang == "sh" and "deployments.batch" in code:
        return "batch"
    if lang == "sh" and re.search(r"\bcurl\b.*localhost:8000", code):
        return "curl"
    if lang == "python" and re.search(r"openai\.|httpx\.|deployments\.client", code):
        return "python"
    return None


def examples() -> list[Example]:
    out = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            indent, lang, code = m.group(1), m.group(2), m.group(3)
            code = "\n".join(line[len(indent):] for line in code.splitlines())
            kind = kind_of(lang, code)
            if kind is not None:
                out.append(Example(path.relative_to(ROOT).as_posix(), text[:m.start()].count("\n") + 1, kind, code))
    return out


# -- curl: `# -> "key": value, ...` against the JSON answer ---------------------------------------

def expectation(code: str) -> str:
    """The `# ->` comment and its continuation lines (`#    ...`), up to a `# (` aside."""
    lines, on = [], False
    for line in code.splitlines():
        s = line.strip()
        if s.startswith("# ->"):
            on = True
            lines.append(s[4:])
        elif on and s.startswith("#") and not s.startswith("# ("):
            lines.append(s[1:])
        else:
            on = False
    return " ".join(lines).strip()


def _split(s: str) -> list[str]:
    """Top-level comma-separated items of `s` (brackets and strings kept whole)."""
    items, depth, cur, quoted = [], 0, "", False
    for ch in s:
        if ch == '"' and not cur.endswith("\\"):
            quoted = not quoted
        if not quoted:
            if ch in "[{":
                depth += 1
            elif ch in "]}":
                depth -= 1
            elif ch == "," and depth == 0:
                items.append(cur.strip())
                cur = ""
                continue
        cur += ch
    if cur.strip():
        items.append(cur.strip())
    return items


def pairs(s: str) -> list[tuple[str, str]]:
    """`"key": value` items of an expectation (an enclosing `{...}` dropped; `...` items skipped)."""
    s = s.strip()
    if s.startswith("{") and s.endswith("}"):
        s = s[1:-1]
    out = []
    for item in _split(s):
        m = re.match(r'"([\w.]+)"\s*:\s*(.+)$', item, re.S)
        if m:
            out.append((m.group(1), m.group(2).strip()))
        elif item.strip() != "...":
            raise ValueError(f"not a `\"key\": value` item: {item!r}")
    return out


def find(doc: Any, key: str) -> list[Any]:
    """Every value of `key` in a JSON document, outermost first."""
    found, todo = [], [doc]
    while todo:
        node = todo.pop(0)
        if isinstance(node, dict):
            if key in node:
                found.append(node[key])
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return found


ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4}


def value_problem(got: Any, want: str) -> str | None:
    """None if `got` is what `want` (an expectation's value) says, else what differs."""
    if m := re.fullmatch(r"\[(\d+) floats\]", want):
        n = int(m.group(1))
        ok = isinstance(got, list) and len(got) == n and all(isinstance(x, (int, float)) for x in got)
        return None if ok else f"not {n} floats: {str(got)[:80]}"
    if m := re.fullmatch(r'"<base64 of (\w+) \[([\d, ]+)\]>"', want):
        size = math.prod(int(x) for x in m.group(2).split(",")) * ITEMSIZE[m.group(1)]
        try:
            n = len(base64.b64decode(got, validate=True))
        except Exception:
            return f"not base64: {str(got)[:80]}"
        return None if n == size else f"{n} bytes of base64, not {size}"
    if want.startswith("{"):
        if not isinstance(got, dict):
            return f"not an object: {str(got)[:80]}"
        return "; ".join(p for p in problems(got, want, nested=True)) or None
    if want.startswith("[") and "..." in want:
        ends = [x for x in _split(want[1:-1])]
        head, tail = ends[:ends.index("...")], ends[ends.index("...") + 1:]
        if not isinstance(got, list) or len(got) < len(head) + len(tail):
            return f"not a list of at least {len(head) + len(tail)}: {str(got)[:80]}"
        bad = [(json.loads(w), g) for w, g in zip(head, got[:len(head)])] + \
              [(json.loads(w), g) for w, g in zip(tail, got[len(got) - len(tail):])]
        return None if all(w == g for w, g in bad) else f"{got} does not run {want}"
    try:
        expected = json.loads(want)
    except ValueError:
        return f"the docs' value {want!r} is not checkable"
    return None if got == expected else f"{got!r} != {expected!r}"


def problems(answer: Any, want: str, nested: bool = False) -> list[str]:
    """What the answer lacks of an expectation (`# ->` text), one line each."""
    out = []
    for key, value in pairs(want):
        values = [answer[key]] if nested and isinstance(answer, dict) and key in answer else find(answer, key)
        if not values:
            out.append(f"no {key!r} in the answer")
            continue
        issue = value_problem(values[0], value)
        if issue is not None:
            out.append(f"{key}: {issue}")
    return out


# -- Python: `expr  # -> value` lines become checks --------------------------------------------

def checked_python(code: str) -> str:
    """The block with each `expression  # -> value` statement turned into `_expect(expression, value)`."""
    lines = code.splitlines()
    tree = ast.parse(code)
    for node in reversed(tree.body):
        if not isinstance(node, ast.Expr):
            continue
        last = lines[node.end_lineno - 1]
        m = re.search(r"#\s*->\s*(.+)$", last)
        if m is None:
            continue
        expr = ast.get_source_segment(code, node)
        indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)
        lines[node.lineno - 1:node.end_lineno] = [f"{indent}_expect(({expr}), {m.group(1).strip()!r}, {node.lineno})"]
    return "\n".join(lines)


def expect(value: Any, want: str, line: int) -> None:
    """The check `checked_python` calls: a literal is compared as a value, anything else as text
    with `...` for anything (`(..., 576)` matches `(7, 576)`)."""
    try:
        if "..." in want:
            raise ValueError("a pattern")
        literal = ast.literal_eval(want)
    except (ValueError, SyntaxError):
        pattern = ".*".join(re.escape(part) for part in want.split("..."))
        if re.fullmatch(pattern, str(value), re.S) is None:
            raise AssertionError(f"line {line}: {value!s} is not what the docs show: {want}") from None
        return
    if value != literal:
        raise AssertionError(f"line {line}: {value!r} != {literal!r} (the docs show {want})")


PRELUDE = '''
import sys
from tests.docs_examples import expect as _expect
'''
