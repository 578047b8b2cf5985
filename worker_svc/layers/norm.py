"""RMSNorm computed in float32, as the HF reference does, then cast back to the activation dtype.

The residual stream is kept in float32 whatever the activation dtype: ``forward_with_residual``
returns the float32 sum and normalizes it unrounded. HF adds in the activation dtype; in bf16 that
rounds the stream (|values| up to ~500 on SmolLM2) to 8 mantissa bits at every layer, and the LM
head turns that noise into a final-logit cosine of 0.9974 against fp32 on a short prompt, where the
float32 stream gives 0.9999 (docs/accuracy.md). It costs one [tokens, hidden] float32 tensor.

On x86 CPUs the runner sets ``cpu_ops`` (layers/cpu_ext.py): one C++ op per call, rounding where
this torch path rounds, instead of 6-8 small torch ops (~40 us per decode-step call on this host).
It is used for bf16 / fp16 activations only: its sum of squares runs in another order than torch's,
which in fp32 moves logits by a few ulps, enough to spend the oracle tests' 1e-4 margin on models
whose logits reach ~70; rounded to 8 or 11 mantissa bits the two agree (tests/unit/test_norm.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.cpu_ops: Any = None  # torch.ops.llmserve_cpu (untyped op namespace) or None

    def _fused(self, x: torch.Tensor) -> bool:
        return (
            self.cpu_ops is not None
            and x.dtype in (torch.bfloat16, torch.float16)
            and x.dtype == self.weight.dtype
            and x.is_contiguous()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops is not None and self._fused(x):
            return self.cpu_ops.rms_norm(x, self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # fused; same math as HF's
        return self.weight * normed.to(x.dtype)

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += x; return (norm(residual) in x's dtype, residual in float32). ``residual`` may
        come in as x's dtype (the embedding, before the first layer) or float32."""
        if (self.cpu_ops is not None and self._fused(x) and residual.is_contiguous()
                and residual.dtype in (x.dtype, torch.float32)):
            return self.cpu_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual.float() + x.float()
        normed = F.rms_norm(residual, (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype), residual
