"""`interface.Engine` declares what the replica uses of its engine: the replica reaches nothing else,
and both engines (vLLM's `HiddenStatesEngine`, the fake tier's `FakeEngine`) take every declared call
with the declared parameters."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest

from hidden_states.interface import Engine

ROOT = pathlib.Path(__file__).resolve().parents[2]


def declared() -> set[str]:
    """The Protocol's members: its annotated attributes and its methods."""
    names = set(Engine.__annotations__)
    names |= {n for n, v in vars(Engine).items() if not n.startswith("_") and callable(getattr(v, "__func__", v))}
    return names


def reached(source: str) -> set[str]:
    """Attributes the code reaches on `self.engine` (or a local `engine` taken from it)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if (isinstance(base, ast.Attribute) and base.attr == "engine" and isinstance(base.value, ast.Name)) or (
            isinstance(base, ast.Name) and base.id == "engine"
        ):
            out.add(node.attr)
    return out


def test_the_replica_reaches_only_what_the_protocol_declares():
    used = reached((ROOT / "deployments/replica.py").read_text())
    assert {"complete", "stats", "openai"} <= used  # the scan sees the replica's calls
    assert used <= declared(), sorted(used - declared())


def test_the_scan_catches_an_undeclared_member():
    """The check above can fail: a call the Protocol does not declare is found."""
    used = reached("class R:\n    async def f(self):\n        await self.engine.extract_layers([1])\n")
    assert used - declared() == {"extract_layers"}


def engines() -> list:
    from hidden_states.testing import FakeEngine
    from hidden_states.vllm.engine import HiddenStatesEngine

    return [HiddenStatesEngine, FakeEngine]


def _accepts(impl: inspect.Signature, want: inspect.Signature) -> list[str]:
    """What a declared call would pass that `impl` does not take: each declared parameter by its kind."""
    params, missing = impl.parameters, []
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, (name, p) in enumerate(want.parameters.items()):
        if p.kind is p.VAR_KEYWORD:
            if not var_kw:
                missing.append(f"**{name}")
        elif p.kind is p.KEYWORD_ONLY:
            got = params.get(name)
            if (got is None or got.kind not in (got.KEYWORD_ONLY, got.POSITIONAL_OR_KEYWORD)) and not var_kw:
                missing.append(name)
        elif i >= len(positional):  # passed by position (its name is the implementation's own)
            missing.append(f"{name} (position {i})")
        if p.default is not p.empty and name in params and params[name].default is p.empty:
            missing.append(f"{name}'s default")
    return missing


@pytest.mark.parametrize("cls", engines(), ids=lambda c: c.__name__)
def test_each_engine_takes_every_declared_call(cls):
    for name in declared() - set(Engine.__annotations__):
        impl = getattr(cls, name, None)
        assert impl is not None, f"{cls.__name__} lacks {name}"
        want = inspect.signature(getattr(Engine, name))
        assert _accepts(inspect.signature(impl), want) == [], (cls.__name__, name)
        assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(getattr(Engine, name)), name


def test_a_narrower_signature_is_caught():
    async def stats(self) -> dict: ...  # FakeEngine's, before it took fresh_workers

    assert _accepts(inspect.signature(stats), inspect.signature(Engine.stats)) == ["fresh_workers (position 1)"]


def attributes(cls) -> set[str]:
    """What an instance of `cls` has without building one: class attributes and properties, and every
    `self.X = ...` (or `self.X: T = ...`) in the `__init__` of a class in its MRO."""
    names = {n for k in cls.__mro__ for n in vars(k)}
    for k in cls.__mro__:
        init = vars(k).get("__init__")
        if init is None or not hasattr(init, "__code__"):
            continue
        for node in ast.walk(ast.parse(_dedent(init))):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                        names.add(e.attr)
    return names


def _dedent(fn) -> str:
    import textwrap

    return textwrap.dedent(inspect.getsource(fn))


@pytest.mark.parametrize("cls", engines(), ids=lambda c: c.__name__)
def test_each_engine_has_every_declared_attribute(cls):
    assert set(Engine.__annotations__) - attributes(cls) == set()


def test_the_fake_engine_takes_the_replicas_stats_call():
    import asyncio

    from hidden_states.testing import FakeEngine

    async def go():
        engine = await FakeEngine.start()
        return await engine.stats(fresh_workers=False)

    assert asyncio.run(go())["enabled"] is True
