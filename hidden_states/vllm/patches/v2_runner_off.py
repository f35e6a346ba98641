"""Ledger point 3: Model Runner V2 turned off (frontend process; the engine core and workers inherit it).

Why: Model Runner V2 (`vllm/v1/worker/gpu/`) has no `execute_model_state`, which point 2 reads.
How: `VLLM_USE_V2_MODEL_RUNNER=0` (`hidden_states.vllm.ENGINE_ENV`) set in the frontend's environment at
`HiddenStatesEngine.start`, inherited by the engine-core and worker processes.
Relies on: the environment variable `vllm.envs.VLLM_USE_V2_MODEL_RUNNER`.
Remove when: point 2 is ported to V2 (docs/how-it-works.md, "Porting the capture").
"""

from __future__ import annotations

import os
from typing import Any

from hidden_states.vllm import ENGINE_ENV
from hidden_states.vllm.patches.drift import Symbol


def start(**_: Any) -> None:
    os.environ.update(ENGINE_ENV)  # inherited by the engine-core process


RELIED: tuple[Symbol, ...] = (Symbol("vllm.envs:VLLM_USE_V2_MODEL_RUNNER", "3", kind="environment variable"),)
