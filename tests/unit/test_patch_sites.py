"""Every patch of vLLM lives in hidden_states/vllm/patches/ (one module per ledger point, installed through its
registry): no other module of the serving path wraps or replaces an attribute of a vLLM (or torch) class,
module or instance, or sets vLLM's configuration or environment. Reads the sources (an AST scan); no vLLM."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCHES = ROOT / "hidden_states" / "vllm" / "patches"
SERVING = [p for d in ("hidden_states", "deployments") for p in sorted((ROOT / d).rglob("*.py"))]


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _chain(node: ast.AST) -> list[str]:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return names


def patch_sites(source: str, in_vllm_package: bool) -> list[str]:
    """The patch sites in one module's source, as "line: what". A patch site: an attribute of something not
    `self`/`cls` set to a function, class or lambda defined here (a wrapper), or by `setattr` to one; any
    attribute set on a name imported from vllm or torch; and, in hidden_states/vllm/, an attribute set on
    vLLM's configuration (`..._config.x = ...`), a private attribute or one `setattr` names set on another
    object (ours aside: "hidden_states..." names), or a change of the process's environment."""
    tree = ast.parse(source)
    methods = {id(m) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for m in c.body}
    defined = {  # functions and classes defined here, methods aside: what a wrapper is
        n.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and id(n) not in methods
    }
    imported = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            imported |= {
                (a.asname or a.name).split(".")[0] for a in n.names if a.name.split(".")[0] in ("vllm", "torch")
            }
        elif isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] in ("vllm", "torch"):
            imported |= {a.asname or a.name for a in n.names}

    def wrapper(value: ast.AST) -> bool:
        values = value.elts if isinstance(value, ast.Tuple) else [value]
        return any(isinstance(v, ast.Lambda) or (isinstance(v, ast.Name) and v.id in defined) for v in values)

    def own(attr: str) -> bool:  # an attribute of ours hung on an object (protocol's *_ATTR are "hidden_states_...")
        return attr.lstrip("_").startswith("hidden_states")

    def ours(target: ast.AST) -> bool:
        root = _root(target)
        return isinstance(root, ast.Name) and root.id in ("self", "cls")

    out = []
    for n in ast.walk(tree):
        pairs: list[tuple[ast.AST, ast.AST]] = []
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple):
                    pairs += list(zip(t.elts, n.value.elts))
                else:
                    pairs.append((t, n.value))
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)) and n.value is not None:
            pairs.append((n.target, n.value))
        for target, value in pairs:
            if not isinstance(target, ast.Attribute):
                continue
            root = _root(target)
            what = f"{n.lineno}: {ast.unparse(target)} = {ast.unparse(value)}"
            if isinstance(root, ast.Name) and root.id in imported:
                out.append(what)
            elif not ours(target) and wrapper(value):
                out.append(what)
            elif in_vllm_package and not ours(target) and any(a.endswith("_config") for a in _chain(target)[1:]):
                out.append(what)
            elif in_vllm_package and not ours(target) and target.attr.startswith("_") and not own(target.attr):
                out.append(what)  # a private attribute of someone else's object
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Name) and f.id == "setattr" and len(n.args) == 3:
                obj, value = n.args[0], n.args[2]
                root = _root(obj)
                name = n.args[1]
                named_ours = (isinstance(name, ast.Constant) and own(str(name.value))) or (
                    isinstance(name, ast.Name) and name.id.endswith("_ATTR")  # protocol's *_ATTR: "hidden_states_..."
                )
                if (
                    (isinstance(root, ast.Name) and root.id in imported)
                    or (not ours(obj) and wrapper(value))
                    or (in_vllm_package and not ours(obj) and not named_ours)
                ):
                    out.append(f"{n.lineno}: {ast.unparse(n)}")
            if in_vllm_package and isinstance(f, ast.Attribute) and ast.unparse(f.value) == "os.environ":
                if f.attr in ("update", "setdefault", "pop", "__setitem__"):
                    out.append(f"{n.lineno}: {ast.unparse(n)}")
        if (
            in_vllm_package
            and isinstance(n, (ast.Assign, ast.AugAssign))
            and any(
                isinstance(t, ast.Subscript) and ast.unparse(t.value) == "os.environ"
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            )
        ):
            out.append(f"{n.lineno}: {ast.unparse(n)}")
    return sorted(set(out), key=lambda s: int(s.split(":")[0]))


def sites_outside_patches(root: Path = ROOT) -> dict[str, list[str]]:
    files = [p for d in ("hidden_states", "deployments") for p in sorted((root / d).rglob("*.py"))]
    out = {}
    for p in files:
        rel = p.relative_to(root)
        if rel.parts[:3] == ("hidden_states", "vllm", "patches"):
            continue
        found = patch_sites(p.read_text(), rel.parts[:2] == ("hidden_states", "vllm"))
        if found:
            out[str(rel)] = found
    return out


def test_no_module_outside_patches_patches_vllm():
    assert len(SERVING) > 30
    assert sites_outside_patches() == {}


def test_every_patch_module_is_in_the_registry_and_the_registry_names_only_modules_that_exist():
    from hidden_states.vllm.patches import POINTS, STAGES

    modules = {p.stem for p in PATCHES.glob("*.py")} - {"__init__", "__main__", "drift", "unpatched"}
    assert {p.module for p in POINTS if p.module} == modules
    numbers = [p.number for p in POINTS]
    assert sorted(n for n in numbers if n) == list(range(1, 25)) and len(numbers) == len(set(numbers))
    by = {p.number: p for p in POINTS}
    for (process, stage), points in STAGES.items():
        for n in points:
            assert by[n].module and process in by[n].processes, (process, stage, n)
            assert f"\ndef {stage}(" in (PATCHES / f"{by[n].module}.py").read_text(), (by[n].module, stage)
    # a patch's module says why, how, what it relies on and when it can go
    for p in POINTS:
        if p.module and p.number:
            doc = ast.get_docstring(ast.parse((PATCHES / f"{p.module}.py").read_text())) or ""
            assert doc.startswith(f"Ledger point {p.number}"), p.module
            for part in ("Why:", "How:", "Relies on:", "Remove"):
                assert part in doc, (p.module, part)


@pytest.mark.parametrize(
    "source, found",
    [
        ("def f(runner):\n    def g(): pass\n    runner.execute_model = g\n", 1),
        ("def f(proc):\n    proc.process_outputs = lambda x: x\n", 1),
        ("from vllm.v1.worker.gpu_worker import Worker\nWorker.load_model = 1\n", 1),
        ("import torch\ntorch.cuda.Stream = object\n", 1),
        ("def g(): pass\ndef f(m):\n    setattr(m, 'bgmv', g)\n", 1),
        ("def f(c):\n    c.scheduler_config.scheduler_cls = 'x'\n", 1),
        ("import os\nos.environ.update({'VLLM_X': '0'})\n", 1),
        ("class A:\n    def f(self):\n        def g(): pass\n        self.x = g\n", 0),  # its own attribute
        ("def f(out, v):\n    setattr(out, 'hidden_states_plan', v)\n", 0),  # our data hung on an object
        ("def f(out, v):\n    setattr(out, STEP_ATTR, v)\n", 0),
        ("def f(m, name, fixed):\n    setattr(m, name, fixed)\n", 1),  # someone else's attribute, by name
        ("def f(w, impl):\n    w._impl = impl\n", 1),  # someone else's private attribute
        ("def f(runner, hook):\n    runner._hidden_states_hook = hook\n", 0),
    ],
)
def test_the_scan_catches_a_patch_site(source, found):
    assert len(patch_sites(source, in_vllm_package=True)) == found, patch_sites(source, True)
