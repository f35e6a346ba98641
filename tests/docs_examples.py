"""The docs' examples, found and checked as written (tests/serve/test_config_yaml.py runs them).

Every fenced block of the README, `docs/*.md` and `cluster/README.md` is accounted for: it is an
example the test runs, or `LISTED` names it (by its doc and the start of its first line) with why.
A block that is neither is a problem (`audit`), so a new example cannot drop out unnoticed, whatever
its tag or wording. What runs:
- a shell block (`sh`, `bash`, `shell`, `console`, `zsh`) with `python -m deployments.batch`: the
  batch command, in a folder of its own (its output folder checked for a row per input row and the
  columns the docs list);
- any other shell block with `curl`: run with bash against the server, its stdout the JSON answer;
- every Python block (`python`, `py`, `python3`): a doc's Python blocks run in one process, in order
  (a later block may use an earlier one's `client`), as another Ray job would: `RAY_ADDRESS` names
  the server's cluster.
Blocks of any other tag (`json`, `yaml`, none) and shell blocks of neither kind must be listed.
`LISTED` says of each listed block whether it is `not run` (it starts or provisions something, or
is not code to run) or `set-up` (it runs, in its place, and shows no answer).

What an example says it answers is its own `# ->` comments, checked against what it printed, each:
- after curl, `"key": value` pairs: the key must be in the JSON answer (anywhere in it) and its
  value as written: a JSON value equal, `[N floats]` a list of N numbers, `[a, ..., b]` a list
  from a to b, `"<base64 of DTYPE [d0, d1]>"` base64 of that many values, `{...}` the same rules
  inside, a `...` element anything more;
- after a Python expression statement (at the block's top level, the comment on its last line), the
  expression's value: equal to the comment if that is a Python literal, else its `str()` must match
  the comment with `...` standing for anything. Each check prints a mark when it passes, and the
  run must show every block's marks: a check that did not run is a problem too.
Every curl and Python example must show an answer of its own (a `set-up` block excepted), and a
`# ->` the harness cannot turn into a check (on an assignment, inside a loop, on a line of its own
after Python) is a problem, not a comment skipped.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import io
import json
import math
import re
import subprocess
import sys
import tokenize
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHELL = {"sh", "bash", "shell", "console", "zsh"}
PYTHON = {"python", "py", "python3"}
KINDS = ("curl", "python", "batch")
NOT_RUN, SET_UP = "not run", "set-up"

# The one list of blocks that are not examples with an answer of their own: (doc, the start of the
# block's first line) -> (NOT_RUN or SET_UP, why). Each entry must name exactly one block.
LISTED: dict[tuple[str, str], tuple[str, str]] = {
    ("README.md", "make serve "): (
        NOT_RUN,
        "starts the server the examples talk to (the test's own fixture runs its script, scripts/serve.sh config.yaml)",
    ),
    ("docs/api.md", '"hidden_states_proof": {"scheme": "toploc"'): (NOT_RUN, "a fragment of an answer, not code"),
    ("docs/benchmarks.md", "make bench "): (NOT_RUN, "the benchmarks: an hour and more, on a machine of their own"),
    ("docs/benchmarks.md", "make serve &"): (NOT_RUN, "starts the server, then drives it with vLLM's load generator"),
    ("docs/configuration.md", "args:"): (NOT_RUN, "a fragment of a config's `args`"),
    ("docs/how-it-works.md", "request -> deployments/router.py"): (NOT_RUN, "a diagram"),
    ("docs/how-it-works.md", "import torch"): (
        NOT_RUN,
        "vLLM's bug report's reproduction: it prints uninitialised "
        "memory, unfixed (tests/engine/test_spec_decode.py tests "
        "the fix)",
    ),
    ("docs/how-it-works.md", "def _expand_kernel_impl("): (
        NOT_RUN,
        "the bug report's fix, as vLLM would take it (hidden_states/vllm/patches/spec_expand_kernel.py applies it)",
    ),
    ("docs/how-it-works.md", "import os"): (
        NOT_RUN,
        "vLLM's bug report's reproduction: its engine dies, unfixed (tests/engine/test_pipeline.py tests the fix)",
    ),
    ("docs/how-it-works.md", "if not get_pp_group().is_first_rank and self.intermediate_tensors is None:"): (
        NOT_RUN,
        "the bug report's fix, as vLLM would take it (hidden_states/vllm/patches/pp_buffers.py applies it)",
    ),
    ("docs/operations.md", "ray start --head --metrics-export-port=8080"): (
        NOT_RUN,
        "starts a Ray cluster and a server of its own",
    ),
    ("docs/multimodal.md", "from ray import serve"): (SET_UP, "deploys the tiny VLM the next blocks talk to"),
    ("docs/multimodal.md", 'serve.delete("vision")'): (SET_UP, "removes it again"),
    ("docs/heads.md", "import tempfile"): (SET_UP, "makes an SAE and a probe and deploys the app the next blocks read"),
    ("docs/heads.md", 'serve.delete("heads")'): (SET_UP, "removes it again"),
    ("cluster/README.md", "ray up cluster/gpu-aws.yaml"): (NOT_RUN, "provisions GPU machines on AWS"),
    ("cluster/README.md", "docker build -f cluster/Dockerfile"): (
        NOT_RUN,
        "builds and pushes an image, deploys on Kubernetes",
    ),
}


@dataclasses.dataclass(frozen=True)
class Block:
    doc: str  # repository-relative path
    line: int  # of the opening fence
    lang: str  # the info string's first word, "" for none
    code: str  # dedented by the fence's indent

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def first(self) -> str:
        """The block's first non-blank line, stripped: what `LISTED` names it by."""
        return next((ln.strip() for ln in self.code.splitlines() if ln.strip()), "")


@dataclasses.dataclass(frozen=True)
class Example(Block):
    kind: str = ""  # "curl", "python" or "batch"
    set_up: bool = False  # listed as SET_UP: runs, shows no answer of its own


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "cluster" / "README.md"]


_OPEN = re.compile(r"^( *)(`{3,}|~{3,})(.*)$")


def blocks_of(doc: str, text: str) -> list[Block]:
    """Every fenced block of a Markdown text (backticks or tildes, any info string, any indent; one left
    open runs to the end, as CommonMark has it)."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if m is None or (m.group(2)[0] == "`" and "`" in m.group(3)):
            i += 1
            continue
        indent, fence, info = len(m.group(1)), m.group(2), m.group(3).strip()
        close = re.compile(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        body = [ln[indent:] if ln[:indent].strip() == "" else ln.lstrip() for ln in lines[i + 1 : j]]
        out.append(Block(doc, i + 1, info.split()[0].lower() if info else "", "\n".join(body)))
        i = j + 1
    return out


def blocks() -> list[Block]:
    return [
        b
        for path in doc_files()
        for b in blocks_of(path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8"))
    ]


def kind_of(block: Block) -> str | None:
    """What the test runs a block as, by what it is; None: not an example (it must be listed)."""
    if block.lang in PYTHON:
        return "python"
    if block.lang in SHELL:
        if re.search(r"-m\s+deployments\.batch\b", block.code):
            return "batch"
        if re.search(r"\bcurl\b", block.code):
            return "curl"
    return None


def listing(found: list[Block], listed: dict | None = None) -> tuple[dict[Block, tuple[str, str]], list[str]]:
    """Each listed block's entry, and the list's own problems (an entry naming no block, or several)."""
    listed = LISTED if listed is None else listed
    out, problems = {}, []
    for (doc, start), entry in listed.items():
        if entry[0] not in (NOT_RUN, SET_UP):
            problems.append(f"LISTED[{doc!r}, {start!r}]: {entry[0]!r} is neither {NOT_RUN!r} nor {SET_UP!r}")
        named = [b for b in found if b.doc == doc and b.first.startswith(start)]
        if len(named) != 1:
            problems.append(
                f"LISTED[{doc!r}, {start!r}] names {len(named)} blocks, not one"
                + (": " + ", ".join(b.where for b in named) if named else " (drop or fix the entry)")
            )
        out.update((b, entry) for b in named)
    return out, problems


def audit(found: list[Block] | None = None, listed: dict | None = None) -> tuple[list[Example], list[str]]:
    """The examples to run, in order, and every problem found without running them: a block neither run
    nor listed, an entry of the list naming no block or several, an example without an answer of its own,
    a `# ->` that would not be checked."""
    found = blocks() if found is None else found
    named, problems = listing(found, listed)
    examples = []
    for b in found:
        kind, entry = kind_of(b), named.get(b)
        if entry is not None and entry[0] == NOT_RUN:
            continue
        if kind is None:
            if entry is None:
                problems.append(
                    f"{b.where}: a ```{b.lang} block ({b.first[:60]!r}) the test neither runs nor lists: "
                    f"make it an example, or name it in tests/docs_examples.py's LISTED"
                )
            else:
                problems.append(f"{b.where}: listed as {SET_UP!r}, but not a block the test can run")
            continue
        e = Example(b.doc, b.line, b.lang, b.code, kind=kind, set_up=entry is not None)
        examples.append(e)
        problems += [f"{e.where}: {p}" for p in check_problems(e)]
    return examples, problems


def examples() -> list[Example]:
    return audit()[0]


def arrows(code: str) -> list[int]:
    """The lines (1-based) of a block's `# ->` comments."""
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(code).readline))
        return [t.start[0] for t in toks if t.type == tokenize.COMMENT and re.match(r"#\s*->", t.string)]
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return [i for i, ln in enumerate(code.splitlines(), 1) if re.search(r"#\s*->", ln)]


def check_problems(e: Example) -> list[str]:
    """What keeps an example's answer from being checked, each of its `# ->` lines in turn."""
    if e.kind == "python":
        try:
            checks = python_checks(e.code)
        except SyntaxError as err:
            return [f"not Python: {err}"]
        out = [
            f"line {e.line + n}: a `# ->` the harness cannot check (it checks one at the end of a top-level "
            f"expression statement)"
            for n in sorted(set(arrows(e.code)) - set(checks))
        ]
        if not checks and not e.set_up:
            out.append(
                "a Python example that shows no answer (`expression  # -> value`); list it as "
                f"{SET_UP!r} if it only sets up the next"
            )
        return out
    if e.kind == "curl":
        out = [
            f"line {e.line + n}: a `# ->` the harness cannot check (it reads `# ->` comment lines)"
            for n, ln in enumerate(e.code.splitlines(), 1)
            if re.search(r"#\s*->", ln) and not ln.strip().startswith("# ->")
        ]
        want = expectation(e.code)
        if not want and not e.set_up:
            out.append('a curl example that shows no answer (`# -> "key": value, ...`)')
        try:
            pairs(want)
        except ValueError as err:
            out.append(str(err))
        return out
    return [
        f"line {e.line + n}: a `# ->` after a batch command is not checked"
        for n in [i for i, ln in enumerate(e.code.splitlines(), 1) if re.search(r"#\s*->", ln)]
    ]


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
            raise ValueError(f'not a `"key": value` item: {item!r}')
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
        head, tail = ends[: ends.index("...")], ends[ends.index("...") + 1 :]
        if not isinstance(got, list) or len(got) < len(head) + len(tail):
            return f"not a list of at least {len(head) + len(tail)}: {str(got)[:80]}"
        bad = [(json.loads(w), g) for w, g in zip(head, got[: len(head)])] + [
            (json.loads(w), g) for w, g in zip(tail, got[len(got) - len(tail) :])
        ]
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


def python_checks(code: str) -> dict[int, tuple[ast.Expr, str]]:
    """The block's checks, by the line of their `# ->`: each top-level expression statement whose last
    line ends in `# -> value`, with that value's text."""
    lines, out = code.splitlines(), {}
    for node in ast.parse(code).body:
        if isinstance(node, ast.Expr) and (m := re.search(r"#\s*->\s*(.+)$", lines[node.end_lineno - 1])):
            if node.end_lineno in arrows(code):  # a comment, not `->` inside a string
                out[node.end_lineno] = (node, m.group(1).strip())
    return out


def checked_python(code: str, where: str | None = None, offset: int = 0) -> str:
    """The block with each `expression  # -> value` statement turned into `_expect(expression, value, line)`;
    `line` is the statement's in the block plus `offset` (the fence's line: then the doc's line), and with
    `where` (the doc) each check prints `CHECKED doc:line` when it passes."""
    lines = code.splitlines()
    for _, (node, want) in sorted(python_checks(code).items(), reverse=True):
        expr = ast.get_source_segment(code, node)
        indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)
        tail = f", {where!r}" if where else ""
        lines[node.lineno - 1 : node.end_lineno] = [
            f"{indent}_expect(({expr}), {want!r}, {node.end_lineno + offset}{tail})"
        ]
    return "\n".join(lines)


def expect(value: Any, want: str, line: int, doc: str | None = None) -> None:
    """The check `checked_python` calls: a literal is compared as a value, anything else as text
    with `...` for anything (`(..., 576)` matches `(7, 576)`). Passed, with `doc`: prints its mark."""
    try:
        if "..." in want:
            raise ValueError("a pattern")
        literal = ast.literal_eval(want)
    except (ValueError, SyntaxError):
        pattern = ".*".join(re.escape(part) for part in want.split("..."))
        if re.fullmatch(pattern, str(value), re.S) is None:
            raise AssertionError(f"line {line}: {value!s} is not what the docs show: {want}") from None
    else:
        if value != literal:
            raise AssertionError(f"line {line}: {value!r} != {literal!r} (the docs show {want})")
    if doc is not None:
        print(f"CHECKED {doc}:{line}", flush=True)


PRELUDE = """
import sys
from tests.docs_examples import expect as _expect
"""


def marks(e: Example) -> set[str]:
    """The `CHECKED` marks a Python example's run must print: one per check."""
    return {f"{e.doc}:{e.line + n}" for n in python_checks(e.code)}


# -- running them (tests/serve/test_config_yaml.py, against a server) ------------------------------


def run_curl(e: Example, env: dict, timeout: float = 300) -> list[str]:
    """A curl example run with bash: its answer against its `# ->` shape; what differs, one line each."""
    out = subprocess.run(["bash", "-c", e.code], capture_output=True, text=True, timeout=timeout, env=env)
    try:
        answer = json.loads(out.stdout)
    except ValueError:
        return [f"{e.where}: not a JSON answer: {out.stdout[:200]!r} {out.stderr[-300:]!r}"]
    got = [f"an error: {answer['error']}"] if isinstance(answer, dict) and "error" in answer else []
    want = expectation(e.code)
    if want:
        got += problems(answer, want)
    elif not e.set_up:
        got.append("no `# ->` shape shown")
    return [f"{e.where}: {p}" for p in got]


def run_python(doc_examples: list[Example], env: dict, cwd: Path | str, timeout: float = 600) -> list[str]:
    """One doc's Python examples in one process, in order: the first that fails, and every check that
    did not print its mark (did not run)."""
    script = PRELUDE + "\n".join(
        f"print('EXAMPLE {e.where}', flush=True)\n{checked_python(e.code, e.doc, e.line)}" for e in doc_examples
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
    )
    printed = out.stdout.splitlines()
    if out.returncode != 0:
        ran = [ln.split()[1] for ln in printed if ln.startswith("EXAMPLE ")]
        return [f"{ran[-1] if ran else doc_examples[0].doc}: failed: {out.stderr[-1500:]}"]
    done = {ln.split()[1] for ln in printed if ln.startswith("CHECKED ")}
    missing = sorted(set().union(*(marks(e) for e in doc_examples)) - done)
    return [f"{m}: its check did not run (the run ended before it, exit status 0)" for m in missing]
