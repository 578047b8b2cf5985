"""Weight quantization: the fast CPU kernels compute what the quantized weights mean (logits equal a
dequantized fp32 reference within 1e-3 relative), configs are parsed and rejected clearly."""

from __future__ import annotations

import pytest
import torch

from llmserve.bench.driver import greedy_with_split_prefill
from tests.unit.oracle import encode_prompts
from worker_svc.config.engine_config import EngineConfig
from worker_svc.executor.kernel_choice import cpu_quant_kernel
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.executor.quantize import QuantConfigError, dequantized_reference, parse_quant_config
from worker_svc.kernels import cpu_ext
from worker_svc.kernels.quant_linear import Int4WeightOnlyKernel, Int8WeightOnlyKernel

WEIGHT_ONLY = ["int8wo", "int4wo-32", "int4wo-64"]


def _runner(model_dir, config, dtype="float32", **kw) -> ModelRunner:
    return ModelRunner(EngineConfig(model_path=str(model_dir), dtype=dtype, max_total_tokens=2048,
                                    torchao_config=config, **kw))


# tiny's hidden size (64) fits groups up to 64; small (hidden 256, intermediate 512) every group size.
REFERENCE_CASES = [(preset, config) for preset in ("tiny", "small") for config in WEIGHT_ONLY] + [
    ("small", "int4wo-128"),
    ("small", "int4wo-256"),
]


def _has_avx512_quant() -> bool:
    ops = cpu_ext.load()
    return ops is not None and bool(ops.quant_avx512_available())


@pytest.mark.parametrize("preset,config", REFERENCE_CASES)
@pytest.mark.parametrize("cpu_kernel", ["avx512", "avx2", "aten"])
def test_quantized_kernels_match_dequantized_reference(model_factory, preset, config, cpu_kernel):
    if cpu_kernel == "avx2" and cpu_ext.load() is None:
        pytest.skip("AVX2 kernels unavailable on this host")
    if cpu_kernel == "avx512" and not _has_avx512_quant():
        pytest.skip("AVX-512 kernels unavailable on this host (no AVX-512 F/BW/VL/DQ or no C++ kernels)")
    model_dir = model_factory(preset)
    prompts = encode_prompts(model_dir)
    fast = _runner(model_dir, config, cpu_quant_kernel=cpu_kernel)
    kernels = [m.kernel for m in fast.model.modules() if isinstance(getattr(m, "kernel", None),
                                                                   (Int8WeightOnlyKernel, Int4WeightOnlyKernel))]
    assert kernels and all(k.avx512 == (cpu_kernel == "avx512") for k in kernels)  # the set asked for ran
    logits, tokens = greedy_with_split_prefill(fast, prompts, 8, cut_len=3)
    reference = _runner(model_dir, config, cpu_quant_kernel=cpu_kernel)
    dequantized_reference(reference.model)
    ref_logits, ref_tokens = greedy_with_split_prefill(reference, prompts, 8, cut_len=3)
    rel = (logits - ref_logits).abs().max() / ref_logits.abs().max()
    assert rel.item() < 1e-3, rel
    assert tokens == ref_tokens


@pytest.mark.parametrize("rows", [1, 7, 32])
def test_int8dq_aten_kernel_matches_its_reference_per_layer(rows):
    """int8dq also quantizes activations per token, a step function: through a whole model, 1-ulp
    differences upstream flip an occasional rounding, so the kernel is held to the reference layer
    by layer on identical inputs (weight-only configs are held to it on whole-model logits above)."""
    from worker_svc.kernels.quant_linear import Int8DynamicKernel

    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen) * 0.05
    x = torch.randn(rows, 64, generator=gen)
    kernel = Int8DynamicKernel(weight, torch.float32)  # aten's _int_mm (the AVX2 kernel: test_quant_cpu_kernels)
    out = kernel(x, weight)
    ref = torch.nn.functional.linear(kernel.fake_quantize_activations(x), kernel.dequantized())
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert not torch.allclose(out, x @ weight.t(), rtol=1e-5)  # it really quantized something


@pytest.mark.parametrize("cpu_kernel", ["auto", "aten"])
def test_int8dq_model_logits_close_to_reference(model_factory, cpu_kernel):
    model_dir = model_factory("small")
    prompts = encode_prompts(model_dir)
    logits, _ = greedy_with_split_prefill(
        _runner(model_dir, "int8dq", cpu_quant_kernel=cpu_kernel), prompts, 1, cut_len=3
    )
    reference = _runner(model_dir, "int8dq", cpu_quant_kernel=cpu_kernel)
    dequantized_reference(reference.model)
    ref_logits, _ = greedy_with_split_prefill(reference, prompts, 1, cut_len=3)
    assert torch.nn.functional.cosine_similarity(logits, ref_logits, dim=-1).min().item() > 0.999


def test_quantization_changes_the_model_and_is_close_to_bf16(model_factory):
    model_dir = model_factory("small")
    prompts = encode_prompts(model_dir)
    base, _ = greedy_with_split_prefill(_runner(model_dir, "none"), prompts, 1, cut_len=3)
    # Random weights: int8 per channel keeps cosine ~0.999, int4 groups ~0.9 (DESIGN-era figures).
    for config, min_cos in (("int8wo", 0.995), ("int4wo-32", 0.85)):
        quant, _ = greedy_with_split_prefill(_runner(model_dir, config), prompts, 1, cut_len=3)
        cosine = torch.nn.functional.cosine_similarity(quant, base, dim=-1).min().item()
        assert not torch.equal(quant, base)
        assert cosine >= min_cos, (config, cosine)


def test_quantized_weight_bytes(model_factory):
    model_dir = model_factory("small")
    full = _runner(model_dir, "none", dtype="bfloat16", cpu_bf16_linear="aten")
    int8 = _runner(model_dir, "int8wo", dtype="bfloat16", cpu_bf16_linear="aten")
    int4 = _runner(model_dir, "int4wo-64", dtype="bfloat16", cpu_bf16_linear="aten")
    cfg = full.model_config
    linear = cfg.num_hidden_layers * (
        cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size)
        + cfg.q_size * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    rest = full.weight_nbytes - 2 * linear
    # int8: 1 byte per weight + a bf16 scale per output row; int4: half a byte + a bf16 (scale,
    # zero) pair per 64-weight group. Relative to bf16's 2 bytes per weight:
    assert abs((int8.weight_nbytes - rest) / (2 * linear) - 0.5) < 0.01
    assert abs((int4.weight_nbytes - rest) / (2 * linear) - (0.5 + 4 / 64) / 2) < 0.005


@pytest.mark.parametrize("text", ["int3wo", "int4wo-100", "fp4", "int4wo"])
def test_unknown_configs_are_rejected_with_the_list(text):
    with pytest.raises(QuantConfigError, match="int4wo-128"):
        parse_quant_config(text)


@pytest.mark.parametrize("text", ["fp8wo", "fp8dq-per_row"])
def test_fp8_on_cpu_fails_at_start_naming_runnable_configs(tiny_model, text):
    with pytest.raises(QuantConfigError, match="int8wo"):
        _runner(tiny_model, text)


def test_int4_group_must_divide_the_shard(model_factory):
    # tiny: hidden 64, so a 128-wide group cannot fit the q/k/v input dimension.
    with pytest.raises(QuantConfigError, match="not a multiple of the group size 128"):
        _runner(model_factory("tiny"), "int4wo-128")


def test_cpu_quant_kernel_choice():
    assert cpu_quant_kernel("aten", "int8wo") == ("aten", None)
    if torch.backends.cpu.get_cpu_capability() == "AVX2" and cpu_ext.load() is not None:
        # aten's int kernels are scalar on AVX2-only CPUs
        assert cpu_quant_kernel("auto", "int4wo") == ("avx2", cpu_ext.load())
    if _has_avx512_quant():
        assert cpu_quant_kernel("auto", "int4wo") == ("avx512", cpu_ext.load())
        assert cpu_quant_kernel("auto", "int8dq") == ("aten", None)
    if cpu_ext.load() is None:
        with pytest.raises(QuantConfigError, match="--cpu-quant-kernel aten"):
            cpu_quant_kernel("avx2", "int8wo")
    with pytest.raises(ValueError, match="--cpu-quant-kernel"):
        EngineConfig(model_path="x", cpu_quant_kernel="fast")
