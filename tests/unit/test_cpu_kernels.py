"""The blocked bf16->fp32 linear computes the same product as an fp32 matmul of the bf16 weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_svc.kernels.bf16_linear import BlockedUpcastLinear, cpu_has_native_bf16


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_blocked_upcast_matches_fp32_reference(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(1000, 96, generator=gen).to(torch.bfloat16)  # 1000 rows: a ragged last block
    b = torch.randn(1000, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    kernel = BlockedUpcastLinear(block_bytes=96 * 4 * 128)  # 128-row blocks
    out = kernel(x, weight, b)
    ref = F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 1000)
    # Only the final rounding to bf16 separates them (relative 2^-8).
    assert torch.allclose(out.float(), ref, rtol=2**-7, atol=1e-2)


def test_blocked_upcast_keeps_leading_dims_and_passes_fp32_through():
    kernel = BlockedUpcastLinear()
    x = torch.randn(2, 3, 8).to(torch.bfloat16)
    w = torch.randn(4, 8).to(torch.bfloat16)
    assert kernel(x, w).shape == (2, 3, 4)
    x32, w32 = torch.randn(3, 8), torch.randn(4, 8)
    assert torch.equal(kernel(x32, w32), F.linear(x32, w32))


def test_cpu_flag_detection(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma\n")
    assert not cpu_has_native_bf16(info)
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert cpu_has_native_bf16(info)


fbgemm = pytest.mark.skipif(
    "fbgemm" not in torch.backends.quantized.supported_engines, reason="torch built without FBGEMM"
)


@fbgemm
@pytest.mark.parametrize("rows", [1, 3, 16, 64])
@pytest.mark.parametrize("gemv_from_bf16", [False, True])
def test_packed_fp16_matches_fp32_reference(rows, gemv_from_bf16):
    from worker_svc.kernels.bf16_linear import PackedFp16Linear

    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(300, 64, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(300, generator=gen).to(torch.bfloat16)
    x = torch.randn(2, rows, 64, generator=gen).to(torch.bfloat16)[0]
    kernel = PackedFp16Linear(weight, gemv_from_bf16=gemv_from_bf16)
    out = kernel(x, weight, bias)
    ref = F.linear(x.float(), weight.float(), bias.float())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 300)
    assert torch.allclose(out.float(), ref, rtol=2**-7, atol=1e-2)
    assert kernel.nbytes == 2 * weight.numel()


@fbgemm
def test_packed_fp16_rejects_weights_beyond_fp16_range():
    from worker_svc.kernels.bf16_linear import PackedFp16Linear

    weight = torch.ones(4, 8, dtype=torch.bfloat16)
    weight[0, 0] = 70000.0
    with pytest.raises(ValueError, match="fp16 range"):
        PackedFp16Linear(weight)


def test_kernel_sources_build_from_a_path_that_does_not_depend_on_the_checkout(tmp_path) -> None:
    """Two checkouts of the same sources share one build: torch rebuilds whenever a source's path
    changes, so the kernels are compiled from a copy named by the sources' digest."""
    from worker_svc.kernels.cpu_ext import CSRC, _sources_in_cache

    first = _sources_in_cache(tmp_path, "d1")
    again = _sources_in_cache(tmp_path, "d1")
    assert first == again and [p.parent for p in first] == [tmp_path / "llmserve_csrc" / "d1"] * len(first)
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in sorted(CSRC.glob("*.cpp"))]
    assert not list((tmp_path / "llmserve_csrc").glob(".*"))  # no staging folder left behind


def _avx512_bf16_ops():
    from worker_svc.kernels import cpu_ext

    ops = cpu_ext.load()
    if ops is None or not ops.bf16_linear_available():
        pytest.skip("this CPU lacks AVX512-BF16 (or the C++ kernels did not build): the packed bf16 kernel cannot run")
    return ops


def _amx_bf16_ops():
    ops = _avx512_bf16_ops()
    if not ops.bf16_linear_amx_available():
        pytest.skip("this CPU lacks AMX-BF16 (or the OS does not grant the AMX tile state): the AMX kernel cannot run")
    return ops


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 15, 16, 17, 32, 33, 64, 130])
@pytest.mark.parametrize("shape", [(96, 1000), (2, 1), (576, 960), (64, 17), (32, 1), (1536, 33)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernel_isa", ["avx512_bf16", "amx_bf16"])
def test_packed_bf16_matches_fp32_reference(rows, shape, bias, kernel_isa):
    """VDPBF16PS: every tile shape (1-6 rows x 1-4 groups of 16 outputs), ragged output groups, K = 2.
    AMX (every row count on tiles where in_features is whole 32-input tiles): every tile step (1-2 row blocks
    x 1-2 output groups), ragged row blocks, and each row computed on its own."""
    from worker_svc.kernels.bf16_linear import PackedBf16Linear

    amx = kernel_isa == "amx_bf16"
    ops = _amx_bf16_ops() if amx else _avx512_bf16_ops()
    in_features, out_features = shape
    gen = torch.Generator().manual_seed(rows * 7 + in_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    kernel = PackedBf16Linear(weight, ops, amx_min_rows=1 if amx else None)
    out = kernel(x, weight, b)
    ref = F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    # fp32 sums, one rounding to bf16: within half a bf16 ulp of the result, plus the fp32 sum's error.
    assert torch.allclose(out.float(), ref, rtol=2**-8, atol=1e-4), (out.float() - ref).abs().max()
    # Each row on its own: the same row alone and inside any batch gives the same bits.
    assert torch.equal(kernel(x[-1:], weight, b), out[-1:])


@pytest.mark.parametrize(("rows", "in_features"), [(449, 576), (1000, 576), (481, 1536), (2050, 64)])
def test_amx_bf16_row_blocks_cover_every_row(rows, in_features):
    """Large calls run in L2-sized row blocks (bf16_linear_amx.cpp, kRowBlockBytes: 448 rows at 576 inputs,
    160 at 1536), balanced and ragged at the end: every row of every block matches the reference, and a
    row's bits do not depend on which block it fell in."""
    from worker_svc.kernels.bf16_linear import PackedBf16Linear

    ops = _amx_bf16_ops()
    gen = torch.Generator().manual_seed(rows + in_features)
    weight = (torch.randn(80, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(80, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    kernel = PackedBf16Linear(weight, ops, amx_min_rows=1)
    out = kernel(x, weight, b)
    ref = F.linear(x.float(), weight.float(), b.float())
    assert torch.allclose(out.float(), ref, rtol=2**-8, atol=1e-4), (out.float() - ref).abs().max()
    for row in (0, rows // 2, rows - 1):
        assert torch.equal(kernel(x[row : row + 1], weight, b), out[row : row + 1])


def test_amx_bf16_runs_from_its_row_threshold_and_only_on_whole_tiles():
    from worker_svc.kernels.bf16_linear import PackedBf16Linear

    ops = _amx_bf16_ops()
    weight = torch.randn(48, 64).to(torch.bfloat16)
    x = torch.randn(4, 64).to(torch.bfloat16)
    kernel = PackedBf16Linear(weight, ops, amx_min_rows=2)
    amx = ops.bf16_linear_packed_amx(x, kernel.packed, 48, None)
    vdp = ops.bf16_linear_packed(x, kernel.packed, 48, None)
    assert torch.equal(kernel(x, weight), amx)  # 4 rows >= 2: AMX
    assert torch.equal(kernel(x[:1], weight), vdp[:1])  # one row: VDPBF16PS
    assert PackedBf16Linear(torch.randn(8, 48).to(torch.bfloat16), ops, amx_min_rows=2).amx_min_rows is None
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.bf16_linear_packed_amx(torch.randn(2, 48).to(torch.bfloat16), ops.bf16_pack_weight(weight[:, :48]),
                                   48, None)


def test_packed_bf16_keeps_leading_dims_and_takes_strided_input():
    from worker_svc.kernels.bf16_linear import PackedBf16Linear

    ops = _avx512_bf16_ops()
    weight = torch.randn(40, 32).to(torch.bfloat16)
    kernel = PackedBf16Linear(weight, ops)
    x = torch.randn(3, 4, 64).to(torch.bfloat16)[..., ::2]  # [3, 4, 32], not contiguous
    out = kernel(x, weight)
    assert out.shape == (3, 4, 40)
    assert torch.allclose(out.float(), F.linear(x.float(), weight.float()), rtol=2**-8, atol=1e-4)
    assert kernel.nbytes == 3 * 16 * 16 * 2 * 2  # 40 outputs padded to 3 groups of 16, 16 input pairs


def test_packed_bf16_refuses_what_it_cannot_run():
    from worker_svc.kernels.bf16_linear import PackedBf16Linear

    ops = _avx512_bf16_ops()
    with pytest.raises(ValueError, match="even number of input features"):
        PackedBf16Linear(torch.randn(8, 7).to(torch.bfloat16), ops)
    kernel = PackedBf16Linear(torch.randn(8, 4).to(torch.bfloat16), ops)
    with pytest.raises(TypeError, match="bfloat16 input"):
        kernel(torch.randn(1, 4), torch.empty(0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,head_dim", [(1, 64), (7, 128), (130, 36)])
def test_rotary_rotate_half_is_bit_identical_to_the_torch_path(dtype, tokens, head_dim):
    """On strided q / k (slices of a fused qkv row, as the Llama attention passes them), every head size
    (36: a tail of 2 past the vector loop), many tokens (threads split them)."""
    from worker_svc.config.model_config import RopeConfig
    from worker_svc.kernels import cpu_ext
    from worker_svc.layers.rotary import RotaryEmbedding, RotateHalfRope, apply_rotary

    ops = cpu_ext.load()
    if ops is None:
        pytest.skip("the C++ kernels did not build (or the CPU lacks AVX2): the torch path runs instead")
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 4096)
    rope.build_cache(torch.device("cpu"))
    gen = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos_sin = rope.lookup(positions, dtype)
    qkv = (torch.randn(tokens, (9 + 2 * 3) * head_dim, generator=gen) * 4).to(dtype)
    q, k, _ = qkv.split([9 * head_dim, 3 * head_dim, 3 * head_dim], dim=-1)
    q, k = q.view(tokens, 9, head_dim), k.view(tokens, 3, head_dim)
    layer = RotateHalfRope()
    layer.cpu_ops = ops
    got_q, got_k = layer(q, k, cos_sin)
    want_q, want_k = apply_rotary(q, k, cos_sin)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    q32, k32 = layer(q.float(), k.float(), (cos_sin[0].float(), cos_sin[1].float()))  # fp32: the torch path
    assert torch.equal(q32, apply_rotary(q.float(), k.float(), (cos_sin[0].float(), cos_sin[1].float()))[0])


def test_rotary_rotate_half_refuses_what_it_cannot_run():
    from worker_svc.kernels import cpu_ext

    ops = cpu_ext.load()
    if ops is None:
        pytest.skip("the C++ kernels did not build (or the CPU lacks AVX2)")
    q, k = torch.randn(2, 4, 64).to(torch.bfloat16), torch.randn(2, 2, 64).to(torch.bfloat16)
    cos = torch.randn(2, 1, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.rotary_rotate_half(q, k, cos.float(), cos.float())
    with pytest.raises(RuntimeError, match="disagree"):
        ops.rotary_rotate_half(q, k[:1], cos, cos)
    with pytest.raises(RuntimeError, match="float32"):
        ops.rotary_rotate_half(q.float(), k.float(), cos.float(), cos.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,d", [(1, 1536), (16, 1536), (130, 24), (3, 20), (2, 5)])
def test_silu_and_mul_rounds_as_the_torch_path(dtype, rows, d):
    """silu(gate) * up in one pass: the silu rounded to the dtype, then the product, as F.silu(gate) * up rounds.
    Widths past the 16-lane loop (24: one 8-lane step; 20, 5: scalar tails); many rows (threads split them);
    saturating gates (+-89, +-100 give -0 and the identity, as in torch; on the 8-lane step also -88.1 .. -88.7,
    where e^-g is still finite and silu a tiny non-zero). Its e^x is a polynomial, not torch's
    libm, so a rounded silu may land one unit of the last place apart now and then: at most 1 in 10^4."""
    from worker_svc.kernels import cpu_ext
    from worker_svc.layers.activation import silu_and_mul
    from worker_svc.layers.mlp import GatedMLP
    from worker_svc.parallel.context import TPContext

    ops = cpu_ext.load()
    if ops is None:
        pytest.skip("the C++ kernels did not build (or the CPU lacks AVX2): the torch path runs instead")
    gen = torch.Generator().manual_seed(rows * d)
    gate_up = (torch.randn(rows, 2 * d, generator=gen) * 4).to(dtype)
    gate_up[0, : min(d, 6)] = torch.tensor([-100.0, -89.0, 89.0, 100.0, 0.0, -0.0])[: min(d, 6)].to(dtype)
    if d == 24:  # the 8-lane (AVX2) step: gates whose e^-g is still finite in fp32 (silu tiny, not -0) and past it
        gate_up[0, 16:24] = torch.tensor([-87.9, -88.1, -88.3, -88.5, -88.7, -88.8, -89.0, -100.0]).to(dtype)
    got, want = ops.silu_and_mul(gate_up), silu_and_mul(gate_up)
    assert got.shape == want.shape and got.dtype == dtype
    assert (got != want).float().mean().item() <= 1e-4
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)
    assert torch.equal(got[0, : min(d, 6)], want[0, : min(d, 6)])
    assert torch.equal(got[0, 16:24], want[0, 16:24])  # regression: exp8 saturated at 88, not ln(FLT_MAX)
    # The MLP takes it once the kernel plan hands it the ops; fp32 stays on the torch path.
    mlp = GatedMLP(8, d, TPContext())
    mlp.cpu_ops = ops
    with torch.profiler.profile() as prof:
        mlp.to(dtype)(torch.randn(3, 8).to(dtype))
    assert "llmserve_cpu::silu_and_mul" in {event.key for event in prof.key_averages()}
    with pytest.raises(RuntimeError, match="float32 keeps the torch path"):
        ops.silu_and_mul(gate_up.float())
    with pytest.raises(RuntimeError, match="2 d"):
        ops.silu_and_mul(gate_up[:, :-1].contiguous())
