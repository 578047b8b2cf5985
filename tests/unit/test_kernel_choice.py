"""The CPU kernel plan (executor/kernel_choice.py): chosen from the EngineConfig, the model kind and the
device before any weight is read, and applied to the loaded model's linears and norms."""

from __future__ import annotations

import pytest
import torch

from worker_svc.attention.torch_native import TorchNativeAttentionBackend
from worker_svc.attention.torch_native_mla import TorchNativeMLABackend
from worker_svc.config.engine_config import EngineConfig
from worker_svc.executor.kernel_choice import DECODE_ATTENTION_ISAS, apply_kernels, attention_backend, choose_kernels
from worker_svc.executor.quantize import QuantConfigError, parse_quant_config
from worker_svc.kernels import cpu_ext
from worker_svc.kernels.bf16_linear import BlockedUpcastLinear, fbgemm_available
from worker_svc.layers.linear import KernelLinear
from worker_svc.layers.norm import RMSNorm

CPU = torch.device("cpu")
NONE = parse_quant_config("none")


def _plan(dtype=torch.bfloat16, mla=False, quant=NONE, head_dim=64, v_head_dim=None, **kw):
    return choose_kernels(EngineConfig(model_path="unused", **kw), quant, mla, CPU, dtype, head_dim=head_dim,
                          v_head_dim=v_head_dim)


def _has_avx512_bf16() -> bool:
    ops = cpu_ext.load()
    return ops is not None and bool(ops.bf16_linear_available())


def _has_amx_bf16() -> bool:
    return _has_avx512_bf16() and bool(cpu_ext.load().bf16_linear_amx_available())


def test_bf16_linear_kernel_applies_only_to_bf16_on_the_cpu():
    assert _plan(cpu_bf16_linear="blocked_upcast").bf16_linear == "blocked_upcast"
    assert _plan(torch.float32, cpu_bf16_linear="blocked_upcast").bf16_linear == "aten"
    assert _plan(torch.float32).bf16_linear == "aten"  # auto
    assert _plan(torch.float32, cpu_bf16_linear="avx512_bf16").bf16_linear == "aten"  # not bf16: nothing to do
    if not fbgemm_available():
        with pytest.raises(ValueError, match="FBGEMM"):
            _plan(torch.float32, cpu_bf16_linear="fbgemm_fp16")


def test_auto_picks_the_packed_bf16_kernel_where_the_cpu_has_avx512_bf16():
    if _has_amx_bf16():
        assert _plan().bf16_linear == "amx_bf16"
        assert _plan(cpu_bf16_linear="amx_bf16").describe()["bf16_linear"] == "amx_bf16"
    else:
        with pytest.raises(ValueError, match="amx_bf16 needs a CPU with AMX-BF16"):
            _plan(cpu_bf16_linear="amx_bf16")
    if _has_avx512_bf16():
        assert _plan().bf16_linear == ("amx_bf16" if _has_amx_bf16() else "avx512_bf16")
        assert _plan(cpu_bf16_linear="avx512_bf16").describe()["bf16_linear"] == "avx512_bf16"
    else:
        assert _plan().bf16_linear in ("aten", "fbgemm_fp16", "blocked_upcast")
        with pytest.raises(ValueError, match="avx512_bf16 needs a CPU with AVX512-BF16"):
            _plan(cpu_bf16_linear="avx512_bf16")
    described = _plan(cpu_bf16_linear="aten").describe()
    assert described["bf16_linear"] == "aten" and described["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert "quant_kernel" not in described
    assert _plan(quant=parse_quant_config("int8wo"), cpu_quant_kernel="aten").describe()["quant_kernel"] == "aten"


def test_apply_kernels_packs_bf16_linears_and_releases_their_weights():
    if not _has_avx512_bf16():
        pytest.skip("this CPU lacks AVX512-BF16 (or the C++ kernels did not build)")
    from worker_svc.kernels.bf16_linear import PackedBf16Linear

    model = torch.nn.Sequential(KernelLinear(4, 8), KernelLinear(3, 8)).to(torch.bfloat16)  # 3 inputs: odd
    x = torch.randn(2, 4).to(torch.bfloat16)
    before = model[0](x)
    apply_kernels(model, _plan(cpu_bf16_linear="avx512_bf16"))
    assert isinstance(model[0].kernel, PackedBf16Linear) and model[0].weight.device.type == "meta"
    assert not isinstance(model[1].kernel, PackedBf16Linear)  # odd in_features: aten keeps it
    assert torch.allclose(model[0](x).float(), before.float(), rtol=2**-7, atol=1e-3)


def test_amx_kernel_runs_from_two_rows_and_from_one_under_deterministic_inference():
    if not _has_amx_bf16():
        pytest.skip("this CPU lacks AMX-BF16 (or the OS does not grant it, or the C++ kernels did not build)")
    for deterministic, min_rows in ((False, 2), (True, 1)):
        model = torch.nn.Sequential(KernelLinear(64, 32), KernelLinear(48, 32)).to(torch.bfloat16)
        apply_kernels(model, _plan(cpu_bf16_linear="amx_bf16", deterministic_inference=deterministic))
        assert model[0].kernel.amx_min_rows == min_rows
        assert model[1].kernel.amx_min_rows is None  # 48 inputs: not whole 32-input tiles, VDPBF16PS only
    model = torch.nn.Sequential(KernelLinear(64, 32)).to(torch.bfloat16)
    apply_kernels(model, _plan(cpu_bf16_linear="avx512_bf16"))
    assert model[0].kernel.amx_min_rows is None


def test_attention_follows_the_model_kind_and_the_cpu_kernels():
    mha = _plan()
    assert mha.attention_decode == ("avx2" if cpu_ext.load() is not None else "grouped_matmul")
    if cpu_ext.load() is not None:
        avx512 = bool(cpu_ext.load().decode_attention_avx512_available())
        bf16_dot = bool(cpu_ext.load().decode_attention_avx512_bf16_available())
        assert mha.describe()["attention_decode_isa"] == ("avx512_bf16" if bf16_dot else "avx512" if avx512 else "avx2")
        assert _plan(torch.float16).describe()["attention_decode_isa"] == ("avx512" if avx512 else "avx2")
        assert _plan(torch.float32).describe()["attention_decode_isa"] == "avx2"  # fp32 pools: the AVX2 code
    backend = attention_backend(mha)
    assert isinstance(backend, TorchNativeAttentionBackend) and backend.decode_impl == mha.attention_decode
    mla = _plan(mla=True, mla_decode="normal")
    assert mla.attention_decode == "normal"
    backend = attention_backend(mla)
    assert isinstance(backend, TorchNativeMLABackend) and backend.mla_decode == "normal"


def test_extend_attention_takes_this_projects_kernel_where_it_fits():
    """AMX tiles where the CPU has AMX-BF16 and key heads are a multiple of 32, VDPBF16PS otherwise; the plan
    names the path the kernel's own auto choice runs."""
    ops = cpu_ext.load()
    if ops is None or not ops.extend_attention_available():
        assert _plan().describe()["attention_extend"] == "sdpa"  # what a host without AVX512-BF16 runs
        pytest.skip("this CPU lacks AVX512-BF16 (or the C++ kernels did not build): only the SDPA choice checked")
    best = "amx_bf16" if ops.extend_attention_amx_available() else "avx512_bf16"
    assert _plan().attention_extend == best and _plan().describe()["attention_extend"] == best
    assert _plan(torch.float32).attention_extend == "sdpa" and _plan(torch.float16).attention_extend == "sdpa"
    assert _plan(head_dim=48).attention_extend == "sdpa"  # values not in multiples of 32
    assert _plan(mla=True, head_dim=48, v_head_dim=32).attention_extend == "avx512_bf16"  # keys off AMX's 32
    assert _plan(mla=True, head_dim=192, v_head_dim=128).attention_extend == best
    assert _plan(deterministic_inference=True).describe()["attention_extend"] == "row_wise"
    assert attention_backend(_plan())._extend_kernel is not None
    assert attention_backend(_plan(torch.float32))._extend_kernel is None
    assert attention_backend(_plan(mla=True, head_dim=192, v_head_dim=128))._extend_kernel is not None


@pytest.mark.skipif(cpu_ext.load() is None, reason="the C++ kernels do not load on this host")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [48, 64, 96, 128])
def test_the_plan_names_the_decode_attention_code_that_runs(dtype, head_dim):
    """The plan asks the kernel's own auto choice, head size included: the AVX-512 paths take heads of 32,
    64 and 128 only, so a bf16 model with heads of 96 runs (and is logged as) the AVX2 code. The auto
    call's output is bit-identical to the named path's forced one (each path rounds its own way)."""
    ops = cpu_ext.load()
    named = _plan(dtype, head_dim=head_dim).describe()["attention_decode_isa"]
    if head_dim in (48, 96) or dtype == torch.float32:
        assert named == "avx2"
    torch.manual_seed(0)
    pool_rows, heads, kv_heads = 40, 6, 2
    q = torch.randn(3, heads, head_dim).to(dtype)
    k_pool = torch.randn(pool_rows, kv_heads, head_dim).to(dtype)
    v_pool = torch.randn(pool_rows, kv_heads, head_dim).to(dtype)
    slots = torch.randperm(pool_rows)[:36].view(3, 12)
    seq_lens = torch.tensor([12, 5, 9])
    isa = {name: number for number, name in DECODE_ATTENTION_ISAS.items()}[named]
    auto = ops.decode_attention(q, k_pool, v_pool, slots, seq_lens, head_dim**-0.5)
    assert torch.equal(auto, ops.decode_attention(q, k_pool, v_pool, slots, seq_lens, head_dim**-0.5, isa))


def test_quant_kernels_only_when_quantizing():
    assert _plan(cpu_quant_kernel="aten", quant=parse_quant_config("int8wo")).quant_ops is None
    assert _plan(cpu_quant_kernel="avx2").quant_ops is None  # nothing to quantize: not even looked up
    if cpu_ext.load() is None:
        with pytest.raises(QuantConfigError, match="cpu-quant-kernel"):
            _plan(cpu_quant_kernel="avx2", quant=parse_quant_config("int8wo"))
    else:
        assert _plan(cpu_quant_kernel="avx2", quant=parse_quant_config("int8wo")).quant_ops is cpu_ext.load()


def _has_avx512_quant() -> bool:
    ops = cpu_ext.load()
    return ops is not None and bool(ops.quant_avx512_available())


def test_auto_quant_kernel_follows_the_cpu():
    int8wo, int4wo, int8dq = (parse_quant_config(c) for c in ("int8wo", "int4wo-32", "int8dq"))
    if _has_avx512_quant():
        for quant in (int8wo, int4wo):
            plan = _plan(quant=quant)
            assert plan.quant_kernel == "avx512" and plan.quant_ops is cpu_ext.load()
            assert plan.describe()["quant_kernel"] == "avx512"
            assert (plan.describe().get("amx_min_rows") == "int4wo 2, int8wo 8") == _has_amx_bf16()
            assert _plan(quant=quant, cpu_quant_kernel="avx512").quant_kernel == "avx512"
        # no AVX-512 int8dq kernel: aten's, vectorized on these CPUs, under auto and avx512 alike
        assert _plan(quant=int8dq).quant_kernel == "aten" and _plan(quant=int8dq).quant_ops is None
        assert _plan(quant=int8dq, cpu_quant_kernel="avx512").quant_kernel == "aten"
    else:
        with pytest.raises(QuantConfigError, match="--cpu-quant-kernel avx512"):
            _plan(quant=int8wo, cpu_quant_kernel="avx512")
        avx2_only = torch.backends.cpu.get_cpu_capability() == "AVX2"
        expected = "avx2" if cpu_ext.load() is not None and avx2_only else "aten"
        assert _plan(quant=int8wo).quant_kernel == expected
    if cpu_ext.load() is not None:  # the AVX2 kernels run on AVX-512 CPUs too, when asked for
        assert _plan(quant=int4wo, cpu_quant_kernel="avx2").quant_kernel == "avx2"
    assert _plan(quant=int4wo, cpu_quant_kernel="aten").quant_kernel == "aten"


def test_apply_kernels_skips_quantized_layers():
    model = torch.nn.Sequential(KernelLinear(4, 4), KernelLinear(4, 4), RMSNorm(4, 1e-6)).to(torch.bfloat16)
    model[1].quantized = True
    plan = _plan(cpu_bf16_linear="blocked_upcast")
    apply_kernels(model, plan)
    assert isinstance(model[0].kernel, BlockedUpcastLinear)
    assert model[1].kernel is torch.nn.functional.linear
    assert model[2].cpu_ops is plan.cpu_ops
