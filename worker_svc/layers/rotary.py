"""Rotary position embeddings with llama3 / linear / YaRN scaling.

Llama uses the non-interleaved HF ``rotate_half`` layout (``apply_rotary``); DeepSeek-V2 rotates
adjacent pairs (x[2i], x[2i+1]) like HF's complex ``apply_rotary_emb`` (``interleaved=True`` and
``apply_rotary_interleaved``). YaRN's attention factor (from mscale / mscale_all_dim) scales cos and sin.

The cos/sin table is a plain attribute computed on the target device after the model is materialised
(``build_cache``), not a buffer, so meta-device construction never has to special-case it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from worker_svc.config.model_config import RopeConfig


def rope_inv_freq(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, rotary_dim)
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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(rope: RopeConfig) -> float:
    """Factor on cos/sin (HF ``attention_scaling``); 1 except for YaRN."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
    return _yarn_mscale(rope.factor)


def softmax_scale_factor(rope: RopeConfig) -> float:
    """DeepSeek multiplies the softmax scale by mscale(factor, mscale_all_dim)^2 under YaRN."""
    if rope.rope_type == "default" or not rope.mscale_all_dim:
        return 1.0
    return _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """transformers' ``_compute_yarn_parameters``: interpolate low frequencies, keep high ones, ramp between."""
    base, orig = rope.theta, rope.original_max_position_embeddings or 4096

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, interleaved: bool = False) -> None:
        super().__init__()
        self.rope = rope
        self.interleaved = interleaved
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.cos_sin: torch.Tensor | None = None  # [max_positions, 2, head_dim] float32

    def build_cache(self, device: torch.device) -> None:
        inv_freq = rope_inv_freq(self.rope, self.head_dim).to(device)
        t = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [positions, head_dim / 2]
        if self.interleaved:  # one angle per pair: [positions, 2, head_dim / 2]
            factor = rope_attention_factor(self.rope)
            self.cos_sin = torch.stack((freqs.cos() * factor, freqs.sin() * factor), dim=1)
            return
        emb = torch.cat((freqs, freqs), dim=-1)  # [positions, head_dim]
        self.cos_sin = torch.stack((emb.cos(), emb.sin()), dim=1)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [tokens, 1, head_dim] in ``dtype`` ([tokens, 1, head_dim / 2] float32 when
        interleaved); computed once per step, used by every layer."""
        assert self.cos_sin is not None, "build_cache() was not called after materialising the model"
        if self.interleaved:
            cos_sin = self.cos_sin[positions]
            return cos_sin[:, 0:1], cos_sin[:, 1:2]
        cos_sin = self.cos_sin[positions].to(dtype)  # [tokens, 2, head_dim]
        return cos_sin[:, 0:1], cos_sin[:, 1:2]


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [tokens, q_heads, head_dim], k: [tokens, kv_heads, head_dim]; cos/sin broadcast over heads."""
    cos, sin = cos_sin
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class RotateHalfRope(nn.Module):
    """``apply_rotary`` as a layer whose kernel the kernel plan picks: this project's C++ op (``cpu_ops``,
    kernels/csrc/rotary_avx2.cpp: bit for bit the torch path, one call instead of ten) for bf16/fp16 on
    the CPU, the torch path otherwise. No parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu_ops: Any = None  # torch.ops.llmserve_cpu (untyped op namespace) or None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin
        if (self.cpu_ops is not None and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)
                and cos.dtype == q.dtype == k.dtype):
            q_out, k_out = self.cpu_ops.rotary_rotate_half(q, k, cos, sin)
            return q_out, k_out
        return apply_rotary(q, k, cos_sin)


def apply_rotary_interleaved(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairwise rotation of (x[2i], x[2i+1]) in float32, then back to the input dtype (as HF's complex
    multiply). q: [tokens, heads, dim], k: [tokens, 1, dim]; cos/sin [tokens, 1, dim / 2] from
    an ``interleaved`` table."""
    cos, sin = cos_sin

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = x.float().unflatten(-1, (-1, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return out.flatten(-2).to(x.dtype)

    return rotate(q), rotate(k)
