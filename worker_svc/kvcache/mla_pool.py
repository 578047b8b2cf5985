"""Per-layer MLA latent buffers: one ``kv_lora_rank + qk_rope_head_dim`` vector per token per layer
(the normalised compressed KV and the shared, already rotated key), instead of per-head K and V."""

from __future__ import annotations

import torch


class MLAKVPool:
    def __init__(
        self, size: int, num_layers: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.size = size
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        shape = (size + 1, kv_lora_rank + rope_dim)  # +1: slot 0 is the padding slot
        self.latent_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> int:
        return num_layers * (kv_lora_rank + rope_dim) * torch.empty((), dtype=dtype).element_size()

    def store(self, layer_id: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        self.latent_buffers[layer_id].index_copy_(0, slots, latent.to(self.latent_buffers[layer_id].dtype))

    def buffer(self, layer_id: int) -> torch.Tensor:
        return self.latent_buffers[layer_id]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.latent_buffers)
