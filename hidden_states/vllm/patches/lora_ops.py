"""Ledger point 11, CPU only, LoRA engines: rows without an adapter get no LoRA delta (worker).

Why: vLLM's torch LoRA ops (the CPU path) index `weights[-1]` for rows with adapter index -1 (base-model
requests), so a base-model request batched with an adapter's got the last adapter applied.
How: `vllm.lora.ops.torch_ops.lora_ops.bgmv_shrink`, `bgmv_expand`, `bgmv_expand_slice` (and the names
`vllm.lora.ops.torch_ops` and `punica_cpu` imported) replaced in the worker (`lora`, the CPU start-up step
`hidden_states_fix_cpu_lora`) by wrappers giving rows with index -1 zero input, as the Triton kernels skip them.
Relies on: the ops' `(inputs, lora_b_weights, output_tensor, lora_indices_tensor, ...)` signatures and the
names imported by `punica_cpu`.
Upstream: open PRs #48421, #49656.
Remove when: vLLM's torch LoRA ops skip -1.
"""

from __future__ import annotations

from typing import Any

from hidden_states.vllm import _require
from hidden_states.vllm.patches.drift import _LORA_OPS, _LORA_PARAMS, _VCFG, Symbol


def lora(**_: Any) -> bool:
    patch_cpu_lora_ops()
    return True


def patch_cpu_lora_ops() -> None:
    """Ledger point 11: rows with index -1 get zero input, so a zero LoRA delta, as the Triton kernels
    skip them. Idempotent."""
    import vllm.lora.ops.torch_ops as package
    import vllm.lora.ops.torch_ops.lora_ops as ops
    from vllm.lora.punica_wrapper import punica_cpu

    _require(all(hasattr(ops, name) for name in _LORA_OPS), "vllm.lora.ops.torch_ops.lora_ops.bgmv_*")
    if getattr(ops, "_hidden_states_no_lora_rows", False):
        return
    for name in _LORA_OPS:
        fixed = _skipping_no_lora_rows(getattr(ops, name))
        for module in (ops, package, punica_cpu):  # sgmv_* call ops' bgmv_*; punica_cpu imported its own names
            if hasattr(module, name):
                setattr(module, name, fixed)
    ops._hidden_states_no_lora_rows = True


def _skipping_no_lora_rows(op):
    def op_skipping_no_lora_rows(inputs, weights, output, indices, *args, **kwargs):
        skip = indices < 0
        if skip.shape[:1] == inputs.shape[:1] and bool(skip.any()):
            inputs = inputs.masked_fill(skip.unsqueeze(-1), 0)
            indices = indices.clamp_min(0)
        return op(inputs, weights, output, indices, *args, **kwargs)

    return op_skipping_no_lora_rows


RELIED: tuple[Symbol, ...] = (
    Symbol("vllm.lora.ops.torch_ops", "11", kind="module"),
    *(Symbol(f"vllm.lora.ops.torch_ops.lora_ops:{op}", "11", _LORA_PARAMS, "replaced") for op in _LORA_OPS),
    *(Symbol(f"vllm.lora.ops.torch_ops:{op}", "11", _LORA_PARAMS, "replaced") for op in _LORA_OPS),
    *(Symbol(f"vllm.lora.punica_wrapper.punica_cpu:{op}", "11", _LORA_PARAMS, "replaced") for op in _LORA_OPS),
    Symbol(f"{_VCFG}.lora_config", "11", kind="field"),
)
