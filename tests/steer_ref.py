"""Steering on transformers: the reference a steered completion is judged against.

Steering at layer L changes the stream transformers records as `hidden_states[L]`: a forward hook
on the output of decoder layer L - 1 (for L = 0, a pre-hook on decoder layer 0: the embeddings as
the model scales and merges them), before anything the model adds between layers (Qwen3-VL's
DeepStack), on the rows of the chosen positions: + scale x vector (`add`), minus the component along the unit
vector (`ablate`), that component limited to c (`("cap", c)`), or an SAE feature set to a value by
SAELens's own `encode` and `W_dec` (`("clamp", sae, feature, value)`), entries in order. Rows are read at the same
sites right after the steering (transformers' own
recorder reads them before a hook added later; unsteered, the two are the same bits: `hook_layers`
checks it), and the final norm's output, and greedy tokens come from recomputing the whole
sequence each step (no KV cache: positions are plain indices).
"""

from __future__ import annotations

import numpy as np


def _rows_of(positions, total: int, prompt_len: int) -> np.ndarray:
    every = np.arange(total)
    if not isinstance(positions, str):  # explicit positions (a conditional entry where it applied)
        return np.asarray([p for p in positions if p < total], dtype=np.int64)
    if positions == "prompt":
        return every[every < prompt_len]
    if positions == "completion":
        return every[every >= prompt_len]
    return every


def hook_layers(layers, norm, entries, total: int, prompt_len: int, recorded: dict) -> list:
    """Steering `entries` [(layer, op, positions, scale, vector)] at transformers' sites for layer L
    (the input of decoder layer 0 for L = 0, the output of decoder layer L - 1 otherwise), each
    site's rows after it into `recorded[L]`, the final norm's output into `recorded[len(layers)]`:
    the hook handles."""
    import torch

    def steer(layer: int, hidden):
        hidden = hidden.clone()
        for e_layer, op, positions, scale, vector in entries:
            if e_layer != layer:
                continue
            rows = torch.as_tensor(_rows_of(positions, total, prompt_len), device=hidden.device)
            v = torch.as_tensor(np.array(vector, np.float32), device=hidden.device)
            if op == "add":
                hidden[0, rows] += scale * v
            elif op == "ablate":
                unit = v / v.norm()
                hidden[0, rows] -= (hidden[0, rows] @ unit)[:, None] * unit
            elif op[0] == "cap":  # ("cap", c): the component along the unit vector at most c
                unit = v / v.norm()
                hidden[0, rows] -= torch.relu(hidden[0, rows] @ unit - op[1])[:, None] * unit
            else:  # ("clamp", SAELens SAE, feature, value): + (value - encode(stream)[feature]) x W_dec[feature]
                _, sae, feature, value = op
                f = sae.encode(hidden[0, rows].float())[:, feature]
                hidden[0, rows] += ((value - f)[:, None] * sae.W_dec[feature]).to(hidden.dtype)
        recorded[layer] = hidden[0].float().cpu().numpy().copy()
        return hidden

    def pre0(module, args, kwargs):
        hidden = steer(0, args[0] if args else kwargs["hidden_states"])
        return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

    def post(layer: int):
        def hook(module, args, kwargs, output):
            if isinstance(output, tuple):
                return (steer(layer, output[0]), *output[1:])
            return steer(layer, output)

        return hook

    def post_norm(module, args, output):
        recorded[len(layers)] = output[0].float().cpu().numpy().copy()

    hooks = [layers[0].register_forward_pre_hook(pre0, with_kwargs=True)]
    hooks += [layers[i - 1].register_forward_hook(post(i), with_kwargs=True) for i in range(1, len(layers))]
    hooks.append(norm.register_forward_hook(post_norm))
    return hooks


def check_sites(recorded: dict, hidden_states) -> None:
    """The rows the hooks read, unsteered, are transformers' own `hidden_states` (the same bits)."""
    for layer, rows in recorded.items():
        if isinstance(layer, int):
            want = hidden_states[layer][0].float().cpu().numpy()
            assert np.array_equal(rows, want), f"layer {layer}: the reference's site is not transformers' row"


def steered_states(model, ids, entries, prompt_len: int) -> list[np.ndarray]:
    """hidden_states of `ids` under `entries` [(layer, op, positions, scale, vector)]: per layer
    0..L (L: after the final norm), [T, D] float32."""
    import torch

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model: its base's modules
    layers, norm = inner.model.layers, inner.model.norm
    recorded: dict[int, np.ndarray] = {}
    hooks = hook_layers(layers, norm, entries, len(ids), prompt_len, recorded)
    try:
        with torch.no_grad():
            out = model(
                torch.tensor([list(ids)], device=next(model.parameters()).device), output_hidden_states=not entries
            )
    finally:
        for h in hooks:
            h.remove()
    if not entries:
        check_sites(recorded, out.hidden_states)
    recorded["logits"] = out.logits[0, -1].float().cpu().numpy()
    return recorded


def steered_greedy(model, prompt_ids, entries, max_tokens: int, eos: int | None = None) -> list[int]:
    """Greedy tokens under `entries`, the whole sequence recomputed each step."""
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        nxt = int(np.argmax(steered_states(model, ids, entries, len(prompt_ids))["logits"]))
        ids.append(nxt)
        if eos is not None and nxt == eos:
            break
    return ids[len(prompt_ids) :]


def write_gguf(path: str, directions: dict[int, np.ndarray]) -> str:
    """A control vector as repeng's export_gguf writes it (arch `controlvector`, direction.N tensors)."""
    import gguf

    writer = gguf.GGUFWriter(path, "controlvector")
    writer.add_string("controlvector.model_hint", "llama")
    writer.add_uint32("controlvector.layer_count", len(directions))
    for layer, v in directions.items():
        writer.add_tensor(f"direction.{layer}", np.asarray(v, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def conditional_greedy(model, prompt_ids, entries, max_tokens: int, conditions: dict) -> tuple[list[int], dict]:
    """Greedy tokens under `entries`, where entry k of `conditions` ({k: (head layer, score(row) -> float,
    above, threshold)}) applies at a completion position q only if its condition held on the head's row
    of q - 1 (transformers' hidden_states[layer] at q - 1, steered as far as it is). Decided position by
    position, each from a forward of the sequence so far; the final token's row gets its decision too.
    Returns (tokens, {k: positions applied})."""
    P, ids = len(prompt_ids), list(prompt_ids)
    applied: dict[int, list[int]] = {k: [] for k in conditions}

    def fixed():
        return [(e[0], e[1], applied[k] if k in conditions else e[2], *e[3:5]) for k, e in enumerate(entries)]

    def decide(q: int) -> None:
        states = steered_states(model, ids[:q], fixed(), P)
        for k, (layer, score, above, threshold) in conditions.items():
            s = score(states[layer][q - 1])
            if (s > threshold) if above else (s < threshold):
                applied[k].append(q)

    for _ in range(max_tokens):
        if len(ids) - 1 >= P:
            decide(len(ids) - 1)
        ids.append(int(np.argmax(steered_states(model, ids, fixed(), P)["logits"])))
    decide(len(ids) - 1)
    return ids[P:], applied


def fixed_entries(entries, applied: dict) -> list:
    """`entries` with the conditional ones at the positions they applied (conditional_greedy's)."""
    return [(e[0], e[1], applied[k] if k in applied else e[2], *e[3:5]) for k, e in enumerate(entries)]


def pick_condition(model, prompt_ids, entries, max_tokens: int, layer: int, score, above: bool):
    """A threshold for entry 0's condition (score of the row at `layer`) under which the reference applies
    it at some completion positions and not at others, every score clear of the threshold by far more
    than the band (relative 1e-5): tried from the unsteered completion's median score outward. Returns
    (threshold, tokens, {0: positions applied}, the rows of prompt + tokens per layer)."""
    P = len(prompt_ids)
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        ids.append(int(np.argmax(steered_states(model, ids, [], P)["logits"])))
    states = steered_states(model, ids, [], P)
    plain = sorted(score(states[layer][q]) for q in range(P - 1, len(ids)))
    middle = sorted(((a + b) / 2 for a, b in zip(plain, plain[1:])), key=lambda t: abs(t - plain[len(plain) // 2]))
    for t in middle:
        tokens, applied = conditional_greedy(model, prompt_ids, entries, max_tokens, {0: (layer, score, above, t)})
        full = list(prompt_ids) + tokens
        final = steered_states(model, full, fixed_entries(entries, applied), P)
        scores = [score(final[layer][q]) for q in range(P - 1, len(full) - 1)]
        band = 1e-5 * max(abs(x) for x in scores)
        if 0 < len(applied[0]) < max_tokens and min(abs(x - t) for x in scores) > 100 * band:
            return float(t), tokens, applied, final
    raise AssertionError("no threshold gives mixed decisions clear of the band")
