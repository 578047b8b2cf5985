"""Linear kernels for bf16 models on the CPU.

On CPUs with AVX512-BF16, ``PackedBf16Linear``: this project's kernel (kernels/csrc/bf16_linear_avx512.cpp)
on a weight packed once at load for VDPBF16PS; it reads the weight near the host's memory bandwidth where
aten's GEMV on the unpacked weight reaches about half of it. Where the CPU also has AMX-BF16 (Sapphire
Rapids and later) the same packed weight feeds AMX tiles (kernels/csrc/bf16_linear_amx.cpp) from two rows
up: VDPBF16PS's cost grows with the rows, a tile multiply's does not until 16.

On AVX2-only x86 (no AVX512-BF16 / AMX / AVX-NE-CONVERT) aten's bf16 GEMM falls back to a scalar
conversion loop: at 16 rows it is 3-5x slower than it needs to be, and 4-8x at prefill sizes.
Two replacements, both keeping 2 bytes per weight and accumulating in fp32:

- ``PackedFp16Linear`` (preferred): FBGEMM's fp16-weight GEMM, which converts packed weight panels
  to fp32 inside its AVX2 micro-kernel. bf16 -> fp16 is exact for every weight whose magnitude lies
  in fp16's normal range [6.1e-5, 65504] (fp16 has more mantissa bits); smaller ones keep an
  absolute error below 6e-8. A weight beyond 65504 makes the layer fall back.
- ``BlockedUpcastLinear``: converts cache-sized blocks of weight rows to fp32 and runs sgemm, for
  torch builds without FBGEMM.

See docs/benchmarks.md for the measurements behind the choice.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert")


FP16_MAX = 65504.0


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


@torch.library.custom_op("llmserve::fbgemm_linear_fp16", mutates_args=())
def fbgemm_linear_fp16(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """[rows, in] fp32 @ the packed fp16 weight + [out] fp32 bias -> [rows, out] fp32.

    aten's ``fbgemm_linear_fp16_weight`` is a composite op that reads a C++ object's address out of
    ``packed`` (an 8-byte tensor), so torch.compile cannot trace into it; as an opaque op with a
    shape-only kernel the compiled decode calls it like any other kernel (executor/compiled_decode.py)."""
    return torch.fbgemm_linear_fp16_weight(x, packed, bias)


@fbgemm_linear_fp16.register_fake
def _fbgemm_linear_fp16_shape(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], bias.shape[0]))


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    try:
        flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return True  # unknown platform: trust aten's own bf16 path
    return any(flag in flags.split() for flag in _BF16_CPU_FLAGS)


AMX_TILE_K = 32  # inputs per AMX tile: the AMX kernel needs in_features in whole tiles


class PackedBf16Linear:
    """One layer's bf16 weight packed for the AVX512-BF16 kernel (``ops``: ``cpu_ext.load()``). The packed
    copy replaces the weight: every row count runs this project's kernels.

    ``amx_min_rows``: inputs of at least this many rows run the AMX kernel on the same packed weight (None:
    never; layers whose in_features is not a multiple of 32 never do). Both kernels compute each row on its
    own, so a row's result does not depend on the other rows; it does depend on which kernel ran, which is
    why deterministic inference passes 1 (every row count on AMX)."""

    def __init__(self, weight: torch.Tensor, ops: Any, amx_min_rows: int | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        if weight.dtype != torch.bfloat16 or self.in_features % 2:
            raise ValueError("PackedBf16Linear needs a bf16 weight with an even number of input features")
        self.ops = ops
        self.packed = ops.bf16_pack_weight(weight)  # [ceil(out/16), in/2, 32]
        self.nbytes = self.packed.numel() * self.packed.element_size()
        self.amx_min_rows = amx_min_rows if self.in_features % AMX_TILE_K == 0 else None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.bfloat16:  # the model runs in bf16; anything else is a caller's mistake
            raise TypeError(f"PackedBf16Linear: bfloat16 input expected, got {x.dtype}")
        bias32 = None if bias is None else bias.float()
        if self.amx_min_rows is not None and x.numel() >= self.amx_min_rows * self.in_features:
            return self.ops.bf16_linear_packed_amx(x, self.packed, self.out_features, bias32)
        return self.ops.bf16_linear_packed(x, self.packed, self.out_features, bias32)


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


class PackedFp16Linear:
    """One layer's weight packed for FBGEMM's fp16 GEMM.

    With ``gemv_from_bf16`` a single row goes to aten's bf16 GEMV instead (multi-threaded and the
    fastest path for one row here), which needs the bf16 weight kept beside the packed copy.
    """

    def __init__(self, weight: torch.Tensor, gemv_from_bf16: bool = False) -> None:
        self.gemv_from_bf16 = gemv_from_bf16
        if weight.abs().max().item() > FP16_MAX:
            raise ValueError("weight exceeds the fp16 range")
        self.out_features, self.in_features = weight.shape
        # The API is marked deprecated in favour of torchao's; it is still the fastest fp16-weight
        # GEMM in a stock CPU build, so silence the one-time notices it raises.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.packed = torch.fbgemm_pack_gemm_matrix_fp16(weight.float())
            self._zero_bias = torch.zeros(self.out_features)
            torch.fbgemm_linear_fp16_weight(torch.zeros(1, self.in_features), self.packed, self._zero_bias)
        self.nbytes = 2 * weight.numel()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # [rows, in]
        if self.gemv_from_bf16 and x2.shape[0] == 1:
            return F.linear(x, weight, bias)
        x2 = x2.float()
        b = self._zero_bias if bias is None else bias.float()
        # The opaque op only while dynamo traces: called eagerly it costs ~20 us of Python dispatch a call.
        linear = fbgemm_linear_fp16 if torch.compiler.is_compiling() else torch.fbgemm_linear_fp16_weight
        out = linear(x2, self.packed, b)  # [rows, out] fp32
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
