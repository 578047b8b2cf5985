"""Sampling noise addressed by (request key, step, token): Philox4x32-10 uniforms and the Gumbel race.

A sampled token is ``argmax_v (s_v + g_v)`` over the tokens truncation keeps, ``s`` the processed logits and
``g_v = -log(-log(u_v))`` Gumbel noise: that samples ``softmax(s)`` over the kept tokens (the Gumbel-max trick).
``u_v`` comes from a counter-based generator, Philox4x32-10 (Salmon et al., SC'11; cuRAND's and JAX's), keyed by
the request's 64-bit noise key and counted by its step (how many tokens it has sampled) and the token id:

* token ``v`` of a 64-token block ``b = v // 64`` is word ``(v % 64) // 16`` of the Philox block with counter
  ``(16 b + v % 16, step & 0xFFFFFFFF, step >> 32, 0)`` and key ``(key & 0xFFFFFFFF, key >> 32)``;
* ``u = ((word >> 9) + 0.5) / 2**23``, exact in float32 and strictly inside (0, 1).

So a token's noise depends on nothing but (key, step, v): not on the batch, the truncation route, the device,
or whether the request was retracted and recomputed in between (there is no generator state to carry). The
layout gives a 16-lane register one Philox block per lane and four consecutive 16-token runs from its four
words (kernels/csrc/sampling_race.cpp runs it fused, on the CPU). This module is the definition and the path
for every device: plain tensor ops, uint32 arithmetic in int64.
"""

from __future__ import annotations

import secrets

import torch

_MASK32 = 0xFFFF_FFFF
_MUL0, _MUL1 = 0xD251_1F53, 0xCD9E_8D57  # round multipliers
_WEYL0, _WEYL1 = 0x9E37_79B9, 0xBB67_AE85  # key schedule increments
_ROUNDS = 10
_BLOCK = 64  # tokens per 16 Philox blocks
_LANES = 16
_CPU_STRETCH = 128  # blocks of 64 tokens per pass on the CPU


def noise_key(seed: int | None) -> int:
    """A request's 64-bit noise key: its seed folded into 64 bits, or a fresh random key without one."""
    return secrets.randbits(64) if seed is None else seed & 0xFFFF_FFFF_FFFF_FFFF


def as_int64(keys: list[int]) -> list[int]:
    """Unsigned 64-bit keys as the int64 values a tensor holds (same bits)."""
    return [k - (1 << 64) if k >= 1 << 63 else k for k in keys]


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32 bits of a * m for uint32 values held in int64. The 64-bit product wraps past 2^63 into
    negative int64 with the same bits (two's complement, as torch's integer multiply does on every device; the
    known-answer test checks it), and the masks read both halves back."""
    product = a * m
    return (product >> 32) & _MASK32, product & _MASK32


def philox4x32_10(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], key: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four output words of Philox4x32-10 (uint32 values in int64 tensors that broadcast together)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(_ROUNDS):
        if r:
            k0, k1 = (k0 + _WEYL0) & _MASK32, (k1 + _WEYL1) & _MASK32
        hi0, lo0 = _mulhilo(c0, _MUL0)
        hi1, lo1 = _mulhilo(c2, _MUL1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _key_and_step(
    keys: torch.Tensor, steps: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
    """[R] int64 keys and steps -> the Philox key halves and step halves, [R, 1] each."""
    keys, steps = keys.view(-1, 1), steps.view(-1, 1)
    return (keys & _MASK32, (keys >> 32) & _MASK32), steps & _MASK32, (steps >> 32) & _MASK32


def _to_uniform(word: torch.Tensor) -> torch.Tensor:
    return (((word >> 9) << 1) + 1).to(torch.float32) * 2.0**-24


def uniforms(keys: torch.Tensor, steps: torch.Tensor, V: int) -> torch.Tensor:
    """[R, V] float32: every token's uniform for rows of (key, step)."""
    key, step_lo, step_hi = _key_and_step(keys, steps)
    R, blocks = keys.numel(), -(-V // _BLOCK)
    out = torch.empty(R, blocks, 4, _LANES, dtype=torch.float32, device=keys.device)  # token 64 b + 16 k + lane
    # On the CPU a stretch of blocks at a time, so the ~120 integer ops' operands stay in cache (2x faster).
    stretch = _CPU_STRETCH if keys.device.type == "cpu" else blocks
    for b0 in range(0, blocks, stretch):
        b1 = min(blocks, b0 + stretch)
        counter = torch.arange(b0 * _LANES, b1 * _LANES, device=keys.device).view(1, -1)  # [1, 16 blocks]
        words = philox4x32_10((counter, step_lo, step_hi, torch.zeros_like(counter)), key)  # 4 x [R, 16 blocks]
        for k, word in enumerate(words):
            out[:, b0:b1, k, :] = _to_uniform(word.view(R, b1 - b0, _LANES))
    return out.view(R, blocks * _BLOCK)[:, :V]


def uniforms_at(keys: torch.Tensor, steps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[R, K] float32: the uniforms of the tokens ``tokens`` ([R, K] int64) only."""
    key, step_lo, step_hi = _key_and_step(keys, steps)
    within = tokens % _BLOCK
    counter = (tokens // _BLOCK) * _LANES + within % _LANES
    words = torch.stack(philox4x32_10((counter, step_lo.expand_as(counter), step_hi.expand_as(counter),
                                       torch.zeros_like(counter)), key), dim=-1)  # [R, K, 4]
    return _to_uniform(words.gather(-1, (within // _LANES).unsqueeze(-1)).squeeze(-1))


def gumbel(u: torch.Tensor) -> torch.Tensor:
    return u.log().neg_().log_().neg_()


def gumbel_race(
    x: torch.Tensor, threshold: torch.Tensor | None, keys: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """The race in tensor ops (any device): [R] int64, the first v maximizing ``x_v + g_v`` over x_v >= threshold
    ([R, 1]; None keeps all). x: [R, V] float32 processed logits."""
    scores = x + gumbel(uniforms(keys.to(x.device), steps.to(x.device), x.shape[1]))
    if threshold is not None:
        scores = scores.masked_fill_(x < threshold, float("-inf"))
    return scores.argmax(dim=-1)
