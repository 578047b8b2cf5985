"""Attention backend interfaces and the per-layer modules that models call.

Models never touch the KV pool: an ``AttentionLayer`` hands q/k/v for its layer to the step's backend,
which stores the new K/V and attends over the cached context. MLA has its own backend interface
(``MLAAttentionBackend.forward_mla``: queries and one latent per token, not per-head K/V). A step's
backend is one or the other; ``kind`` tells them apart, so each layer checks that it got its own kind
with one string compare, not a protocol check, in every layer.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
from torch import nn

from worker_svc.forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    """Multi-head / grouped-query attention over per-head K and V."""

    @property
    def kind(self) -> Literal["mha"]: ...

    def prepare(self, batch: ForwardBatch) -> None:
        """Build per-step metadata (gather indices, masks) once, shared by every layer."""

    def prepare_fixed_decode(self, batch: ForwardBatch, seq_lens: torch.Tensor, max_len: int) -> None:
        """A decode step's metadata at a fixed shape ([batch, max_len], lengths as the device tensor
        ``seq_lens``) with no host read: what a CUDA graph captures (attention/metadata.py)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [tokens, q_heads, head_dim]; k, v: [tokens, kv_heads, head_dim] -> [tokens, q_heads * head_dim]."""


class MLAAttentionBackend(Protocol):
    """Multi-head latent attention over one cached latent per token (``MLAAttentionLayer``)."""

    @property
    def kind(self) -> Literal["mla"]: ...

    def prepare(self, batch: ForwardBatch) -> None:
        """Build per-step metadata (gather indices, masks) once, shared by every layer."""

    def prepare_fixed_decode(self, batch: ForwardBatch, seq_lens: torch.Tensor, max_len: int) -> None:
        """A decode step's metadata at a fixed shape ([batch, max_len], lengths as the device tensor
        ``seq_lens``) with no host read: what a CUDA graph captures (attention/metadata.py)."""

    def forward_mla(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, layer: MLAAttentionLayer,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q_nope [tokens, heads, qk_nope], q_pe [tokens, heads, rope], latent [tokens, kv_lora + rope]
        -> [tokens, heads * v_head_dim]."""


StepAttentionBackend = AttentionBackend | MLAAttentionBackend


class AttentionLayer(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        backend = batch.attn_backend
        if backend.kind != "mha":
            raise TypeError(f"AttentionLayer needs an MHA attention backend, got {type(backend).__name__}")
        return backend.forward(q, k, v, self, batch)


class MLAAttentionLayer(nn.Module):
    """Multi-head latent attention (DeepSeek-V2) for one layer.

    The model hands over the per-head ``q_nope``/``q_pe`` and each new token's latent
    ``[normalised compressed KV (kv_lora_rank) | rotated shared key (qk_rope_head_dim)]``; the backend
    caches the latent and either decompresses cached latents through ``kv_b_proj`` (``decompress``,
    the "normal" path) or folds its halves into the query and output (``absorbed_weights``).
    ``kv_b_proj`` is referenced, not registered, so its parameter keeps its checkpoint name.
    """

    def __init__(
        self, layer_id: int, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
        v_head_dim: int, scaling: float, kv_b_proj: nn.Linear,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads  # local heads on this rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scaling = scaling
        # In a tuple, so nn.Module does not register it as a child (its parameter would get a second name).
        self._kv_b_proj = (kv_b_proj,)

    @property
    def kv_b_proj(self) -> nn.Linear:
        return self._kv_b_proj[0]

    def decompress(self, latent_nope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, kv_lora_rank] -> per-head K_nope [n, heads, qk_nope] and V [n, heads, v_head_dim]."""
        kv = self.kv_b_proj(latent_nope).view(-1, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        return kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, qk_nope, kv_lora_rank] and W_UV [heads, v_head_dim, kv_lora_rank] (views)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def forward(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """q_nope [tokens, heads, qk_nope], q_pe [tokens, heads, rope], latent [tokens, kv_lora + rope]
        -> [tokens, heads * v_head_dim]."""
        backend = batch.attn_backend
        if backend.kind != "mla":
            raise TypeError(f"MLAAttentionLayer needs an MLA attention backend, got {type(backend).__name__}")
        return backend.forward_mla(q_nope, q_pe, latent, self, batch)
