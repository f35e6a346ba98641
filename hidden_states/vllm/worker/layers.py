"""Which models' intermediate layers can be captured: the decoder-layer convention (ledger point 8).

Intermediate layers are served on the architectures verified against transformers
(`hidden_states.vllm.VERIFIED_LAYER_ARCHS`, each with its test). `layer_capture_support` checks the
model itself at install and can only refuse one of those (a layer class that no longer follows the
convention); it never admits another. `entry_site` says where layer L's rows are read.
"""

from __future__ import annotations

from typing import Any


def _residual_norm_of(layer_cls: type) -> tuple[str | None, str | None]:
    """(name of the norm that adds the residual at the layer's entry, None) if the
    class's forward follows the residual-stream convention, else (None, why not)."""
    import ast
    import inspect
    import textwrap

    name = layer_cls.__name__
    try:
        params = list(inspect.signature(layer_cls.forward).parameters)[1:]
    except (TypeError, ValueError):
        return None, f"{name}.forward has no inspectable signature"
    if params[:3] != ["positions", "hidden_states", "residual"]:
        return None, f"{name}.forward takes ({', '.join(params)}), not (positions, hidden_states, residual)"
    try:
        fn = ast.parse(textwrap.dedent(inspect.getsource(layer_cls.forward))).body[0]
    except (OSError, TypeError, SyntaxError):
        return None, f"the source of {name}.forward is not available"

    def is_name(node, ident):
        return isinstance(node, ast.Name) and node.id == ident

    def uses_residual(node):
        return any(is_name(n, "residual") for n in ast.walk(node))

    for stmt in fn.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # docstring
        # if residual is None: residual = hidden_states; ...
        # else: hidden_states, residual = self.<norm>(hidden_states, residual)
        if (
            isinstance(stmt, ast.If)
            and isinstance(stmt.test, ast.Compare)
            and is_name(stmt.test.left, "residual")
            and isinstance(stmt.test.ops[0], ast.Is)
            and isinstance(stmt.test.comparators[0], ast.Constant)
            and stmt.test.comparators[0].value is None
        ):
            first = stmt.body[0]
            starts = (
                isinstance(first, ast.Assign)
                and len(first.targets) == 1
                and is_name(first.targets[0], "residual")
                and is_name(first.value, "hidden_states")
            )
            fused = stmt.orelse[0] if len(stmt.orelse) == 1 else None
            if (
                starts
                and isinstance(fused, ast.Assign)
                and len(fused.targets) == 1
                and isinstance(fused.targets[0], ast.Tuple)
                and [getattr(e, "id", None) for e in fused.targets[0].elts] == ["hidden_states", "residual"]
                and isinstance(fused.value, ast.Call)
                and isinstance(fused.value.func, ast.Attribute)
                and is_name(fused.value.func.value, "self")
                and not fused.value.keywords
                and [getattr(a, "id", None) for a in fused.value.args] == ["hidden_states", "residual"]
            ):
                return fused.value.func.attr, None
            break
        if uses_residual(stmt):
            break
    return None, (
        f"{name}.forward does not begin by adding its residual argument to hidden_states "
        "in a fused norm (`if residual is None: ... else: hidden_states, residual = "
        "self.<norm>(hidden_states, residual)`)"
    )


def on_this_stage(layer: Any) -> bool:
    """Whether a decoder layer runs in this process: under pipeline parallelism vLLM keeps the other stages'
    layers as `PPMissingLayer` placeholders (vllm.model_executor.models.utils.make_layers)."""
    return type(layer).__name__ != "PPMissingLayer"


def stage_layers(decoder: list) -> list[int]:
    """The layers 0..n-1 whose site is in this process: those whose decoder layer runs here (all of them
    without pipeline parallelism)."""
    return [i for i, layer in enumerate(decoder) if on_this_stage(layer)]


def entry_site(decoder: list, layer: int) -> tuple[Any, str]:
    """Where layer `layer`'s rows are read and its steering applied: (module, "input" | "output").

    Layer L is transformers' `hidden_states[L]`: the embeddings (the input of decoder layer 0) for
    L = 0, the output of decoder layer L-1 for 1 <= L < n. Read at that output (hidden + residual),
    not at the input of layer L: a model may add to the stream between the two (Qwen3-VL's DeepStack
    adds visual features after layers 0..k-1), and transformers records the output. Under pipeline
    parallelism a layer's site is on the stage that runs decoder layer L: a stage's first layer is read at
    its input, the stream (hidden + residual) the stage before sent (engine_args refuses pipeline
    parallelism for multimodal models, DeepStack's among them)."""
    if layer == 0 or not on_this_stage(decoder[layer - 1]):
        return decoder[layer], "input"
    return decoder[layer - 1], "output"


def text_model(model: Any) -> Any:
    """The decoder-only language model: a multimodal model's text stack (vLLM's SupportsMultiModal
    `get_language_model`), else the model itself."""
    get = getattr(model, "get_language_model", None)
    inner = get() if callable(get) else None
    return model if inner is None else inner


def layer_capture_support(model: Any, num_layers: int, hidden_size: int) -> tuple[list | None, str | None]:
    """The decoder layers of a vLLM model (a multimodal model's text stack) whose layer inputs carry
    the residual stream as hidden + residual (see the module docstring), or (None, why not)."""
    import torch

    model = text_model(model)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        return None, f"{type(model).__name__} has no decoder layer list at .model.layers"
    if len(layers) != num_layers:
        return None, f"{type(model).__name__}.model.layers holds {len(layers)} layers, the config {num_layers}"
    norms: dict[type, str] = {}
    for cls in dict.fromkeys(type(layer) for layer in layers if on_this_stage(layer)):
        norm, why = _residual_norm_of(cls)
        if norm is None:
            return None, why
        norms[cls] = norm
    # The norm must return (norm(h + r), h + r): probe it once per layer class on random rows.
    for cls, attr in norms.items():
        module = getattr(next(layer for layer in layers if type(layer) is cls), attr, None)
        weight = next((p for p in module.parameters()), None) if isinstance(module, torch.nn.Module) else None
        if weight is None:
            return None, f"{cls.__name__}.{attr} is not a norm module with weights"
        gen = torch.Generator().manual_seed(0)
        h, r = (torch.randn(2, hidden_size, generator=gen).to(weight.device, weight.dtype) for _ in range(2))
        expected = h.float() + r.float()
        try:
            with torch.inference_mode():
                out = module(h.clone(), r.clone())
        except Exception as e:  # noqa: BLE001 - any failure means "not this convention"
            return None, f"{cls.__name__}.{attr}(hidden, residual) failed: {e}"
        if not (
            isinstance(out, tuple)
            and len(out) == 2
            and out[1].shape == h.shape
            and torch.allclose(out[1].float(), expected, rtol=1e-2, atol=1e-2)
        ):
            return None, f"{cls.__name__}.{attr}(hidden, residual) does not return hidden + residual"
    return list(layers), None


def final_norm_in_logits(model: Any, hidden_size: int) -> Any | None:
    """The model's final norm if its forward returns the stream before it and `compute_logits` applies
    it (MiMo; ledger point 8), else None; the capture then applies it to the final-layer rows.
    Decided by a probe on random rows; runs on every tensor-parallel rank in the same order."""
    import logging

    import torch

    model = text_model(model)
    norm = getattr(getattr(model, "model", None), "norm", None)
    head, logits = getattr(model, "lm_head", None), getattr(model, "logits_processor", None)
    if not isinstance(norm, torch.nn.Module) or head is None or logits is None or not hasattr(model, "compute_logits"):
        return None
    weight = next(model.parameters())
    x = (torch.randn(3, hidden_size, generator=torch.Generator().manual_seed(0)) * 4).to(weight.device, weight.dtype)
    try:
        with torch.inference_mode():
            got, plain, normed = model.compute_logits(x), logits(head, x), logits(head, norm(x))
    except Exception as e:  # noqa: BLE001 - a head the probe cannot call (e.g. LoRA state unset): as before
        logging.getLogger(__name__).info("final-norm probe skipped on %s: %s", type(model).__name__, e)
        return None
    if got is None or plain is None or normed is None:  # logits gathered on another rank
        return None

    def same(a, b) -> bool:
        return bool(torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3))

    return norm if not same(got, plain) and same(got, normed) else None
