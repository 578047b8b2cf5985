"""Rotary position embeddings (non-interleaved, HF ``rotate_half`` layout) with llama3 / linear scaling.

The cos/sin table is a plain attribute computed on the target device after the model is materialised
(``build_cache``), not a buffer, so meta-device construction never has to special-case it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from worker_svc.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        old_ctx = rope.original_max_position_embeddings or 8192
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.cos_sin: torch.Tensor | None = None  # [max_positions, 2, head_dim] float32

    def build_cache(self, device: torch.device) -> None:
        inv_freq = rope_inv_freq(self.rope, self.head_dim).to(device)
        t = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [positions, head_dim]
        self.cos_sin = torch.stack((emb.cos(), emb.sin()), dim=1)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [tokens, 1, head_dim] in ``dtype``; computed once per step, used by every layer."""
        assert self.cos_sin is not None, "build_cache() was not called after materialising the model"
        cos_sin = self.cos_sin[positions].to(dtype)  # [tokens, 2, head_dim]
        return cos_sin[:, 0:1], cos_sin[:, 1:2]


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [tokens, q_heads, head_dim], k: [tokens, kv_heads, head_dim]; cos/sin broadcast over heads."""
    cos, sin = cos_sin
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
