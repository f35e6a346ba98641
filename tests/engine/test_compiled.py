"""vLLM's default execution, `enforce_eager: false` (torch.compile; CUDA graphs on GPUs):
last-layer vectors stay exact, since the hook reads the rows the LM head consumes
after the compiled forward pass; intermediate layers keep their clear refusal
(forward pre-hooks are not in a compiled graph, so none are registered)."""

from __future__ import annotations

import pytest

from tests.conftest import TEST_ENGINE_ARGS, TEST_MODEL
from tests.engine.test_engine import PROMPTS, sp


@pytest.fixture(scope="module")
def compiled_engine(loop_thread):
    from hidden_states.vllm.engine import HiddenStatesEngine

    args = {**TEST_ENGINE_ARGS, "enforce_eager": False}
    # warm_up_s=0: a warm-up per batch size would compile for each; not what this tests.
    eng = loop_thread.run(HiddenStatesEngine.start(TEST_MODEL, warm_up_s=0, **args), timeout=900)
    yield eng
    eng.shutdown()


def test_engine_is_compiled(compiled_engine):
    mode = compiled_engine.startup
    assert mode["enforce_eager"] is False and compiled_engine.eager is False, mode
    assert mode["compilation_mode"] not in ("0", "None", "CompilationMode.NONE"), mode


def test_last_layer_exact_on_compiled_engine(compiled_engine, loop_thread, reference):
    import asyncio

    async def run():
        return await asyncio.gather(*(compiled_engine.complete(p, sp(max_tokens=12)) for p in PROMPTS))

    for c in loop_thread.run(run()):
        for ch in c.choices:
            reference.assert_matches(c.prompt_token_ids + ch.token_ids, ch.hidden_states)


def test_intermediate_layers_refused_on_compiled_engine(compiled_engine):
    from hidden_states.params import HiddenStatesRequestError

    assert compiled_engine.check_layers([-1]) == (-1,)
    with pytest.raises(HiddenStatesRequestError, match="enforce_eager=True"):
        compiled_engine.check_layers([1, -1])
