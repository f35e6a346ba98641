"""The docs name only what exists: README.md (README.new.md while that draft exists), docs/*.md
and cluster/README.md.

Every path under tests/, bench/, scripts/, cluster/, hidden_states/, deployments/ exists
(one written `COMMIT:path`, git's name for it in a commit, is in that commit instead: what
was removed is cited from history); every `tests/...py::name` is a test function or class defined in that file (a bare
`::name` refers to the test file named last before it); every `make X` is a Makefile
target; every `python -m X` is a module; every relative link resolves, and its #anchor
is a heading there; every docs page is linked from the README; the README stays under
10 KB. Each test lists every problem it finds, one line each. No vLLM, no Ray: text
and `ast` only, in milliseconds.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_LIMIT = 10_000  # bytes: a README read in minutes; the rest goes to docs/

PREFIXES = ("tests", "bench", "scripts", "cluster", "hidden_states", "deployments")
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+", re.I)
# A path under one of PREFIXES: a file with one of these extensions, or a folder written
# with its trailing slash. `../` of relative links is dropped; a path inside a longer one
# (`foo/tests/x.py`) is not taken.
PATH = re.compile(
    r"(?<![\w.-])(?:\.\./)*((?:"
    + "|".join(PREFIXES)
    + r")/(?:[\w.-]+/)*(?:[\w.-]+\.(?:py|md|yaml|json|sh)\b|(?=[\s`'\")\],;:]|$)))"
)
# `tests/x/test_y.py::name` (or `::Class::name`; a parametrized id's `[...]` is not part of
# the name); a test file named alone sets the file for a bare `::name` after it.
TEST_ID = re.compile(r"(?<![\w/.:-])(?=tests/|::)(tests/(?:[\w.-]+/)*test_\w+\.py)?(?:::(\w+)(?:::(\w+))?)?")
# git's `COMMIT:path`: a path as it was in that commit (a removed module, a superseded result).
IN_COMMIT = re.compile(r"(?<![\w.-])([0-9a-f]{7,40}):$")
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)
MAKE = re.compile(r"(?<![\w/.-])make[ \t]+([A-Za-z][\w-]*)")
PY_M = re.compile(r"(?<![\w-])python3?[ \t]+-m[ \t]+([A-Za-z_][\w.]*)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def readme() -> Path:
    """README.new.md while that draft exists (it replaces README.md), else README.md."""
    draft = ROOT / "README.new.md"
    return draft if draft.exists() else ROOT / "README.md"


def doc_files() -> list[Path]:
    return [readme(), *sorted((ROOT / "docs").glob("*.md")), ROOT / "cluster" / "README.md"]


def text(path: Path) -> str:
    return URL.sub(" ", path.read_text(encoding="utf-8"))


def code_spans(s: str) -> list[str]:
    """Inline code and fenced blocks: where commands are written (prose says "make a vector")."""
    return [m.group(0).strip("`") for m in CODE.finditer(s)]


def in_commit(s: str, start: int):
    """The `COMMIT:` just before s[start:], if there is one."""
    return IN_COMMIT.search(s, max(0, start - 41), start)


def named_paths(s: str):
    """Paths as they are now; not those written `COMMIT:path` (named_history_paths)."""
    return (m.group(1) for m in PATH.finditer(s) if not in_commit(s, m.start(1)))


def named_history_paths(s: str):
    """(commit, path) of each path written `COMMIT:path`."""
    for m in PATH.finditer(s):
        if c := in_commit(s, m.start(1)):
            yield c.group(1), m.group(1)


def named_tests(s: str):
    path = None
    for m in TEST_ID.finditer(s):
        path = m.group(1) or path
        if m.group(2):
            yield "::".join(g for g in (path or "", *m.groups()[1:]) if g is not None)


def named_targets(s: str):
    return (m.group(1) for span in code_spans(s) for m in MAKE.finditer(span))


def named_modules(s: str):
    return (m.group(1).rstrip(".") for span in code_spans(s) for m in PY_M.finditer(span))


def named_links(s: str):
    return (m.group(1) for m in LINK.finditer(CODE.sub(" ", s)) if not m.group(1).startswith("mailto:"))


def everything(find) -> list[tuple[str, str]]:
    """(doc, what it names) over every doc, each pair once."""
    return sorted({(p.relative_to(ROOT).as_posix(), x) for p in doc_files() for x in find(text(p))})


@cache
def defined_names(path: Path) -> dict[str, set[str]]:
    """Functions and classes a test file defines at top level: {name: names defined inside it}."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {n.name: {c.name for c in n.body if isinstance(c, kinds)} for n in tree.body if isinstance(n, kinds)}


@cache
def make_targets() -> frozenset[str]:
    lines = (ROOT / "Makefile").read_text(encoding="utf-8").splitlines()
    return frozenset(t for line in lines if (m := re.match(r"^([\w .-]+?)\s*:(?!=)", line)) for t in m.group(1).split())


def module_exists(name: str) -> bool:
    """A module of this repository, or an installed one: found by its file, never imported."""
    parts = name.split(".")
    base = ROOT.joinpath(*parts)
    if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file() or (base / "__main__.py").is_file():
        return True
    if (ROOT / parts[0]).is_dir() or (ROOT / f"{parts[0]}.py").is_file():
        return False  # one of ours, and not there
    spec = importlib.util.find_spec(parts[0])
    if spec is None:
        return False
    for loc in spec.submodule_search_locations or () if len(parts) > 1 else ():
        sub = Path(loc).joinpath(*parts[1:])
        if sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file():
            return True
    return len(parts) == 1


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).replace("`", "").replace("*", "").lower()
    return re.sub(r"[^\w\- ]", "", s).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    body = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", body, re.M)}


def link_problem(doc: str, link: str) -> str | None:
    target, _, anchor = link.partition("#")
    here = ROOT / doc
    # README.new.md is written for README.md's place (the same folder); its own anchors are its own.
    dest = (here.parent / target).resolve() if target else here
    if not dest.exists():
        return f"{doc} links {link}: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} does not exist"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{doc} links {link}: no heading with that anchor in {dest.name}"
    return None


def report(problems: list[str], what: str) -> str:
    return f"{len(problems)} {what}:\n  " + "\n  ".join(problems)


def test_named_paths_exist():
    named = everything(named_paths)
    assert named, "the docs name no paths at all: the pattern is broken"
    problems = [f"{doc} names {path}, which does not exist" for doc, path in named if not (ROOT / path).exists()]
    assert not problems, report(problems, "paths named in the docs do not exist")


def missing_in_history(pairs) -> list[tuple[str, str]] | None:
    """The (commit, path) pairs git does not have (a folder as `path/`), or None without git or the commits."""
    try:
        commits = sorted({c for c, _ in pairs})
        have = subprocess.run(
            ["git", "cat-file", "--batch-check"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            input="".join(f"{c}^{{commit}}\n" for c in commits),
            timeout=30,
        )
        if have.returncode or "missing" in have.stdout:
            return None  # not a git checkout, or a shallow one without those commits
        out = subprocess.run(
            ["git", "cat-file", "--batch-check"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            input="".join(f"{c}:{p.rstrip('/')}\n" for c, p in pairs),
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.splitlines()
    return [
        pair
        for pair, line in zip(pairs, lines)
        if line.endswith(" missing") or pair[1].endswith("/") and " tree " not in line
    ]


def test_paths_named_in_history_exist_there():
    named = everything(named_history_paths)
    if not named:
        return
    pairs = [x for _, x in named]
    missing = missing_in_history(pairs)
    if missing is None:
        pytest.skip("no git history here to check `COMMIT:path` against")
    problems = [f"{doc} names {c}:{p}, which that commit does not have" for doc, (c, p) in named if (c, p) in missing]
    assert missing_in_history([(pairs[0][0], "bench/no_such_file.py")]), "the history check cannot fail"
    assert not problems, report(problems, "paths named in git history are not there")


def test_named_tests_are_defined():
    named = everything(named_tests)
    assert named, "the docs name no tests at all: the pattern is broken"
    problems = []
    for doc, test_id in named:
        path, name, *inner = test_id.split("::")  # "::name" when no file was named before it
        if not path:
            problems.append(f"{doc} names ::{name} before naming any test file")
        elif not (ROOT / path).is_file():
            problems.append(f"{doc} names {test_id}: {path} does not exist")
        elif name not in defined_names(ROOT / path):
            problems.append(f"{doc} names {test_id}: no function or class {name} in {path}")
        elif inner and inner[0] not in defined_names(ROOT / path)[name]:
            problems.append(f"{doc} names {test_id}: {name} defines no {inner[0]}")
    assert not problems, report(problems, "tests named in the docs are not defined")


def test_named_make_targets_exist():
    problems = [
        f"{doc} names `make {t}`; the Makefile has {', '.join(sorted(make_targets()))}"
        for doc, t in everything(named_targets)
        if t not in make_targets()
    ]
    assert not problems, report(problems, "make targets named in the docs do not exist")


def test_named_modules_exist():
    problems = [
        f"{doc} names `python -m {m}`, which is no module"
        for doc, m in everything(named_modules)
        if not module_exists(m)
    ]
    assert not problems, report(problems, "modules named in the docs do not exist")


def test_relative_links_resolve():
    problems = [p for doc, link in everything(named_links) if (p := link_problem(doc, link))]
    assert not problems, report(problems, "links in the docs do not resolve")


def test_every_docs_page_is_linked_from_the_readme():
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages, "docs/ has no pages"
    linked = {(ROOT / link.partition("#")[0]).resolve() for link in named_links(readme().read_text("utf-8"))}
    missing = [p.name for p in pages if p.resolve() not in linked]
    assert not missing, f"{readme().name} links no {missing}"


def test_readme_is_read_in_minutes():
    size = len(readme().read_bytes())
    assert size < README_LIMIT, (
        f"{readme().name} is {size:,} bytes; keep it under {README_LIMIT:,} (move detail to docs/)"
    )


def test_the_checks_can_fail():
    """The patterns find what they are meant to find, and the lookups say no, so a pass means something."""
    s = URL.sub(
        " ",
        "see `tests/scaffolding/test_docs.py::test_nope[x]`, bench/results/tiny-quiet/ and "
        "https://example.com/tests/x.py; run `make nope` and `.venv/bin/python -m bench.nope`. "
        "It cannot make a vector differ; needs `make`.",
    )
    assert list(named_paths(s)) == ["tests/scaffolding/test_docs.py", "bench/results/tiny-quiet/"]
    old = "`git show 1234abc:bench/gone.py` and 1234abc:bench/results/gone/ (now bench/results/kept/)"
    assert list(named_paths(old)) == ["bench/results/kept/"]
    assert list(named_history_paths(old)) == [("1234abc", "bench/gone.py"), ("1234abc", "bench/results/gone/")]
    assert list(named_tests(s + " `tests/scaffolding/test_docs.py`: `::test_too`; `::A::b`")) == [
        "tests/scaffolding/test_docs.py::test_nope",
        "tests/scaffolding/test_docs.py::test_too",
        "tests/scaffolding/test_docs.py::A::b",
    ]
    assert list(named_tests("`::orphan`")) == ["::orphan"]  # no file before it: reported as such
    assert "test_nope" not in defined_names(ROOT / "tests/scaffolding/test_docs.py")
    assert list(named_targets(s)) == ["nope"] and "nope" not in make_targets() and "test" in make_targets()
    assert list(named_modules(s)) == ["bench.nope"] and not module_exists("bench.nope")
    assert module_exists("bench.arms") and module_exists("deployments.batch") and module_exists("pytest")
    assert not module_exists("no_such_module_here") and not module_exists("pytest.no_such_module")
    assert link_problem("docs/api.md", "../cluster/README.md") is None
    assert link_problem("docs/api.md", "missing.md") and link_problem("docs/api.md", "#no-such-heading")
    assert slug("Which vector, exactly") == "which-vector-exactly"
    assert slug("Verifying a vector: `POST /v1/hidden_states`") == "verifying-a-vector-post-v1hidden_states"
