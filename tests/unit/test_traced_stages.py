"""traced.py under pipeline parallelism, on stand-in decoder stacks (vLLM's PPMissingLayer for another stage's
layers): which layers a stage traces, and that a stage writes only its own layers' steering."""

from __future__ import annotations

import numpy as np
import torch

from hidden_states.vllm.worker.traced import TracedLayers, on_this_stage_of


class Layer(torch.nn.Module):
    """A decoder layer's calling convention: (positions, hidden, residual) -> (hidden, residual)."""

    def forward(self, positions, hidden_states, residual):
        return hidden_states * 2, hidden_states if residual is None else residual + hidden_states


def stages():
    from vllm.model_executor.models.utils import PPMissingLayer

    return [Layer(), Layer(), PPMissingLayer()], [PPMissingLayer(), PPMissingLayer(), Layer()]


def test_each_stage_traces_the_layers_whose_decoder_layer_it_runs():
    first, last = stages()
    assert on_this_stage_of(first, [0, 1, 2]) == [0, 1] and on_this_stage_of(last, [0, 1, 2]) == [2]
    assert on_this_stage_of(last, [0, 1]) == []  # a stage with none of them traces nothing


def test_a_stage_with_none_of_the_layers_allocates_nothing_and_skips_other_stages_steering():
    _, last = stages()
    traced = TracedLayers(last, [], 8, 4, torch.float32, "cpu", engine_layers=[0, 1])
    assert traced.layers == [] and traced.engine_layers == [0, 1] and traced.bytes == 0 and not traced.slots
    rows = np.array([0, 1])
    assert traced.fill({1: [(rows, "add", torch.ones(4), None)]}, 3) == (0, 0)
    traced.clear()


def test_a_stage_steers_and_captures_its_own_layer_at_its_first_decoder_layer_s_input():
    """Layer 2 on the last stage: read at the input of decoder layer 2, the stream (hidden + residual) the stage
    before sent; an add at layer 1 (the other stage's) is skipped, the one at layer 2 written and applied."""
    _, last = stages()
    traced = TracedLayers(last, [2], 8, 4, torch.float32, "cpu", engine_layers=[1, 2])
    assert traced.layers == [2] and traced.bytes > 0
    vec = torch.tensor([1.0, 2.0, 3.0, 4.0])
    plan = {1: [(np.array([0, 1, 2]), "add", vec, None)], 2: [(np.array([1]), "add", vec, None)]}
    assert traced.fill(plan, 3) == (1, 0)
    hidden, residual = torch.arange(12.0).reshape(3, 4), torch.ones(3, 4)
    out, _ = last[2](None, hidden, residual)
    steered = hidden.clone()
    steered[1] += vec
    torch.testing.assert_close(out, steered * 2, rtol=0, atol=0)  # row 1 steered, rows 0 and 2 their exact bits
    torch.testing.assert_close(traced.rows(2)[:3], steered + residual, rtol=0, atol=0)
    traced.clear()
    out, _ = last[2](None, hidden, residual)
    torch.testing.assert_close(out, hidden * 2, rtol=0, atol=0)
