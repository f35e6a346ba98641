"""Chosen layers and the prompt-end vector, against transformers (issue: beyond the seed).

transformers numbering: 0 = embeddings, l = residual stream entering layer l,
L = after the final norm; negative counts from the end.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import TEST_ENGINE_ARGS, Reference, long_text


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def setup(request, loop_thread):
    from hidden_states.engine import HiddenStatesEngine
    from hidden_states.tiny_model import build

    path = str(build(request.param))
    eng = loop_thread.run(HiddenStatesEngine.start(path, **TEST_ENGINE_ARGS))
    yield eng, Reference(path)
    eng.shutdown()


def sp(**kw):
    from vllm import SamplingParams

    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0.0)
    return SamplingParams(**kw)


def test_every_layer_matches_transformers(setup, loop_thread):
    eng, ref = setup
    L = eng.num_layers
    layers = [0, 1, -1, L, -2, -(L + 1)]
    for prompt in ("Hello! How are you today?", long_text(300, seed=9)):
        c = loop_thread.run(eng.complete(prompt, sp(), layers=layers))
        ch = c.choices[0]
        ids = c.prompt_token_ids + ch.token_ids
        assert sorted(ch.hidden_states_by_layer) == sorted(set(layers))
        for layer, vec in ch.hidden_states_by_layer.items():
            ref.assert_matches(ids, vec, layer=layer)
        assert np.array_equal(ch.hidden_states, ch.hidden_states_by_layer[-1])
        assert not np.allclose(ch.hidden_states_by_layer[0], ch.hidden_states_by_layer[1])


def test_prompt_end_needs_no_extraction_step(setup, loop_thread):
    eng, ref = setup
    prompt = long_text(200, seed=10)
    before = eng.extractions
    c = loop_thread.run(eng.complete(prompt, sp(n=2, temperature=1.0, seed=1), layers=[-1, 1], position="prompt_end"))
    assert eng.extractions == before  # no extraction request was made
    for ch in c.choices:
        assert ch.extraction is None
        ref.assert_matches(c.prompt_token_ids, ch.hidden_states_by_layer[-1], layer=-1)
        ref.assert_matches(c.prompt_token_ids, ch.hidden_states_by_layer[1], layer=1)


def test_bad_layer_requests_are_refused_clearly(setup, loop_thread):
    from hidden_states.engine import HiddenStatesRequestError

    eng, _ = setup
    with pytest.raises(HiddenStatesRequestError, match="out of range"):
        eng.check_request([eng.num_layers + 1])
    with pytest.raises(HiddenStatesRequestError, match="hidden_states_position"):
        eng.check_request([-1], "middle")
    with pytest.raises(HiddenStatesRequestError, match="at least one"):
        eng.check_request([])
