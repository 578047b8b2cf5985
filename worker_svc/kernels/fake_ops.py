"""Shape-only ("fake") kernels of this project's CPU ops, so torch.compile can trace a step that calls them
(executor/compiled_decode.py): each returns an empty tensor of the shape and dtype the C++ op returns,
without touching data. ``register(ops)`` runs once, after the library is loaded (kernels/cpu_ext.py).

The C++ side registers these ops under the CPU dispatch key (``TORCH_LIBRARY_IMPL``), not as
composite functions: a fake kernel can only stand beside a backend kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

LIBRARY = "llmserve_cpu"


def _rows_out(x: torch.Tensor, n: int) -> torch.Tensor:
    """[..., in] -> empty [..., n] in x's dtype (the linears keep x's leading dims)."""
    return x.new_empty((*x.shape[:-1], n))


def register(ops: object) -> None:
    """Register the fake kernels of the ops ``ops`` (torch.ops.llmserve_cpu) has; idempotent."""
    fakes: dict[str, Callable[..., Any]] = {
        "int4_weight_linear_avx512": lambda x, packed, n, group, scale_dtype, bias=None, mode=0: _rows_out(x, n),
        "int8_weight_linear_avx512": lambda x, packed, scale, n, bias=None, mode=0: _rows_out(x, n),
        "bf16_linear_packed": lambda x, packed, n, bias: _rows_out(x, n),
        "bf16_linear_packed_amx": lambda x, packed, n, bias: _rows_out(x, n),
        # The AVX2 quantized linears take [rows, in] and return [rows, weight rows].
        "int8_weight_linear": lambda x, qweight, scale: x.new_empty((x.shape[0], qweight.shape[0])),
        "int8_dynamic_linear": lambda x, qweight, scale: x.new_empty((x.shape[0], qweight.shape[0])),
        "int4_weight_linear": lambda x, packed, scale, zero, group: x.new_empty((x.shape[0], packed.shape[0])),
        "rms_norm": lambda x, weight, eps: torch.empty_like(x),
        "silu_and_mul": lambda gate_up: gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2)),
        "fused_add_rms_norm": lambda x, residual, weight, eps: (torch.empty_like(x),
                                                                 torch.empty_like(x, dtype=torch.float32)),
        "rotary_rotate_half": lambda q, k, cos, sin: (torch.empty_like(q), torch.empty_like(k)),
        "decode_attention": lambda q, k_pool, v_pool, slots, seq_lens, scaling, isa=0: q.new_empty(
            (q.shape[0], q.shape[1], v_pool.shape[2])),
    }
    for name, fake in fakes.items():
        if not hasattr(ops, name):
            continue
        qualname = f"{LIBRARY}::{name}"
        if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta"):
            continue  # registered by an earlier load in this process
        torch.library.register_fake(qualname, fake)
