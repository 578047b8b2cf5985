"""RMSNorm computed in float32, as the HF reference does, then cast back to the activation dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # fused; same math as HF's
        return self.weight * normed.to(x.dtype)

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += x; return (norm(residual), residual). Adds in the activation dtype like HF."""
        residual = residual + x
        return self.forward(residual), residual
