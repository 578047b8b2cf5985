"""Which kernel runs an extend's attention (one request's new tokens over its prefix and themselves): SDPA
(attention/sdpa.py) or this project's AVX512-BF16 flash kernel (kernels/csrc/extend_attention_avx512.cpp),
as the kernel plan chose (executor/kernel_choice.py). Shared by the MHA and MLA backends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

EXTEND_IMPLS = ("sdpa", "avx512_bf16")


def extend_kernel(extend_impl: str, cpu_ops: object | None) -> Callable[..., Any] | None:
    """The C++ extend attention for ``extend_impl="avx512_bf16"`` (``torch.ops.llmserve_cpu.extend_attention``),
    None for SDPA."""
    if extend_impl not in EXTEND_IMPLS:
        raise ValueError(f"extend_impl must be one of {', '.join(EXTEND_IMPLS)}, got {extend_impl!r}")
    if extend_impl == "sdpa":
        return None
    if cpu_ops is None:
        raise ValueError("extend_impl 'avx512_bf16' needs the CPU kernels (layers.cpu_ext.load())")
    return cpu_ops.extend_attention  # type: ignore[attr-defined]
