"""Chosen layers and the prompt-end vector, against transformers (issue: beyond the seed).

transformers numbering: 0 = embeddings, l = the output of decoder layer l - 1,
L = after the final norm; negative counts from the end.

One engine per family (module scope). Llama and Qwen2 as before; Gemma2 and
Gemma3 for (1 + w) RMSNorms, sqrt(hidden)-scaled embeddings and a 16-token
sliding window on layer 0 (shorter than the prompts: checked to matter); Qwen3
for q/k norms. Gemma and Phi3 run under HS_LONG_TESTS=1 (`make test-long`).
"""

from __future__ import annotations

import base64
import os
import types

import numpy as np
import pytest
import torch

from hidden_states.models.builtin import SPECS
from hidden_states.vllm import LONG_TESTED, VERIFIED_LAYER_ARCHS
from tests.conftest import TEST_ENGINE_ARGS, Reference, long_text, sampling

# As every test engine, but a 64 MiB KV cache (a fixed size, whatever the machine's
# memory), no warm-up (the tests do not measure speed) and always eager: intermediate
# layers need an eager engine (tests/engine/test_compiled.py checks the refusal).
ENGINE_ARGS = {**TEST_ENGINE_ARGS, "kv_cache_memory_bytes": 64 * 2**20, "warm_up_s": 0.0, "enforce_eager": True}

LONG = [
    pytest.mark.long,
    pytest.mark.skipif(os.environ.get("HS_LONG_TESTS") != "1", reason="long test: set HS_LONG_TESTS=1"),
]
# Every verified text architecture (hidden_states.vllm.VERIFIED_LAYER_ARCHS) by its built-in model; MiMo's
# (built on tiny-qwen2 with an MTP layer) runs in tests/engine/test_spec_decode.py.
FAMILIES = [
    pytest.param(model, marks=LONG) if arch in LONG_TESTED else model
    for arch, model in VERIFIED_LAYER_ARCHS.items()
    if arch.endswith("ForCausalLM") and model in SPECS
]

# float32 on both sides: the error must stay under 1e-5 of the largest reference
# entry, and under 1e-4 absolute (the tiny models' entries are at most ~5).
REL_TOL, ABS_TOL = 1e-5, 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, loop_thread):
    from hidden_states.models.builtin import build
    from hidden_states.vllm.engine import HiddenStatesEngine

    path = str(build(request.param))
    eng = loop_thread.run(HiddenStatesEngine.start(path, **ENGINE_ARGS))
    yield eng, Reference(path)
    eng.shutdown()


sp = sampling(max_tokens=12)  # greedy SamplingParams; keywords override


def assert_close(ref: Reference, ids, vec, layer: int, arch: str = "") -> float:
    """Max abs error against transformers, within REL_TOL of max|reference| and ABS_TOL."""
    want = ref.last_hidden(ids, layer)
    got = np.asarray(vec, dtype=np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    err, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
    print(f"{arch} layer {layer} over {len(ids)} tokens: max abs err {err:.3g}, max|ref| {scale:.3g}")
    assert err <= REL_TOL * scale, f"{arch} layer {layer}: max abs err {err:.3g} > {REL_TOL:g} * {scale:.3g}"
    assert err <= ABS_TOL, f"{arch} layer {layer}: max abs err {err:.3g} > {ABS_TOL:g}"
    return err


def sliding_window(ref: Reference) -> int | None:
    cfg = ref.model.config
    layer_types = getattr(cfg, "layer_types", None) or []
    return cfg.sliding_window if "sliding_attention" in layer_types else None


def test_install_reports_layer_capture(setup, loop_thread):
    eng, _ = setup
    found = eng.layer_capture
    assert found["installed"] and found["architecture"] == eng.architecture
    assert found["layer_capture"] and found["layer_structure"] and found["layer_capture_reason"] is None
    workers = loop_thread.run(eng.stats())["workers"]
    assert [w["layer_hooks"] for w in workers] == [eng.num_layers]


def test_every_layer_matches_transformers(setup, loop_thread):
    eng, ref = setup
    L = eng.num_layers
    layers = [0, 1, -1, L, -2, -(L + 1)]
    window = sliding_window(ref)
    for prompt in ("Hello! How are you today?", long_text(300, seed=9)):
        c = loop_thread.run(eng.complete(prompt, sp(), layers=layers))
        ch = c.choices[0]
        ids = c.prompt_token_ids + ch.token_ids
        assert sorted(ch.hidden_states_by_layer) == sorted(set(layers))
        for layer, vec in ch.hidden_states_by_layer.items():
            assert_close(ref, ids, vec, layer, eng.architecture)
        assert np.array_equal(ch.hidden_states, ch.hidden_states_by_layer[-1])
        assert not np.allclose(ch.hidden_states_by_layer[0], ch.hidden_states_by_layer[1])
        if window is not None and len(ids) > window:
            # The window matters: without it transformers gives another layer-1 vector.
            from transformers import AutoModelForCausalLM

            unwindowed = AutoModelForCausalLM.from_pretrained(
                ref.model.name_or_path, dtype=torch.float32, sliding_window=len(ids) + 1
            ).eval()
            with torch.no_grad():
                out = unwindowed(torch.tensor([list(ids)]), output_hidden_states=True)
            gap = float(np.abs(out.hidden_states[1][0, -1].numpy() - ch.hidden_states_by_layer[1]).max())
            assert gap > 100 * REL_TOL * float(np.abs(ch.hidden_states_by_layer[1]).max()), gap


def test_prompt_end_needs_no_extraction_step(setup, loop_thread):
    eng, ref = setup
    prompt = long_text(200, seed=10)
    before = eng.extraction.extractions
    c = loop_thread.run(eng.complete(prompt, sp(n=2, temperature=1.0, seed=1), layers=[-1, 1], position="prompt_end"))
    assert eng.extraction.extractions == before  # no extraction request was made
    for ch in c.choices:
        assert ch.extraction is None
        assert_close(ref, c.prompt_token_ids, ch.hidden_states_by_layer[-1], -1, eng.architecture)
        assert_close(ref, c.prompt_token_ids, ch.hidden_states_by_layer[1], 1, eng.architecture)


def test_bad_layer_requests_are_refused_clearly(setup, loop_thread):
    from hidden_states.params import HiddenStatesRequestError, spec_of

    eng, _ = setup
    with pytest.raises(HiddenStatesRequestError, match="out of range"):
        eng.check_layers([eng.num_layers + 1])
    with pytest.raises(HiddenStatesRequestError, match="out of range"):
        eng.check_spec(spec_of(True, [eng.num_layers + 1], enabled=True))
    with pytest.raises(HiddenStatesRequestError, match="hidden_states_position"):
        eng.check_spec(spec_of(True, [-1], "middle", enabled=True))
    with pytest.raises(HiddenStatesRequestError, match="at least one"):
        eng.check_layers([])


# -- support detection, without an engine ----------------------------------------


@pytest.mark.parametrize(
    "module, layer_cls, supported",
    [
        ("llama", "LlamaDecoderLayer", True),
        ("qwen3", "Qwen3DecoderLayer", True),
        ("gemma2", "Gemma2DecoderLayer", True),
        ("gemma3", "Gemma3DecoderLayer", True),
        ("mistral", "MistralDecoderLayer", True),
        ("granite", "GraniteDecoderLayer", False),  # takes and returns the whole stream
        ("commandr", "CohereDecoderLayer", False),  # ignores its residual argument
        ("gemma3n", "Gemma3nDecoderLayer", False),  # per-layer inputs, no residual argument
    ],
)
def test_layer_convention_is_read_from_the_layer(module, layer_cls, supported):
    import importlib

    from hidden_states.vllm.worker.layers import _residual_norm_of

    cls = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), layer_cls)
    norm, why = _residual_norm_of(cls)
    assert (norm == "input_layernorm") if supported else (norm is None and cls.__name__ in why)


class _AddNorm(torch.nn.Module):
    def __init__(self, adds: bool = True):
        super().__init__()
        self.weight, self.adds = torch.nn.Parameter(torch.ones(8)), adds

    def forward(self, x, residual=None):
        if residual is None:
            return x * self.weight
        s = x + residual if self.adds else residual
        return s * self.weight, s


class _Layer(torch.nn.Module):
    def __init__(self, adds: bool = True):
        super().__init__()
        self.input_layernorm = _AddNorm(adds)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        return hidden_states, residual


def _fake_hook(eager: bool, adds: bool = True, arch: str = "LlamaForCausalLM"):
    from hidden_states.vllm.worker.capture import _RunnerHook

    hf = types.SimpleNamespace(num_hidden_layers=2, architectures=[arch])
    mc = types.SimpleNamespace(hf_config=hf, hf_text_config=hf, enforce_eager=eager, get_hidden_size=lambda: 8)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([_Layer(adds), _Layer(adds)])
    runner = types.SimpleNamespace(vllm_config=types.SimpleNamespace(model_config=mc), model=model)
    return _RunnerHook(runner), model.model.layers


def _hooks(layers) -> list[tuple[int, int]]:
    return [(len(layer._forward_pre_hooks), len(layer._forward_hooks)) for layer in layers]


def test_layer_hooks_only_on_eager_engines_at_transformers_sites():
    """Layer 0 at the input of decoder layer 0, layer 1 at the output of decoder layer 0 (not the input of
    layer 1: a model may add between them); nothing on the last decoder layer (layer -1 is the final norm's)."""
    hook, layers = _fake_hook(eager=True)
    found = hook.install_layer_hooks()
    assert found["layer_capture"] and found["layer_hooks"] == 2 and found["layer_capture_verified"]
    assert _hooks(layers) == [(1, 1), (0, 0)]

    hook, layers = _fake_hook(eager=False)
    found = hook.install_layer_hooks()
    assert found["layer_structure"] and not found["layer_capture"] and "enforce_eager" in found["layer_capture_reason"]
    assert _hooks(layers) == [(0, 0), (0, 0)]

    hook, layers = _fake_hook(eager=True, adds=False)  # a norm that does not add the residual
    found = hook.install_layer_hooks()
    assert not found["layer_structure"] and "hidden + residual" in found["layer_capture_reason"]
    assert _hooks(layers) == [(0, 0), (0, 0)]


def test_an_unverified_architecture_is_refused_by_name_even_with_the_structure():
    """The structure is the convention, but the architecture is not in the verified list: no hooks, and
    the reason names the verified families (what a 400 and a failed start then say)."""
    hook, layers = _fake_hook(eager=True, arch="ToyForCausalLM")
    found = hook.install_layer_hooks()
    assert found["layer_structure"] and not found["layer_capture"] and not found["layer_capture_verified"]
    assert _hooks(layers) == [(0, 0), (0, 0)]
    for part in ("ToyForCausalLM", "not verified", "Llama", "Qwen3VL", "Gemma3"):
        assert part in found["layer_capture_reason"], found["layer_capture_reason"]


def test_unsupported_models_get_the_reason():
    from hidden_states.params import spec_of
    from hidden_states.vllm.engine import HiddenStatesEngine, HiddenStatesRequestError

    eng = HiddenStatesEngine.__new__(HiddenStatesEngine)
    eng._enabled, eng.num_layers, eng.architecture, eng.eager = True, 4, "GraniteForCausalLM", True
    eng.hidden_size, eng.steering_vectors, eng.heads = 8, {}, {}
    eng.layer_capture = {
        "layer_structure": False,
        "layer_capture": False,
        "layer_capture_verified": False,
        "layer_capture_reason": "intermediate layers of GraniteForCausalLM are not verified",
    }
    assert eng.check_layers([-1, 4]) == (-1, 4)  # the last layer works on every model
    with pytest.raises(HiddenStatesRequestError) as e:
        eng.check_layers([2])
    assert e.value.param == "hidden_states_layers"
    for part in ("GraniteForCausalLM", "verified against transformers", "Gemma2", "Qwen3", "Qwen3VL", "(-1)"):
        assert part in str(e.value)
    vec = base64.b64encode(np.ones(8, "<f4").tobytes()).decode()
    with pytest.raises(HiddenStatesRequestError) as e:
        eng.steering_of(
            spec_of(
                True, [-1], "completion_end", "float32", None, None, None, [{"layer": 1, "vector": vec}], enabled=True
            )
        )
    assert e.value.param == "hidden_states_steering" and "not verified" in str(e.value)
    # a verified family whose layer class no longer follows the convention: refused with the structure's reason
    eng.architecture = "LlamaForCausalLM"
    eng.layer_capture = {
        "layer_structure": False,
        "layer_capture": False,
        "layer_capture_verified": True,
        "layer_capture_reason": "LlamaDecoderLayer.forward takes (positions, hidden_states)",
    }
    with pytest.raises(HiddenStatesRequestError, match="LlamaDecoderLayer.forward takes"):
        eng.check_layers([1])
    eng.layer_capture = {
        "layer_structure": True,
        "layer_capture": False,
        "layer_capture_verified": True,
        "layer_capture_reason": "x",
    }
    eng.eager = False
    with pytest.raises(HiddenStatesRequestError, match="enforce_eager=True"):
        eng.check_layers([1])


def test_the_verified_table_names_built_in_models_of_its_architectures_and_each_is_tested():
    """A family in VERIFIED_LAYER_ARCHS is one whose test runs: its built-in model is of that architecture
    and is among the test modules' families."""
    import json
    from pathlib import Path

    from hidden_states.models.builtin import FAMILIES as BUILDERS
    from hidden_states.models.builtin import resolve_model
    from hidden_states.models.vlm import VLM_MODELS
    from tests.engine import test_multimodal

    for arch, model in VERIFIED_LAYER_ARCHS.items():
        if arch == "MiMoForCausalLM":  # tests/engine/test_spec_decode.py's mtp engine asks layers [1, -1]
            continue
        if model in SPECS:
            assert BUILDERS[SPECS[model].family] + "ForCausalLM" == arch
            assert model in [getattr(f, "values", [f])[0] for f in FAMILIES]
        else:
            assert model in VLM_MODELS and f"builtin:{model}" in test_multimodal.FAMILIES
            config = json.loads((Path(resolve_model(f"builtin:{model}")) / "config.json").read_text())
            assert config["architectures"] == [arch], (model, config["architectures"])


def test_a_compiled_engine_serves_its_static_layers_and_names_them():
    """capture_layers (worker/traced.py): a layer or a steering entry outside the set is a 400 naming
    the set; a compiled engine started without one points at it; a second ablation of the same
    positions at one layer is refused by name."""
    from hidden_states.params import spec_of
    from hidden_states.vllm.engine import HiddenStatesEngine, HiddenStatesRequestError

    eng = HiddenStatesEngine.__new__(HiddenStatesEngine)
    eng._enabled, eng.num_layers, eng.architecture, eng.eager = True, 4, "LlamaForCausalLM", False
    eng.hidden_size, eng.steering_vectors, eng.heads = 8, {}, {}
    eng.layer_capture = {
        "layer_structure": True,
        "layer_capture": True,
        "layer_capture_reason": None,
        "layer_capture_verified": True,
        "capture_layers": [1, 3],
    }
    assert eng.check_layers([1, 3, -1, 4]) == (1, 3, -1, 4)
    with pytest.raises(HiddenStatesRequestError, match=r"\[2\] are outside this engine's capture_layers \[1, 3\]") as e:
        eng.check_layers([2, -1])
    assert e.value.param == "hidden_states_layers"
    vec = base64.b64encode(np.ones(8, "<f4").tobytes()).decode()

    def steer(*entries):
        return eng.steering_of(
            spec_of(True, [-1], "completion_end", "float32", None, None, None, list(entries), enabled=True)
        )

    assert len(steer({"layer": 3, "vector": vec})[0]) == 1
    with pytest.raises(HiddenStatesRequestError, match=r"layer 2 is outside this engine's capture_layers \[1, 3\]"):
        steer({"layer": 2, "vector": vec})
    assert (
        len(
            steer(
                {"layer": 1, "vector": vec, "op": "ablate", "positions": "prompt"},
                {"layer": 1, "vector": vec, "op": "ablate", "positions": "completion"},
            )[0]
        )
        == 2
    )
    with pytest.raises(HiddenStatesRequestError, match="two ablations/clamps/caps of the same positions at layer 1"):
        steer(
            {"layer": 1, "vector": vec, "op": "ablate"},
            {"layer": 1, "vector": vec, "op": "ablate", "positions": "prompt"},
        )
    eng.layer_capture = {
        "layer_structure": True,
        "layer_capture": False,
        "layer_capture_reason": "compiled",
        "layer_capture_verified": True,
    }
    with pytest.raises(HiddenStatesRequestError, match="need capture_layers at start"):
        eng.check_layers([1])


def test_the_static_set_adds_the_heads_and_vectors_layers():
    from hidden_states.preflight import EngineStartupError
    from hidden_states.vllm.engine import _static_layers

    heads = [types.SimpleNamespace(layer=2), types.SimpleNamespace(layer=4)]  # 4: the last layer, always served
    assert _static_layers(None, (), {}, 4, compiled=False) is None  # eager: every layer, by pre-hooks
    assert _static_layers(None, (), {}, 4, compiled=True) == []
    assert _static_layers([-2, 0, 4, -1], heads, {"v": {1: None}}, 4, compiled=True) == [0, 1, 2, 3]
    assert _static_layers([3], (), {}, 4, compiled=False) == [3]  # an eager engine may run the traced path too
    with pytest.raises(EngineStartupError, match="capture_layers: layer 5 out of range"):
        _static_layers([5], (), {}, 4, compiled=True)


def test_an_architecture_without_traced_capture_says_why():
    """capture_layers on a model whose layers do not follow the convention: the install reports
    the reason the start-up error then names."""
    from hidden_states.vllm.worker.traced import TRACED_ATTR

    hook, layers = _fake_hook(eager=False)
    setattr(hook.runner, TRACED_ATTR, "GraniteDecoderLayer.forward takes (positions, hidden_states)")
    found = hook.install_layer_hooks()
    assert not found["layer_capture"] and "GraniteDecoderLayer" in found["layer_capture_reason"]
    assert _hooks(layers) == [(0, 0), (0, 0)]


@pytest.mark.parametrize("arch, traced", [("LlamaForCausalLM", True), ("ToyForCausalLM", False)])
def test_the_traced_set_sits_at_transformers_sites_and_only_on_verified_architectures(arch, traced):
    """capture_layers [0, 1] (worker/traced.py): layer 0's entry at the input of decoder layer 0, layer 1's
    at its output, both on layer 0's module; the rows are transformers' hidden_states[0] and [1]. On an
    unverified architecture nothing is traced and the reason names the verified families, the words the
    start-up error then carries."""
    from hidden_states.protocol import with_capture_layers
    from hidden_states.vllm.worker.traced import TRACED_ATTR, install

    hf = types.SimpleNamespace(num_hidden_layers=2, architectures=[arch])
    mc = types.SimpleNamespace(
        hf_config=hf, hf_text_config=hf, enforce_eager=False, dtype=torch.float32, get_hidden_size=lambda: 8
    )
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([_Layer(), _Layer()])
    cfg = types.SimpleNamespace(
        model_config=mc, additional_config={}, compilation_config=types.SimpleNamespace(max_cudagraph_capture_size=0)
    )
    with_capture_layers(cfg, [0, 1])
    runner = types.SimpleNamespace(vllm_config=cfg, max_num_tokens=4, get_model=lambda: model)
    install(runner)
    found = getattr(runner, TRACED_ATTR)
    if not traced:
        assert isinstance(found, str) and "ToyForCausalLM" in found and "Qwen3VL" in found, found
        return
    assert sorted(found.slots) == [0, 1]
    assert [(s.module is model.model.layers[0], s.at) for s in found.slots.values()] == [
        (True, "input"),
        (True, "output"),
    ]
    hidden = torch.randn(3, 8)
    with torch.inference_mode():
        h1, r1 = model.model.layers[0](torch.arange(3), hidden, None)
    assert torch.equal(found.rows(0)[:3], hidden)  # the embeddings: layer 0's input
    assert torch.equal(found.rows(1)[:3], h1 + r1)  # layer 0's output, hidden + residual


class _FakeRunner:
    """Just what the hook reads of a GPUModelRunner, around the toy model: one request
    "r" of 3 prompt tokens, computed in one step (flat rows 0..2)."""

    def __init__(self):
        hf = types.SimpleNamespace(num_hidden_layers=2, architectures=["LlamaForCausalLM"])
        mc = types.SimpleNamespace(hf_config=hf, hf_text_config=hf, enforce_eager=True, get_hidden_size=lambda: 8)
        self.vllm_config = types.SimpleNamespace(
            model_config=mc,
            speculative_config=None,
            parallel_config=types.SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1, world_size=1),
        )
        self.model = torch.nn.Module()
        self.model.model = torch.nn.Module()
        self.model.model.layers = torch.nn.ModuleList([_Layer(), _Layer()])
        self.input_batch = types.SimpleNamespace(req_id_to_index={"r": 0})
        self.requests = {"r": types.SimpleNamespace(num_computed_tokens=0, num_prompt_tokens=3)}
        self.query_start_loc = types.SimpleNamespace(np=np.array([0, 3]))
        self.execute_model_state = None
        self.device = None

    @torch.inference_mode()
    def _forward(self, rows: int):
        hidden, residual = torch.arange(rows * 8, dtype=torch.float32).reshape(rows, 8), None
        for layer in self.model.model.layers:
            hidden, residual = layer(torch.arange(rows), hidden, residual)
        return hidden

    def _model_forward(self, input_ids=None, **kwargs):  # the real runner's forward helper (wrapped on install)
        return self._forward(int(input_ids.shape[0]))

    def execute_model(self, so):
        hidden = self._model_forward(input_ids=torch.zeros(3, dtype=torch.long))
        self.execute_model_state = types.SimpleNamespace(hidden_states=hidden, sample_hidden_states=hidden[[2]])
        return None  # sampling pending, as on the real runner

    def sample_tokens(self, grammar_output=None):
        self.execute_model_state = None
        return types.SimpleNamespace(req_ids=["r"], req_id_to_index={"r": 0})  # a ModelRunnerOutput

    def _dummy_run(self, rows: int):
        self._forward(rows)


def test_no_capture_plan_outlives_its_step():
    """A forward outside execute_model (a dummy batch) sees no plan, even right after a capture;
    the step's rows leave on its ModelRunnerOutput, and only there."""
    from hidden_states.protocol import PLAN_ATTR, STEP_ATTR, PlanEntry, encode_plan
    from hidden_states.vllm.worker.extension import HiddenStatesWorkerExtension

    runner = _FakeRunner()
    worker = types.SimpleNamespace(model_runner=runner, rank=0)
    found = HiddenStatesWorkerExtension.hidden_states_install(worker)
    assert found["installed"] and found["layer_capture"]
    hook = runner._hidden_states_hook
    # The scheduler's plan: layer 1 of "r"'s third scheduled token (its last prompt token).
    so = types.SimpleNamespace(
        finished_req_ids=set(),
        num_scheduled_tokens={"r": 3},
        **{PLAN_ATTR: encode_plan({"r": PlanEntry([2], [2], [1], 3, None, 0)})},
    )
    runner.execute_model(so)
    out = runner.sample_tokens(None)
    step = getattr(out, STEP_ATTR)
    (block,) = step.requests["r"]  # layer 1 of the last prompt token (flat row 2), float32 [1, 8] in the step's bytes
    assert (block.num_tokens, block.layer, block.positions, block.dtype, block.width) == (3, 1, [2], "float32", 8)
    assert step.data.dtype == np.uint8 and step.data.nbytes == 8 * 4 and block.values(step.data).shape == (1, 8)
    assert hook._given is None and hook._plan is None and not hook._layer_rows and not hook._slices
    # A stale plan would slice this one-row batch at flat row 2 (IndexError) or queue a stale row.
    runner._dummy_run(1)
    assert not hook._slices and hook._ready is None
    assert not hasattr(runner.sample_tokens(None), STEP_ATTR)  # nothing captured, nothing attached
