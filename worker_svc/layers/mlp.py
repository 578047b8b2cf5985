"""The gated (SwiGLU) MLP: down(silu(gate(x)) * up(x)), gate and up fused in one column-parallel matmul.

Llama's MLP and DeepSeek's dense layers, routed experts and shared experts are all this block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker_svc.layers.activation import silu_and_mul
from worker_svc.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from worker_svc.parallel.context import TPContext


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPContext, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp)
        # torch.ops.llmserve_cpu (set by the kernel plan on x86 CPUs) or None: silu(gate) * up in one C++ pass
        # for bf16 / fp16 (kernels/csrc/activation_avx2.cpp), rounded where the torch path rounds.
        self.cpu_ops: Any = None

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """x [tokens, hidden] -> [tokens, hidden]; with ``reduce=False`` this rank's partial sum."""
        gate_up = self.gate_up_proj(x)
        if self.cpu_ops is not None and gate_up.dtype in (torch.bfloat16, torch.float16) and gate_up.is_contiguous():
            return self.down_proj(self.cpu_ops.silu_and_mul(gate_up), reduce=reduce)
        return self.down_proj(silu_and_mul(gate_up), reduce=reduce)
