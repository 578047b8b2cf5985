"""Linear kernels for CPUs without native bf16 matrix instructions.

On AVX2-only x86 (no AVX512-BF16 / AMX) aten's bf16 GEMM falls back to a scalar-conversion loop:
at 16 rows it is several times slower than fp32 sgemm, while its single-row GEMV path is fine.
``BlockedUpcastLinear`` keeps weights in bf16 (memory and bandwidth stay bf16) and, for two or more
rows, converts one cache-sized block of weight rows at a time into a reused fp32 scratch buffer and
runs sgemm on it, so the weights are read from DRAM once, as bf16. Results are fp32-accumulated,
then cast back to the activation dtype. See docs/benchmarks.md for the measurements behind it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert")


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    try:
        flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return True  # unknown platform: trust aten's own bf16 path
    return any(flag in flags.split() for flag in _BF16_CPU_FLAGS)


class BlockedUpcastLinear:
    """``y = x @ W^T + b`` for bf16 ``W`` with fp32 compute over cache-sized weight blocks."""

    def __init__(self, block_bytes: int = 1 << 20, min_rows: int = 2) -> None:
        self.block_bytes = block_bytes
        self.min_rows = min_rows
        self._scratch = torch.empty(0, dtype=torch.float32)

    def _scratch_for(self, numel: int) -> torch.Tensor:
        if self._scratch.numel() < numel:
            self._scratch = torch.empty(numel, dtype=torch.float32)
        return self._scratch

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.dtype != torch.bfloat16 or x.device.type != "cpu":
            return F.linear(x, weight, bias)
        x2 = x.reshape(-1, x.shape[-1])  # [rows, in]
        if x2.shape[0] < self.min_rows:
            return F.linear(x, weight, bias)  # GEMV: aten's bf16 path is already bandwidth-bound
        out_features, in_features = weight.shape
        block = max(16, self.block_bytes // (4 * in_features))
        scratch = self._scratch_for(min(block, out_features) * in_features)
        x32 = x2.float()
        out = torch.empty(x2.shape[0], out_features, dtype=torch.float32)
        for start in range(0, out_features, block):
            rows = min(block, out_features - start)
            w32 = scratch[: rows * in_features].view(rows, in_features)
            w32.copy_(weight[start : start + rows])  # bf16 -> fp32 into cache-resident scratch
            torch.mm(x32, w32.t(), out=out[:, start : start + rows])
        if bias is not None:
            out += bias
        return out.to(x.dtype).reshape(*x.shape[:-1], out_features)
