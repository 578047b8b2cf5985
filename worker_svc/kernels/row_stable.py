"""fp32 linears whose every row is rounded the same whatever the batch around it (``RowStableLinear``).

MKL's sgemm on x86 takes a separate small-M path for few rows, and there a row of a partial tile is
rounded differently from the same row in a bigger GEMM. Measured on an AVX-512 Zen 4 (torch 2.13, MKL):
for M < 12 rows with M % 4 != 0 the last M % 4 rows differ (a few fp32 ulps); every other M gives every
row bit for bit as a 64-row GEMM does. On a Sapphire Rapids-class Xeon (AMX) every M below 57 differs.
So a request's logits depend on how many other requests share its
step, and the two-batch overlap's micro-batches (fewer rows than the whole step) drift from the
sequential forward by 1e-5..5e-5.

``probe_row_padding`` finds the rule on the host it runs on instead of assuming this one: it compares
each row count's rows against a reference GEMM, for a few layer shapes, and returns for every row count
the smallest count at or above it whose rows all match (``None`` when every count already does).
``RowStableLinear`` pads its input with zero rows to that count, so every row takes the reference
rounding: a few rows more work for at most a dozen rows, where the weight read dominates anyway.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Row counts 1..REFERENCE_ROWS are probed against a GEMM of REFERENCE_ROWS rows; from there up the GEMM is
# taken to round every row alike (on the Zen 4 host every count from 12 up already does).
REFERENCE_ROWS = 64
# Layer shapes (out, in) the probe multiplies: narrow and wide, short and long reductions.
PROBE_SHAPES = ((64, 64), (256, 176), (768, 576), (576, 1536))


def probe_row_padding(device: torch.device | str = "cpu") -> tuple[int, ...] | None:
    """``pad_to[m]`` for m < REFERENCE_ROWS: the row count to run an m-row fp32 linear at so that its rows
    equal a REFERENCE_ROWS-row GEMM's (REFERENCE_ROWS itself always does); None when no count needs
    padding."""
    generator = torch.Generator().manual_seed(0)
    stable = [True] * (REFERENCE_ROWS + 1)
    for out_features, in_features in PROBE_SHAPES:
        weight = torch.randn(out_features, in_features, generator=generator).to(device)
        x = torch.randn(REFERENCE_ROWS, in_features, generator=generator).to(device)
        reference = F.linear(x, weight)
        for rows in range(1, REFERENCE_ROWS + 1):
            if stable[rows] and not torch.equal(F.linear(x[:rows], weight), reference[:rows]):
                stable[rows] = False
    if all(stable[1:]):
        return None
    stable[REFERENCE_ROWS] = True  # the reference's own rows
    return tuple([0] + [next(m for m in range(rows, REFERENCE_ROWS + 1) if stable[m])
                        for rows in range(1, REFERENCE_ROWS)])


class RowStableLinear:
    """``F.linear`` for fp32 inputs [tokens, in] that pads the token rows to a count whose rounding
    matches a large GEMM's (``pad_to`` from ``probe_row_padding``); other dtypes and counts go straight
    through. Shared by every linear of a model: it holds no weight."""

    def __init__(self, pad_to: tuple[int, ...]) -> None:
        self.pad_to = pad_to

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() != 2 or x.dtype != torch.float32:
            return F.linear(x, weight, bias)
        padded = pad_rows(x, self.pad_to)  # [target, in]
        out = F.linear(padded, weight, bias)
        return out if padded is x else out[: x.shape[0]]  # [target, out] -> [rows, out]


def pad_rows(x: torch.Tensor, pad_to: tuple[int, ...] | None) -> torch.Tensor:
    """``x`` with zero rows appended along dim 0 up to ``pad_to``'s count for its size (``x`` itself
    when no padding applies); also for GEMMs that are not a linear (MLA decode's per-head bmm's)."""
    rows = x.shape[0]
    return zero_pad_rows(x, pad_to[rows]) if pad_to is not None and 0 < rows < len(pad_to) else x


def zero_pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended along dim 0 up to ``rows`` (``t`` itself when it has that many)."""
    return torch.cat((t, t.new_zeros(rows - t.shape[0], *t.shape[1:]))) if rows > t.shape[0] else t
