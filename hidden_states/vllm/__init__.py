"""Everything that touches vLLM lives in this package; nothing else imports vllm.

- `engine.py`       HiddenStatesEngine: the vLLM implementation of hidden_states/interface.py;
- `engine_args.py`  every vLLM engine argument: exercised, refused at start, or irrelevant;
- `cpu.py`          CPU engines' start-up steps (KV-cache pre-fault, warm-up, the CPU fixes' installation);
- `patches/`        the vLLM seam: every patched or relied-on point of vLLM (and Ray's private internals), one
                    registry (`patches.POINTS`, `patches.install(process, stage)`), one module per patch, and
                    the drift check (`python -m hidden_states.vllm.patches --check`);
- `frontend/`       the AsyncLLM's process: `extraction.py`, `openai.py`;
- `core/`           the engine-core process: `scheduler.py` (and, tests only, `fault_injection.py`);
- `worker/`         the worker processes: `extension.py`, `capture.py`, `layers.py`, `steering.py`, `traced.py`
                    (and, tests only, `fault_injection.py`).

The three processes import none of each other; what crosses between them is hidden_states/protocol.py.

The ledger of vLLM points (supported: vLLM {SUPPORTED}) is the registry in `patches/__init__.py`: each point's
number, kind (a patch, or not), process and module; a patch's module says why, how, what it relies on, the
upstream report and when it can go; the others are in `patches/unpatched.py`.
"""

from __future__ import annotations

SUPPORTED_VLLM = ("0.32.",)
__doc__ = __doc__.replace("{SUPPORTED}", ", ".join(v + "x" for v in SUPPORTED_VLLM))
# The architectures whose intermediate layers (rows, heads, steering, stop and `when` conditions at
# layers 0..n-1) are served: each name -> the built-in model whose test checks every layer of it
# against transformers' own class (the tests read this table, so a family added here is tested:
# text stacks in tests/engine/test_layers.py, multimodal ones in tests/engine/test_multimodal.py,
# MiMo in tests/engine/test_spec_decode.py). Any other architecture serves the last layer (-1) only,
# and a request for more gets a 400 naming these families. The structural check
# (worker/layers.layer_capture_support) can only refuse one of them, never admit another.
VERIFIED_LAYER_ARCHS = {
    "LlamaForCausalLM": "tiny-llama",
    "Qwen2ForCausalLM": "tiny-qwen2",
    "Qwen3ForCausalLM": "tiny-qwen3",
    "Gemma2ForCausalLM": "tiny-gemma2",
    "Gemma3ForCausalLM": "tiny-gemma3",
    "GemmaForCausalLM": "tiny-gemma",  # make test-long
    "Phi3ForCausalLM": "tiny-phi3",  # make test-long
    "MiMoForCausalLM": "mimo (tests/engine/draft_heads.py, on tiny-qwen2)",
    # vision-language models' text stacks
    "Gemma3ForConditionalGeneration": "tiny-gemma3-vlm",
    "LlavaForConditionalGeneration": "tiny-llava",
    "Qwen2_5_VLForConditionalGeneration": "tiny-qwen2.5-vl",
    "Qwen3VLForConditionalGeneration": "tiny-qwen3-vl",  # DeepStack: rows before its additions
}
LONG_TESTED = ("GemmaForCausalLM", "Phi3ForCausalLM")  # verified by `make test-long` only


def verified_families() -> str:
    """The verified architectures, short: "Llama, Qwen2, ..., Qwen3VL"."""
    return ", ".join(
        a.removesuffix("ForCausalLM").removesuffix("ForConditionalGeneration") for a in VERIFIED_LAYER_ARCHS
    )


def unverified_reason(arch: str) -> str:
    return (
        f"intermediate layers of {arch} are not verified against transformers; they are served on {verified_families()}"
    )


WORKER_EXTENSION = "hidden_states.vllm.worker.extension.HiddenStatesWorkerExtension"
ENGINE_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}


class VLLMIncompatibleError(RuntimeError):
    pass


def _require(cond: bool, what: str) -> None:
    if not cond:
        import vllm

        raise VLLMIncompatibleError(
            f"hidden-states hook: {what} is missing in vLLM {vllm.__version__}; "
            f"this project supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)} "
            "(see the ledger in hidden_states/vllm/patches/)"
        )


def check_vllm_version(*, drift: bool = False) -> None:
    """Refuses a vLLM outside the tested range. With `drift` (an engine's start), also runs the drift check
    (hidden_states/vllm/patches/drift.py; its result cached per installed vLLM, Ray and tables): a drifted symbol
    refuses the start, naming it, and a refused version says what the check found."""
    import vllm

    found = []
    if drift:
        from hidden_states.vllm.patches.drift import cached_check

        found = cached_check()
    tested = ", ".join(v + "x" for v in SUPPORTED_VLLM)
    shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        what = (
            f"; the drift check found {len(found)} drifted symbol(s): {shown}"
            if found
            else "; the drift check found none drifted"
            if drift
            else ""
        )
        raise VLLMIncompatibleError(
            f"vLLM {vllm.__version__} is not supported; install one of {tested} (scripts/setup.sh does){what}"
        )
    if found:
        raise VLLMIncompatibleError(
            f"vLLM {vllm.__version__}: {len(found)} symbol(s) this project relies on drifted "
            f"(python -m hidden_states.vllm.patches --check lists them): {shown}"
        )
