"""Attention backend interface and the per-layer module that models call.

Models never touch the KV pool: an ``AttentionLayer`` hands q/k/v for its layer to the step's backend,
which stores the new K/V and attends over the cached context. MLA backends add their own entry points.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from worker_svc.forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    def prepare(self, batch: ForwardBatch) -> None:
        """Build per-step metadata (gather indices, masks) once, shared by every layer."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "AttentionLayer", batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [tokens, q_heads, head_dim]; k, v: [tokens, kv_heads, head_dim] -> [tokens, q_heads * head_dim]."""


class AttentionLayer(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return batch.attn_backend.forward(q, k, v, self, batch)
