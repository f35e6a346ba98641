"""What the code imports is what pyproject.toml declares, and nothing more.

Every third-party import (by its top-level name, wherever it sits in a file) in hidden_states/ and
deployments/ is a main dependency or an engine's (the cpu and gpu extras: vllm, torch); in tests/
it may also be in the test extra; in bench/ also in the bench extra (setup.sh installs bench with
test). Every main, test and bench dependency is imported by the code it serves, or is in
NOT_IMPORTED with the reason it is needed anyway. No vLLM, no Ray: `ast` and `tomllib` only.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OURS = {"hidden_states", "deployments", "tests", "bench"}
# Import name -> distribution name, where they differ.
DISTRIBUTION = {
    "PIL": "pillow",
    "yaml": "pyyaml",
    "zmq": "pyzmq",
    "prometheus_client": "prometheus-client",
    "cv2": "opencv-python-headless",
}
# Declared, needed at run time, imported by no code of ours.
NOT_IMPORTED = {
    "pyzmq": "vLLM's engine core speaks ZMQ and our vectors ride it (vLLM depends on pyzmq itself)",
    "gguf": "transformers reads SmolLM2's GGUF with it (hidden_states/models/smollm2.py checks it is there)",
    "accelerate": "transformers needs it to load the GGUF model (the same check)",
    "pytest-timeout": "a pytest plugin, used through `timeout` in [tool.pytest.ini_options]",
    "ninja": "torch.utils.cpp_extension's build driver, for tests/toploc_ref.py",
    "ruff": "the formatter and linter `make lint` runs (a command, not imported)",
    "scipy": "bench/measure.py draws the bench's intervals with it; tests/scaffolding/test_bench_stats.py runs them",
    "soxr": "vLLM resamples audio with it (hidden_states/vllm/patches/audio_resampler.py names it; vLLM imports it)",
}
# The code, the dependency groups it may import from, and the groups it must use.
SCOPES = {
    "product": (("hidden_states", "deployments"), ("main", "cpu", "gpu"), ("main",)),
    "tests": (("tests",), ("main", "cpu", "gpu", "test"), ("test",)),
    "bench": (("bench",), ("main", "cpu", "gpu", "test", "bench"), ("bench",)),
}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def group(name: str) -> set[str]:
    """Distribution names of a dependency group: `main` or an extra."""
    reqs = PROJECT["dependencies"] if name == "main" else PROJECT["optional-dependencies"][name]
    return {normalize(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r).group(0)) for r in reqs}


def third_party_imports(folders, root: Path = ROOT) -> dict[str, set[str]]:
    """{distribution name: files importing it} over the folders' .py files."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for top in {n.split(".")[0] for n in names} - OURS - set(sys.stdlib_module_names):
                    found.setdefault(normalize(DISTRIBUTION.get(top, top)), set()).add(
                        path.relative_to(root).as_posix()
                    )
    return found


def undeclared(imported: dict[str, set[str]], declared: set[str]) -> list[str]:
    return [
        f"{dist} is imported ({', '.join(sorted(files))}) but not declared"
        for dist, files in sorted(imported.items())
        if dist not in declared
    ]


def unused(imported: dict[str, set[str]], required: set[str]) -> list[str]:
    return [
        f"{dist} is declared but never imported (import it, drop it, or say why in NOT_IMPORTED)"
        for dist in sorted(required - set(imported) - set(NOT_IMPORTED))
    ]


@pytest.mark.parametrize("scope", sorted(SCOPES))
def test_every_import_is_declared(scope):
    folders, allowed, _ = SCOPES[scope]
    assert undeclared(third_party_imports(folders), set().union(*map(group, allowed))) == []


@pytest.mark.parametrize("scope", sorted(SCOPES))
def test_every_dependency_is_imported(scope):
    folders, _, required = SCOPES[scope]
    assert unused(third_party_imports(folders), set().union(*map(group, required))) == []


def test_not_imported_names_declared_packages():
    declared = set().union(*map(group, ("main", "test", "bench")))
    assert set(NOT_IMPORTED) <= declared, set(NOT_IMPORTED) - declared


def test_the_checks_can_fail(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "import os, requests.adapters\nfrom yaml import safe_load\nfrom . import x\n"
    )
    imported = third_party_imports(["pkg"], tmp_path)
    assert imported == {"requests": {"pkg/m.py"}, "pyyaml": {"pkg/m.py"}}
    assert undeclared(imported, {"pyyaml"}) == ["requests is imported (pkg/m.py) but not declared"]
    assert len(unused(imported, {"requests", "pyyaml", "pandas", "pyzmq"})) == 1  # pandas; pyzmq is allowed


def test_a_newer_ray_on_the_registry_changes_nothing(tmp_path):
    """A Ray release after the pinned one (a stand-in wheel, 99.0.0, on a local registry) is what an
    unpinned `ray[serve]>=2.50` would install; pyproject's pin and constraints.txt each still give
    the pinned version, the one the cluster configs' images carry (tests/cluster/test_configs.py)."""
    import subprocess

    ray_req = next(d for d in PROJECT["dependencies"] if d.startswith("ray["))
    pinned = ray_req.split("==")[1]
    src = tmp_path / "src"
    (src / "ray").mkdir(parents=True)
    (src / "ray" / "__init__.py").write_text("")
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\n'
        'build-backend = "setuptools.build_meta"\n[project]\nname = "ray"\n'
        'version = "99.0.0"\n[project.optional-dependencies]\nserve = []\ndata = []\n'
    )
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheels"), str(src)],
        check=True,
        capture_output=True,
        timeout=120,
    )

    def would_install(*args: str) -> str:
        out = subprocess.run(
            [
                *pip,
                "install",
                "--dry-run",
                "--ignore-installed",
                "--no-deps",
                "--no-index",
                "--find-links",
                str(tmp_path / "wheels"),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        return out.stdout + out.stderr

    assert "Would install ray-99.0.0" in would_install("ray[serve]>=2.50")  # the check can fail
    # pyproject's pin alone: nothing newer qualifies (no older one is on this registry either: a refusal)
    assert "Would install ray-99.0.0" not in would_install(ray_req)
    assert f"ray=={pinned}" in (ROOT / "constraints.txt").read_text().splitlines()
    assert "Would install ray-99.0.0" not in would_install("-c", "constraints.txt", "ray[serve]>=2.50")
