"""Models the project builds itself, because model hubs are unreachable here.

Deterministic random-weight decoders (the same bytes on every machine for a spec) with a
byte-level BPE tokenizer and chat template, for tests and benchmarks; built once into a cache
folder. Progress goes to stderr (stdout carries the paths). Also `smollm2-135m-instruct`
(hidden_states/models/smollm2.py).

    python -m hidden_states.models.builtin [NAME ...]   # default: the server's default model
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from hidden_states.models.common import folder_mb, say, train_tokenizer

BUILTIN_PREFIX = "builtin:"
DEFAULT_MODEL = "builtin:smollm2-135m-instruct"  # the server's default: a real chat model


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    family: str  # a key of FAMILIES
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int = 1024
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    config: tuple[tuple[str, object], ...] = ()  # more config arguments, e.g. (("sliding_window", 16),)


# head_dim must be 64 or more: vLLM's CPU attention rejects head_dim 16.
_NO_PAD = (("pad_token_id", None),)  # Gemma's and Phi3's default pad ids are bos or out of the vocabulary
SPECS = {
    "tiny-llama": ModelSpec("llama", 128, 256, 2, 2, 1),
    # Four layers: pipeline parallelism 3 splits them unevenly, 1 + 2 + 1 (tests/engine/test_pipeline_stages.py).
    "tiny-llama-4l": ModelSpec("llama", 128, 256, 4, 2, 1),
    "tiny-qwen2": ModelSpec("qwen2", 128, 256, 2, 2, 1, tie_word_embeddings=True),
    "llama-100m": ModelSpec("llama", 768, 2048, 12, 12, 4, vocab_size=4096),
    # More decoder families, for the intermediate-layer tests (tests/engine/test_layers.py).
    # Gemma2: (1 + w) RMSNorms, sqrt(hidden)-scaled embeddings, attention softcapping and a
    # 16-token sliding window on layer 0 (shorter than the test prompts, so it matters).
    "tiny-gemma2": ModelSpec(
        "gemma2",
        128,
        256,
        2,
        2,
        1,
        tie_word_embeddings=True,
        config=_NO_PAD + (("head_dim", 64), ("query_pre_attn_scalar", 64), ("sliding_window", 16)),
    ),
    # Gemma3 (text): as Gemma2 plus q/k norms; layer 0 sliding (16 tokens), layer 1 global.
    "tiny-gemma3": ModelSpec(
        "gemma3_text",
        128,
        256,
        2,
        2,
        1,
        tie_word_embeddings=True,
        config=_NO_PAD
        + (
            ("head_dim", 64),
            ("query_pre_attn_scalar", 64),
            ("sliding_window", 16),
            ("layer_types", ("sliding_attention", "full_attention")),
        ),
    ),
    "tiny-qwen3": ModelSpec("qwen3", 128, 256, 2, 2, 1, config=(("head_dim", 64),)),  # q/k norms
    "tiny-gemma": ModelSpec("gemma", 128, 256, 2, 2, 1, tie_word_embeddings=True, config=_NO_PAD + (("head_dim", 64),)),
    "tiny-phi3": ModelSpec("phi3", 128, 256, 2, 2, 1, config=_NO_PAD),  # fused qkv / gate_up weights
}
_VERSION = "v1"  # bump when a spec or the builder changes: a new cache folder (a new spec has its own)

# Real models, built by their own modules: name -> cache folder name (bump it when the build changes).
SMOLLM2 = "smollm2-135m-instruct"
REAL_MODELS = {SMOLLM2: "smollm2-135m-instruct-q4_1-f32"}


def multimodal_models() -> dict:
    """Tiny random-weight multimodal models, name -> its writer (a function filling a folder): the
    VLMs (hidden_states/models/vlm.py) and the audio LM (hidden_states/models/audio.py)."""
    from hidden_states.models import audio, vlm

    return {**vlm.VLM_MODELS, **audio.AUDIO_MODELS}


_MULTIMODAL_VERSION = "v1"  # bump when a multimodal writer changes: new cache folders


def builtin_names() -> list[str]:
    return sorted(SPECS) + sorted(REAL_MODELS) + sorted(multimodal_models())


def cache_root() -> Path:
    root = os.environ.get("HIDDEN_STATES_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hidden-states"
    )
    return Path(root) / "models"


def resolve_model(model: str) -> str:
    """Turns `builtin:NAME` into a local folder (building it once); other values pass through."""
    if model.startswith(BUILTIN_PREFIX):
        return str(build(model[len(BUILTIN_PREFIX) :]))
    return model


def build(name: str = "tiny-llama") -> Path:
    if name == SMOLLM2:
        from hidden_states.models import smollm2

        return smollm2.build(cache_root() / REAL_MODELS[SMOLLM2])
    if name in (multimodal := multimodal_models()):

        def write_multimodal(folder: Path) -> str:
            multimodal[name](folder)
            return json.dumps({"name": name, "version": _MULTIMODAL_VERSION})

        return build_once(
            cache_root() / f"{name}-{_MULTIMODAL_VERSION}",
            f"builtin:{name} (random weights, the family's processor)",
            write_multimodal,
        )
    if name not in SPECS:
        raise ValueError(f"unknown built-in model {name!r}; choose one of {builtin_names()}")
    spec = SPECS[name]

    def write(folder: Path) -> str:
        tokenizer = train_tokenizer(spec.vocab_size)
        tokenizer.save_pretrained(folder)
        _build_weights(spec, len(tokenizer), tokenizer).save_pretrained(folder, safe_serialization=True)
        return json.dumps(dataclasses.asdict(spec))

    return build_once(
        cache_root() / f"{name}-{_VERSION}",
        f"builtin:{name} (random weights, a tokenizer trained on the corpus)",
        write,
    )


def build_once(out: Path, what: str, write) -> Path:
    """`out`, built once: `write(folder)` fills a fresh folder and returns its DONE record, and the
    folder becomes `out` (a later call finds it; so does a process that lost a race to build it)."""
    if (out / "DONE").exists():
        return out
    say(f"building {what} into {out}")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "DONE").write_text(write(tmp))
    try:
        tmp.rename(out)
    except OSError:  # another process built it first
        if not (out / "DONE").exists():
            raise
    say(f"done: {out} ({folder_mb(out)} MB)")
    return out


# ModelSpec.family -> transformers class prefix ({prefix}Config, {prefix}ForCausalLM).
FAMILIES = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma": "Gemma",
    "gemma2": "Gemma2",
    "gemma3_text": "Gemma3",
    "phi3": "Phi3",
}


def _build_weights(spec: ModelSpec, vocab: int, tokenizer):
    import torch
    import transformers

    common = dict(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        vocab_size=vocab,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    prefix = FAMILIES[spec.family]
    extra = {k: list(v) if isinstance(v, tuple) else v for k, v in spec.config}
    config_cls = getattr(transformers, prefix + ("TextConfig" if spec.family == "gemma3_text" else "Config"))
    config, cls = config_cls(**common, **extra), getattr(transformers, prefix + "ForCausalLM")
    torch.manual_seed(0)
    model = cls(config)
    # Default init leaves biases and norms at 0/1; make them random so tests see them.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
    return model


if __name__ == "__main__":
    for name in sys.argv[1:] or [DEFAULT_MODEL[len(BUILTIN_PREFIX) :]]:
        print(build(name))
