"""Which kernel runs an extend's attention (one request's new tokens over its prefix and themselves): SDPA
(attention/sdpa.py) or this project's flash kernel (kernels/csrc/extend_attention_avx512.cpp) on AVX512-BF16
or on AMX tiles, as the kernel plan chose (executor/kernel_choice.py). Shared by the MHA and MLA backends; the
MHA backend runs a step's requests in one call of the kernel's batched form."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

EXTEND_IMPLS = ("sdpa", "avx512_bf16", "amx_bf16")
# The C++ kernel's `impl` argument for each of its paths.
EXTEND_KERNEL_IMPL = {"avx512_bf16": 1, "amx_bf16": 2}


def _kernel_impl(extend_impl: str, cpu_ops: object | None) -> int | None:
    """The C++ kernel's ``impl`` for the path ``extend_impl`` names, None for SDPA."""
    if extend_impl not in EXTEND_IMPLS:
        raise ValueError(f"extend_impl must be one of {', '.join(EXTEND_IMPLS)}, got {extend_impl!r}")
    if extend_impl == "sdpa":
        return None
    if cpu_ops is None:
        raise ValueError(f"extend_impl {extend_impl!r} needs the CPU kernels (layers.cpu_ext.load())")
    return EXTEND_KERNEL_IMPL[extend_impl]


def extend_kernel(extend_impl: str, cpu_ops: object | None) -> Callable[..., Any] | None:
    """The C++ extend attention (``torch.ops.llmserve_cpu.extend_attention``) bound to the path
    ``extend_impl`` names, None for SDPA."""
    impl = _kernel_impl(extend_impl, cpu_ops)
    return None if impl is None else functools.partial(cpu_ops.extend_attention, impl=impl)  # type: ignore[union-attr]


def extend_batch_kernel(extend_impl: str, cpu_ops: object | None) -> Callable[..., Any] | None:
    """The C++ extend attention over a step's requests in one call
    (``torch.ops.llmserve_cpu.extend_attention_batch``) bound to the path ``extend_impl`` names, None for SDPA."""
    impl = _kernel_impl(extend_impl, cpu_ops)
    return None if impl is None else functools.partial(cpu_ops.extend_attention_batch, impl=impl)  # type: ignore[union-attr]
