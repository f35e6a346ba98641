"""The transformers reference for the built-in multimodal models (hidden_states/models/vlm.py, audio.py).

Independent of the server: only transformers, on the model folder, with the folder's own processor
(AutoProcessor) for the images. Token ids come from the caller (the prompt ids as vLLM produced
them, image placeholders expanded, plus any completion ids); the processor only makes the pixels.

transformers numbering of `hidden_states`: 0 = embeddings (image features already scattered in),
l = the residual stream entering layer l, L = after the final norm.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np


@functools.lru_cache(maxsize=4)
def load(model_dir: str):
    """(model, processor): the folder's transformers class in float32, eval mode."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model, info = AutoModelForImageTextToText.from_pretrained(
        str(model_dir), dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"{model_dir}: weights not loaded as saved: {bad}"
    return model.eval(), AutoProcessor.from_pretrained(str(model_dir))


def model_inputs(model_dir: str, token_ids: Sequence[int], images: Sequence) -> dict:
    """The model's forward inputs: `token_ids` as given, the images through the folder's image processor,
    and the token types the family's processor makes from the ids, where its model reads them:

    - Gemma 3: `token_type_ids` (1 on an image's tokens), from which transformers lets an image's tokens
      attend to each other both ways; without them it runs every token causally, which is not Gemma 3
      (the rows differ by ~1e-2). The CPU engine computes the bidirectional form through ledger point 18;
    - Qwen-VL: `mm_token_type_ids`, from which its 3-D rotary positions (M-RoPE) are computed; without
      them transformers positions every token as text."""
    import torch

    model, processor = load(str(model_dir))
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if images:
        pixels = processor.image_processor(images=list(images), return_tensors="pt")
        inputs.update({k: v for k, v in pixels.items() if k != "num_crops"})
        n = int((ids == model.config.image_token_id).sum())
        per_image = n // len(images)
        assert per_image * len(images) == n and per_image > 0, f"{n} image tokens for {len(images)} images"
    kind = TOKEN_TYPES.get(model.config.model_type)
    if kind:  # which tokens are an image's (1) or a video's (2), as the family's own processor marks them
        inputs[kind] = torch.tensor(processor.create_mm_token_type_ids(ids.tolist()))
    return inputs


# the model input each family reads its processor's token types from
TOKEN_TYPES = {"gemma3": "token_type_ids", "qwen2_vl": "mm_token_type_ids", "qwen2_5_vl": "mm_token_type_ids",
               "qwen3_vl": "mm_token_type_ids"}


def reference_forward(model_dir, token_ids: Sequence[int], images: Sequence = (), completion_ids: Sequence[int] = ()):
    """transformers' output (logits, hidden_states) for the prompt plus completion ids, in one forward."""
    import torch

    model, _ = load(str(model_dir))
    inputs = model_inputs(str(model_dir), list(token_ids) + list(completion_ids), images)
    with torch.no_grad():
        return model(**inputs, output_hidden_states=True, use_cache=False)


def reference_hidden_states(model_dir, prompt_token_ids: Sequence[int], images: Sequence = (),
                            completion_ids: Sequence[int] = ()) -> np.ndarray:
    """transformers' `hidden_states` as float32 [L + 1, T, D]; [-1] is after the final norm."""
    out = reference_forward(model_dir, prompt_token_ids, images, completion_ids)
    return np.stack([h[0].float().numpy() for h in out.hidden_states])


def reference_logits(model_dir, prompt_token_ids: Sequence[int], images: Sequence = (),
                     completion_ids: Sequence[int] = ()) -> np.ndarray:
    """transformers' logits [T, V] (float32)."""
    out = reference_forward(model_dir, prompt_token_ids, images, completion_ids)
    return out.logits[0].float().numpy()


def prompt_ids(model_dir, messages: list[dict], images: Sequence) -> list[int]:
    """The prompt ids transformers' own processor makes for `messages` (chat template, image tokens
    expanded). vLLM's may differ in token boundaries (Gemma 3: its merged newline runs); prefer
    vLLM's `prompt_token_ids` when comparing with vLLM."""
    _, processor = load(str(model_dir))
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # the chat template writes the BOS itself
    out = processor(text=text, images=list(images) or None, add_special_tokens=False, return_tensors="np")
    return out["input_ids"][0].tolist()


def reference_greedy(model_dir, messages_or_prompt_ids, images: Sequence = (), max_new_tokens: int = 8) -> list[int]:
    """transformers' greedy `generate` token ids (stopping at EOS as vLLM does), from chat messages
    or from prompt ids."""
    import torch

    model, _ = load(str(model_dir))
    ids = messages_or_prompt_ids
    if ids and isinstance(ids[0], dict):
        ids = prompt_ids(model_dir, ids, images)
    inputs = model_inputs(str(model_dir), ids, images)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, top_k=None, top_p=None,
                             temperature=None, pad_token_id=model.config.get_text_config().eos_token_id)
    return out[0, len(ids):].tolist()


def reference_audio_hidden_states(model_dir, token_ids: Sequence[int], clips: Sequence[np.ndarray],
                                  rate: int = 16000) -> np.ndarray:
    """An audio LM's (Qwen2-Audio's) `hidden_states` as float32 [L + 1, T, D] for `token_ids` as given
    and each clip (float samples at `rate`) through the folder's feature extractor, padded to its 30 s
    as vLLM's processor pads it."""
    import torch
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    model = Qwen2AudioForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    extractor = AutoProcessor.from_pretrained(str(model_dir)).feature_extractor
    feats = extractor(list(clips), sampling_rate=rate, return_attention_mask=True, padding="max_length",
                      truncation=True, return_tensors="pt")
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids, input_features=feats["input_features"], feature_attention_mask=feats["attention_mask"],
                    attention_mask=torch.ones_like(ids), output_hidden_states=True, use_cache=False)
    return np.stack([h[0].float().numpy() for h in out.hidden_states])


def steered_forward(model_dir, token_ids: Sequence[int], images: Sequence, entries, prompt_len: int):
    """transformers' VLM forward over `token_ids` with the images, steered as tests/steer_ref.py steers a
    text model (forward pre-hooks on the text stack's decoder layers: + scale x vector on the rows of
    `positions`, entries (layer, "add", positions, scale, vector)): (hidden_states [L + 1, T, D] as our
    layers number them, logits [T, V]), float32. Rows are read by hooks of our own (each layer's input
    after the steering, the final norm's output)."""
    import torch

    from tests.steer_ref import _rows_of

    model, _ = load(str(model_dir))
    text = model.model.language_model
    layers, total, recorded, hooks = text.layers, len(token_ids), {}, []

    def pre(index: int):
        def hook(module, args, kwargs):
            hidden = (args[0] if args else kwargs["hidden_states"]).clone()
            for layer, op, positions, scale, vector in entries:
                assert op == "add"
                if layer == index:
                    rows = torch.as_tensor(_rows_of(positions, total, prompt_len))
                    hidden[0, rows] += scale * torch.as_tensor(np.array(vector, np.float32))
            recorded[index] = hidden[0].float().numpy().copy()
            return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
        return hook

    def post_norm(module, args, output):
        recorded[len(layers)] = output[0].float().numpy().copy()

    hooks = [layer.register_forward_pre_hook(pre(i), with_kwargs=True) for i, layer in enumerate(layers)]
    hooks.append(text.norm.register_forward_hook(post_norm))
    try:
        with torch.no_grad():
            out = model(**model_inputs(str(model_dir), token_ids, images), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return np.stack([recorded[i] for i in range(len(layers) + 1)]), out.logits[0].float().numpy()
