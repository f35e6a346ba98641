"""The GPU check: a compiled engine (torch.compile, and CUDA graphs on a GPU) on the built-in SmolLM2,
its vectors, rows, an SAE head and a steering entry against transformers on the same device, then
decode tokens/s with the features on and off, beside an eager engine. One line per check.

    bash scripts/gpu-check.sh             # on a machine with one NVIDIA GPU, after the README's set-up
    .venv/bin/python -m tests.gpu.gpu_check [--model builtin:smollm2-135m-instruct] [--device cuda] \
        [--max-tokens 16] [--no-speed] [--dry-run]

The engine: `enforce_eager: false` with vLLM's own compilation and CUDA-graph defaults, float32,
`capture_layers: [L // 2]` (the static layer set, traced into the compiled forward: worker/traced.py),
and a top-k SAE (SAELens's format, random weights) registered at that layer. The checks (`run_checks`,
also run by tests/engine/test_compiled.py on the CPU's compiled engine):
- `last layer`: the tail step's final-token vector against transformers' `hidden_states[-1]`;
- `layer l rows`: rows at the static layer at every position of prompt + completion;
- `extraction`: a stop string's final vector (the extraction step, a prefill of prompt + completion);
- `sae head`: the SAE's top-k at every completion position against SAELens's `encode` of
  transformers' rows;
- `stop`: a stop condition on an SAE feature (`hidden_states_stop`), decided in the engine: the greedy
  tokens up to the first position SAELens's features cross its threshold, the score there, and the
  final vector transformers' row there;
- `steering when`: an add at the static layer applied only where an SAE feature held on the row before
  (`when`), decided in the engine (on a GPU, under async scheduling, by the worker on the device): the
  tokens, the positions applied and the final vector against transformers deciding position by position;
- `steering`: an add at the static layer on the completion: the tokens equal transformers' greedy
  tokens with the same hook (tests/steer_ref.py) and the final vector equals its;
- `beside steering`: an unsteered request in the same batch as a steered one, against transformers;
- `no recompiles`: vLLM's compile counts (graphs traced, inductor compiles, CUDA graphs captured) and
  dynamo's, equal after the checks as before them.
Each prints its max abs error and max |reference| (the rule: error <= 1e-5 x max |reference|, float32).
Then (unless --no-speed) decode tokens/s at concurrency 8 on the compiled engine with nobody asking
(`off`) and with half the batch asking for rows at the static layer, the SAE head and the steering
(`on`), then the same on an eager engine (`enforce_eager: true`), side by side. Exits 1 if a check
failed, 2 if the device is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import json
import os
import sys
import tempfile
import time

import numpy as np

REL_TOL = 1e-5
PROMPT = "The capital of France is"


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    error: float | None = None
    scale: float | None = None
    note: str = ""

    def line(self) -> str:
        figures = (
            ""
            if self.error is None
            else f": max abs error {self.error:.3g}, max |reference| {self.scale:.3g} "
            f"({self.error / max(self.scale, 1e-30):.2g} relative)"
        )
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name}{figures}{' - ' + self.note if self.note else ''}"


def engine_args(device: str, eager: bool) -> dict:
    """The check's engine arguments: vLLM's GPU defaults (CUDA graphs) where `eager` is false."""
    args = {"dtype": "float32", "max_model_len": 1024, "enforce_eager": eager}
    if device == "cpu":
        args.update(kv_cache_memory_bytes=512 * 2**20, max_num_batched_tokens=512)
    else:
        args.update(gpu_memory_utilization=0.5)
    return args


def plan(args) -> dict:
    """What the check starts and runs (printed by --dry-run)."""
    return {
        "model": args.model,
        "device": args.device,
        "engine": {
            **engine_args(args.device, eager=False),
            "capture_layers": "[L // 2]",
            "heads": "a top-k SAE at layer L // 2 (SAELens, random weights)",
        },
        "checks": [
            "last layer",
            "layer rows",
            "extraction",
            "sae head",
            "stop on an sae feature",
            "steering when",
            "steering",
            "beside steering",
            "no recompiles",
        ],
        "speed": None
        if args.no_speed
        else {
            "concurrency": 8,
            "requests": 16,
            "max_tokens": 64,
            "arms": ["compiled off", "compiled on", "compiled off2", "eager off", "eager on", "eager off2"],
        },
    }


def _compare(name: str, got, ref, note: str = "") -> Check:
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    if got.shape != ref.shape:
        return Check(name, False, note=f"shape {got.shape} != reference {ref.shape}")
    err, scale = float(np.abs(got - ref).max()), float(np.abs(ref).max())
    return Check(name, err <= REL_TOL * scale, err, scale, note)


class Reference:
    """transformers' own model class on the same weights and device, float32."""

    def __init__(self, path: str, device: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch, self.device = torch, device
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()

    def states(self, ids) -> list[np.ndarray]:
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([list(ids)], device=self.device), output_hidden_states=True)
        return [h[0].float().cpu().numpy() for h in out.hidden_states]


async def run_checks(engine, ref: Reference, layer: int, sae: dict, max_tokens: int = 16) -> list[Check]:
    """The checks on a started engine whose static set holds `layer` and which serves the SAE head
    `sae` ({"name", "path", "layer", "k"}); each against `ref`."""
    from vllm import SamplingParams

    from tests.heads_ref import assert_sae_topk, sae_reference
    from tests.steer_ref import steered_greedy, steered_states

    async def counts():
        return [w.get("compilations") for w in (await engine.stats())["workers"]]

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    checks: list[Check] = []
    before = await counts()

    out = await engine.complete(PROMPT, greedy, layers=[layer, -1], position="all")
    ch = out.choices[0]
    ids = list(out.prompt_token_ids) + list(ch.token_ids)
    states = ref.states(ids)
    checks.append(
        _compare(
            "last layer (tail step)",
            ch.hidden_states_by_layer[-1][-1],
            states[-1][-1],
            f"via {ch.extraction.via}, {len(ids)} tokens",
        )
    )
    checks.append(_compare(f"layer {layer} rows, every position", ch.hidden_states_by_layer[layer], states[layer]))

    stop = await engine.complete(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=["zzzz"]))
    sc = stop.choices[0]
    sids = list(stop.prompt_token_ids) + list(sc.token_ids)
    checks.append(
        _compare(
            "extraction step (a stop string)", sc.hidden_states, ref.states(sids)[-1][-1], f"via {sc.extraction.via}"
        )
    )

    heads = await engine.complete(
        PROMPT,
        greedy,
        return_hidden_states=False,
        position="completion",
        heads=[{"name": sae["name"], "topk": sae["k"]}],
    )
    hc = heads.choices[0]
    hids = list(heads.prompt_token_ids) + list(hc.token_ids)
    positions = list(range(len(heads.prompt_token_ids), len(hids)))
    rows = ref.states(hids)[sae["layer"]][positions]
    try:
        worst = max(
            assert_sae_topk(p["indices"], p["values"], r, sae["k"])
            for p, r in zip(hc.heads[sae["name"]], sae_reference(sae["path"], rows))
        )
        checks.append(Check(f"sae head top-{sae['k']}, {len(positions)} positions", True, *worst))
    except AssertionError as e:
        checks.append(Check(f"sae head top-{sae['k']}", False, note=str(e)[:200]))
    checks.append(
        await _stop_check(engine, ref, sae, greedy, hids, len(heads.prompt_token_ids), sae_reference(sae["path"], rows))
    )

    checks.append(await _when_check(engine, ref, sae, layer, min(max_tokens, 12)))

    d = len(states[-1][-1])
    vec = np.random.default_rng(7).normal(size=d).astype("<f4")
    vec *= 4.0 / np.linalg.norm(vec)
    steer = [{"layer": layer, "vector": base64.b64encode(vec.tobytes()).decode(), "positions": "completion"}]
    steered, beside = await asyncio.gather(
        engine.complete(PROMPT, greedy, steering=steer), engine.complete("Rain falls on the", greedy)
    )
    st = steered.choices[0]
    entries = [(layer, "add", "completion", 1.0, vec)]
    want = steered_greedy(ref.model, list(steered.prompt_token_ids), entries, max_tokens)
    if list(st.token_ids) != want[: len(st.token_ids)]:
        checks.append(Check("steering (add, completion)", False, note=f"tokens {list(st.token_ids)} != {want}"))
    else:
        P = len(steered.prompt_token_ids)
        sref = steered_states(ref.model, list(steered.prompt_token_ids) + list(st.token_ids), entries, P)
        last = max(k for k in sref if isinstance(k, int))  # after the final norm
        checks.append(
            _compare(
                f"steering (add at layer {layer}, completion)",
                st.hidden_states,
                sref[last][-1],
                f"{len(st.token_ids)} tokens, transformers' with the same hook",
            )
        )
    bc = beside.choices[0]
    checks.append(
        _compare(
            "unsteered beside a steered request",
            bc.hidden_states,
            ref.states(list(beside.prompt_token_ids) + list(bc.token_ids))[-1][-1],
        )
    )

    after = await counts()
    changed = [{k: (b[k], a.get(k)) for k in b if b[k] != a.get(k)} for b, a in zip(before, after) if b]
    checks.append(
        Check(
            "no recompiles, no new graphs",
            before == after and all(before),
            note=json.dumps(changed) if any(changed) else f"counts equal on {len(after)} worker(s)",
        )
    )
    return checks


async def _stop_check(engine, ref: Reference, sae: dict, greedy, ids: list[int], P: int, feats: np.ndarray) -> Check:
    """A stop condition on an SAE feature (hidden_states_stop), decided in the engine (under async
    scheduling on a GPU, vLLM's default): a threshold that SAELens's features of the greedy completion
    (`feats`, [completion positions, F]) first cross at a middle position p, clear of the band; the
    choice keeps the greedy tokens up to p, says p and the feature's score, and its final vector is
    transformers' row p."""
    from tests.heads_ref import crossing

    spread = np.argsort(-(feats.max(0) - feats.min(0)))
    for feature in spread[:32]:  # the first feature, by spread, whose scores cross clearly
        scores = np.concatenate([np.zeros(P), feats[:, feature].astype(np.float64)])
        try:
            p, threshold = crossing(scores, P, True)
            break
        except AssertionError:
            continue
    else:
        return Check("stop on an sae feature", False, note="no feature crosses clearly in this completion")
    out = await engine.complete(
        PROMPT, greedy, stop_conditions=[{"head": sae["name"], "feature": int(feature), "above": threshold}]
    )
    ch = out.choices[0]
    got = list(out.prompt_token_ids) + list(ch.token_ids)
    if got != ids[: p + 1] or not ch.stop or ch.stop["position"] != p:
        return Check(
            "stop on an sae feature",
            False,
            note=f"tokens {got[P:]} (want {ids[P : p + 1]}), stop {ch.stop}, finish {ch.finish_reason}",
        )
    err = abs(ch.stop["score"] - scores[p])
    if err > REL_TOL * np.abs(scores).max():
        return Check("stop on an sae feature: its score", False, err, float(np.abs(scores).max()))
    return _compare(
        f"stop on sae feature {feature} at position {p} (its score off by {err:.2g})",
        ch.hidden_states,
        ref.states(ids[: p + 1])[-1][p],
        f"finish {ch.finish_reason}, via {ch.extraction.via}",
    )


async def _when_check(engine, ref: Reference, sae: dict, layer: int, n: int) -> Check:
    """Conditional steering (`when`): an add at the static layer on the completion, applied at position q only
    where an SAE feature held above a threshold on the row of q - 1, decided in the engine (under async
    scheduling, a GPU's default, by the worker on the device). Against transformers deciding position by
    position with SAELens's encode (tests/steer_ref.py): the tokens, the positions applied, the final vector."""
    import torch
    from sae_lens import SAE
    from vllm import SamplingParams

    from tests.steer_ref import pick_condition

    plain = await engine.complete(PROMPT, SamplingParams(max_tokens=n, temperature=0.0), return_hidden_states=False)
    prompt = list(plain.prompt_token_ids)
    states = ref.states(prompt + list(plain.choices[0].token_ids))
    coder = SAE.load_from_disk(sae["path"], device="cpu")
    with torch.no_grad():  # the features of the rows that decide: the last prompt row's on
        feats = coder.encode(torch.tensor(np.asarray(states[sae["layer"]][len(prompt) - 1 :], np.float32)))
    vec = np.random.default_rng(9).normal(size=states[-1].shape[-1]).astype("<f4")
    vec *= 4.0 / np.linalg.norm(vec)
    base = [(layer, "add", "completion", 1.0, vec)]
    for feature in np.argsort(-(feats.max(0).values - feats.min(0).values).numpy())[:8]:

        def score(row, f=int(feature)):
            with torch.no_grad():
                return float(coder.encode(torch.tensor(np.asarray(row, np.float32)[None]))[0, f])

        try:
            t, tokens, applied, final = pick_condition(ref.model, prompt, base, n, sae["layer"], score, True)
            break
        except AssertionError:
            continue
    else:
        return Check(
            "steering when an sae feature held", False, note="no feature gives mixed decisions clear of the band"
        )
    steering = [
        {
            "layer": layer,
            "vector": base64.b64encode(vec.tobytes()).decode(),
            "positions": "completion",
            "when": {"head": sae["name"], "feature": int(feature), "above": t},
        }
    ]
    out = await engine.complete(PROMPT, SamplingParams(max_tokens=n, temperature=0.0), steering=steering)
    ch = out.choices[0]
    got = ch.steering[0].get("applied") if ch.steering else None
    if list(ch.token_ids) != tokens or got != applied[0]:
        return Check(
            "steering when an sae feature held",
            False,
            note=f"tokens {list(ch.token_ids)} (want {tokens}), applied {got} (want {applied[0]})",
        )
    last = max(k for k in final if isinstance(k, int))  # after the final norm
    return _compare(
        f"steering when sae feature {int(feature)} held (applied at {len(got)} of {n} positions)",
        ch.hidden_states,
        final[last][-1],
        f"via {ch.extraction.via}",
    )


async def _tok_s(engine, features: dict, n: int = 16, concurrency: int = 8, max_tokens: int = 64) -> float:
    from vllm import SamplingParams

    sem = asyncio.Semaphore(concurrency)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i):
        async with sem:
            kw = features if features and i % 2 == 0 else {"return_hidden_states": False}
            return len(
                (await engine.complete(f"Request {i}: tell me a story about", params, **kw)).choices[0].token_ids
            )

    await one(0)
    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(n))))
    return tokens / (time.perf_counter() - t0)


def _features(layer: int, sae: str, d: int) -> dict:
    vec = np.random.default_rng(8).normal(size=d).astype("<f4")
    return {
        "layers": [layer],
        "position": "completion",
        "heads": [{"name": sae, "topk": 16}],
        "steering": [{"layer": layer, "vector": base64.b64encode(vec.tobytes()).decode()}],
    }


async def _main(args) -> int:
    from hidden_states.models.builtin import resolve_model
    from hidden_states.vllm.engine import HiddenStatesEngine
    from tests.heads_ref import make_sae

    path = resolve_model(args.model)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    L, d = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    layer = L // 2
    folder = tempfile.mkdtemp(prefix="gpu-check-")
    sae = {
        "name": "sae",
        "path": make_sae(
            os.path.join(folder, "sae"), "topk", d, 4 * d, f"blocks.{layer - 1}.hook_resid_post", seed=0, k=16
        ),
        "layer": layer,
        "k": 16,
    }
    heads = [{"name": "sae", "path": sae["path"]}]
    print(f"gpu-check: {args.model} (L = {L}, D = {d}) on {args.device}; static layer set [{layer}]", flush=True)
    t0 = time.perf_counter()
    engine = await HiddenStatesEngine.start(
        path, warm_up_s=0, capture_layers=[layer], heads=heads, **engine_args(args.device, eager=False)
    )
    print(f"compiled engine started in {time.perf_counter() - t0:.1f} s: {json.dumps(engine.startup)}", flush=True)
    speeds = {}
    try:
        ref = Reference(path, args.device)
        checks = await run_checks(engine, ref, layer, sae, args.max_tokens)
        for c in checks:
            print(c.line(), flush=True)
        del ref
        if not args.no_speed:
            feats = _features(layer, "sae", d)
            for arm in ("off", "on", "off2"):
                speeds[f"compiled {arm}"] = await _tok_s(engine, feats if arm == "on" else {})
    finally:
        engine.shutdown()
    if not args.no_speed:
        eager = await HiddenStatesEngine.start(path, warm_up_s=0, heads=heads, **engine_args(args.device, eager=True))
        try:
            for arm in ("off", "on", "off2"):
                speeds[f"eager {arm}"] = await _tok_s(eager, _features(layer, "sae", d) if arm == "on" else {})
        finally:
            eager.shutdown()
        base = speeds["eager off"]
        print(
            "decode tok/s at concurrency 8 (16 requests x 64 tokens; `on`: half the batch asks for rows, "
            "the SAE and steering; `off2`: `off` again, the A/A control):"
        )
        for arm, rate in speeds.items():
            print(f"  {arm:<13} {rate:8.1f} tok/s  ({rate / base:.2f}x eager off)")
    return 0 if all(c.ok for c in checks) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-speed", action="store_true", help="the checks only, no tokens/s")
    ap.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    args = ap.parse_args(argv)
    if args.dry_run:
        print(json.dumps(plan(args), indent=2))
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(
                "gpu-check: no CUDA device visible to torch; run this on a GPU machine (or --device cpu)",
                file=sys.stderr,
            )
            return 2
    from bench.servers import ENGINE_ENV

    if args.device == "cpu":
        os.environ.update(ENGINE_ENV)
    return asyncio.run(_main(args))


if __name__ == "__main__":
    sys.exit(main())
