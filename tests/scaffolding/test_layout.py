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
    offenders = [
        str(p.relative_to(ROOT))
        for p in SERVING
        if p.name != "testing.py"
        and any(m == "hidden_states.testing" or m.startswith("hidden_states.testing.") for m in imports(p))
    ]
    assert not offenders, f"production code imports the FakeEngine module: {offenders}"


def test_only_hidden_states_vllm_imports_vllm():
    offenders = [
        str(p.relative_to(ROOT))
        for p in SERVING
        if "vllm" not in p.relative_to(ROOT).parts[:2] and any(m == "vllm" or m.startswith("vllm.") for m in imports(p))
    ]
    assert not offenders, f"only hidden_states/vllm/ may import vllm: {offenders}"


def test_the_built_in_models_live_apart_from_the_serving_path():
    models = {p.stem for p in (ROOT / "hidden_states" / "models").glob("*.py")}
    assert {"builtin", "smollm2"} <= models
    assert (
        not (ROOT / "hidden_states" / "tiny_model.py").exists() and not (ROOT / "hidden_states" / "smollm2.py").exists()
    )


# What the engine core and the workers may import of ours: the wire (protocol.py), the heads the
# workers run (heads.py: msgspec and torch, no schema), and the vLLM package's own siblings (its
# ledger helpers, the worker's layers, the CPU steps, the patches the workers install). Never the API
# schema (params.py, pydantic), proofs, the engine interface or the frontend.
ENGINE_SIDE = ["hidden_states/vllm/core", "hidden_states/vllm/worker", "hidden_states/vllm/patches"]
ENGINE_SIDE_MAY_IMPORT = (
    "hidden_states.protocol",
    "hidden_states.heads",
    "hidden_states.vllm",
    "hidden_states.preflight",
    "hidden_states.malloc_trim",
)


def ours_imported(path: Path) -> set[str]:
    return {m for m in imports(path) if m.split(".")[0] in ("hidden_states", "deployments")}


def engine_side_offenders(sources: dict[str, set[str]]) -> dict[str, list[str]]:
    """Modules of the engine side (and what they reach of ours, transitively) importing outside the rule."""

    def allowed(m: str) -> bool:
        return any(m == a or m.startswith(a + ".") for a in ENGINE_SIDE_MAY_IMPORT) and not (
            m.startswith("hidden_states.vllm.frontend")
            or m == "hidden_states.vllm.engine"
            or m.startswith("hidden_states.vllm.engine.")
        )

    return {
        name: sorted(m for m in mods if not allowed(m))
        for name, mods in sources.items()
        if any(not allowed(m) for m in mods)
    }


def test_engine_core_and_workers_import_nothing_of_the_api_schema():
    sources = {str(p.relative_to(ROOT)): ours_imported(p) for d in ENGINE_SIDE for p in (ROOT / d).rglob("*.py")}
    sources["hidden_states/vllm/cpu.py"] = ours_imported(ROOT / "hidden_states/vllm/cpu.py")
    assert len(sources) >= 5, sources
    assert engine_side_offenders(sources) == {}


def test_the_engine_side_rule_catches_an_api_import():
    """The check above fails if the scheduler imports params.py again (as it did)."""
    sources = {
        "hidden_states/vllm/core/scheduler.py": {"hidden_states.params", "hidden_states.protocol"},
        "hidden_states/vllm/worker/capture.py": {"hidden_states.vllm.frontend.extraction"},
    }
    assert set(engine_side_offenders(sources)) == set(sources)
