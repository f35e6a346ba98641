"""The drift check's machinery: every vLLM internal (and private Ray one) the project relies on, against what is
installed.

Each point of the registry (hidden_states/vllm/patches/__init__.py) lists what it relies on as data: a patch's
module its own `RELIED`, the points that are not patches theirs in unpatched.py, Ray's in ray_internals.py. One
`Symbol` per module, class, method, field or attribute the product code imports, overrides, wraps, replaces,
calls or reads (hidden_states/vllm/, hidden_states/protocol.py, deployments/; not tests/ or bench/), with the
ledger point(s) it serves ("import" where none, "ray" for Ray's internals). Nothing starts: modules are
imported and classes read, so a new vLLM or Ray is checked in seconds, before any engine or cluster runs.

    python -m hidden_states.vllm.patches            # the table: symbol, kind, ledger point, what is expected
    python -m hidden_states.vllm.patches --check    # each drifted symbol on a line, exit 1; else one line, exit 0

An entry's `path` is "module:Qualname.attr" ("module" for a module). `params`, where given, are the parameter
names relied on (`self` skipped), a prefix of the signature in order; names after "*" are passed by keyword, so
they need only exist; "name=<repr>" also checks the default; `exact=True`: the whole list, in order. `mentions`:
text the object's source must contain (whitespace ignored), for behaviour a name cannot show (which method calls
which, with what). `defined_in`: the class the attribute must come from (no subclass in between overrides it).
`kind` says how the project uses the name, and how the last name is checked:

- "field": a dataclass, msgspec, pydantic, NamedTuple or TypedDict field (or anything on the class);
- "init attr" / "load_model attr": an instance attribute, found as an assignment to `self.<name>` in the source
  of `__init__`/`__post_init__` (or `load_model`) of the class or a base, or anything on the class: the object
  itself is never built, so these are checked by their source text;
- "called" and "class": the project calls (constructs) it with `params` only, so any other parameter must have
  a default; "override": vLLM calls our subclass's method; "wrapped" / "replaced": ours stands in for it at run
  time (where this process already runs a patch of ours, the original it keeps is checked);
- "open instances": the class's instances take new attributes (no `__slots__`): the project hangs its own on them;
- "decoder layer": the layer's `forward` also passes the install-time convention check each worker runs
  (worker/layers._residual_norm_of: a fused residual norm at its entry);
- any other kind (module, class, function, method, property, constant, ...): the name resolves.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import re
import sys
import textwrap
from typing import Any, NamedTuple


class Symbol(NamedTuple):
    path: str  # "module:Qualname.attr", or "module"
    point: str  # the ledger point(s) it serves: "9", "9, 20"; "import" or "ray" where none
    params: tuple[str, ...] | None = None  # parameter names relied on (see the module docstring)
    kind: str = "attr"  # how the project uses it, which decides how it is checked (see the module docstring)
    exact: bool = False  # params: the whole list, not a prefix
    mentions: tuple[str, ...] = ()  # strings the source must contain (whitespace ignored)
    defined_in: str = ""  # the class (qualname) the attribute must be defined by


# -- the table, by ledger point ---------------------------------------------------------------------------------

_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
_ASYNC_SCHED = "vllm.v1.core.sched.async_scheduler:AsyncScheduler"
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_CPU_RUNNER = "vllm.v1.worker.cpu_model_runner:CPUModelRunner"
_XPU_RUNNER = "vllm.v1.worker.xpu_model_runner:XPUModelRunner"
_BATCH = "vllm.v1.worker.gpu_input_batch:InputBatch"
_WORKER = "vllm.v1.worker.gpu_worker:Worker"
_ASYNC_LLM = "vllm.v1.engine.async_llm:AsyncLLM"
_REQUEST = "vllm.v1.request:Request"
_STATUS = "vllm.v1.request:RequestStatus"
_SO = "vllm.v1.core.sched.output:SchedulerOutput"
_MRO = "vllm.v1.outputs:ModelRunnerOutput"
_ECO = "vllm.v1.engine:EngineCoreOutput"
_SP = "vllm.sampling_params:SamplingParams"
_VCFG = "vllm.config:VllmConfig"
_MCFG = "vllm.config:ModelConfig"
_SCFG = "vllm.config:SchedulerConfig"
_PCFG = "vllm.config:ParallelConfig"
_ARGS = "vllm.engine.arg_utils:AsyncEngineArgs"
_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
_CM = "vllm.v1.attention.backend:CommonAttentionMetadata"
_LORA_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
_LORA_PARAMS = ("inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor")
_MODELS = "vllm.model_executor.models"
_SERVING_CMPL = "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion"
_SERVING_CHAT = "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat"
_PREFIX = "ray.llm._internal.serve.routing_policies.prefix_aware"
_RR = "ray.serve._private.request_router.request_router:RequestRouter"
_LAYER_PARAMS = ("positions", "hidden_states", "residual")
_VLMS = (  # the verified vision-language models (VERIFIED_LAYER_ARCHS): their text stacks and encoders
    "gemma3_mm:Gemma3ForConditionalGeneration",
    "llava:LlavaForConditionalGeneration",
    "qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl:Qwen3VLForConditionalGeneration",
)


def _refused_args() -> tuple[Symbol, ...]:
    """Point 4: each engine argument refused by name is still vLLM's name for that feature."""
    from hidden_states.vllm.engine_args import REFUSED

    return tuple(Symbol(f"{_ARGS}.{name}", "4", kind="field") for name in REFUSED if name != "worker_extension_cls")


def __getattr__(name: str) -> Any:
    """`RELIED`: every symbol of the registry's points (hidden_states.vllm.patches.relied()), read when asked."""
    if name == "RELIED":
        from hidden_states.vllm.patches import relied

        return relied()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- resolution: never raises; a problem is a string ---------------------------------------------------------------


_CALLED = ("called", "class")  # the project calls (constructs) these with the names in `params` and no others


class _Drift(Exception):
    """What was found instead of what was expected."""


def _walk(module: str, names: list[str]) -> Any:
    """`module`'s attribute `names[0]`, then its `names[1]`, ...; a submodule is imported where a module lacks it."""
    obj = importlib.import_module(module)
    for i, name in enumerate(names):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            if not inspect.ismodule(obj):
                raise _Drift(f"no attribute {name!r} on {'.'.join([module, *names[:i]])}") from None
            try:
                obj = importlib.import_module(f"{obj.__name__}.{name}")
            except ImportError:
                raise _Drift(f"no attribute {name!r} on module {obj.__name__}") from None
    return obj


def _sources(obj: Any) -> str:
    if isinstance(obj, property):
        obj = obj.fget
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError) as e:
        raise _Drift(f"no source to read ({type(e).__name__})") from None


def _assigned_in(func: Any, name: str) -> bool:
    """Whether `func`'s source assigns `self.<name>` (plain, annotated, augmented, or in a tuple)."""
    tree = ast.parse(textwrap.dedent(_sources(func)))
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for t in ast.walk(target):
                if (
                    isinstance(t, ast.Attribute)
                    and t.attr == name
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                ):
                    return True
    return False


def _field_names(cls: Any) -> set[str]:
    names: set[str] = set()
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    names |= set(getattr(cls, "__struct_fields__", ()))  # msgspec
    model_fields = getattr(cls, "model_fields", None)  # pydantic
    if isinstance(model_fields, dict):
        names |= set(model_fields)
    names |= set(getattr(cls, "_fields", ()))  # NamedTuple
    for klass in getattr(cls, "__mro__", (cls,)):  # annotations: TypedDict, Protocol, plain classes
        annotations = vars(klass).get("__annotations__", {})
        if isinstance(annotations, dict):
            names |= set(annotations)
    return names


def _check_field(owner: Any, name: str) -> str:
    if name in _field_names(owner) or hasattr(owner, name):
        return "present"
    raise _Drift(f"no field or attribute {name!r}")


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


# Where each kind of instance attribute is assigned (in the class or any base).
_SETTERS = {"init attr": ("__init__", "__post_init__"), "load_model attr": ("load_model",)}


def _check_set_attr(owner: Any, name: str, kind: str) -> str:
    if hasattr(owner, name) or name in _field_names(owner):
        return "present"
    for klass in getattr(owner, "__mro__", ()):
        for method in _SETTERS[kind]:
            func = vars(klass).get(method)
            if not inspect.isfunction(func):
                continue
            # A decorator's wrapper: also the function it wraps or closes over (vLLM's support_torch_compile
            # keeps the original __init__ in a closure); a generated dataclass __init__ has no source.
            cells = [f for f in map(_cell, func.__closure__ or ()) if inspect.isfunction(f)]
            for candidate in (inspect.unwrap(func), *cells):
                try:
                    if _assigned_in(candidate, name):
                        return f"set in {klass.__qualname__}.{method}"
                except _Drift:
                    continue
    where = "/".join(_SETTERS[kind])
    raise _Drift(f"self.{name} is assigned in no {where} of {getattr(owner, '__qualname__', owner)} or its bases")


def _found_params(obj: Any) -> tuple[list[str], dict[str, inspect.Parameter]]:
    """The callable's parameter names, `self` skipped ("*args", "**kwargs" as such), and its parameters."""
    names = getattr(obj, "arg_names", None)  # a Triton kernel, or vLLM's KernelOverride standing in for one
    if isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names) and not inspect.isclass(obj):
        return list(names), {}
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError) as e:
        raise _Drift(f"no signature ({e})") from None
    shown, params = [], {}
    for p in signature.parameters.values():
        if not shown and not params and p.name in ("self", "cls") and not inspect.isclass(obj):
            continue
        shown.append({p.VAR_POSITIONAL: f"*{p.name}", p.VAR_KEYWORD: f"**{p.name}"}.get(p.kind, p.name))
        params[p.name] = p
    return shown, params


def _check_params(sym: Symbol, obj: Any) -> str:
    shown, params = _found_params(obj)
    expected = [p for p in sym.params if p != "*"]
    cut = sym.params.index("*") if "*" in sym.params else len(sym.params)
    positional = [p.partition("=")[0] for p in sym.params[:cut]]
    keywords = [p.partition("=")[0] for p in sym.params[cut + 1 :]]
    found = f"({', '.join(shown)})"
    if sym.exact and shown != [p.partition("=")[0] for p in expected]:
        raise _Drift(found)
    if shown[: len(positional)] != positional:
        raise _Drift(found)
    by_keyword = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [k for k in keywords if k not in by_keyword]
    if params and missing:
        raise _Drift(f"{found}: no parameter {', '.join(missing)}")
    if sym.kind in _CALLED:  # the project's call passes these names only: any other must have a default
        required = [
            n
            for n, p in params.items()
            if p.default is p.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            and n not in positional
            and n not in keywords
        ]
        if required:
            raise _Drift(f"{found}: {', '.join(required)} required")
    for p in expected:
        name, eq, default = p.partition("=")
        if eq and name in params and repr(params[name].default) != default:
            raise _Drift(f"{found} with {name}={params[name].default!r}")
    return found


def _check_mentions(sym: Symbol, obj: Any) -> None:
    source = re.sub(r"\s+", "", _sources(obj))
    missing = [m for m in sym.mentions if re.sub(r"\s+", "", m) not in source]
    if missing:
        raise _Drift(f"source without {' / '.join(repr(m) for m in missing)}")


def _check_defined_in(sym: Symbol, owner: Any, name: str) -> None:
    definer = next((k for k in getattr(owner, "__mro__", ()) if name in vars(k)), None)
    if definer is None or definer.__qualname__ != sym.defined_in:
        raise _Drift(f"defined in {getattr(definer, '__qualname__', None)}")


def _check_open(cls: Any) -> None:
    if not inspect.isclass(cls) or not cls.__dictoffset__:
        raise _Drift("instances without a __dict__ (__slots__): no attribute of ours can be set on them")


def _unpatched(owner: Any, name: str, obj: Any) -> Any:
    """vLLM's own object where this process already runs a patch of ours in its place (a wrapper installed at
    class or module level): the original it keeps, as `_hidden_states_<name>` on the owner or in its closure."""
    if not str(getattr(obj, "__module__", "")).startswith("hidden_states."):
        return obj
    kept = getattr(owner, f"_hidden_states_{name}", None)
    if kept is not None:
        return kept
    inner = [
        f
        for f in map(_cell, getattr(obj, "__closure__", None) or ())
        if callable(f) and not str(getattr(f, "__module__", "")).startswith("hidden_states.")
    ]
    return inner[0] if inner else obj


def _check_decoder_layer(owner: Any) -> None:
    from hidden_states.vllm.worker.layers import _residual_norm_of

    norm, why = _residual_norm_of(owner)
    if norm is None:
        raise _Drift(why)


def _check_one(sym: Symbol) -> str:
    """What was found for `sym` (a short description), or raises _Drift saying what was found instead."""
    module, _, qualname = sym.path.partition(":")
    names = qualname.split(".") if qualname else []
    if sym.kind == "field":
        return _check_field(_walk(module, names[:-1]), names[-1])
    if sym.kind in _SETTERS:
        return _check_set_attr(_walk(module, names[:-1]), names[-1], sym.kind)
    owner = _walk(module, names[:-1]) if names else None
    obj = _walk(module, names)
    if names:
        obj = _unpatched(owner, names[-1], obj)
    if sym.kind == "module" and not inspect.ismodule(obj):
        raise _Drift(f"a {type(obj).__name__}, not a module")
    if sym.kind == "open instances":
        _check_open(obj)
    if sym.kind == "dataclass instance" and not dataclasses.is_dataclass(obj):
        raise _Drift(f"a {type(obj).__name__}, not a dataclass instance")
    found = "present"
    if sym.params is not None:
        found = _check_params(sym, obj)
    if sym.mentions:
        _check_mentions(sym, obj)
    if sym.defined_in:
        _check_defined_in(sym, owner, names[-1])
    if sym.kind == "decoder layer":
        _check_decoder_layer(owner)
    return found


def expected(sym: Symbol) -> str:
    """What the entry expects, as the table and the drift lines show it."""
    if sym.kind == "field":
        what = "a field"
    elif sym.kind in _SETTERS:
        what = f"self.{sym.path.rpartition('.')[2]} set in {'/'.join(_SETTERS[sym.kind])}"
    elif sym.kind == "open instances":
        what = "instances take new attributes"
    elif sym.params is not None:
        what = f"({', '.join(sym.params)}{'' if sym.exact or not sym.params else ', ...'})"
    else:
        what = "present"
    extra = [f"defined in {sym.defined_in}"] if sym.defined_in else []
    extra += [f"source with {m!r}" for m in sym.mentions]
    if sym.kind == "decoder layer":
        extra.append("forward opens with the fused residual norm")
    return " and ".join([what, *extra])


def _point(sym: Symbol) -> str:
    if sym.point in ("import", "ray"):
        return sym.point
    return f"ledger point{'s' if ',' in sym.point else ''} {sym.point}"


def drift_of(sym: Symbol) -> str | None:
    """The drift line of one entry, or None if it holds. Never raises."""
    try:
        _check_one(sym)
        return None
    except _Drift as e:
        found = str(e)
    except (Exception, SystemExit) as e:  # an import that fails, or anything a module raises at import
        found = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return f"{sym.path} ({sym.kind}, {_point(sym)}): expected {expected(sym)}; found: {found}"


def _all() -> tuple[Symbol, ...]:
    from hidden_states.vllm.patches import relied

    return relied()


def check(relied: tuple[Symbol, ...] | None = None) -> list[str]:
    """One line per drifted symbol (the symbol, its kind and ledger point, what was expected, what was found);
    [] if none drifted. `relied`: every point's symbols (hidden_states.vllm.patches.relied()) unless given."""
    return [line for sym in (_all() if relied is None else relied) if (line := drift_of(sym)) is not None]


def cached_check() -> list[str]:
    """`check()`, its result kept on disk per installed vLLM and Ray and this table (the engine's start runs it:
    seconds once per install, a file read after)."""
    import hashlib
    import json
    import os
    from pathlib import Path

    tables = "".join(p.read_text() for p in sorted(Path(__file__).parent.glob("*.py")))  # every point's symbols
    key = hashlib.sha256((_versions() + tables).encode()).hexdigest()[:16]
    root = os.environ.get("HIDDEN_STATES_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hidden-states"
    )
    path = Path(root) / "drift" / f"{key}.json"
    try:
        return list(json.loads(path.read_text()))
    except (OSError, ValueError):
        pass
    lines = check()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(lines))
        tmp.replace(path)
    except OSError:  # a read-only cache: checked again next time
        pass
    return lines


def _versions() -> str:
    out = []
    for name in ("vllm", "ray"):
        try:
            out.append(f"{name} {importlib.import_module(name).__version__}")
        except Exception:  # noqa: BLE001 - reported by the check itself
            out.append(f"{name} not importable")
    return ", ".join(out)


def table(relied: tuple[Symbol, ...] | None = None) -> str:
    """The entries as a table: symbol, kind, ledger point, what is expected."""
    relied = _all() if relied is None else relied
    rows = [("symbol", "kind", "ledger point", "expected"), *((s.path, s.kind, s.point, expected(s)) for s in relied)]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(r[:3], widths)), r[3]]).rstrip() for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hidden_states.vllm.patches", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="check the installed vLLM and Ray; exit 1 on drift")
    args = parser.parse_args(argv)
    if not args.check:
        print(table())
        return 0
    relied = _all()
    lines = check(relied)
    if lines:  # the lines alone on stdout; the summary on stderr
        for line in lines:
            print(line)
        print(
            f"{len(lines)} of {len(relied)} symbols drifted ({_versions()}): hidden_states/vllm/patches/ says "
            "what each point is (its module's docstring, or the registry's entry)",
            file=sys.stderr,
        )
        return 1
    print(f"{len(relied)} symbols checked, none drifted ({_versions()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
