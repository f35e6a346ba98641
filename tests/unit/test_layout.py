"""The tree as the data flow: who may import what (no vLLM, no Ray: reads the sources)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVING = [p for d in ("hidden_states", "deployments") for p in (ROOT / d).rglob("*.py")]


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_the_serving_path_never_imports_the_fakes():
    offenders = [str(p.relative_to(ROOT)) for p in SERVING if p.name != "testing.py"
                 and any(m == "hidden_states.testing" or m.startswith("hidden_states.testing.") for m in imports(p))]
    assert not offenders, f"production code imports the FakeEngine module: {offenders}"


def test_only_hidden_states_vllm_imports_vllm():
    offenders = [str(p.relative_to(ROOT)) for p in SERVING if "vllm" not in p.relative_to(ROOT).parts[:2]
                 and any(m == "vllm" or m.startswith("vllm.") for m in imports(p))]
    assert not offenders, f"only hidden_states/vllm/ may import vllm: {offenders}"


def test_the_built_in_models_live_apart_from_the_serving_path():
    models = {p.stem for p in (ROOT / "hidden_states" / "models").glob("*.py")}
    assert {"builtin", "smollm2"} <= models
    assert not (ROOT / "hidden_states" / "tiny_model.py").exists() and not (ROOT / "hidden_states" / "smollm2.py").exists()
