"""Steering as the frontend resolves it: a request's `hidden_states_steering` entries against the
model, the registered vectors and the SAE heads, into the entries the workers apply
(`protocol.SteerEntry`), what the response echoes, and the digest that joins the cache salt.

Layers are numbered as `hidden_states_layers`: entry layer L changes transformers' `hidden_states[L]`,
the output of decoder layer L - 1 (0: the embeddings' output; n - 1 at most: the stream after the
final norm is not steerable). Registered vectors (`steering_vectors`) are read at start:
- `.gguf`: a control vector as repeng exports it and llama.cpp reads it, `direction.N` tensors, each
  added to the output of decoder layer N (0-based), i.e. this server's layer N + 1;
- `.safetensors`: a `vector` tensor [D] (the entry's `layer` says where), or `direction.N` tensors as
  in the GGUF;
- `.npy`: one vector [D] (with `layer`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from hidden_states.heads import HeadConfigError
from hidden_states.params import HiddenStatesRequestError, absolute_layer, resolve_condition
from hidden_states.protocol import Clamp, SteerEntry

_DIRECTION = re.compile(r"^direction\.(\d+)$")


def _directions(tensors: Mapping[str, np.ndarray], name: str, num_layers: int) -> dict[int, np.ndarray]:
    out = {}
    for key, t in tensors.items():
        m = _DIRECTION.match(key)
        if m is None:
            continue
        layer = int(m.group(1)) + 1  # direction.N: the output of block N
        if layer >= num_layers:
            raise HeadConfigError(
                f"steering vector {name!r}: {key} steers the last block's output before the final norm, which this "
                f"server does not steer (layers 0..{num_layers - 1}: direction.0..direction.{num_layers - 2})"
            )
        out[layer] = np.asarray(t, np.float32).reshape(-1)
    return out


def load_vectors(
    entries: Sequence[Mapping[str, Any]], num_layers: int, hidden_size: int
) -> dict[str, dict[int, np.ndarray]]:
    """The `steering_vectors` arg ([{name, path, layer?}]) read and checked: name -> {layer: float32 [D]};
    HeadConfigError names the first that does not fit."""
    out: dict[str, dict[int, np.ndarray]] = {}
    for i, e in enumerate(entries):
        name, path = e.get("name"), e.get("path")
        if not isinstance(name, str) or not path or name in out:
            raise HeadConfigError(f"steering_vectors[{i}] needs a distinct `name` and a `path`, got {e!r}")
        path = os.path.abspath(os.path.expanduser(str(path)))
        if not os.path.exists(path):
            raise HeadConfigError(f"steering vector {name!r}: {path} does not exist")
        try:
            if path.endswith(".gguf"):
                import gguf

                reader = gguf.GGUFReader(path)
                layers = _directions({t.name: np.asarray(t.data) for t in reader.tensors}, name, num_layers)
            elif path.endswith(".safetensors"):
                from safetensors.numpy import load_file

                tensors = load_file(path)
                layers = _directions(tensors, name, num_layers)
                if "vector" in tensors:
                    layers = {None: tensors["vector"].astype(np.float32).reshape(-1)}
            elif path.endswith(".npy"):
                layers = {None: np.load(path, allow_pickle=False).astype(np.float32).reshape(-1)}
            else:
                raise HeadConfigError(f"steering vector {name!r}: {path} is not .gguf, .safetensors or .npy")
        except (OSError, ValueError) as err:
            raise HeadConfigError(f"steering vector {name!r}: cannot read {path}: {err}") from None
        if None in layers:
            if e.get("layer") is None:
                raise HeadConfigError(f"steering vector {name!r}: one vector needs a `layer`")
            layer = absolute_layer(int(e["layer"]), num_layers)
            if not 0 <= layer < num_layers:
                raise HeadConfigError(
                    f"steering vector {name!r}: layer {e['layer']} out of range (0..{num_layers - 1})"
                )
            layers = {layer: layers[None]}
        if not layers:
            raise HeadConfigError(f"steering vector {name!r}: {path} holds no vector (`vector` or direction.N)")
        for layer, v in layers.items():
            if v.shape != (hidden_size,) or not np.isfinite(v).all():
                raise HeadConfigError(
                    f"steering vector {name!r}: layer {layer} has {v.shape[0]} entries (finite "
                    f"ones expected), the model's hidden size is {hidden_size}"
                )
        out[name] = layers
    return out


def _vector(raw: Any, where: str, hidden_size: int) -> np.ndarray:
    if isinstance(raw, str):
        try:
            data = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            raise HiddenStatesRequestError(
                f"{where}.vector is not base64 (little-endian float32) or a list of floats", "hidden_states_steering"
            ) from None
        if len(data) % 4:
            raise HiddenStatesRequestError(
                f"{where}.vector has {len(data)} bytes, not float32s", "hidden_states_steering"
            )
        v = np.frombuffer(data, "<f4").astype(np.float32)
    else:
        v = np.asarray(raw, np.float32)
    if v.shape != (hidden_size,):
        raise HiddenStatesRequestError(
            f"{where}.vector has {v.size} entries; the model's hidden size is {hidden_size}", "hidden_states_steering"
        )
    if not np.isfinite(v).all():
        raise HiddenStatesRequestError(f"{where}.vector has NaN or infinite entries", "hidden_states_steering")
    return v


def _feature(head: Any, feature: int, where: str) -> np.ndarray:
    """An SAE head's decoder row (W_dec[feature]), read alone from its safetensors file."""
    from safetensors import safe_open

    with safe_open(os.path.join(head.path, "sae_weights.safetensors"), framework="numpy") as f:
        return np.asarray(f.get_slice("W_dec")[feature : feature + 1], np.float32).reshape(-1)


def _clamp(head: Any, feature: int, value: float, where: str) -> Clamp:
    """The clamp of an SAE head's feature: its encoder, read alone from its safetensors file, in the one
    form every served architecture but top-k takes (protocol.Clamp)."""
    from safetensors import safe_open

    with safe_open(os.path.join(head.path, "sae_weights.safetensors"), framework="numpy") as f:

        def column(name: str) -> np.ndarray:
            return np.asarray(f.get_slice(name)[:, feature : feature + 1], np.float32).reshape(-1)

        def one(name: str) -> float:
            return float(np.asarray(f.get_slice(name)[feature : feature + 1], np.float32)[0])

        b_dec, w = np.asarray(f.get_tensor("b_dec"), np.float32), column("W_enc")
        if head.architecture == "gated":  # gate: W_enc, b_gate; magnitude: W_enc * exp(r_mag), b_mag
            w_mag = (w * np.exp(np.float32(one("r_mag")))).astype(np.float32)
            parts = (w_mag, one("b_mag"), w, one("b_gate"), 0.0)
        else:
            threshold = one("threshold") if head.architecture == "jumprelu" else 0.0
            parts = (w, one("b_enc"), w, one("b_enc"), threshold)
    le = lambda v: np.ascontiguousarray(v, "<f4").tobytes()  # noqa: E731
    return Clamp(float(value), le(b_dec), le(parts[0]), parts[1], le(parts[2]), parts[3], parts[4])


def resolve(
    spec: Any,
    num_layers: int,
    hidden_size: int,
    vectors: Mapping[str, Mapping[int, np.ndarray]],
    heads: Mapping[str, Any],
) -> tuple[list[SteerEntry], list[dict]]:
    """(the entries, not anchored yet: `anchor`; what the response echoes); a 400 naming the entry for
    a wrong dimension, a layer out of range, an unknown name or feature."""
    entries, echo = [], []
    for i, ask in enumerate(spec.hidden_states_steering or ()):
        where = f"hidden_states_steering[{i}]"
        when, when_echo = (
            (None, None)
            if ask.when is None
            else resolve_condition(ask.when, heads, f"{where}.when", "hidden_states_steering")
        )
        if ask.vector is not None:
            found = {ask.layer: _vector(ask.vector, where, hidden_size)}
            source = {}
        elif ask.name is not None:
            if ask.name not in vectors:
                have = ", ".join(sorted(vectors)) or "none"
                raise HiddenStatesRequestError(
                    f"{where}: unknown steering vector {ask.name!r}; this server's are {have}", "hidden_states_steering"
                )
            found = dict(vectors[ask.name])
            if ask.layer is not None:
                layer = absolute_layer(ask.layer, num_layers)
                if layer not in found:
                    raise HiddenStatesRequestError(
                        f"{where}: steering vector {ask.name!r} has layers {sorted(found)}, not {ask.layer}",
                        "hidden_states_steering",
                    )
                found = {layer: found[layer]}
            source = {"name": ask.name}
        else:
            head = heads.get(ask.head)
            if head is None or head.kind != "sae":
                have = ", ".join(sorted(n for n, h in heads.items() if h.kind == "sae")) or "none"
                kind = "a linear head, no SAE head" if head is not None else "no SAE head"
                verb = "a clamp sets" if ask.op == "clamp" else "a feature is"
                raise HiddenStatesRequestError(
                    f"{where}: {ask.head!r} is {kind}; {verb} an SAE's feature (this server's SAEs: {have})",
                    "hidden_states_steering",
                )
            if ask.feature >= head.width:
                raise HiddenStatesRequestError(
                    f"{where}: feature {ask.feature} is beyond the SAE {ask.head!r}'s {head.width} features",
                    "hidden_states_steering",
                )
            if ask.op == "clamp" and head.architecture == "topk":
                raise HiddenStatesRequestError(
                    f"{where}: {ask.head!r} is a top-k SAE: a feature's activation depends on all the others (whether "
                    "it is among the k largest), so it cannot be set alone; clamp a standard, JumpReLU or gated SAE's",
                    "hidden_states_steering",
                )
            if ask.op == "clamp" and ask.layer is not None and absolute_layer(ask.layer, num_layers) != head.layer:
                raise HiddenStatesRequestError(
                    f"{where}: a clamp acts at its SAE's layer ({head.layer}), not {ask.layer}: drop `layer`",
                    "hidden_states_steering",
                )
            found = {head.layer if ask.layer is None else ask.layer: _feature(head, ask.feature, where)}
            source = {"head": ask.head, "feature": ask.feature}
        for layer, v in sorted(found.items()):
            absolute = absolute_layer(layer, num_layers)
            if not 0 <= absolute < num_layers:
                raise HiddenStatesRequestError(
                    f"{where}: layer {layer} out of range: steering changes transformers' hidden_states[L], "
                    f"the output of decoder layer L - 1, L from 0 (the embeddings' output) to {num_layers - 1} "
                    f"(the stream after the final norm, "
                    f"{num_layers} or -1, is not steerable)",
                    "hidden_states_steering",
                )
            if ask.op in ("ablate", "cap") and not np.any(v):
                raise HiddenStatesRequestError(
                    f"{where}: {'ablating' if ask.op == 'ablate' else 'capping along'} a zero vector",
                    "hidden_states_steering",
                )
            raw = np.ascontiguousarray(v, "<f4").tobytes()
            clamp = _clamp(heads[ask.head], ask.feature, ask.value, where) if ask.op == "clamp" else None
            entries.append(
                SteerEntry(
                    absolute,
                    ask.op,
                    ask.positions,
                    float(ask.scale),
                    raw,
                    when=when,
                    clamp=clamp,
                    cap=float(ask.max) if ask.op == "cap" else 0.0,
                )
            )
            echo.append(
                {
                    "layer": absolute,
                    "op": ask.op,
                    "positions": ask.positions,
                    "scale": float(ask.scale),
                    "digest": hashlib.sha256(raw).hexdigest()[:16],
                    **source,
                    **({"value": float(ask.value)} if ask.op == "clamp" else {}),
                    **({"max": float(ask.max)} if ask.op == "cap" else {}),
                    **({"when": when_echo} if when is not None else {}),
                }
            )
    return entries, echo


def replay(entries: Sequence[SteerEntry], applied: Mapping[int, Sequence[int]]) -> list[SteerEntry]:
    """A request's anchored entries with each conditional one replaced by where it was applied (`applied`: entry
    index -> positions; none: nowhere): what an extraction step of that choice applies, so it computes the rows
    the choice's own steps did."""
    return [
        msgspec.structs.replace(e, when=None, at=sorted(int(p) for p in applied.get(k, ())))
        if e.when is not None
        else e
        for k, e in enumerate(entries)
    ]


def anchor(entries: Sequence[SteerEntry], prompt_len: int) -> tuple[list[SteerEntry], str]:
    """The entries on absolute positions of a sequence whose prompt has `prompt_len` tokens (prompt:
    0..P-1, completion: P onward), and their digest: the cache salt's part, so a KV block computed
    under one steering (or another anchoring of it) never serves another; the same steering and
    prompt length share blocks."""
    spans = {"prompt": (0, prompt_len), "completion": (prompt_len, -1), "all": (0, -1)}
    out = [msgspec.structs.replace(e, start=spans[e.positions][0], end=spans[e.positions][1]) for e in entries]
    return out, hashlib.sha256(msgspec.msgpack.encode(out)).hexdigest()[:16]
