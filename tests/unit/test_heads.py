"""Heads (hidden_states/heads.py) without an engine: the registry's checks at start, the hook-point
mapping, the device encode against SAELens's own encode and numpy, the request field, the output."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hidden_states.heads import DeviceHead, HeadConfigError, head_outputs, hook_layer, load_heads
from hidden_states.interface import RowBatch
from hidden_states.params import HiddenStatesFields, HiddenStatesRequestError, parse_fields, resolve_heads
from tests.heads_ref import ARCHS, assert_sae_topk, linear_reference, make_linear, make_sae, sae_reference

D, F, L = 16, 128, 4


@pytest.mark.parametrize(
    "hook, layer",
    [
        ("blocks.0.hook_resid_pre", 0),
        ("blocks.0.hook_resid_post", 1),
        ("blocks.2.hook_resid_pre", 2),
        ("blocks.2.hook_resid_post", 3),
        ("ln_final.hook_normalized", L),
    ],
)
def test_hook_points_map_to_transformers_hidden_states_indices(hook, layer):
    assert hook_layer(hook, L) == layer


@pytest.mark.parametrize(
    "hook, words",
    [
        ("blocks.3.hook_resid_post", "before the final norm"),
        ("blocks.1.attn.hook_z", "not the residual stream"),
        ("blocks.1.hook_mlp_out", "not the residual stream"),
        ("blocks.9.hook_resid_pre", "blocks 0..3"),
    ],
)
def test_hook_points_off_the_served_stream_are_refused_by_name(hook, words):
    with pytest.raises(HeadConfigError, match=words):
        hook_layer(hook, L)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_device_encode_is_saelens_encode(tmp_path, arch):
    """Every architecture: DeviceHead's features equal SAELens's `encode` (relative 1e-5), and its
    top-k passes the boundary rule of tests/heads_ref.py."""
    import torch

    folder = make_sae(str(tmp_path / arch), arch, D, F, "blocks.1.hook_resid_post", seed=3, k=12)
    (spec,) = load_heads([{"name": "s", "path": folder}], L, D)
    assert (spec.kind, spec.architecture, spec.layer, spec.width) == ("sae", arch, 2, F)
    assert spec.topk == (12 if arch == "topk" else 64)
    rows = np.random.default_rng(0).normal(size=(9, D)).astype(np.float32) * 3
    ref = sae_reference(folder, rows)
    assert (ref > 0).any(axis=1).all(), "the test SAE fires on every row"
    head = DeviceHead(spec, "cpu")
    got = head.features(torch.tensor(rows)).numpy()
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    values, indices = head.encode(torch.tensor(rows), 10)
    for v, i, r in zip(values.numpy(), indices.numpy(), ref):
        nz = v != 0
        assert_sae_topk(i[nz], v[nz], r, 10)
    # A monitor's few features from their own encoder columns: SAELens's where they fire; a top-k
    # SAE's are what each takes among the k largest (the reference's where it is among them).
    some = [0, 5, F - 1, *np.flatnonzero(ref[0])[:3]]
    alone = head.some_features(torch.tensor(rows), some).numpy()
    fires = ref[:, some] > 0
    assert fires.any() and (arch == "topk" or not fires.all())
    assert np.abs(alone - ref[:, some])[fires if arch == "topk" else slice(None)].max() <= 1e-5 * np.abs(ref).max()


def test_a_linear_head_is_numpy(tmp_path):
    import torch

    path = make_linear(str(tmp_path / "p.safetensors"), D, 5, seed=1)
    rows = np.random.default_rng(1).normal(size=(7, D)).astype(np.float32)
    for activation in ("none", "sigmoid", "softmax"):
        (spec,) = load_heads([{"name": "p", "path": path, "activation": activation, "layer": 2}], L, D)
        assert (spec.kind, spec.layer, spec.width) == ("linear", 2, 5)
        values, indices = DeviceHead(spec, "cpu").encode(torch.tensor(rows), 0)
        ref = linear_reference(path, activation, rows)
        assert indices is None and np.abs(values.numpy() - ref).max() <= 1e-5 * np.abs(ref).max()


def _sae_with(tmp_path, **cfg_over) -> str:
    folder = make_sae(str(tmp_path / "s"), "standard", D, F, "blocks.0.hook_resid_post", seed=0)
    cfg = json.loads((tmp_path / "s" / "cfg.json").read_text())
    for key, value in cfg_over.items():
        if key == "hook_name":
            cfg["metadata"]["hook_name"] = value
        else:
            cfg[key] = value
    (tmp_path / "s" / "cfg.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize(
    "entry, cfg, words",
    [
        ({}, {"d_in": 32}, "d_in = 32, but the model's hidden size is 16"),
        ({}, {"hook_name": "blocks.3.hook_resid_post"}, "before the final norm"),
        ({}, {"hook_name": "blocks.0.attn.hook_z"}, "not the residual stream"),
        ({}, {"normalize_activations": "layer_norm"}, "normalize_activations"),
        ({}, {"architecture": "matryoshka"}, "architecture 'matryoshka' is not served"),
        ({"layer": 3}, {}, "disagrees with its SAE's hook point"),
        ({"topk": F + 1}, {}, "topk 129"),
        ({"colour": "red"}, {}, "unknown keys ['colour']"),
    ],
)
def test_an_sae_that_does_not_fit_is_refused_at_start_naming_the_head(tmp_path, entry, cfg, words):
    folder = _sae_with(tmp_path, **cfg)
    with pytest.raises(HeadConfigError) as e:
        load_heads([{"name": "feat", "path": folder, **entry}], L, D)
    assert "'feat'" in str(e.value) and words in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "entry, words",
    [
        ({"d": 32}, "weight is [3, 32], expected [C, 16]"),
        ({"layer": 5}, "layer 5 out of range: this model has layers 0..4"),
        ({"labels": ["a", "b"]}, "2 labels for 3 outputs"),
        ({"activation": "tanh"}, "activation 'tanh'"),
    ],
)
def test_a_linear_head_that_does_not_fit_is_refused_at_start(tmp_path, entry, words):
    path = make_linear(str(tmp_path / "p.safetensors"), entry.pop("d", D), 3, seed=0)
    with pytest.raises(HeadConfigError) as e:
        load_heads([{"name": "probe", "path": path, **entry}], L, D)
    assert "'probe'" in str(e.value) and words in str(e.value), str(e.value)


def test_names_are_distinct_and_paths_exist(tmp_path):
    path = make_linear(str(tmp_path / "p.safetensors"), D, 3, seed=0)
    with pytest.raises(HeadConfigError, match="distinct"):
        load_heads([{"name": "a", "path": path}, {"name": "a", "path": path}], L, D)
    with pytest.raises(HeadConfigError, match="does not exist"):
        load_heads([{"name": "b", "path": str(tmp_path / "missing.safetensors")}], L, D)


def test_the_request_field_parses_once_and_refuses_clearly():
    spec = parse_fields({"hidden_states_heads": ["probe", {"name": "sae", "topk": 8}]}, enabled=True)
    assert spec.heads == (("probe", None), ("sae", 8)) and spec.wants and not spec.rows_asked
    assert HiddenStatesFields.from_json(spec.to_json()).heads == spec.heads  # as it crosses to the replica
    for bad, words in (
        ([], "non-empty"),
        (["a", "a"], "twice"),
        ([{"name": "a", "k": 2}], "name and topk only"),
        ([{"name": "a", "topk": 0}], "positive integer"),
        ("a", "non-empty list"),
    ):
        with pytest.raises(HiddenStatesRequestError) as e:
            parse_fields({"hidden_states_heads": bad}, enabled=True)
        assert words in str(e.value) and e.value.param == "hidden_states_heads", str(e.value)
    with pytest.raises(HiddenStatesRequestError, match="heads are disabled"):
        parse_fields({"hidden_states_heads": ["a"]}, enabled=False)
    with pytest.raises(HiddenStatesRequestError, match="cannot be combined with hidden_states_proof"):
        parse_fields({"hidden_states_heads": ["a"], "hidden_states_proof": {"scheme": "toploc"}}, enabled=True)


def test_heads_resolve_against_the_registry(tmp_path):
    sae = make_sae(str(tmp_path / "s"), "topk", D, F, "blocks.0.hook_resid_post", seed=0, k=6)
    lin = make_linear(str(tmp_path / "p.safetensors"), D, 3, seed=0)
    registry = {h.name: h for h in load_heads([{"name": "s", "path": sae}, {"name": "p", "path": lin}], L, D)}
    ask = lambda heads: resolve_heads(parse_fields({"hidden_states_heads": heads}, enabled=True), registry)  # noqa: E731
    assert ask(["s", "p"]) == (("s", 6), ("p", 0))  # a top-k SAE's own k by default
    assert ask([{"name": "s", "topk": 20}]) == (("s", 20),)
    with pytest.raises(HiddenStatesRequestError, match="unknown head 'x': this server's heads are p, s"):
        ask(["x"])
    with pytest.raises(HiddenStatesRequestError, match="linear head"):
        ask([{"name": "p", "topk": 2}])


def test_outputs_drop_zero_features_and_name_labels():
    batch = RowBatch(
        np.array([4, 5]),
        {},
        heads={
            "s": np.array([[2.0, 0.5, 0.0], [1.0, 0.0, 0.0]], np.float32),
            "p": np.array([[0.1, 0.9], [0.7, 0.3]], np.float32),
        },
        head_indices={"s": np.array([[7, 3, 1], [2, 0, 9]], np.int32)},
    )
    assert head_outputs(batch, "s", multi=True) == [
        {"indices": [7, 3], "values": [2.0, 0.5]},
        {"indices": [2], "values": [1.0]},
    ]
    out = head_outputs(batch, "p", ["no", "yes"], multi=True)
    assert [o["label"] for o in out] == ["yes", "no"] and out[0]["scores"] == pytest.approx([0.1, 0.9])
    assert head_outputs(batch.select(np.array([False, True])), "s") == {"indices": [2], "values": [1.0]}
    merged = RowBatch.merge([batch.select(np.array([False, True])), batch.select(np.array([True, False]))])
    assert merged.positions.tolist() == [4, 5] and merged.head_indices["s"][0].tolist() == [7, 3, 1]


def test_sae_features_carry_their_neuronpedia_descriptions():
    """Labels by feature index: each SAE position's "labels" beside its indices, null where a feature has no
    description; without descriptions no "labels" key."""
    batch = RowBatch(
        np.array([4]),
        {},
        heads={"s": np.array([[2.0, 0.5, 0.0]], np.float32)},
        head_indices={"s": np.array([[7, 3, 1]], np.int32)},
    )
    assert head_outputs(batch, "s", {7: "mentions of Paris"}) == {
        "indices": [7, 3],
        "values": [2.0, 0.5],
        "labels": ["mentions of Paris", None],
    }
    assert "labels" not in head_outputs(batch, "s", {})


def _export(records) -> list[dict]:
    """Records as Neuronpedia's explanations export writes them (index as a string)."""
    return [
        {
            "modelId": "tiny-llama",
            "layer": "0-res",
            "index": str(i),
            "description": d,
            "explanationModelName": "gpt-4o-mini",
            "typeName": "oai_token-act-pair",
        }
        for i, d in records
    ]


@pytest.mark.parametrize("layout", ["json", "jsonl", "jsonl.gz", "folder"])
def test_an_sae_folder_s_explanations_export_is_read_at_start(tmp_path, layout):
    """The export's layouts: the API's JSON array, JSON lines (plain or gzip), a folder of gzip batches as
    Neuronpedia's datasets ship them; a feature explained twice keeps its first description; /v1/models
    counts them; the workers' copy of the spec carries none."""
    import gzip

    folder = make_sae(str(tmp_path / "sae"), "standard", D, F, "blocks.0.hook_resid_post", seed=0)
    records = _export([(5, " mentions of Paris"), (17, "code"), (5, "a second explanation")])
    lines = "".join(json.dumps(r) + "\n" for r in records)
    if layout == "json":
        (tmp_path / "sae" / "explanations.json").write_text(json.dumps(records))
    elif layout == "jsonl":
        (tmp_path / "sae" / "explanations.jsonl").write_text(lines)
    elif layout == "jsonl.gz":
        (tmp_path / "sae" / "explanations.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    else:
        (tmp_path / "sae" / "explanations").mkdir()
        (tmp_path / "sae" / "explanations" / "batch-0.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (spec,) = load_heads([{"name": "s", "path": folder}], L, D)
    assert spec.descriptions == {5: "mentions of Paris", 17: "code"}
    assert spec.public()["described_features"] == 2 and spec.for_workers().descriptions == {}


@pytest.mark.parametrize(
    "record, words",
    [
        ({"index": "128", "description": "x"}, r"feature 128; the SAE has features 0\.\.127"),
        ({"index": "a", "description": "x"}, "is not an explanation"),
        ({"index": 3}, "is not an explanation"),
    ],
)
def test_an_explanations_export_of_another_sae_stops_the_start(tmp_path, record, words):
    folder = make_sae(str(tmp_path / "sae"), "standard", D, F, "blocks.0.hook_resid_post", seed=0)
    (tmp_path / "sae" / "explanations.json").write_text(json.dumps([record]))
    with pytest.raises(HeadConfigError, match=f"head 's': .*{words}"):
        load_heads([{"name": "s", "path": folder}], L, D)
