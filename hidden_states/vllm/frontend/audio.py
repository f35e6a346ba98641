"""Audio at any sample rate (ledger point 17), in the process that turns requests into engine inputs.

vLLM decodes an audio part at its own rate (`load_audio(..., sr=None)`: soundfile reads WAV, FLAC,
MP3 and OGG) and its multimodal parser then resamples it to the model's rate (a Whisper-style
feature extractor's 16 kHz) with `AudioResampler`, whose method is torchaudio's unless the model
names another. The CPU set-up has no torchaudio (PyPI's build is CUDA's), so a clip at any other
rate failed inside the engine. Here every `AudioResampler` built with vLLM's default method resamples
with soxr instead (vLLM's own `resample_audio_soxr`: libsoxr's high-quality band-limited resampler),
on every machine, GPU ones included, so a clip is resampled the same way wherever it is served and
the reference (soxr on the same decoded samples, then transformers) is one function. A model whose
processor names its own method (Phi-4-MM: scipy) keeps it.
"""

from __future__ import annotations

METHOD = "soxr"


def patch_audio_resampler() -> None:
    """Once per process: vLLM's default resampling method becomes soxr's."""
    from vllm.multimodal import audio

    if getattr(audio.AudioResampler.__init__, "_hidden_states", False):
        return
    init = audio.AudioResampler.__init__

    def __init__(self, target_sr=None, method="torchaudio"):
        init(self, target_sr=target_sr, method=METHOD if method == "torchaudio" else method)

    __init__._hidden_states = True
    audio.AudioResampler.__init__ = __init__
