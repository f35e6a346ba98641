"""Ledger point 17: audio at any sample rate (frontend process, where requests become engine inputs).

Why: vLLM decodes an audio part at its own rate (`load_audio(..., sr=None)`: soundfile reads WAV, FLAC, MP3
and OGG) and its multimodal parser then resamples it to the model's rate (a Whisper-style feature extractor's
16 kHz) with `AudioResampler`, whose method is torchaudio's unless the model names another. The CPU set-up has
no torchaudio (PyPI's build is CUDA's), so a clip at any other rate failed inside the engine.
How: `vllm.multimodal.audio.AudioResampler.__init__` is wrapped at class level, once per process
(`start`, from `HiddenStatesEngine.start`): every `AudioResampler` built with vLLM's default method resamples
with soxr instead (vLLM's own `resample_audio_soxr`: libsoxr's high-quality band-limited resampler), on every
machine, GPU ones included, so a clip is resampled the same way wherever it is served and the reference (soxr
on the same decoded samples, then transformers) is one function. A model whose processor names its own method
(Phi-4-MM: scipy) keeps it.
Relies on: `AudioResampler.__init__(target_sr=None, method="torchaudio")` and its "soxr" method.
Remove when: vLLM's default resampler needs no optional package, or keep for one resampler on every machine.
"""

from __future__ import annotations

from typing import Any

from hidden_states.vllm.patches.drift import Symbol

METHOD = "soxr"


def start(**_: Any) -> None:
    """Once per process: vLLM's default resampling method becomes soxr's."""
    from vllm.multimodal import audio

    if getattr(audio.AudioResampler.__init__, "_hidden_states", False):
        return
    init = audio.AudioResampler.__init__

    def __init__(self, target_sr=None, method="torchaudio"):
        init(self, target_sr=target_sr, method=METHOD if method == "torchaudio" else method)

    __init__._hidden_states = True
    audio.AudioResampler.__init__ = __init__


RELIED: tuple[Symbol, ...] = (
    Symbol(
        "vllm.multimodal.audio:AudioResampler.__init__",
        "17",
        ("target_sr", "method='torchaudio'"),
        "wrapped",
        exact=True,
    ),
    Symbol("vllm.multimodal.audio:AudioResampler.resample", "17", kind="method", mentions=("resample_audio_soxr(",)),
    Symbol("vllm.multimodal.audio:resample_audio_soxr", "17", ("audio", "*", "orig_sr", "target_sr"), "function"),
)
