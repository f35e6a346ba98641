"""Built-in vision-language models: tiny random-weight VLMs of two families that vLLM serves with images.

As hidden_states/models/builtin.py (deterministic random weights, the project's byte-level BPE
tokenizer, built once into a cache folder with a DONE file), plus the family's image tokens and
its processor saved in the folder, so vLLM and transformers (AutoProcessor) read the same one.

- `tiny-gemma3-vlm`: Gemma3ForConditionalGeneration; a 64 px SigLIP tower (16 patches, pooled to
  4 image tokens) and a 2-layer Gemma 3 text model (hidden 128, head_dim 64).
- `tiny-llava`: LlavaForConditionalGeneration; a 32 px CLIP tower (4 patches + CLS, the CLS dropped:
  4 image tokens) and a 2-layer Llama text model (hidden 128, head_dim 64).

What vLLM 0.32 needs that transformers 5.19 does not write by itself:
- Gemma 3: the newline runs "\\n" .. "\\n\\n\\n\\n" as added tokens (vLLM's Gemma 3 processor merges
  the newlines around an image into single tokens, as Gemma's vocabulary has them), and the
  vision tower's weights as `vision_tower.vision_model.*` (transformers saves `vision_tower.*`;
  vLLM loads the hub checkpoints' layout). transformers loads both layouts.
- LLaVA: the same `vision_tower.vision_model.*` layout (vLLM's CLIPVisionModel), and a processor
  whose image token count (patch_size, num_additional_image_tokens,
  vision_feature_select_strategy) matches the model's.

Both chat templates take a string content or OpenAI-style content lists (text parts and
{"type": "image"} parts: vLLM's chat renderer turns image_url parts into the latter).

    python -m hidden_states.models.builtin tiny-gemma3-vlm tiny-llava
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hidden_states.models.common import say, train_tokenizer

VOCAB = 1024  # the trained BPE's size, before the image and newline tokens


def _chat_template(image_text: str) -> str:
    """common.CHAT_TEMPLATE, with content lists: text parts as they are, image parts as `image_text`."""
    return (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
        "{% if p['type'] == 'image' %}" + image_text + "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
        "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )


def _tokenizer(specials: dict[str, str], newlines: bool = False):
    """The project's trained tokenizer plus `specials` (attribute name -> token) as special tokens."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tok = train_tokenizer(VOCAB)
    tok.add_special_tokens({"additional_special_tokens": list(specials.values())})
    if newlines:
        tok.add_tokens([AddedToken("\n" * k, normalized=False, special=False) for k in (1, 2, 3, 4)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok.backend_tokenizer,
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        pad_token=tok.pad_token,
        model_max_length=4096,
        extra_special_tokens=specials,
    )


def _randomize(model) -> None:
    """Default init leaves biases and norms at 0/1 (and Gemma 3's projector at 0): make them random."""
    import torch

    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
            elif not p.any():
                p.normal_(0.0, 0.02 if p.dim() > 1 else 0.1)


def _vision_model_layout(folder: Path) -> None:
    """`vision_tower.X` -> `vision_tower.vision_model.X` in the saved weights: transformers 5.19 saves
    the tower's weights without the `vision_model.` level, vLLM 0.32 (its SiglipVisionModel and
    CLIPVisionModel) loads them with it (the hub checkpoints' layout); transformers loads both."""

    def rename(k: str) -> str:
        for old in ("model.vision_tower.", "vision_tower."):
            if k.startswith(old):
                return k if k.startswith(old + "vision_model.") else old + "vision_model." + k[len(old) :]
        return k

    say(f"renamed {rename_weights(folder, rename)} vision tower weights to vision_tower.vision_model.*")


def rename_weights(folder: Path, rename) -> int:
    """The folder's model.safetensors with each key `k` saved as `rename(k)`; how many changed."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    weights = load_file(path)
    save_file({rename(k): v for k, v in weights.items()}, path, metadata={"format": "pt"})
    return sum(k != rename(k) for k in weights)


def write_gemma3(out: Path) -> None:
    import torch
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    specials = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tok = _tokenizer(specials, newlines=True)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in specials.items()}
    text = Gemma3TextConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        vocab_size=len(tok),
        max_position_embeddings=4096,
        pad_token_id=None,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    vision = SiglipVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1, image_size=64, patch_size=16
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        torch_dtype="float32",
        tie_word_embeddings=True,
    )
    config.text_config.bos_token_id, config.text_config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    _randomize(model)
    chat = _chat_template("<start_of_image>")
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": 64, "width": 64}),
        tokenizer=tok,
        chat_template=chat,
        image_seq_length=4,
    )
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    tok.chat_template = chat
    tok.save_pretrained(out)
    _vision_model_layout(out)


def write_llava(out: Path) -> None:
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    image_token = "<image>"
    tok = _tokenizer({"image_token": image_token})
    image_id = tok.convert_tokens_to_ids(image_token)
    text = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=len(tok),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=None,
    )
    # 32 px, 16 px patches: 4 patches + CLS; the "default" strategy drops the CLS: 4 image tokens.
    # The single layer's output is the feature layer (-1; the usual -2 would be the embeddings).
    vision = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=1,
        image_size=32,
        patch_size=16,
        projection_dim=64,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_id,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=4,
        multimodal_projector_bias=True,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    _randomize(model)
    chat = _chat_template(image_token)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=chat,
        patch_size=16,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token=image_token,
    )
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    tok.chat_template = chat
    tok.save_pretrained(out)
    _vision_model_layout(out)


# Qwen2-VL's and Qwen2.5-VL's own chat template (their hub tokenizer_config.json), whitespace as there.
QWEN_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_qwen2_5_vl(out: Path) -> None:
    """Qwen2_5_VLForConditionalGeneration: a 2-block vision tower (14 px patches, 2x2 merged: a 56 px
    image is 4 tokens; window attention in block 0, full in block 1) and a 2-layer Qwen2 text model
    (hidden 128, head_dim 64) with M-RoPE (3-D positions: time, height, width; mrope_section 16/8/8);
    the family's processor (Qwen2VLImageProcessor, Qwen2_5_VLProcessor) and chat template."""
    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    specials = {
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
    }
    tok = _tokenizer({**specials, "im_start": "<|im_start|>", "im_end": "<|im_end|>"})
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in specials.items()}
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    text = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": len(tok),
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 8, 8]},
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": None,
        "tie_word_embeddings": False,
    }
    vision = {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [1],
        "out_hidden_size": 128,
        "tokens_per_second": 2,
    }
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["image_token"],
        video_token_id=ids["video_token"],
        vision_start_token_id=ids["vision_start_token"],
        vision_end_token_id=ids["vision_end_token"],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    _randomize(model)
    pixels = {"min_pixels": 56 * 56, "max_pixels": 112 * 112}
    image_processor = Qwen2VLImageProcessor(
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": pixels["min_pixels"], "longest_edge": pixels["max_pixels"]},
        **pixels,
    )
    video_processor = Qwen2VLVideoProcessor(
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": pixels["min_pixels"], "longest_edge": 4 * pixels["max_pixels"]},
    )
    tok.eos_token = "<|im_end|>"
    processor = Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        chat_template=QWEN_VL_CHAT_TEMPLATE,
    )
    model.generation_config.eos_token_id = eos
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    tok.chat_template = QWEN_VL_CHAT_TEMPLATE
    tok.save_pretrained(out)


# Qwen3-VL's chat template (the hub's, without its tool-call and reasoning parts): no default
# system prompt; image and video parts as the family's vision tokens.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content['type'] == 'video' or 'video' in content %}{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{- content['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def write_qwen3_vl(out: Path) -> None:
    """Qwen3VLForConditionalGeneration: a 2-block vision tower (16 px patches, 2x2 merged: a 64 px
    image is 4 tokens; learned position embeddings) whose blocks 0 and 1 also feed DeepStack, and a
    3-layer Qwen3 text model (hidden 128, head_dim 64, q/k norms) with interleaved M-RoPE
    (mrope_section 12/10/10: the family's 24/20/20 for head_dim 128, halved). DeepStack adds block 0's and
    block 1's merged features to the stream at the image's positions after text layers 0 and 1, so
    layers 1 and 2 are where a capture at the wrong site shows; layer 3 is not injected."""
    import torch
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    specials = {
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
    }
    tok = _tokenizer({**specials, "im_start": "<|im_start|>", "im_end": "<|im_end|>"})
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in specials.items()}
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    text = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "vocab_size": len(tok),
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [12, 10, 10],
            "mrope_interleaved": True,
        },
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": None,
    }
    vision = {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 128,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0, 1],
    }
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["image_token"],
        video_token_id=ids["video_token"],
        vision_start_token_id=ids["vision_start_token"],
        vision_end_token_id=ids["vision_end_token"],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).eval()
    _randomize(model)
    pixels = {"min_pixels": 64 * 64, "max_pixels": 128 * 128}
    image_processor = Qwen2VLImageProcessor(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": pixels["min_pixels"], "longest_edge": pixels["max_pixels"]},
        **pixels,
    )
    video_processor = Qwen3VLVideoProcessor(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": pixels["min_pixels"], "longest_edge": 4 * pixels["max_pixels"]},
    )
    tok.eos_token = "<|im_end|>"
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        chat_template=QWEN3_VL_CHAT_TEMPLATE,
    )
    model.generation_config.eos_token_id = eos
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    tok.chat_template = QWEN3_VL_CHAT_TEMPLATE
    tok.save_pretrained(out)


VLM_MODELS: dict[str, Callable[[Path], None]] = {
    "tiny-gemma3-vlm": write_gemma3,
    "tiny-llava": write_llava,
    "tiny-qwen2.5-vl": write_qwen2_5_vl,
    "tiny-qwen3-vl": write_qwen3_vl,
}
