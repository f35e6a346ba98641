"""Heads made by the libraries people use, and the references they are judged against.

- SAEs are made and saved by SAELens itself (`save_model`: its folder format), with random
  weights from a seed; their reference is SAELens's own `SAE.load_from_disk(...).encode` on
  transformers' hidden states at the same hook.
- Linear heads are safetensors files; their reference is numpy (float64).

How an SAE's top-k outputs are judged (`assert_sae_topk`): every returned value equals the
reference activation of its index within `tol` (relative 1e-5 of the largest |reference|);
values come largest first; and the returned set is the reference's top k up to entries within
`tol` of the k-th largest value, which may fall either side (ties: torch.topk's order, unspecified
between exactly equal values). Zeros are never returned.
"""

from __future__ import annotations

import os

import numpy as np

ARCHS = ("standard", "topk", "jumprelu", "gated")
REL_TOL = 1e-5


def make_sae(folder: str, arch: str, d_in: int, d_sae: int, hook: str, seed: int, k: int = 16) -> str:
    """An SAE of `arch` saved by SAELens into `folder`: random weights (fixed seed) scaled so that
    about half the features fire on a tiny model's rows (threshold ~ typical pre-activations)."""
    import sae_lens
    import torch

    cls, cfg_cls = {
        "standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig),
        "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig),
        "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig),
        "gated": (sae_lens.GatedSAE, sae_lens.GatedSAEConfig),
    }[arch]
    cfg = cfg_cls(d_in=d_in, d_sae=d_sae, dtype="float32", device="cpu", **({"k": k} if arch == "topk" else {}))
    cfg.metadata.hook_name = hook
    sae = cls(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name in ("W_enc", "W_dec"):
                p.copy_(noise / d_in**0.5)
            elif name == "threshold":
                p.copy_(noise.abs() * 0.3)
            elif name == "r_mag":
                p.copy_(noise * 0.1)
            else:
                p.copy_(noise * 0.1)
    sae.save_model(folder)
    return folder


def sae_reference(folder: str, rows: np.ndarray) -> np.ndarray:
    """SAELens's own encode of `rows` [m, D] (float32) with the SAE it loads from `folder`."""
    import torch
    from sae_lens import SAE

    sae = SAE.load_from_disk(folder, device="cpu")
    with torch.no_grad():
        return sae.encode(torch.tensor(np.asarray(rows, np.float32))).numpy()


def make_linear(path: str, d_in: int, classes: int, seed: int) -> str:
    """A linear head: safetensors with weight [C, D] and bias [C]."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    save_file(
        {
            "weight": torch.randn(classes, d_in, generator=gen) / d_in**0.5,
            "bias": torch.randn(classes, generator=gen) * 0.1,
        },
        path,
    )
    return path


def linear_reference(path: str, activation: str, rows: np.ndarray) -> np.ndarray:
    """numpy, float64: rows @ W.T + b, then the activation."""
    from safetensors.numpy import load_file

    w = load_file(path)
    y = np.asarray(rows, np.float64) @ w["weight"].astype(np.float64).T + w["bias"].astype(np.float64)
    if activation == "sigmoid":
        return 1 / (1 + np.exp(-y))
    if activation == "softmax":
        e = np.exp(y - y.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    return y


def assert_sae_topk(indices, values, ref: np.ndarray, k: int) -> tuple[float, float]:
    """One position's returned (indices, values) against the reference activations [F] (the rule in
    the module docstring). Returns (max abs error, max |reference|)."""
    indices, values = np.asarray(indices, np.int64), np.asarray(values, np.float64)
    scale = float(np.abs(ref).max())
    tol = REL_TOL * max(scale, 1e-30)
    assert len(indices) == len(set(indices.tolist())) <= k, (indices, k)
    assert np.all(values != 0), "a zero activation was returned"
    err = float(np.abs(values - ref[indices]).max()) if len(indices) else 0.0
    assert err <= tol, f"max abs error {err:.3g} > {REL_TOL:g} x max|reference| ({scale:.3g})"
    assert np.all(np.diff(values) <= tol), "values are not largest first"
    order = np.sort(ref)[::-1]
    kth = order[k - 1] if k <= len(order) else 0.0
    must = set(np.flatnonzero(ref > max(kth, 0) + tol).tolist())  # clearly inside the top k, and active
    assert must <= set(indices.tolist()), f"missing features {sorted(must - set(indices.tolist()))}"
    assert np.all(ref[indices] >= kth - tol), "a feature outside the top k was returned"
    return err, scale


# The test heads on the built-in tiny Llama (D = 128, 2 decoder layers): an SAE of each SAELens
# architecture, 8x wider than D, at each kind of hook point, and two linear heads.
# (name, architecture, hook point, this server's layer)
TINY_SAES = [
    ("sae-std", "standard", "blocks.0.hook_resid_post", 1),
    ("sae-topk", "topk", "ln_final.hook_normalized", -1),  # the last layer: 2 on the tiny Llama
    ("sae-jump", "jumprelu", "blocks.1.hook_resid_pre", 1),
    ("sae-gated", "gated", "blocks.0.hook_resid_pre", 0),
]
TINY_LINEAR = [
    ("probe", -1, {"activation": "softmax", "labels": ["neg", "neutral", "pos"]}),
    ("mid", 1, {"layer": 1, "activation": "sigmoid"}),
]
TINY_D, TINY_F, TINY_TOPK_K = 128, 1024, 16
HEAD_LAYERS = {name: layer for name, _, _, layer in TINY_SAES} | {name: layer for name, layer, _ in TINY_LINEAR}


def build_test_heads() -> list[dict]:
    """The `heads` entries of the test heads, built once into the built-in models' cache (the folder
    name hashes the recipe; SAELens's and safetensors' own savers)."""
    import hashlib
    import json
    import os

    from hidden_states.models.builtin import cache_root

    recipe = json.dumps(
        [
            TINY_SAES,
            TINY_LINEAR,
            TINY_D,
            TINY_F,
            TINY_TOPK_K,
            "heads-v2",
            {name: [f.start, f.stop, f.step] for name, f in DESCRIBED.items()},
        ]
    )
    out = cache_root().parent / "test-heads" / hashlib.sha1(recipe.encode()).hexdigest()[:10]
    entries = [{"name": name, "path": str(out / name)} for name, *_ in TINY_SAES]
    entries += [{"name": name, "path": str(out / f"{name}.safetensors"), **extra} for name, _, extra in TINY_LINEAR]
    if (out / "DONE").exists():
        return entries
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True)
    for i, (name, arch, hook, _) in enumerate(TINY_SAES):
        make_sae(str(tmp / name), arch, TINY_D, TINY_F, hook, seed=i, k=TINY_TOPK_K)
        if name in DESCRIBED:
            write_explanations(str(tmp / name), DESCRIBED[name])
    for i, (name, _, _) in enumerate(TINY_LINEAR):
        make_linear(str(tmp / f"{name}.safetensors"), TINY_D, (3, 2)[i], seed=10 + i)
    (tmp / "DONE").write_text("")
    try:
        tmp.rename(out)
    except OSError:  # another process built it first
        if not (out / "DONE").exists():
            raise
    return entries


# The test SAEs with Neuronpedia's explanations export in their folder, and which features it describes.
DESCRIBED = {"sae-std": range(0, TINY_F, 2)}


def write_explanations(folder: str, features) -> None:
    """`explanations.json` as Neuronpedia's `/api/explanation/export` writes it: index as a string, and a
    second explanation of one feature (the server keeps the first)."""
    import json

    records = [
        {
            "modelId": "tiny-llama",
            "layer": "0-res",
            "index": str(i),
            "description": f" feature {i} words",
            "explanationModelName": "test",
            "typeName": "test",
        }
        for i in features
    ]
    records.append({**records[0], "description": "a later explanation"})
    with open(os.path.join(folder, "explanations.json"), "w") as f:
        json.dump(records, f)


def explanations_of(folder: str) -> dict[int, str]:
    """The test's own reading of an export: the first description per index, stripped."""
    import json

    path = os.path.join(folder, "explanations.json")
    if not os.path.exists(path):
        return {}
    out: dict[int, str] = {}
    for r in json.load(open(path)):
        out.setdefault(int(r["index"]), r["description"].strip())
    return out


def check_heads(
    case: str, hs_heads: dict, states: list, positions, heads: list[dict], asked: dict, errors: list | None = None
) -> None:
    """Each asked head's outputs ({name: outputs}; one position: an object, several: a list) at
    `positions` against SAELens / numpy on transformers' `states` (hidden_states per layer, [T, D])."""
    by_name = {h["name"]: h for h in heads}
    assert set(hs_heads) == set(asked), (set(hs_heads), asked)
    for name, k in asked.items():
        got = hs_heads[name]
        per = got if isinstance(got, list) else [got]
        assert len(per) == len(positions), (name, len(per), positions)
        rows = states[HEAD_LAYERS[name]][list(positions)]
        head = by_name[name]
        if not k:  # a linear head
            ref = linear_reference(head["path"], head.get("activation", "none"), rows)
            scores = np.asarray([p["scores"] for p in per], np.float64)
            diff, scale = float(np.abs(scores - ref).max()), float(np.abs(ref).max())
            assert diff <= REL_TOL * scale, f"{case} {name}: max abs error {diff:.3g} (max |reference| {scale:.3g})"
            if head.get("labels"):
                assert [p["label"] for p in per] == [head["labels"][int(np.argmax(r))] for r in ref]
            worst = (diff, scale)
        else:
            ref = sae_reference(head["path"], rows)
            worst = (0.0, 0.0)
            described = explanations_of(head["path"])
            for p, r in zip(per, ref):
                worst = max(worst, assert_sae_topk(p["indices"], p["values"], r, k))
                if described:  # each feature's description from the export, as the file says (null: none)
                    assert p["labels"] == [described.get(i) for i in p["indices"]], (case, name, p)
                else:
                    assert "labels" not in p
        if errors is not None:
            errors.append((f"{case} {name}" + (f" top-{k}" if k else ""), *worst))


def head_scorer(name: str, index: int):
    """Test head `name`'s output `index` of one row [D], as the reference computes it: SAELens's encode, or
    numpy (float64)."""
    import torch
    from sae_lens import SAE

    head = {h["name"]: h for h in build_test_heads()}[name]
    if name.startswith("sae"):
        sae = SAE.load_from_disk(head["path"], device="cpu")
        return lambda row: float(sae.encode(torch.tensor(np.asarray(row, np.float32)[None]))[0, index])
    return lambda row: float(
        linear_reference(head["path"], head.get("activation", "none"), np.asarray(row)[None])[0, index]
    )


def crossing(scores: np.ndarray, P: int, above: bool) -> tuple[int, float]:
    """A threshold the completion's scores cross first at a middle position, clear of every earlier
    score by far more than the tolerance band (relative 1e-5 of max |score|): (position, threshold)."""
    s = scores if above else -scores
    for p in range(P + 1, len(scores) - 1):
        before = s[P:p].max()
        if s[p] - before > 1e-3 * np.abs(scores).max():
            t = (s[p] + before) / 2
            return p, float(t if above else -t)
    raise AssertionError(f"no clear crossing in this completion: pick another prompt ({scores[P:]})")
