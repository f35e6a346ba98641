"""The drift check (hidden_states/vllm/patches/, `python -m hidden_states.vllm.patches --check`) on the
installed vLLM and Ray: nothing drifted; a symbol removed,
a signature changed or a module that fails to import is reported (symbol, expected, found, ledger point), never
raised. Imports vLLM and Ray; starts no engine and no cluster."""

from __future__ import annotations

import sys

import pytest

from hidden_states.vllm.patches import POINTS, drift, relied
from hidden_states.vllm.patches.drift import Symbol, check, main

RELIED = relied()

SCHED = "vllm.v1.core.sched.scheduler:Scheduler"


def entry(path: str) -> Symbol:
    (sym,) = [s for s in RELIED if s.path == path]
    return sym


def test_nothing_drifted_on_the_installed_versions(capsys):
    assert check() == []
    assert main(["--check"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(f"{len(RELIED)} symbols checked, none drifted"), out


def test_the_table_lists_each_symbol_once_and_serves_every_ledger_point(capsys):
    paths = [s.path for s in RELIED]
    assert len(paths) == len(set(paths)), sorted(p for p in paths if paths.count(p) > 1)
    ledger = {p.number for p in POINTS if p.number}
    served = {int(p) for s in RELIED for p in s.point.split(",") if p.strip().isdigit()}
    assert ledger == set(range(1, 25)) and ledger <= served, sorted(ledger - served)
    assert {s.point for s in RELIED if not s.point[0].isdigit()} == {"import", "ray"}
    assert main([]) == 0
    out = capsys.readouterr().out
    assert all(p in out for p in paths)


def test_a_removed_method_is_reported_with_its_ledger_point(monkeypatch, capsys):
    from vllm.v1.core.sched.scheduler import Scheduler

    sym = entry(f"{SCHED}._update_request_with_output")
    monkeypatch.delattr(Scheduler, "_update_request_with_output")
    lines = check()
    assert lines == [drift.drift_of(sym)], lines  # that symbol alone (AsyncScheduler's own override stands)
    (line,) = lines
    assert line.startswith(f"{sym.path} (override, ledger points 9, 20): expected (request, new_token_ids, ...)")
    assert "found: no attribute '_update_request_with_output'" in line
    assert main(["--check"]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [line]
    assert "1 of" in captured.err


def renamed(self, ids, status):  # Scheduler.finish_requests(request_ids, finished_status), renamed
    return []


def default_changed(self, target_sr=None, method="scipy"):  # AudioResampler.__init__, another default method
    pass


def keyword_gone(self, num_tokens, force=False):  # GPUModelRunner._dummy_run without force_attention
    pass


def more_required(self, device):  # GPUModelRunner.get_model, now with a required argument
    pass


@pytest.mark.parametrize(
    "module, cls, name, replacement, found",
    [
        ("vllm.v1.core.sched.scheduler", "Scheduler", "finish_requests", renamed, "found: (ids, status)"),
        (
            "vllm.multimodal.audio",
            "AudioResampler",
            "__init__",
            default_changed,
            "found: (target_sr, method) with method='scipy'",
        ),
        (
            "vllm.v1.worker.cpu_model_runner",
            "CPUModelRunner",
            "_dummy_run",
            keyword_gone,
            "found: (num_tokens, force): no parameter force_attention",
        ),
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "get_model", more_required, "found: (device): device"),
    ],
)
def test_a_changed_signature_is_reported_with_expected_and_found(
    monkeypatch, capsys, module, cls, name, replacement, found
):
    import importlib

    owner = getattr(importlib.import_module(module), cls)
    monkeypatch.setattr(owner, name, replacement)
    sym = entry(f"{module}:{cls}.{name}")
    lines = check()
    assert lines == [drift.drift_of(sym)], lines
    (line,) = lines
    assert line.startswith(f"{sym.path} ({sym.kind}, ledger point {sym.point}): expected {drift.expected(sym)}; ")
    assert found in line, line
    assert main(["--check"]) == 1
    assert capsys.readouterr().out.splitlines() == [line]


def test_a_module_that_fails_to_import_is_reported_not_raised(monkeypatch, tmp_path, capsys):
    (tmp_path / "hs_drift_broken.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    relied = (
        Symbol("hs_drift_broken:Scheduler.add_request", "9", ("request",), "override"),
        Symbol("hs_drift_no_such_module", "import", kind="module"),
        Symbol(f"{SCHED}.add_request", "9", ("request",), "override"),
    )
    lines = check(relied)
    assert len(lines) == 2, lines
    assert lines[0].startswith("hs_drift_broken:Scheduler.add_request (override, ledger point 9): expected (request")
    assert lines[0].endswith("found: RuntimeError: broken at import")
    assert lines[1].startswith("hs_drift_no_such_module (module, import): expected present; found: ModuleNotFoundError")
    monkeypatch.setattr(drift, "_all", lambda: relied)
    assert main(["--check"]) == 1
    assert capsys.readouterr().out.splitlines() == lines


def test_a_vllm_module_that_no_longer_imports_fails_each_of_its_symbols(monkeypatch):
    check()  # every module the table reaches imported, so only the audio module is missing below
    monkeypatch.setitem(sys.modules, "vllm.multimodal.audio", None)  # import raises ModuleNotFoundError
    audio = [drift.drift_of(s) for s in RELIED if s.path.startswith("vllm.multimodal.audio:")]
    assert len(audio) == 3 and all("ModuleNotFoundError" in line and "ledger point 17" in line for line in audio)
    assert check() == audio


class _Local:
    slots_free = True

    def __init__(self):
        self.a, (self.b, _) = 1, (2, 3)
        self.c: int = 4


class _Slotted:
    __slots__ = ("x",)


class _NotALayer:
    def forward(self, positions, hidden_states, residual):
        return hidden_states + residual, residual


def test_attributes_fields_open_instances_and_the_layer_convention_are_checked():
    here = __name__
    holds = [
        Symbol(f"{here}:_Local.a", "import", kind="init attr"),
        Symbol(f"{here}:_Local.b", "import", kind="init attr"),
        Symbol(f"{here}:_Local.c", "import", kind="init attr"),
        Symbol(f"{here}:_Local", "import", kind="open instances"),
        Symbol(f"{here}:Symbol.params", "import", kind="field"),
        Symbol(f"{here}:_Local.__init__", "import", (), "called", exact=True),
    ]
    assert check(tuple(holds)) == []
    drifts = [
        (Symbol(f"{here}:_Local.d", "import", kind="init attr"), "self.d is assigned in no __init__/__post_init__"),
        (Symbol(f"{here}:_Slotted", "import", kind="open instances"), "instances without a __dict__"),
        (Symbol(f"{here}:Symbol.parameters", "import", kind="field"), "no field or attribute 'parameters'"),
        (Symbol(f"{here}:_Local.__init__", "import", ("x",), "called"), "found: ()"),
        (Symbol(f"{here}:_Local.__init__", "import", kind="method", mentions=("self.d =",)), "source without"),
        (
            Symbol(f"{here}:_NotALayer.forward", "8", drift._LAYER_PARAMS, "decoder layer"),
            "does not begin by adding its residual argument",
        ),
        (Symbol(f"{here}:_Local.slots_free", "import", kind="inherited", defined_in="Base"), "defined in _Local"),
    ]
    for sym, found in drifts:
        line = drift.drift_of(sym)
        assert line is not None and line.startswith(f"{sym.path} ({sym.kind}, ") and found in line, (sym, line)


def test_a_patch_of_ours_running_in_this_process_is_seen_through(monkeypatch):
    """Where this process already runs a patch of ours (the LoRA ops' wrappers, ledger point 11), vLLM's own
    functions are the ones checked."""
    import vllm.lora.ops.torch_ops as package
    import vllm.lora.ops.torch_ops.lora_ops as ops
    from vllm.lora.punica_wrapper import punica_cpu

    from hidden_states.vllm.patches.lora_ops import patch_cpu_lora_ops

    for module in (ops, package, punica_cpu):
        for name in drift._LORA_OPS:
            monkeypatch.setattr(module, name, getattr(module, name))  # put back after the test
    monkeypatch.setattr(ops, "_hidden_states_no_lora_rows", False, raising=False)
    patch_cpu_lora_ops()
    assert ops.bgmv_shrink.__module__ == "hidden_states.vllm.patches.lora_ops"
    assert check() == []


def test_the_engine_start_refuses_drift_by_name_and_a_version_outside_the_range_says_what_drifted(
    monkeypatch, tmp_path
):
    """check_vllm_version(drift=True), the engine's start: a drifted symbol refuses the start naming it; a vLLM
    outside the tested range is refused with what the check found; the check's result is cached per install."""
    import vllm

    from hidden_states.vllm import VLLMIncompatibleError, check_vllm_version

    monkeypatch.setenv("HIDDEN_STATES_CACHE", str(tmp_path))
    check_vllm_version(drift=True)  # the installed, tested vLLM: nothing drifted
    (cached,) = (tmp_path / "drift").iterdir()
    assert cached.read_text() == "[]"
    line = "vllm.v1.core.sched.scheduler:Scheduler.schedule (override, ledger point 9): expected ...; found: missing"
    monkeypatch.setattr(drift, "check", lambda relied=RELIED: [line])
    assert drift.cached_check() == []  # the cached result of this install
    cached.unlink()
    with pytest.raises(VLLMIncompatibleError, match=r"1 symbol\(s\) this project relies on drifted") as e:
        check_vllm_version(drift=True)
    assert "Scheduler.schedule (override, ledger point 9)" in str(e.value)
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.raises(VLLMIncompatibleError, match=r"vLLM 0\.34\.0 is not supported") as e:
        check_vllm_version(drift=True)
    assert "the drift check found 1 drifted symbol(s): " + line in str(e.value)
    monkeypatch.setattr(drift, "check", lambda relied=RELIED: [])
    for f in (tmp_path / "drift").iterdir():
        f.unlink()
    with pytest.raises(VLLMIncompatibleError, match="the drift check found none drifted"):
        check_vllm_version(drift=True)
