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
