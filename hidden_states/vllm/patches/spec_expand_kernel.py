"""Ledger point 13, CPU only, speculative decoding: the rejection sampler's expand kernel writes its output.

Why: the CPU stand-in for the rejection sampler's `expand_kernel` (`cpu_triton_utils._expand_kernel_impl`,
behind a `KernelOverride`) writes to a converted copy and never copies back, so the temperatures, top-k and
top-p of each draft position are wrong, and greedy rows in a mixed batch take wrong tokens.
How: each worker with a drafter (`spec_sampling`, the CPU start-up step `hidden_states_fix_cpu_spec_sampling`)
swaps the shared `KernelOverride`'s implementation for `expand_batch_to_tokens`, a torch one writing in place;
`fixed=False` puts vLLM's back (the tests show the bug with it).
Relies on: `vllm.v1.sample.rejection_sampler.expand_kernel` being a `KernelOverride` with `_impl`, `func`,
`arg_names`, `_forward_by_name`; `cpu_triton_utils._expand_kernel_impl`.
Upstream: the report text is in docs/how-it-works.md, "The ledger, in short".
Remove when: vLLM's CPU stand-in writes its output.
"""

from __future__ import annotations

from typing import Any

from hidden_states.vllm import _require
from hidden_states.vllm.patches.drift import Symbol


def spec_sampling(fixed: bool = True, **_: Any) -> bool:
    return fix_cpu_spec_sampling(fixed)


def expand_batch_to_tokens(output, input, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:
    """vLLM's `expand_kernel` (Triton) in torch: `output[cu[i-1]:cu[i]] = input[i]`, with
    `replace_from` read as `replace_to`, written in place at `output`'s own dtype."""
    import torch

    if cu_num_tokens.numel() == 0:
        return
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input == replace_from, torch.full_like(input, replace_to), input)
    n = int(cu_num_tokens[-1])
    output[:n].copy_(torch.repeat_interleave(values, counts, output_size=n))


def fix_cpu_spec_sampling(fixed: bool = True) -> bool:
    """Ledger point 13: swaps the shared `KernelOverride`'s implementation for `expand_batch_to_tokens`
    (`fixed=False`: vLLM's back); re-registering would rescan modules and fail in the worker.
    Returns whether the fix is in place (False where vLLM runs Triton itself)."""
    import inspect

    import vllm.v1.sample.rejection_sampler as rejection_sampler
    from vllm.triton_utils.dispatcher import KernelOverride
    from vllm.utils import cpu_triton_utils

    wrapper = getattr(rejection_sampler, "expand_kernel", None)
    if not isinstance(wrapper, KernelOverride):
        return False
    _require(
        hasattr(wrapper, "_impl") and hasattr(cpu_triton_utils, "_expand_kernel_impl"),
        "KernelOverride._impl / cpu_triton_utils._expand_kernel_impl",
    )
    impl = expand_batch_to_tokens if fixed else cpu_triton_utils._expand_kernel_impl
    wrapper._impl = wrapper.func = impl
    wrapper._forward_by_name = tuple(inspect.signature(impl).parameters) == wrapper.arg_names
    return fixed


RELIED: tuple[Symbol, ...] = (
    Symbol(
        "vllm.v1.sample.rejection_sampler:expand_kernel",
        "13",
        ("output_ptr", "input_ptr", "cu_num_tokens_ptr", "replace_from", "replace_to", "MAX_NUM_TOKENS"),
        "replaced",
        exact=True,
    ),
    Symbol("vllm.triton_utils.dispatcher:KernelOverride", "13", kind="class"),
    Symbol("vllm.triton_utils.dispatcher:KernelOverride._impl", "13", kind="init attr"),
    Symbol("vllm.triton_utils.dispatcher:KernelOverride.func", "13", kind="init attr"),
    Symbol("vllm.triton_utils.dispatcher:KernelOverride.arg_names", "13", kind="init attr"),
    Symbol("vllm.triton_utils.dispatcher:KernelOverride._forward_by_name", "13", kind="init attr"),
    Symbol(
        "vllm.utils.cpu_triton_utils:_expand_kernel_impl",
        "13",
        ("output", "input_val", "cu_num_tokens", "replace_from", "replace_to", "MAX_NUM_TOKENS"),
        "function",
        exact=True,
    ),
)
