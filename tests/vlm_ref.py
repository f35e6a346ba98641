"""The transformers reference for the built-in multimodal models (hidden_states/models/vlm.py, audio.py).

Independent of the server: only transformers, on the model folder, with the folder's own processor
(AutoProcessor) for the images. Token ids come from the caller (the prompt ids as vLLM produced
them, image placeholders expanded, plus any completion ids); the processor only makes the pixels.

transformers numbering of `hidden_states`: 0 = embeddings (image features already scattered in),
l = the output of decoder layer l - 1 (before Qwen3-VL's DeepStack additions), L = after the final norm.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np


@functools.lru_cache(maxsize=4)
def load(model_dir: str):
    """(model, processor): the folder's transformers class in float32, eval mode."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model, info = AutoModelForImageTextToText.from_pretrained(
        str(model_dir), dtype=torch.float32, output_loading_info=True
    )
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
TOKEN_TYPES = {
    "gemma3": "token_type_ids",
    "qwen2_vl": "mm_token_type_ids",
    "qwen2_5_vl": "mm_token_type_ids",
    "qwen3_vl": "mm_token_type_ids",
}


def reference_forward(model_dir, token_ids: Sequence[int], images: Sequence = (), completion_ids: Sequence[int] = ()):
    """transformers' output (logits, hidden_states) for the prompt plus completion ids, in one forward."""
    import torch

    model, _ = load(str(model_dir))
    inputs = model_inputs(str(model_dir), list(token_ids) + list(completion_ids), images)
    with torch.no_grad():
        return model(**inputs, output_hidden_states=True, use_cache=False)


def reference_hidden_states(
    model_dir, prompt_token_ids: Sequence[int], images: Sequence = (), completion_ids: Sequence[int] = ()
) -> np.ndarray:
    """transformers' `hidden_states` as float32 [L + 1, T, D]; [-1] is after the final norm."""
    out = reference_forward(model_dir, prompt_token_ids, images, completion_ids)
    return np.stack([h[0].float().numpy() for h in out.hidden_states])


def reference_logits(
    model_dir, prompt_token_ids: Sequence[int], images: Sequence = (), completion_ids: Sequence[int] = ()
) -> np.ndarray:
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
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            top_k=None,
            top_p=None,
            temperature=None,
            pad_token_id=model.config.get_text_config().eos_token_id,
        )
    return out[0, len(ids) :].tolist()


def video_frames(path) -> tuple[np.ndarray, dict]:
    """A video file's frames (RGB, uint8 [N, H, W, 3]) decoded with OpenCV, as vLLM's default video loader
    decodes them, and the file's metadata as transformers' video processors take it."""
    import cv2

    cap = cv2.VideoCapture(str(path))
    frames = []
    while True:
        ok, frame = cap.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    fps = float(cap.get(cv2.CAP_PROP_FPS))
    cap.release()
    return np.stack(frames), {"fps": fps, "total_num_frames": len(frames), "frames_indices": list(range(len(frames)))}


def qwen_vl_positions(
    token_types: Sequence[int], grids: Sequence[Sequence[int]], intervals: Sequence[float], merge: int
) -> np.ndarray:
    """Qwen2.5-VL's 3-D rotary positions [3, T] as its authors define them (transformers PR #35569, the
    `get_rope_index` docstring of the release): text counts up by 1; a vision item's tokens take
    (t x interval, h, w) over its merged grid, offset by the position where it starts; the text after
    it starts at the largest of those positions + 1. `token_types`: 0 text, 1 image, 2 video, one
    run per item; `intervals`: per item, tokens_per_second x seconds per temporal grid (1 for images).

    transformers 5.19's own `get_rope_index` starts the text after a video at start + max(h, w) / merge
    instead, which differs from the release once the video's temporal positions outrun its spatial
    ones; vLLM 0.32 keeps the release's rule."""
    out, nxt, item, i = [], 0, 0, 0
    while i < len(token_types):
        j = i
        while j < len(token_types) and token_types[j] == token_types[i]:
            j += 1
        if token_types[i] == 0:
            out += [[nxt + k] * 3 for k in range(j - i)]
            nxt += j - i
        else:
            t, h, w = grids[item]
            interval = intervals[item]
            item += 1
            vision = [
                [nxt + int(a * interval), nxt + b, nxt + c]
                for a in range(t)
                for b in range(h // merge)
                for c in range(w // merge)
            ]
            assert len(vision) == j - i, (len(vision), j - i)
            out += vision
            nxt = max(max(p) for p in vision) + 1
        i = j
    return np.array(out, dtype=np.int64).T


def reference_video_hidden_states(model_dir, token_ids: Sequence[int], video_path) -> np.ndarray:
    """Qwen2.5-VL's `hidden_states` as float32 [L + 1, T, D] for `token_ids` (one video's placeholders
    expanded) and the video file: its frames and metadata through the folder's video processor, the
    seconds per temporal grid as the family's processor computes them (temporal patch size / sampled
    fps), the processor's token types, and the positions of `qwen_vl_positions`."""
    import torch

    model, processor = load(str(model_dir))
    frames, meta = video_frames(video_path)
    video = processor.video_processor(videos=[frames], return_tensors="pt")
    seconds = processor.video_processor.temporal_patch_size / (
        len(meta["frames_indices"]) / meta["total_num_frames"] * meta["fps"]
    )
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    types = processor.create_mm_token_type_ids(ids.tolist())
    positions = qwen_vl_positions(
        types[0],
        video["video_grid_thw"].tolist(),
        [model.config.vision_config.tokens_per_second * seconds],
        model.config.vision_config.spatial_merge_size,
    )
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        **video,
        "second_per_grid_ts": torch.tensor([seconds]),
        "mm_token_type_ids": torch.tensor(types),
        "position_ids": torch.from_numpy(positions)[:, None, :],
    }
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True, use_cache=False)
    return np.stack([h[0].float().numpy() for h in out.hidden_states])


def reference_audio_hidden_states(
    model_dir, token_ids: Sequence[int], clips: Sequence[np.ndarray], rate: int = 16000
) -> np.ndarray:
    """An audio LM's (Qwen2-Audio's) `hidden_states` as float32 [L + 1, T, D] for `token_ids` as given
    and each clip (float samples at `rate`) through the folder's feature extractor, padded to its 30 s
    as vLLM's processor pads it."""
    import torch
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    model = Qwen2AudioForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    extractor = AutoProcessor.from_pretrained(str(model_dir)).feature_extractor
    feats = extractor(
        list(clips),
        sampling_rate=rate,
        return_attention_mask=True,
        padding="max_length",
        truncation=True,
        return_tensors="pt",
    )
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    with torch.no_grad():
        out = model(
            input_ids=ids,
            input_features=feats["input_features"],
            feature_attention_mask=feats["attention_mask"],
            attention_mask=torch.ones_like(ids),
            output_hidden_states=True,
            use_cache=False,
        )
    return np.stack([h[0].float().numpy() for h in out.hidden_states])


def steered_forward(model_dir, token_ids: Sequence[int], images: Sequence, entries, prompt_len: int):
    """transformers' VLM forward over `token_ids` with the images, steered as tests/steer_ref.py steers a
    text model (at transformers' site for layer L: the output of decoder layer L - 1, before DeepStack's
    additions; entries (layer, op, positions, scale, vector)): (hidden_states [L + 1, T, D], logits [T, V]),
    float32; rows read at the same sites after the steering (unsteered: transformers' own, checked)."""
    import torch

    from tests.steer_ref import check_sites, hook_layers

    model, _ = load(str(model_dir))
    text = model.model.language_model
    recorded: dict = {}
    hooks = hook_layers(text.layers, text.norm, entries, len(token_ids), prompt_len, recorded)
    try:
        with torch.no_grad():
            out = model(
                **model_inputs(str(model_dir), token_ids, images), use_cache=False, output_hidden_states=not entries
            )
    finally:
        for h in hooks:
            h.remove()
    if not entries:
        check_sites(recorded, out.hidden_states)
    return np.stack([recorded[i] for i in range(len(text.layers) + 1)]), out.logits[0].float().numpy()
