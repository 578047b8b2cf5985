"""The AVX2 quantized-linear kernels (worker_svc/kernels/csrc/quant_linear_avx2.cpp) against the fp32
arithmetic they stand for, over the shapes that exercise every register-block edge: 1-9 activation
rows (full blocks of 4 and the 1-3 remainders), output features that are not a multiple of the
weight-row block, input features with a tail that is not a multiple of the vector width (int8)."""

from __future__ import annotations

import pytest
import torch

from worker_svc.kernels import cpu_ext
from worker_svc.kernels.quant_linear import (
    Int4WeightOnlyKernel,
    Int8DynamicKernel,
    Int8WeightOnlyKernel,
    pack_nibbles,
    unpack_nibbles,
)

OPS = cpu_ext.load()
pytestmark = pytest.mark.skipif(
    OPS is None, reason="AVX2 kernels unavailable on this host (not x86-64 AVX2 or no compiler)"
)

ROWS = [1, 2, 3, 4, 5, 9]


def _data(rows: int, out_features: int, in_features: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    return weight, x


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", [(37, 70), (64, 1024), (130, 96)])
def test_int8_weight_only_matches_fp32(rows, shape):
    weight, x = _data(rows, *shape, torch.float32)
    kernel = Int8WeightOnlyKernel(weight, torch.float32, ops=OPS)
    out = kernel(x, weight)
    assert _rel(out, x @ kernel.dequantized().t()) < 1e-5
    assert out.dtype == torch.float32 and out.shape == (rows, shape[0])


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(
    "shape,group", [((37, 64), 32), ((37, 96), 32), ((130, 256), 64), ((64, 1024), 128), ((16, 512), 256)]
)
def test_int4_weight_only_matches_fp32(rows, shape, group):
    weight, x = _data(rows, *shape, torch.float32)
    kernel = Int4WeightOnlyKernel(weight, torch.float32, group, ops=OPS)
    out = kernel(x, weight)
    assert _rel(out, x @ kernel.dequantized().t()) < 1e-5


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", [(37, 70), (64, 1024), (130, 96)])
def test_int8_dynamic_matches_fp32(rows, shape):
    weight, x = _data(rows, *shape, torch.float32)
    kernel = Int8DynamicKernel(weight, torch.float32, ops=OPS)
    out = kernel(x, weight)
    ref = kernel.fake_quantize_activations(x) @ kernel.dequantized().t()
    assert _rel(out, ref) < 1e-5  # int32 accumulation is exact; only the two scale products round
    aten = Int8DynamicKernel(weight, torch.float32)(x, weight)  # the same quantized values through aten
    assert _rel(out, aten) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_activations_and_bias(dtype):
    weight, x = _data(3, 48, 128, dtype)
    bias = torch.randn(48).to(dtype)
    for kernel in (
        Int8WeightOnlyKernel(weight, dtype, ops=OPS),
        Int4WeightOnlyKernel(weight, dtype, 32, ops=OPS),
        Int8DynamicKernel(weight, dtype, ops=OPS),
    ):
        out = kernel(x.view(1, 3, 128), weight, bias)  # [batch, tokens, in]: leading dims kept
        prepare = getattr(kernel, "fake_quantize_activations", lambda t: t.float())
        ref = prepare(x) @ kernel.dequantized().float().t() + bias.float()
        assert out.dtype == dtype and out.shape == (1, 3, 48)
        assert _rel(out.view(3, 48), ref) < 1e-2  # one rounding of the output to 8/11 mantissa bits


def test_avx2_and_aten_int4_layouts_mean_the_same_weights():
    weight, x = _data(4, 48, 256, torch.bfloat16)
    avx2 = Int4WeightOnlyKernel(weight, torch.bfloat16, 64, ops=OPS)
    aten = Int4WeightOnlyKernel(weight, torch.bfloat16, 64)
    assert torch.equal(avx2.dequantized(), aten.dequantized())
    assert avx2.nbytes == aten.nbytes  # half a byte per weight + a (scale, zero) pair per group
    assert _rel(avx2(x, weight), aten(x, weight).float()) < 1e-2


@pytest.mark.parametrize("cols", [64, 96, 256])
def test_nibble_packing_round_trips(cols):
    q = torch.randint(0, 16, (5, cols), generator=torch.Generator().manual_seed(3))
    packed = pack_nibbles(q)
    assert packed.shape == (5, -(-cols // 64) * 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed, cols), q.to(torch.uint8))
    word0 = int.from_bytes(bytes(packed[0, :4].tolist()), "little")  # weights 0, 8, 16, ... 56 of row 0
    assert word0 == sum(q[0, 8 * t].item() << (4 * t) for t in range(8))


def test_bad_shapes_raise_instead_of_reading_out_of_bounds():
    weight, x = _data(2, 32, 64, torch.float32)
    kernel = Int8WeightOnlyKernel(weight, torch.float32, ops=OPS)
    with pytest.raises(RuntimeError, match="features"):
        OPS.int8_weight_linear(torch.randn(2, 63), kernel.qweight, kernel.kernel_scale)
    with pytest.raises(RuntimeError, match="scale"):
        OPS.int8_weight_linear(x, kernel.qweight, kernel.kernel_scale[:5])
    int4 = Int4WeightOnlyKernel(weight, torch.float32, 32, ops=OPS)
    with pytest.raises(RuntimeError, match="group"):
        OPS.int4_weight_linear(x, int4.packed, int4.scale, int4.zero, 48)
