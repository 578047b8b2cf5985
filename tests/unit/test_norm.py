"""RMSNorm: the C++ ops (kernels/csrc/rms_norm_avx2.cpp) equal the torch path they replace, which
the model oracle tests hold to HF's LlamaRMSNorm."""

from __future__ import annotations

import pytest
import torch

from worker_svc.kernels import cpu_ext
from worker_svc.layers.norm import RMSNorm

CPU_OPS = cpu_ext.load()
pytestmark = pytest.mark.skipif(CPU_OPS is None, reason="AVX2 kernels unavailable on this host")


def _norms(hidden: int, dtype: torch.dtype) -> tuple[RMSNorm, RMSNorm]:
    torch_norm = RMSNorm(hidden, 1e-6)
    torch_norm.weight.data = (torch.rand(hidden, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    fused = RMSNorm(hidden, 1e-6)
    fused.weight.data = torch_norm.weight.data.clone()
    fused.cpu_ops = CPU_OPS
    return torch_norm, fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 1024), (5, 100), (40, 64)])
@pytest.mark.parametrize("residual_dtype", ["activation", "float32"])
def test_fused_norms_equal_the_torch_path(dtype, rows, hidden, residual_dtype):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen)
    residual = residual.to(dtype) if residual_dtype == "activation" else residual + 1e-3  # not bf16-representable
    torch_norm, fused = _norms(hidden, dtype)
    expected, expected_residual = torch_norm.forward_with_residual(x, residual)
    if dtype == torch.float32:  # the module keeps fp32 on the torch path; hold the ops themselves to it
        out, summed = CPU_OPS.fused_add_rms_norm(x, residual, fused.weight, fused.eps)
        fused = lambda t: CPU_OPS.rms_norm(t, torch_norm.weight, torch_norm.eps)  # noqa: E731
    else:
        out, summed = fused.forward_with_residual(x, residual)
    assert summed.dtype == expected_residual.dtype == torch.float32  # the residual stream stays fp32
    assert torch.equal(summed, expected_residual)  # residual + x, never rounded
    for got, want in ((out, expected), (fused(x), torch_norm(x))):
        assert got.dtype == dtype and got.shape == want.shape
        # Sums of squares in another order: the fp32 row can differ in its last bit, which a cast to
        # bf16 / fp16 turns into at most one unit in the last place of a few elements.
        ulp = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
        assert ((got.float() - want.float()).abs() <= ulp * want.float().abs() + 1e-6).all()
        if dtype != torch.float32:
            assert (got == want).float().mean().item() > 0.98


def test_non_contiguous_input_takes_the_torch_path():
    torch_norm, fused = _norms(64, torch.bfloat16)
    x = torch.randn(64, 8).to(torch.bfloat16).t()  # [8, 64], not contiguous
    assert torch.equal(fused(x), torch_norm(x))


def test_bad_weight_is_rejected():
    with pytest.raises(RuntimeError, match="weight"):
        CPU_OPS.rms_norm(torch.randn(2, 64), torch.ones(32), 1e-6)


def test_residual_stream_is_not_rounded_to_the_activation_dtype():
    """Regression (bf16 logits cosine 0.9974 vs fp32 on the real model): summing in bf16 loses what
    is added to a large residual; the float32 stream keeps it, on both paths."""
    torch_norm, fused = _norms(64, torch.bfloat16)
    residual = torch.full((2, 64), 256.0)
    x = torch.full((2, 64), 0.5, dtype=torch.bfloat16)  # 256.5 rounds to 256 in bf16
    for norm in (torch_norm, fused):
        _, summed = norm.forward_with_residual(x, residual)
        assert summed.dtype == torch.float32 and torch.equal(summed, torch.full((2, 64), 256.5))
