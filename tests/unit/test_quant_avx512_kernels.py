"""The AVX-512 weight-only quantized linears (worker_svc/kernels/csrc/quant_linear_avx512.cpp) against the
fp32 arithmetic of the dequantized weights they stand for, on every path (fp32 FMA; VDPBF16PS for bf16
activations, int4's weights widened in registers, int8's in a per-tile panel), over shapes that exercise
the register blocks' edges: 1-130 rows (one-row tiles, row blocks of 4 and their remainders), output
features not a multiple of 16 (masked stores), odd input features (int8), every int4 group size."""

from __future__ import annotations

import pytest
import torch

from worker_svc.kernels import cpu_ext
from worker_svc.kernels.quant_linear import (
    Int4WeightOnlyKernel,
    Int8DynamicKernel,
    Int8WeightOnlyKernel,
    pack_int4_avx512,
    pack_int8_avx512,
    unpack_int4_avx512,
    unpack_int8_avx512,
)

OPS = cpu_ext.load()
AVX512 = OPS is not None and bool(OPS.quant_avx512_available())
AVX512_BF16 = AVX512 and bool(OPS.quant_avx512_bf16_available())
pytestmark = pytest.mark.skipif(
    not AVX512, reason="AVX-512 kernels cannot run: the CPU lacks AVX-512 F/BW/VL/DQ or the C++ kernels did not build"
)
needs_bf16 = pytest.mark.skipif(not AVX512_BF16, reason="this CPU lacks AVX512-BF16: the VDPBF16PS path cannot run")
AMX = AVX512 and bool(OPS.quant_amx_available())
needs_amx = pytest.mark.skipif(
    not AMX, reason="this CPU lacks AMX-BF16 (or the OS does not grant the tile state): int4's AMX path cannot run"
)

ROWS = [1, 2, 5, 16, 33, 130]
FP32_PATH, BF16_PATH, AMX_PATH, AUTO = 1, 2, 3, 0
# (activation dtype, mode): the fp32 path for every dtype, the bf16 path, and what mode 0 picks for bf16.
PATHS = [
    (torch.float32, FP32_PATH),
    (torch.float16, FP32_PATH),
    (torch.bfloat16, FP32_PATH),
    pytest.param(torch.bfloat16, BF16_PATH, marks=needs_bf16),
    (torch.bfloat16, AUTO),
]
AMX_PATHS = [*PATHS, pytest.param(torch.bfloat16, AMX_PATH, marks=needs_amx)]


def _data(rows: int, out_features: int, in_features: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    return weight, x


def _assert_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """fp32 outputs within 1e-5 of the largest; half-precision outputs within their one final rounding
    (half an ulp: 2^-8 relative for bf16, 2^-11 for fp16) plus 1e-4 of the largest for fp32 summation."""
    assert out.shape == ref.shape and not out.isnan().any(), what
    scale = ref.abs().max().item()
    err = (out.float() - ref).abs()
    if out.dtype == torch.float32:
        assert err.max().item() <= 1e-5 * scale, (what, err.max().item() / scale)
    else:
        rounding = 2.0**-8 if out.dtype == torch.bfloat16 else 2.0**-11
        bound = rounding * ref.abs() + 1e-4 * scale
        assert (err <= bound).all(), (what, (err - bound).max().item())


def _int8(kernel: Int8WeightOnlyKernel, x: torch.Tensor, mode: int) -> torch.Tensor:
    return OPS.int8_weight_linear_avx512(x, kernel.packed, kernel.kernel_scale, kernel.out_features, None, mode)


def _int4(kernel: Int4WeightOnlyKernel, x: torch.Tensor, mode: int) -> torch.Tensor:
    return OPS.int4_weight_linear_avx512(
        x, kernel.packed, kernel.out_features, kernel.group_size, kernel.scale_dtype, None, mode
    )


@pytest.mark.parametrize("dtype,mode", AMX_PATHS)
@pytest.mark.parametrize("shape", [(37, 70), (64, 1024), (130, 96), (16, 33), (200, 64)])
def test_int8_weight_only_matches_fp32(shape, dtype, mode):
    """The AMX path only where the inputs are whole 32-input tiles (1024, 96, 64)."""
    if mode == AMX_PATH and shape[1] % 32:
        pytest.skip("the AMX path needs whole 32-input tiles: refused (test_amx_paths_refuse_partial_tiles)")
    weight, x = _data(max(ROWS), *shape, dtype)
    kernel = Int8WeightOnlyKernel(weight, dtype, ops=OPS, isa="avx512")
    w = kernel.dequantized()
    for rows in ROWS:
        _assert_close(_int8(kernel, x[:rows], mode), x[:rows].float() @ w.t(), f"rows={rows}")
        assert _int8(kernel, x[:rows], mode).dtype == dtype


@pytest.mark.parametrize("dtype,mode", AMX_PATHS)
@pytest.mark.parametrize(
    "shape,group", [((37, 64), 32), ((33, 96), 32), ((130, 256), 64), ((64, 1024), 128), ((16, 512), 256)]
)
def test_int4_weight_only_matches_fp32(shape, group, dtype, mode):
    weight, x = _data(max(ROWS), *shape, dtype)
    kernel = Int4WeightOnlyKernel(weight, dtype, group, ops=OPS, isa="avx512")
    w = kernel.dequantized()
    for rows in ROWS:
        _assert_close(_int4(kernel, x[:rows], mode), x[:rows].float() @ w.t(), f"rows={rows}")


@needs_amx
@pytest.mark.parametrize("rows", [2, 16, 17, 31, 32, 33, 64, 100])
@pytest.mark.parametrize("out_features", [16, 33, 64, 200])
def test_int4_amx_path_every_tile_step_with_bias_and_leading_dims(rows, out_features):
    """1-2 row blocks x 1-2 output groups per tile step, ragged rows (padded tiles) and outputs, the bias
    added before the one rounding; the same bits with or without leading dims, and the same bits for a row
    alone as inside the batch (each row on its own)."""
    weight, x = _data(rows, out_features, 256, torch.bfloat16, seed=rows)
    bias = torch.randn(out_features).to(torch.bfloat16)
    kernel = Int4WeightOnlyKernel(weight, torch.bfloat16, 64, ops=OPS, isa="avx512")

    def run(x_: torch.Tensor) -> torch.Tensor:
        return OPS.int4_weight_linear_avx512(x_, kernel.packed, out_features, 64, torch.bfloat16, bias, AMX_PATH)

    out = run(x)
    _assert_close(out, x.float() @ kernel.dequantized().t() + bias.float(), f"rows={rows}")
    if rows % 2 == 0:
        assert torch.equal(run(x.view(2, rows // 2, 256)).view(rows, -1), out)
    assert torch.equal(run(x[-1:].repeat(2, 1))[:1], out[-1:])
    assert torch.equal(kernel(x, weight, bias), out)  # what the model calls picks AMX from 2 rows


@needs_amx
def test_amx_paths_refuse_partial_tiles():
    weight, x = _data(4, 32, 70, torch.bfloat16)
    int8 = Int8WeightOnlyKernel(weight, torch.bfloat16, ops=OPS, isa="avx512")
    with pytest.raises(RuntimeError, match="whole tiles of 32"):
        OPS.int8_weight_linear_avx512(x, int8.packed, int8.kernel_scale, 32, None, AMX_PATH)
    _assert_close(int8(x, weight), x.float() @ int8.dequantized().t(), "70 inputs under auto: not AMX")


@needs_amx
@pytest.mark.parametrize("rows", [2, 8, 16, 17, 32, 33, 100])
def test_int8_amx_path_with_bias_matches_and_is_what_auto_picks(rows):
    """Up to 32 rows the B tiles stream (widened per input tile), from 33 a panel serves every row block."""
    weight, x = _data(rows, 72, 128, torch.bfloat16, seed=rows)
    bias = torch.randn(72).to(torch.bfloat16)
    int8 = Int8WeightOnlyKernel(weight, torch.bfloat16, ops=OPS, isa="avx512")
    out = OPS.int8_weight_linear_avx512(x, int8.packed, int8.kernel_scale, 72, bias, AMX_PATH)
    _assert_close(out, x.float() @ int8.dequantized().t() + bias.float(), f"rows={rows}")
    if rows >= 8:  # what the model calls picks AMX from 8 rows
        assert torch.equal(int8(x, weight, bias), out)
    assert torch.equal(OPS.int8_weight_linear_avx512(x[-1:].repeat(2, 1), int8.packed, int8.kernel_scale, 72, bias,
                                                     AMX_PATH)[:1], out[-1:])


@needs_amx
def test_int4_amx_path_refuses_groups_that_are_not_whole_tiles():
    weight, x = _data(4, 32, 64, torch.bfloat16)
    kernel = Int4WeightOnlyKernel(weight, torch.bfloat16, 16, ops=OPS, isa="avx512")
    with pytest.raises(RuntimeError, match="groups of a multiple of 32"):
        OPS.int4_weight_linear_avx512(x, kernel.packed, 32, 16, torch.bfloat16, None, AMX_PATH)
    _assert_close(kernel(x, weight), x.float() @ kernel.dequantized().t(), "group 16 under auto: the bf16 path")


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_int4_scales_in_another_dtype_than_the_activations(scale_dtype):
    weight, x = _data(5, 40, 128, torch.bfloat16)
    kernel = Int4WeightOnlyKernel(weight, scale_dtype, 64, ops=OPS, isa="avx512")
    assert kernel.packed.shape == (3, 2, 32 * torch.finfo(scale_dtype).bits // 8 + 64 * 8)
    _assert_close(_int4(kernel, x, AUTO), x.float() @ kernel.dequantized().t(), str(scale_dtype))


@needs_bf16
def test_auto_mode_takes_the_documented_path():
    """mode 0 with bf16 activations: int8 takes the fp32 path up to four rows and the bf16 panel from five
    on (on AMX CPUs: fp32 below eight rows, AMX from eight), int4 the bf16 path at every row count (its AMX
    path from two rows where the CPU has AMX, which treats
    denormal inputs as zero too). Told apart by denormal activations, which VDPBF16PS treats
    as zero and the fp32 FMAs do not (they alternate in sign, so int4's per-group sums of x are zero and
    only x . q carries them)."""
    weight, _ = _data(1, 48, 256, torch.float32)
    weight = weight * 2000  # outputs of denormal x times these weights stay in the normal range
    tiny = 2.0**-127
    x = torch.tensor([tiny, -tiny]).repeat(128).to(torch.bfloat16).repeat(16, 1)
    assert (x.float().abs() < torch.finfo(torch.float32).tiny).all() and (x != 0).all()
    int8 = Int8WeightOnlyKernel(weight, torch.bfloat16, ops=OPS, isa="avx512")
    int4 = Int4WeightOnlyKernel(weight, torch.bfloat16, 32, ops=OPS, isa="avx512")
    for kernel, run in ((int8, _int8), (int4, _int4)):
        assert (run(kernel, x, FP32_PATH) != 0).all() and (run(kernel, x, BF16_PATH) == 0).all()
    # AMX CPUs: int8 fp32 path below 8 rows, AMX from 8 (no panel path); others: the panel from 5.
    for rows in (1, 4, 5, 7) if AMX else (1, 4):
        assert (_int8(int8, x[:rows], AUTO) != 0).all()  # fp32 path
    for rows in (8, 16) if AMX else (5, 16):
        assert (_int8(int8, x[:rows], AUTO) == 0).all()
    for rows in (1, 3, 16):
        assert (_int4(int4, x[:rows], AUTO) == 0).all()
    assert (_int4(int4, x.float(), AUTO) != 0).all()  # fp32 activations: fp32 path


@pytest.mark.parametrize("dtype,mode", PATHS)
@pytest.mark.parametrize("rows", [1, 7])
def test_leading_dims_and_bias_in_one_call(dtype, mode, rows):
    """[batch, tokens, in] in, [batch, tokens, out] out; the bias (model dtype) is added in fp32 before
    the one rounding to the output dtype."""
    weight, x = _data(2 * rows, 40, 128, dtype)
    bias = torch.randn(40).to(dtype)
    x3 = x.view(2, rows, 128)
    int8 = Int8WeightOnlyKernel(weight, dtype, ops=OPS, isa="avx512")
    int4 = Int4WeightOnlyKernel(weight, dtype, 32, ops=OPS, isa="avx512")
    outs = {
        "int8": (OPS.int8_weight_linear_avx512(x3, int8.packed, int8.kernel_scale, 40, bias, mode), int8),
        "int4": (OPS.int4_weight_linear_avx512(x3, int4.packed, 40, 32, dtype, bias, mode), int4),
    }
    for name, (out, kernel) in outs.items():
        assert out.dtype == dtype and out.shape == (2, rows, 40), name
        _assert_close(out.view(-1, 40), x.float() @ kernel.dequantized().t() + bias.float(), name)
        if mode == AUTO:  # what the model calls: the kernel object, the same op
            assert torch.equal(kernel(x3, weight, bias), out), name
    assert torch.equal(int8(x3, weight), OPS.int8_weight_linear_avx512(x3, int8.packed, int8.kernel_scale, 40))


def test_zero_rows_give_an_empty_output():
    weight, _ = _data(1, 40, 128, torch.bfloat16)
    x = torch.empty(0, 128, dtype=torch.bfloat16)
    assert Int8WeightOnlyKernel(weight, torch.bfloat16, ops=OPS, isa="avx512")(x, weight).shape == (0, 40)
    assert Int4WeightOnlyKernel(weight, torch.bfloat16, 32, ops=OPS, isa="avx512")(x, weight).shape == (0, 40)


def test_avx512_avx2_and_aten_mean_the_same_quantized_weights():
    weight, x = _data(4, 48, 256, torch.bfloat16)
    for group in (32, 64):
        avx512 = Int4WeightOnlyKernel(weight, torch.bfloat16, group, ops=OPS, isa="avx512")
        avx2 = Int4WeightOnlyKernel(weight, torch.bfloat16, group, ops=OPS)
        aten = Int4WeightOnlyKernel(weight, torch.bfloat16, group)
        assert torch.equal(avx512.dequantized(), avx2.dequantized())
        assert torch.equal(avx512.dequantized(), aten.dequantized())
        assert avx512.nbytes == avx2.nbytes  # 48 outputs: no padding rows; half a byte + (s, z) per group
        assert ((avx512(x, weight).float() - aten(x, weight).float()).abs().max() / aten(x, weight).abs().max()) < 1e-2
    int8_512 = Int8WeightOnlyKernel(weight, torch.bfloat16, ops=OPS, isa="avx512")
    int8_aten = Int8WeightOnlyKernel(weight, torch.bfloat16)
    assert torch.equal(int8_512.dequantized(), int8_aten.dequantized())
    assert int8_512.qweight is None  # the packed copy is the only one kept
    assert int8_512.nbytes == int8_aten.nbytes + 48 * 2  # fp32 scales here, the model dtype for aten


def test_padded_outputs_are_counted_in_nbytes():
    weight, _ = _data(1, 40, 129, torch.float32)  # 40 outputs -> 48 rows, 129 inputs -> 130
    kernel = Int8WeightOnlyKernel(weight, torch.float32, ops=OPS, isa="avx512")
    assert kernel.packed.shape == (3, 65, 32)
    assert kernel.nbytes == 48 * 130 + 48 * 4


def test_packings_round_trip_and_put_weights_where_the_kernels_read_them():
    gen = torch.Generator().manual_seed(3)
    q8 = torch.randint(-127, 128, (21, 9), generator=gen, dtype=torch.int8)
    p8 = pack_int8_avx512(q8)
    assert p8.shape == (2, 5, 32) and torch.equal(unpack_int8_avx512(p8, 21, 9), q8)
    assert p8[1, 2, 2 * 3 + 1].item() == q8[16 + 3, 2 * 2 + 1].item()  # (n0k0, n0k1, n1k0, ...) per pair
    assert (p8[1, :, 2 * 5 :] == 0).all() and (p8[:, 4, 1::2] == 0).all()  # padding rows and the 10th input

    q4 = torch.randint(0, 16, (21, 48), generator=gen)
    scale, zero = torch.randn(21, 3).to(torch.bfloat16), torch.randn(21, 3).to(torch.bfloat16)
    p4 = pack_int4_avx512(q4, scale, zero, 16)  # 3 quantization groups of 16 inputs: 2 blocks of 8 each
    assert p4.shape == (2, 3, 64 + 2 * 64) and p4.dtype == torch.uint8
    q_back, s_back, z_back = unpack_int4_avx512(p4, 21, 16, torch.bfloat16)
    assert torch.equal(q_back, q4.to(torch.uint8)) and torch.equal(s_back, scale) and torch.equal(z_back, zero)
    record = p4[1, 2]  # outputs 16..31, quantization group 2 (inputs 32..47)
    assert record[:64].view(torch.bfloat16)[16 + 4].item() == zero[20, 2].item()  # 16 scales, then 16 zeros
    word = int.from_bytes(bytes(record[64 + 64 + 4 * 4 :][:4].tolist()), "little")  # block 5, output 20
    assert word == sum(q4[20, 40 + t].item() << (4 * t) for t in range(8))
    assert (p4[1, :, 64 + 4 * 5 : 64 + 64] == 0).all()  # block 0 of padding rows 21..31


def test_bad_inputs_raise_naming_the_problem():
    weight, x = _data(2, 32, 64, torch.float32)
    int8 = Int8WeightOnlyKernel(weight, torch.float32, ops=OPS, isa="avx512")
    with pytest.raises(RuntimeError, match="packed must be int8"):
        OPS.int8_weight_linear_avx512(torch.randn(2, 62), int8.packed, int8.kernel_scale, 32)
    with pytest.raises(RuntimeError, match="scale must be"):
        OPS.int8_weight_linear_avx512(x, int8.packed, int8.kernel_scale[:16], 32)
    with pytest.raises(RuntimeError, match="mode"):
        OPS.int8_weight_linear_avx512(x, int8.packed, int8.kernel_scale, 32, None, 4)
    int4 = Int4WeightOnlyKernel(weight, torch.float32, 32, ops=OPS, isa="avx512")
    with pytest.raises(RuntimeError, match="bias must be"):
        OPS.int8_weight_linear_avx512(x, int8.packed, int8.kernel_scale, 32, torch.zeros(31))
    with pytest.raises(RuntimeError, match="group"):
        OPS.int4_weight_linear_avx512(x, int4.packed, 32, 48, torch.float32)
    with pytest.raises(RuntimeError, match="packed must be uint8"):
        OPS.int4_weight_linear_avx512(torch.randn(2, 96), int4.packed, 32, 32, torch.float32)
    with pytest.raises(RuntimeError, match="BFloat16 scales"):  # the record size says float32
        OPS.int4_weight_linear_avx512(x, int4.packed, 32, 32, torch.bfloat16)
    if AVX512_BF16:
        with pytest.raises(RuntimeError, match="bfloat16 activations"):
            OPS.int4_weight_linear_avx512(x, int4.packed, 32, 32, torch.float32, None, BF16_PATH)
    with pytest.raises(ValueError, match="no AVX-512 int8dq kernel"):
        Int8DynamicKernel(weight, torch.float32, ops=OPS, isa="avx512")
    with pytest.raises(ValueError, match="isa"):
        Int8WeightOnlyKernel(weight, torch.float32, ops=OPS, isa="avx1024")
