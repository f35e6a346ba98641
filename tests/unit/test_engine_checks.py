"""HiddenStatesEngine.check_layers: our validation logic, no vLLM engine started."""

import pytest

from hidden_states.vllm.engine import HiddenStatesEngine, HiddenStatesRequestError


def fake_engine(arch="LlamaForCausalLM", layers=12, eager=True):
    eng = HiddenStatesEngine.__new__(HiddenStatesEngine)
    eng._enabled, eng.num_layers, eng.architecture, eng.eager = True, layers, arch, eager
    eng.layer_capture = None  # no workers: the checked architectures decide
    return eng


def test_layers_normalise_and_dedupe():
    assert fake_engine().check_layers([-1, 12, 0, 0]) == (-1, 12, 0)


def test_unsupported_family_names_the_supported_ones():
    eng = fake_engine("GPT2LMHeadModel")
    assert eng.check_layers([-1]) == (-1,)  # the last layer works on every model
    with pytest.raises(HiddenStatesRequestError) as e:
        eng.check_layers([3])
    for family in ("Llama", "Qwen2", "Qwen3VL", "GPT2LMHeadModel", "verified against transformers"):
        assert family in str(e.value)


def test_intermediate_layers_need_eager():
    with pytest.raises(HiddenStatesRequestError, match="enforce_eager"):
        fake_engine(eager=False).check_layers([0])
    assert fake_engine(eager=False).check_layers([-1, 12]) == (-1, 12)


@pytest.mark.parametrize("layers", [[13], [-14], [100]])
def test_out_of_range(layers):
    with pytest.raises(HiddenStatesRequestError, match=r"0\.\.12"):
        fake_engine().check_layers(layers)


def test_a_capture_layer_no_pipeline_stage_traces_stops_the_start_naming_what_is_possible():
    """Each stage reports the static set's layers it traced (those whose decoder layer it runs); a layer none
    traced stops the start, naming capture_layers, the stages' decoder layers and what capture_layers may name."""
    from hidden_states.preflight import EngineStartupError
    from hidden_states.vllm.engine import check_traced_stages

    stages = [
        {"traced_layers": [0, 1], "stage_layers": [0, 2]},
        {"traced_layers": [2], "stage_layers": [2, 4]},
    ]
    check_traced_stages([0, 1, 2], stages, 4)  # every layer on the stage that runs it
    check_traced_stages([3], [{"traced_layers": [], "stage_layers": [0, 2]}, {"traced_layers": [3]}], 4)
    with pytest.raises(EngineStartupError) as e:
        check_traced_stages([0, 3], stages, 4)
    msg = str(e.value)
    assert msg.startswith("capture_layers: layer(s) [3] are traced by no pipeline stage"), msg
    assert "decoder layers 0..1, 2..3" in msg and "trace [0, 1, 2]" in msg, msg
    assert "0..3" in msg and "(4 or -1)" in msg, msg
