"""Steering without an engine: the request field's rules, the entries resolved against a model, the
registered vectors' formats and layer mapping, and the workers' per-row deltas (a stand-in runner)."""

from __future__ import annotations

import base64
import types

import numpy as np
import pytest

from hidden_states.heads import HeadConfigError
from hidden_states.params import HiddenStatesRequestError, parse_fields
from hidden_states.protocol import RequestSpec, SteerEntry
from hidden_states.steering import anchor, load_vectors, resolve
from tests.steer_ref import write_gguf

D, L = 8, 4


def spec(*entries):
    return parse_fields({"hidden_states_steering": list(entries)}, enabled=True)


def b64(v) -> str:
    return base64.b64encode(np.asarray(v, "<f4").tobytes()).decode()


def test_entries_resolve_with_their_echo_and_anchor_with_a_digest_that_tells_steerings_apart():
    v = np.arange(D, dtype=np.float32)
    entries, echo = resolve(spec({"layer": -2, "vector": b64(v), "scale": 2.0, "positions": "prompt"}), L, D, {}, {})
    assert entries == [SteerEntry(3, "add", "prompt", 2.0, v.astype("<f4").tobytes())]
    assert echo[0]["layer"] == 3 and len(echo[0]["digest"]) == 16
    anchored, digest = anchor(entries, 7)
    assert (anchored[0].start, anchored[0].end) == (0, 7)  # the prompt's positions, absolute
    again = anchor(
        resolve(spec({"layer": 3, "vector": v.tolist(), "scale": 2.0, "positions": "prompt"}), L, D, {}, {})[0], 7
    )[1]
    other = anchor(
        resolve(spec({"layer": 3, "vector": v.tolist(), "scale": 2.5, "positions": "prompt"}), L, D, {}, {})[0], 7
    )[1]
    assert again == digest != other != anchor(entries, 8)[1]  # base64 or floats: the same; a scale or P: another
    completion = resolve(spec({"layer": 0, "vector": v.tolist(), "positions": "completion"}), L, D, {}, {})[0]
    assert [(e.start, e.end) for e in anchor(completion, 5)[0]] == [(5, -1)]


@pytest.mark.parametrize(
    "entry, words",
    [
        ({"layer": 0, "vector": [1.0] * (D + 1)}, "9 entries"),
        ({"layer": L, "vector": [1.0] * D}, "layer 4 out of range"),
        ({"layer": -1, "vector": [1.0] * D}, "layer -1 out of range"),
        ({"layer": 0, "vector": "not base64!"}, "not base64"),
        ({"layer": 0, "vector": b64(np.full(D, np.inf))}, "NaN or infinite"),
        ({"name": "missing"}, "unknown steering vector 'missing'"),
    ],
)
def test_what_needs_the_model_is_a_400_naming_the_entry(entry, words):
    with pytest.raises(HiddenStatesRequestError) as e:
        resolve(spec({"layer": 0, "vector": [1.0] * D}, entry), L, D, {}, {})
    assert "hidden_states_steering[1]" in str(e.value) and words in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "entries, words",
    [
        ([], "non-empty"),
        ([{"layer": 0, "vector": [1.0]}] * 17, "at most 16"),
        ([{"layer": 0}], "exactly one of"),
        ([{"head": "s"}], "exactly one of"),
        ([{"vector": [1.0]}], "needs a `layer`"),
        ([{"layer": 0, "vector": [1.0], "scale": float("inf")}], "scale must be finite"),
        ([{"layer": 0, "vector": [1.0], "op": "swap"}], "op"),
        ([{"layer": 0, "vector": [1.0], "positions": "middle"}], "positions"),
    ],
)
def test_the_field_s_shape_is_a_400_before_the_engine(entries, words):
    with pytest.raises(HiddenStatesRequestError) as e:
        parse_fields({"hidden_states_steering": entries}, enabled=True)
    assert words in str(e.value) and e.value.param == "hidden_states_steering", str(e.value)
    with pytest.raises(HiddenStatesRequestError, match="steering is disabled"):
        parse_fields({"hidden_states_steering": [{"layer": 0, "vector": [1.0]}]}, enabled=False)


def test_registered_formats_and_the_control_vector_layer_mapping(tmp_path):
    from safetensors.numpy import save_file

    a, b = np.ones(D, np.float32), np.arange(D, dtype=np.float32)
    np.save(tmp_path / "a.npy", a)
    save_file({"direction.0": a, "direction.2": b}, str(tmp_path / "d.safetensors"))
    write_gguf(str(tmp_path / "c.gguf"), {1: b})
    vectors = load_vectors(
        [
            {"name": "a", "path": str(tmp_path / "a.npy"), "layer": 2},
            {"name": "d", "path": str(tmp_path / "d.safetensors")},
            {"name": "c", "path": str(tmp_path / "c.gguf")},
        ],
        L,
        D,
    )
    assert sorted(vectors["a"]) == [2] and sorted(vectors["d"]) == [1, 3] and sorted(vectors["c"]) == [2]
    np.testing.assert_array_equal(vectors["c"][2], b)
    entries, echo = resolve(spec({"name": "d", "scale": 0.5}), L, D, vectors, {})
    assert [(e.layer, e.scale) for e in entries] == [(1, 0.5), (3, 0.5)] and echo[0]["name"] == "d"
    assert [e.layer for e in resolve(spec({"name": "d", "layer": 3}), L, D, vectors, {})[0]] == [3]
    write_gguf(str(tmp_path / "last.gguf"), {L - 1: a})
    for entry, words in (
        ({"name": "x", "path": str(tmp_path / "last.gguf")}, "direction.3 steers the last block"),
        ({"name": "x", "path": str(tmp_path / "a.npy")}, "needs a `layer`"),
        ({"name": "x", "path": str(tmp_path / "a.npy"), "layer": 4}, "out of range"),
    ):
        with pytest.raises(HeadConfigError, match=words):
            load_vectors([entry], L, D)
    with pytest.raises(HeadConfigError, match="hidden size is 16"):
        load_vectors([{"name": "a", "path": str(tmp_path / "a.npy"), "layer": 1}], L, 16)


class _Runner:
    """What StepSteering reads of a model runner: two requests in a step's batch."""

    def __init__(self, steer: dict[str, list[SteerEntry]], prompt_lens: dict[str, int], computed: dict[str, int]):
        import torch

        rids = list(prompt_lens)
        self.requests = {
            rid: types.SimpleNamespace(
                num_prompt_tokens=prompt_lens[rid],
                sampling_params=types.SimpleNamespace(
                    extra_args=RequestSpec(steer=steer[rid]).into(None) if rid in steer else {"other": 1}
                ),
            )
            for rid in rids
        }
        self.input_batch = types.SimpleNamespace(
            req_id_to_index={rid: i for i, rid in enumerate(rids)},
            num_computed_tokens_cpu=np.array([computed[r] for r in rids]),
        )
        self.model_config = types.SimpleNamespace(dtype=torch.float32)
        self.device, self.max_num_tokens = "cpu", 16
        self.query_start_loc = types.SimpleNamespace(np=None)


class _Guard:
    """What StepSteering reports faults to (capture._RunnerHook): `fails` names requests whose entries raise
    (through the fault-injecting twin, worker/fault_injection.py, which reads `_inject`)."""

    def __init__(self, fails=()):
        self.faults = {}
        self._inject = {rid: "steering" for rid in fails}

    def fault(self, rid, hook, error):
        self.faults.setdefault(rid, (hook, str(error)))

    def faulted(self, rid):
        return rid in self.faults


def test_each_row_gets_its_own_request_s_steering_and_unsteered_rows_are_unchanged():
    import torch

    from hidden_states.vllm.worker.steering import StepSteering

    v, u = np.arange(1, D + 1, dtype=np.float32), np.eye(D, dtype=np.float32)[0]
    steer = {
        "s": [
            SteerEntry(1, "add", "completion", 2.0, v.tobytes(), 4, -1),  # anchored: its prompt has 4 tokens
            SteerEntry(1, "ablate", "all", 1.0, u.tobytes(), 0, -1),
        ]
    }
    runner = _Runner(steer, {"u": 3, "s": 4}, {"u": 0, "s": 3})  # u: a 3-token prefill; s: positions 3, 4 (prompt 4)
    runner.query_start_loc.np = np.array([0, 3, 5])
    st = StepSteering(runner, _Guard())
    st.begin(types.SimpleNamespace(num_scheduled_tokens={"u": 3, "s": 2}, finished_req_ids=set()))
    hidden = torch.randn(5, D)
    hidden[:3, 0] = -0.0
    residual = torch.randn(5, D)
    assert st.apply(0, hidden, residual) is None  # no entry at layer 0
    out = st.apply(1, hidden, residual)
    assert torch.equal(out[:3], hidden[:3]) and torch.signbit(out[:3, 0]).all()  # the same bits, -0.0 too
    stream = hidden + residual
    want = stream[3:].clone()
    want[1] += 2.0 * torch.from_numpy(v)  # position 4 is a completion row, position 3 a prompt row
    want[:, 0] = 0.0  # the unit direction ablated from the stream
    np.testing.assert_allclose((out[3:] + residual[3:]).numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    assert st.steered_rows == 1 + 2
    st.end()
    assert st.apply(1, hidden, residual) is None  # no step: nothing


def test_a_request_whose_steering_raises_fails_alone_and_the_others_are_steered_as_before():
    """Two steered requests in a step; one's entries raise: it is reported (hook "steering") and its rows
    are left as they came, the other's rows are the same bits as when it is steered alone."""
    import torch

    from hidden_states.vllm.worker.fault_injection import StepSteering as InjectingSteering

    v = np.arange(1, D + 1, dtype=np.float32)
    steer = {
        "a": [SteerEntry(1, "add", "all", 2.0, v.tobytes(), 0, -1)],
        "b": [SteerEntry(1, "add", "all", -1.0, v.tobytes(), 0, -1)],
    }
    hidden, residual = torch.randn(5, D), torch.randn(5, D)

    def run(fails):
        runner = _Runner(steer, {"a": 3, "b": 2}, {"a": 0, "b": 0})
        runner.query_start_loc.np = np.array([0, 3, 5])
        guard = _Guard(fails)
        st = InjectingSteering(runner, guard)
        st.begin(types.SimpleNamespace(num_scheduled_tokens={"a": 3, "b": 2}, finished_req_ids=set()))
        return st.apply(1, hidden, residual), guard.faults, st.steered_rows

    both, no_faults, rows = run(())
    out, faults, rows_b = run({"a"})
    assert not no_faults and rows == 5 and list(faults) == ["a"] and faults["a"][0] == "steering"
    assert torch.equal(out[3:], both[3:]) and torch.equal(out[:3], hidden[:3]) and rows_b == 2


def test_a_top_k_sae_s_feature_cannot_be_clamped_alone():
    """A top-k SAE's feature is nonzero only among the k largest: setting it alone is not defined, a 400."""
    from hidden_states.heads import HeadSpec

    topk = HeadSpec(
        "tk", "sae", "/nonexistent", 1, 16, architecture="topk", k=4, topk=4, hook="blocks.0.hook_resid_post"
    )
    with pytest.raises(HiddenStatesRequestError) as e:
        resolve(spec({"op": "clamp", "head": "tk", "feature": 3, "value": 2.0}), L, D, {}, {"tk": topk})
    assert "top-k SAE" in str(e.value) and "hidden_states_steering[0]" in str(e.value), str(e.value)


@pytest.mark.parametrize("name", ["sae-std", "sae-jump", "sae-gated"])
def test_a_clamp_s_encoder_gives_the_feature_saelens_gives(name):
    """The entry's encoder (b_dec folded into the biases by the worker, `nonlinear`) gives the feature SAELens's
    own encode gives, on rows either side of the feature's threshold; the direction is W_dec[feature]; the
    digest (the cache salt) tells another value, or an add of the same feature, apart."""
    import torch
    from safetensors.numpy import load_file

    from hidden_states.heads import load_heads
    from hidden_states.vllm.worker.steering import nonlinear
    from tests.heads_ref import TINY_D, build_test_heads, sae_reference

    heads = {h.name: h for h in load_heads(build_test_heads(), 2, TINY_D)}
    head, feature = heads[name], 5
    (e,), echo = resolve(spec({"head": name, "feature": feature, "op": "clamp", "value": 2.5}), 2, TINY_D, {}, heads)
    assert (e.layer, e.op, e.clamp.value, echo[0]["value"]) == (head.layer, "clamp", 2.5, 2.5)
    np.testing.assert_array_equal(e.array(), load_file(f"{head.path}/sae_weights.safetensors")["W_dec"][feature])
    rows = np.random.default_rng(0).normal(size=(64, TINY_D)).astype(np.float32) * 2
    want = sae_reference(head.path, rows)[:, feature]
    _, enc, par = nonlinear(e, "cpu", torch.float32)
    s = torch.from_numpy(rows) @ enc.T + par[:2]
    got = (torch.relu(s[:, 0]) * (s[:, 1] > par[2]).float()).numpy()
    assert 0 < (want > 0).sum() < len(want)
    assert float(np.abs(got - want).max()) <= 1e-5 * float(np.abs(want).max())
    digest = lambda **kw: anchor(
        resolve(
            spec({"head": name, "feature": feature, **kw}),
            2,
            TINY_D,
            {},  # noqa: E731
            heads,
        )[0],
        4,
    )[1]
    assert digest(op="clamp", value=2.5) == anchor([e], 4)[1] != digest(op="clamp", value=2.0) != digest()
