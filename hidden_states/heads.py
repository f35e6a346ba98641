"""Heads: small modules run on the device over captured rows, so a request gets their outputs
instead of the rows (docs/heads.md).

- A **sparse autoencoder** in SAELens's folder format (`cfg.json` + `sae_weights.safetensors`):
  the standard, top-k, JumpReLU and gated architectures, encoded as SAELens's `encode` does.
  Its hook point names its layer (`hook_layer`).
- A **linear head**: a safetensors file with `weight [C, D]` and `bias [C]`, an activation
  (none, sigmoid, softmax) and optional label names.
- An SAE's **feature labels**: Neuronpedia's explanations export in its folder (`read_explanations`),
  so each feature a choice carries comes with its description.

`load_heads` reads and checks the registered heads against the model at start (`HeadConfigError`
names the head and what it expected); `HeadSpec` is what crosses to the workers (builtins only).
`DeviceHead` runs one on a batch of rows: `encode(rows) -> (values, indices)`; `head_fields` is
what a choice carries of them (`hidden_states_heads`). No vLLM here.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from hidden_states.shape import squeeze

SAE_ARCHITECTURES = ("standard", "topk", "jumprelu", "gated")
ACTIVATIONS = ("none", "sigmoid", "softmax")
DEFAULT_SAE_TOPK = 64  # features per position of a non-top-k SAE when neither the head nor the request says
_RESID = re.compile(r"^blocks\.(\d+)\.hook_resid_(pre|post)$")
FINAL_NORM_HOOK = "ln_final.hook_normalized"


class HeadConfigError(ValueError):
    """A registered head that does not fit the model or cannot be read: the server does not start."""


class HeadSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """One registered head, checked (what the workers load and the frontend answers with)."""

    name: str
    kind: str  # "sae" | "linear"
    path: str  # the SAE's folder, or the linear head's safetensors file (absolute)
    layer: int  # absolute, transformers' numbering (0 = embeddings, L = after the final norm)
    width: int  # outputs per position: SAE features, or linear classes
    architecture: str = ""  # an SAE's
    k: int = 0  # a top-k SAE's own k
    topk: int = 0  # an SAE's features per position when a request gives no topk
    activation: str = "none"  # a linear head's
    labels: list[str] = msgspec.field(default_factory=list)
    hook: str = ""  # an SAE's hook point, as SAELens names it
    # An SAE's feature descriptions (read_explanations), by feature index; frontend only (`for_workers`)
    descriptions: dict[int, str] = msgspec.field(default_factory=dict)

    def for_workers(self) -> HeadSpec:
        """What the workers load: the weights' spec, without the descriptions they never read."""
        return msgspec.structs.replace(self, descriptions={}) if self.descriptions else self

    def public(self) -> dict[str, Any]:
        """What /v1/models says of it."""
        out = {"name": self.name, "kind": self.kind, "layer": self.layer, "width": self.width}
        if self.kind == "sae":
            out.update(architecture=self.architecture, hook=self.hook, default_topk=self.topk)
            if self.descriptions:
                out["described_features"] = len(self.descriptions)
        else:
            out["activation"] = self.activation
            if self.labels:
                out["labels"] = list(self.labels)
        return out


def hook_layer(hook: str, num_layers: int) -> int:
    """A TransformerLens/SAELens hook point as this server's layer (transformers' `hidden_states`
    index): `blocks.L.hook_resid_pre` is L (the stream entering block L), `blocks.L.hook_resid_post`
    is L + 1 (leaving it), `ln_final.hook_normalized` is num_layers (after the final norm). The last
    block's resid_post (before the final norm) and hooks off the residual stream are refused."""
    if hook == FINAL_NORM_HOOK:
        return num_layers
    m = _RESID.match(hook)
    if m is None:
        raise HeadConfigError(
            f"hook point {hook!r} is not the residual stream: this server serves SAEs on blocks.L.hook_resid_pre, "
            f"blocks.L.hook_resid_post (L + 1 < {num_layers}) or {FINAL_NORM_HOOK}"
        )
    block, where = int(m.group(1)), m.group(2)
    if block >= num_layers:
        raise HeadConfigError(f"hook point {hook!r}: the model has blocks 0..{num_layers - 1}")
    layer = block if where == "pre" else block + 1
    if layer == num_layers:
        raise HeadConfigError(
            f"hook point {hook!r} is the last block's output before the final norm, which this server does not "
            f"capture (its layer {num_layers} is after the norm: {FINAL_NORM_HOOK})"
        )
    return layer


def _safetensors_shapes(path: str) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors file's header (nothing loaded)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


EXPLANATIONS = ("explanations.json", "explanations.jsonl", "explanations.jsonl.gz", "explanations")


def _explanation_records(path: str):
    """(where, record) of an explanations export: a JSON array (`/api/explanation/export`), JSON lines
    (plain or gzip), or a folder of those (Neuronpedia's datasets, `explanations/batch-N.jsonl.gz`)."""
    if os.path.isdir(path):
        for f in sorted(os.listdir(path)):
            if f.endswith((".json", ".jsonl", ".jsonl.gz")):
                yield from _explanation_records(os.path.join(path, f))
        return
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        if path.endswith(".json"):
            data = json.load(f)
            if not isinstance(data, list):
                raise ValueError("expected a JSON array of explanations")
            yield from ((f"{path}[{i}]", r) for i, r in enumerate(data))
        else:
            yield from ((f"{path}:{n}", json.loads(line)) for n, line in enumerate(f, 1) if line.strip())


def read_explanations(name: str, folder: str, d_sae: int) -> dict[int, str]:
    """An SAE's feature descriptions from Neuronpedia's explanations export in its folder (the first of
    EXPLANATIONS found; none: {}): each record's `index` (a string or an int) and `description`. A
    feature with several explanations keeps the first; an index outside the SAE is a HeadConfigError."""
    found = next((os.path.join(folder, f) for f in EXPLANATIONS if os.path.exists(os.path.join(folder, f))), None)
    if found is None:
        return {}
    out: dict[int, str] = {}
    try:
        for where, record in _explanation_records(found):
            index, text = (record.get("index"), record.get("description")) if isinstance(record, dict) else (None, None)
            if isinstance(index, str) and index.strip().isdigit():
                index = int(index)
            if not isinstance(index, int) or isinstance(index, bool) or not isinstance(text, str):
                raise HeadConfigError(
                    f"head {name!r}: {where} is not an explanation (an object with an `index` "
                    f"and a `description`, as Neuronpedia exports them)"
                )
            if not 0 <= index < d_sae:
                raise HeadConfigError(
                    f"head {name!r}: {where} describes feature {index}; the SAE has features "
                    f"0..{d_sae - 1} (an export of another SAE?)"
                )
            out.setdefault(index, text.strip())
    except (OSError, ValueError) as e:
        raise HeadConfigError(f"head {name!r}: cannot read the explanations in {found}: {e}") from None
    return out


def _sae(name: str, entry: Mapping[str, Any], path: str, num_layers: int, hidden_size: int) -> HeadSpec:
    try:
        cfg = json.load(open(os.path.join(path, "cfg.json")))
    except (OSError, ValueError) as e:
        raise HeadConfigError(f"head {name!r}: cannot read the SAE's cfg.json in {path}: {e}") from None
    arch = cfg.get("architecture", "standard")
    if arch not in SAE_ARCHITECTURES:
        raise HeadConfigError(
            f"head {name!r}: SAE architecture {arch!r} is not served; "
            f"this server encodes {', '.join(SAE_ARCHITECTURES)}"
        )
    for key, want in (("normalize_activations", "none"), ("reshape_activations", "none")):
        if cfg.get(key, "none") != want:
            raise HeadConfigError(
                f"head {name!r}: the SAE's {key} is {cfg[key]!r}; this server serves SAEs with "
                f"{key} {want!r} (fold the normalization into the weights first)"
            )
    if cfg.get("rescale_acts_by_decoder_norm"):
        raise HeadConfigError(f"head {name!r}: rescale_acts_by_decoder_norm is not served")
    hook = (cfg.get("metadata") or {}).get("hook_name") or cfg.get("hook_name")
    if not hook:
        raise HeadConfigError(f"head {name!r}: the SAE's cfg.json names no hook point (metadata.hook_name)")
    try:
        layer = hook_layer(hook, num_layers)
    except HeadConfigError as e:
        raise HeadConfigError(f"head {name!r}: {e}") from None
    if entry.get("layer") is not None and _absolute(entry["layer"], num_layers) != layer:
        raise HeadConfigError(
            f"head {name!r}: layer {entry['layer']} disagrees with its SAE's hook point {hook!r} "
            f"(layer {layer}); drop `layer` (an SAE takes its layer from its hook)"
        )
    d_in, d_sae = int(cfg["d_in"]), int(cfg["d_sae"])
    if d_in != hidden_size:
        raise HeadConfigError(
            f"head {name!r}: the SAE reads d_in = {d_in}, but the model's hidden size is {hidden_size}"
        )
    weights = os.path.join(path, "sae_weights.safetensors")
    try:
        shapes = _safetensors_shapes(weights)
    except (OSError, ValueError) as e:
        raise HeadConfigError(f"head {name!r}: cannot read {weights}: {e}") from None
    need = {"W_enc": [d_in, d_sae], "b_dec": [d_in]}
    need |= {
        "gated": {"b_gate": [d_sae], "b_mag": [d_sae], "r_mag": [d_sae]},
        "jumprelu": {"b_enc": [d_sae], "threshold": [d_sae]},
    }.get(arch, {"b_enc": [d_sae]})
    for key, shape in need.items():
        if shapes.get(key) != shape:
            raise HeadConfigError(f"head {name!r}: {weights} has {key} {shapes.get(key)}, expected {shape}")
    k = int(cfg.get("k") or 0) if arch == "topk" else 0
    topk = int(entry.get("topk") or k or DEFAULT_SAE_TOPK)
    if not 1 <= topk <= d_sae:
        raise HeadConfigError(f"head {name!r}: topk {topk} must be from 1 to the SAE's {d_sae} features")
    return HeadSpec(
        name,
        "sae",
        path,
        layer,
        d_sae,
        architecture=arch,
        k=k,
        topk=topk,
        hook=hook,
        descriptions=read_explanations(name, path, d_sae),
    )


def _linear(name: str, entry: Mapping[str, Any], path: str, num_layers: int, hidden_size: int) -> HeadSpec:
    try:
        shapes = _safetensors_shapes(path)
    except (OSError, ValueError) as e:
        raise HeadConfigError(
            f"head {name!r}: cannot read {path} (a safetensors file with weight [C, D] and bias [C]): {e}"
        ) from None
    w = shapes.get("weight")
    if w is None or len(w) != 2 or w[1] != hidden_size:
        raise HeadConfigError(f"head {name!r}: weight is {w}, expected [C, {hidden_size}] (the model's hidden size)")
    if shapes.get("bias", [w[0]]) != [w[0]]:
        raise HeadConfigError(f"head {name!r}: bias is {shapes['bias']}, expected [{w[0]}]")
    activation = entry.get("activation", "none")
    if activation not in ACTIVATIONS:
        raise HeadConfigError(f"head {name!r}: activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}")
    labels = [str(x) for x in entry.get("labels") or ()]
    if labels and len(labels) != w[0]:
        raise HeadConfigError(f"head {name!r}: {len(labels)} labels for {w[0]} outputs")
    layer = entry.get("layer", -1)
    if not isinstance(layer, int) or isinstance(layer, bool) or not -(num_layers + 1) <= layer <= num_layers:
        raise HeadConfigError(
            f"head {name!r}: layer {layer!r} out of range: this model has layers 0..{num_layers} "
            f"(-1 = {num_layers}, after the final norm)"
        )
    return HeadSpec(name, "linear", path, _absolute(layer, num_layers), w[0], activation=activation, labels=labels)


def _absolute(layer: int, num_layers: int) -> int:
    return layer if layer >= 0 else num_layers + 1 + layer


_ENTRY_KEYS = {"name", "path", "layer", "kind", "activation", "labels", "topk"}


def load_heads(entries: Sequence[Mapping[str, Any]], num_layers: int, hidden_size: int) -> list[HeadSpec]:
    """The `heads` arg ([{name, path, layer?, ...}]) read and checked against the model; HeadConfigError
    names the first head that does not fit. `kind` defaults from the path: a folder is an SAE."""
    specs, names = [], set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str) or not entry.get("path"):
            raise HeadConfigError(f"heads[{i}] needs a `name` and a `path`, got {entry!r}")
        name = entry["name"]
        if unknown := sorted(set(entry) - _ENTRY_KEYS):
            raise HeadConfigError(f"head {name!r}: unknown keys {unknown}; a head takes {sorted(_ENTRY_KEYS)}")
        if name in names or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
            raise HeadConfigError(f"head {name!r}: names are distinct and made of letters, digits, '_', '.', '-'")
        names.add(name)
        path = os.path.abspath(os.path.expanduser(str(entry["path"])))
        kind = entry.get("kind") or ("sae" if os.path.isdir(path) else "linear")
        if kind not in ("sae", "linear"):
            raise HeadConfigError(f"head {name!r}: kind {kind!r}; expected 'sae' or 'linear'")
        if not os.path.exists(path):
            raise HeadConfigError(f"head {name!r}: {path} does not exist")
        specs.append((_sae if kind == "sae" else _linear)(name, entry, path, num_layers, hidden_size))
    return specs


class DeviceHead:
    """A head's weights on the device (float32) and its encode: rows [m, D] -> (values, indices)."""

    def __init__(self, spec: HeadSpec, device: Any):
        import torch
        from safetensors.torch import load_file

        self.spec = spec
        path = os.path.join(spec.path, "sae_weights.safetensors") if spec.kind == "sae" else spec.path
        self.w = {k: v.to(device=device, dtype=torch.float32).contiguous() for k, v in load_file(path).items()}
        if spec.kind == "linear":
            self.w["weight_t"] = self.w["weight"].t().contiguous()
            self.w.setdefault("bias", torch.zeros(spec.width, device=device))
        elif spec.architecture == "gated":
            self.w["W_mag"] = (self.w["W_enc"] * self.w["r_mag"].exp()).contiguous()
        self._columns: dict[tuple[int, ...], tuple] = {}  # some_features' encoder columns, by feature set
        # the weight columns a full encode multiplies a row by, per output (a gated SAE: its two paths)
        self.paths = 2 if spec.architecture == "gated" else 1
        self.columns = spec.width * self.paths

    def features(self, rows: Any) -> Any:
        """An SAE's feature activations [m, F] as SAELens's `encode` computes them (float32)."""
        import torch

        w, arch = self.w, self.spec.architecture
        x = rows.float() - w["b_dec"]  # apply_b_dec_to_input (SAELens's default; every format it saves)
        if arch == "gated":
            gate = (x @ w["W_enc"] + w["b_gate"]) > 0
            return gate.float() * torch.relu(x @ w["W_mag"] + w["b_mag"])
        pre = x @ w["W_enc"] + w["b_enc"]
        if arch == "jumprelu":
            return torch.relu(pre) * (pre > w["threshold"]).float()
        if arch == "topk":  # SAELens's TopK: the k largest pre-activations, ReLU'd; the rest 0
            vals, idx = torch.topk(pre, self.spec.k, dim=-1)
            return torch.zeros_like(pre).scatter_(-1, idx, torch.relu(vals))
        return torch.relu(pre)

    def some_features(self, rows: Any, features: Sequence[int]) -> Any:
        """Features `features` of an SAE alone, [m, len(features)] float32, from their own encoder
        columns (a dot product each, not the full encode), b_dec folded into the bias ((x - b_dec).w + b
        = x.w + (b - b_dec.w)): standard relu(pre), JumpReLU relu(pre) x [pre > threshold], gated
        relu(magnitude) x [gate > 0], as `features(rows)` gives them, to float32 rounding. A top-k SAE's
        are what each takes where it is among the k largest (0 where its pre-activation is not positive,
        whatever its rank; capture._ranked decides the rank where it matters)."""
        import torch

        key = tuple(int(i) for i in features)
        cols = self._columns.get(key)
        if cols is None:
            w, index = self.w, torch.tensor(key, device=self.w["b_dec"].device)
            if self.spec.architecture == "gated":  # [D, 2f]: magnitude then gate, one product
                weight = torch.cat([w["W_mag"][:, index], w["W_enc"][:, index]], dim=1)
                bias = torch.cat([w["b_mag"][index], w["b_gate"][index]])
            else:
                weight, bias = w["W_enc"][:, index], w["b_enc"][index]
            weight = weight.contiguous()
            threshold = w["threshold"][index] if self.spec.architecture == "jumprelu" else None
            cols = (weight, bias - w["b_dec"] @ weight, threshold)
            if len(self._columns) >= 64:
                self._columns.pop(next(iter(self._columns)))
            self._columns[key] = cols
        weight, bias, threshold = cols
        pre = torch.addmm(bias, rows.float(), weight)
        if self.spec.architecture == "gated":
            f = len(key)
            return pre[:, :f].relu() * (pre[:, f:] > 0)
        pre = pre.relu_()
        return pre if threshold is None else pre * (pre > threshold)

    def encode(self, rows: Any, topk: int) -> tuple[Any, Any]:
        """(float32 values [m, C] or [m, topk], int32 indices [m, topk] or None). An SAE's: its `topk`
        largest feature activations, largest first (zeros among them are dropped by the reader)."""
        import torch

        if self.spec.kind == "linear":
            y = rows.float() @ self.w["weight_t"] + self.w["bias"]
            if self.spec.activation == "sigmoid":
                y = torch.sigmoid(y)
            elif self.spec.activation == "softmax":
                y = torch.softmax(y, dim=-1)
            return y.contiguous(), None
        acts = self.features(rows)
        values, indices = torch.topk(acts, topk, dim=-1)
        return values.contiguous(), indices.to(torch.int32).contiguous()


# -- what a choice carries ----------------------------------------------------


def head_outputs(
    batch: Any, name: str, labels: Sequence[str] | Mapping[int, str] = (), multi: bool = False
) -> dict | list[dict]:
    """One head's outputs as a choice carries them: per position a linear head's {"scores"} (and its
    "label", the top score's, where the head has label names `labels`), an SAE's {"indices", "values"}
    (its largest feature activations, largest first; zeros dropped), and where its features have
    descriptions (`labels`, by index) their "labels" (null for a feature without one). One position:
    the object; several: a list in position order."""
    per = []
    if batch is not None:
        values = batch.heads[name]
        indices = batch.head_indices.get(name)
        for p in range(len(batch)):
            if indices is None:
                item = {"scores": values[p].tolist()}
                if labels:
                    item["label"] = labels[int(values[p].argmax())]
            else:
                nz = values[p] != 0
                item = {"indices": indices[p][nz].tolist(), "values": values[p][nz].tolist()}
                if labels:
                    item["labels"] = [labels.get(i) for i in item["indices"]]
            per.append(item)
    return squeeze(per, multi, {})


def head_fields(batch: Any, heads: Sequence[tuple[str, int]], registry: Mapping[str, HeadSpec], multi: bool) -> dict:
    """`hidden_states_heads` {name: outputs} of the asked heads ((name, k) pairs)."""

    def labels(spec: HeadSpec | None):
        return () if spec is None else spec.descriptions if spec.kind == "sae" else spec.labels

    return {name: head_outputs(batch, name, labels(registry.get(name)), multi) for name, _ in heads}
