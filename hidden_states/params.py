"""The hidden-states request fields and their rules: the one definition.

Every surface uses this module: the HTTP ingress checks and their OpenAPI
schema (deployments/http.py), vLLM's OpenAI request models as the replica
extends them (hidden_states/vllm/openai.py), Python-handle requests
(deployments/wire.py), and the engine, which checks layers against its model
(hidden_states/engine.py). Messages name the fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

POSITIONS = ("completion_end", "prompt_end")
ENCODINGS = ("float", "base64")

DISABLED = ("hidden states are disabled on this server: set `enable_return_hidden_states: true` in the app's args "
            "(config.yaml: applications[0].args) and redeploy (a Python engine: "
            "HiddenStatesEngine.start(enable_return_hidden_states=True))")


class HiddenStatesRequestError(ValueError):
    """A hidden-states request that cannot be served as asked (a 400); `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class HiddenStatesDisabledError(HiddenStatesRequestError):
    """Hidden states asked of a server or engine started without them."""

    def __init__(self):
        super().__init__(DISABLED, "return_hidden_states")


class HiddenStatesFields(BaseModel):
    """The request fields this server adds to vLLM's OpenAI API."""

    return_hidden_states: bool = Field(False, description="attach each choice's final-token hidden state")
    hidden_states_encoding: Literal["float", "base64"] = Field(
        "float", description="a JSON list of floats, or base64 of the little-endian float32 bytes")
    hidden_states_layers: list[int] | None = Field(
        None, description="layers as transformers numbers output_hidden_states (0 = embeddings, -1 = after the "
                          "final norm); the choice then carries hidden_states_by_layer")
    hidden_states_position: Literal["completion_end", "prompt_end"] = Field(
        "completion_end", description="the final token of prompt+completion, or the last prompt token")


def check_fields(req: Mapping[str, Any], *, enabled: bool) -> None:
    """The field rules on a raw JSON object, before any engine work; raises HiddenStatesRequestError."""
    hs = req.get("return_hidden_states", False)
    if not isinstance(hs, bool):
        raise HiddenStatesRequestError("return_hidden_states must be a boolean", "return_hidden_states")
    if hs and not enabled:
        raise HiddenStatesDisabledError()
    enc = req.get("hidden_states_encoding", "float")
    if enc not in ENCODINGS:
        raise HiddenStatesRequestError(f"hidden_states_encoding must be 'float' or 'base64', not {enc!r}",
                                       "hidden_states_encoding")
    layers = req.get("hidden_states_layers")
    if layers is not None and (not isinstance(layers, list) or not layers
                               or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)):
        raise HiddenStatesRequestError("hidden_states_layers must be a non-empty list of integers (-1 = last layer)",
                                       "hidden_states_layers")
    check_position(req.get("hidden_states_position", "completion_end"))


def check_position(position: str) -> None:
    if position not in POSITIONS:
        raise HiddenStatesRequestError(
            f"hidden_states_position must be 'completion_end' or 'prompt_end', not {position!r}",
            "hidden_states_position")


def check_layers(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """The layers, deduplicated in order, if the model has them (0..L, or -(L+1)..-1)."""
    layers = tuple(dict.fromkeys(int(layer) for layer in layers))
    if not layers:
        raise HiddenStatesRequestError("hidden_states_layers must name at least one layer", "hidden_states_layers")
    L = num_layers
    bad = [layer for layer in layers if not -(L + 1) <= layer <= L]
    if bad:
        raise HiddenStatesRequestError(
            f"hidden_states_layers {bad} out of range: this model has layers 0..{L} "
            f"(0 = embeddings, {L} = after the final norm; negative counts from the end, -1 = {L})",
            "hidden_states_layers")
    return layers
