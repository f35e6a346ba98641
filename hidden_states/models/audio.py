"""Built-in audio-language model: a tiny random-weight Qwen2-Audio that vLLM serves with audio.

As hidden_states/models/vlm.py (deterministic random weights, the project's byte-level BPE
tokenizer plus the family's special tokens, the processor saved in the folder so vLLM and
transformers (AutoProcessor) read the same one).

- `tiny-qwen2-audio`: Qwen2AudioForConditionalGeneration; a 1-layer Whisper-style audio encoder
  (d_model 64, 1 head of 64, 16 mel bins) and a 2-layer Qwen2 text model (hidden 128, head_dim 64).
  The encoder still takes 30 s of mel frames (3000, padded): vLLM 0.32's Qwen2-Audio input schema
  fixes that length, and transformers' encoder wants max_source_positions (1500) x 2 frames. A clip
  of n samples at 16 kHz gives ceil(n / 160) mel frames and ((frames - 1) // 2 + 1 - 2) // 2 + 1
  audio tokens (1 s: 100 frames, 25 tokens); the 30 s padding costs encoder time, not tokens.

What vLLM 0.32 needs beyond what transformers 5.19 writes:
- an audio decoder for `input_audio` / `audio_url` parts: the `soundfile` package (its wheel bundles
  libsndfile) or PyAV; vLLM's first choice, torchcodec, is CUDA-built on PyPI and set-up removes it.
- clips at the feature extractor's 16 kHz: any other rate is resampled with torchaudio (vLLM's
  default resampler for Qwen2-Audio), which set-up removes too.
- the weights in the hub checkpoints' layout (`audio_tower.*`, `multi_modal_projector.*`,
  `language_model.model.*`, `language_model.lm_head.*`): vLLM's Qwen2-Audio loader has no key
  mapper; transformers 5.19 saves the text model as `language_model.model.model.*`. transformers
  loads both.

The chat template takes a string content or OpenAI-style content lists (text parts and
{"type": "audio"} parts: vLLM's chat renderer turns input_audio / audio_url parts into the latter),
an audio part rendered as `<|audio_bos|><|AUDIO|><|audio_eos|>` (the processor expands <|AUDIO|>).

    python -m hidden_states.models.builtin tiny-qwen2-audio
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hidden_states.models.common import say
from hidden_states.models.vlm import _randomize, _tokenizer, rename_weights

_VERSION = "v1"  # bump when a builder changes: a new cache folder
AUDIO_TEXT = "<|audio_bos|><|AUDIO|><|audio_eos|>"
SAMPLING_RATE = 16000


def _chat_template(audio_text: str) -> str:
    """common.CHAT_TEMPLATE, with content lists: text parts as they are, audio parts as `audio_text`.

    The newline closing a message is `{{ '\\n' }}`, not a literal: chat templates render with
    trim_blocks, which drops a newline right after `{% endif %}` (as vlm.py's templates lose it)."""
    return (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
        "{% if p['type'] in ('audio', 'input_audio', 'audio_url') %}"
        + audio_text
        + "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
        "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )


def _hub_layout(folder: Path) -> None:
    """The saved keys -> the hub checkpoints' layout (vLLM 0.32's Qwen2-Audio loads only that).

    transformers 5.19 saves `audio_tower.*`, `multi_modal_projector.*` and `language_model.lm_head.*`
    as the hub does, but the text model as `language_model.model.model.*` (its two save-time renames,
    the class's `^language_model.model -> model.language_model` and Qwen2AudioModel's
    `^language_model.model -> language_model`, both reversed): -> `language_model.model.*`, which
    transformers loads as well. The in-memory names (`model.audio_tower.*`, ..., `lm_head.*`) are
    mapped too, should a later transformers save those."""

    def rename(k: str) -> str:
        for old, new in (
            ("language_model.model.model.", "language_model.model."),
            ("model.audio_tower.", "audio_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
            ("model.language_model.", "language_model.model."),
            ("lm_head.", "language_model.lm_head."),
        ):
            if k.startswith(old):
                return new + k[len(old) :]
        return k

    say(f"renamed {rename_weights(folder, rename)} weights to the hub layout")


def write_qwen2_audio(out: Path) -> None:
    import torch
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioEncoderConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        Qwen2Config,
        WhisperFeatureExtractor,
    )

    specials = {"audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
    tok = _tokenizer(specials)
    audio_id = tok.convert_tokens_to_ids(specials["audio_token"])
    text = Qwen2Config(
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
    mel_bins = 16
    # max_source_positions must stay 1500: the encoder checks for 2 x 1500 = 3000 mel frames
    # (WhisperFeatureExtractor's 30 s chunk at hop 160), and vLLM's input schema fixes 3000.
    audio = Qwen2AudioEncoderConfig(
        num_mel_bins=mel_bins,
        encoder_layers=1,
        encoder_attention_heads=1,
        encoder_ffn_dim=128,
        d_model=64,
        max_source_positions=1500,
    )
    config = Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_index=audio_id, torch_dtype="float32")
    torch.manual_seed(0)
    model = Qwen2AudioForConditionalGeneration(config).eval()
    _randomize(model)
    chat = _chat_template(AUDIO_TEXT)
    feature_extractor = WhisperFeatureExtractor(
        feature_size=mel_bins,
        sampling_rate=SAMPLING_RATE,
        hop_length=160,
        chunk_length=30,
        n_fft=400,
        return_attention_mask=True,
    )
    processor = Qwen2AudioProcessor(feature_extractor=feature_extractor, tokenizer=tok, chat_template=chat, **specials)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    tok.chat_template = chat
    tok.save_pretrained(out)
    _hub_layout(out)


AUDIO_MODELS: dict[str, Callable[[Path], None]] = {
    "tiny-qwen2-audio": write_qwen2_audio,
}
