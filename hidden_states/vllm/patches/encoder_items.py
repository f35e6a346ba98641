"""Ledger point 14 (its one wrap): a multimodal model's encoder items counted (worker).

Why: a test must see that an extraction step reuses the encoder cache (the same image, not encoded again):
the worker's stats count `encoder_items`, the images and audio clips the model's encoder embedded.
How: the model's `embed_multimodal` is wrapped on the model instance (`runner`, from `hidden_states_install`),
adding each call's items to `hook.encoder_items`. The rest of point 14 reads vLLM's internals without
patching them (the extraction step's `mm_input`/`embeds_input`, `get_language_model()`, `hf_text_config`,
`AsyncLLM.renderer.render_chat_async`: listed in unpatched.py).
Relies on: `SupportsMultiModal.embed_multimodal(**kwargs)` returning a sequence or a tensor of items.
Remove: never; re-check when vLLM's input types change.
"""

from __future__ import annotations

from typing import Any

from hidden_states.vllm.patches.drift import _MODELS, _VLMS, Symbol


def runner(runner: Any, hook: Any, **_: Any) -> None:
    model = runner.model
    encode = getattr(model, "embed_multimodal", None)
    if encode is None or getattr(encode, "_hidden_states_counted", False):
        return

    def embed_multimodal(**kwargs):
        out = encode(**kwargs)
        hook.encoder_items += len(out) if isinstance(out, (list, tuple)) else int(out.shape[0])
        return out

    embed_multimodal._hidden_states_counted = True
    model.embed_multimodal = embed_multimodal


RELIED: tuple[Symbol, ...] = tuple(
    Symbol(f"{_MODELS}.{cls}.embed_multimodal", "14", ("**kwargs",), "wrapped", exact=True) for cls in _VLMS
)
