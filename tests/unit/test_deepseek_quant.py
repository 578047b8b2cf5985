"""Quantization of DeepSeek-V2 (worker_svc/executor/quantize.py): attention projections and MoE experts (routed and
shared) run the quantized CPU kernels and compute what their quantized weights mean (logits equal the
dequantized fp32 reference within 1e-3 relative); kv_b_proj is kept unquantized for the absorbed decode,
which still equals the normal (decompressing) decode."""

from __future__ import annotations

import pytest
import torch

from llmserve.bench.driver import greedy_with_split_prefill
from tests.unit.oracle import encode_prompts
from worker_svc.config.engine_config import EngineConfig
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.executor.quantize import dequantized_reference
from worker_svc.kernels.quant_linear import Int4WeightOnlyKernel, Int8WeightOnlyKernel

OUTPUT_LEN = 8


def _runner(model_dir, config, **kw) -> ModelRunner:
    return ModelRunner(EngineConfig(model_path=str(model_dir), dtype="float32", max_total_tokens=2048,
                                    torchao_config=config, **kw))


# int4 group 32 divides every quantized input dimension of both presets (tiny: 64, 32, 128; small:
# 256, 96, 64, 128); kv_b_proj's input (kv_lora_rank) is not quantized.
@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("config", ["int8wo", "int4wo-32"])
def test_quantized_deepseek_matches_dequantized_reference(model_factory, preset, config):
    model_dir = model_factory(preset, arch="deepseek_v2")
    prompts = encode_prompts(model_dir)
    fast = _runner(model_dir, config)
    logits, tokens = greedy_with_split_prefill(fast, prompts, OUTPUT_LEN, cut_len=3)
    reference = _runner(model_dir, config)
    dequantized_reference(reference.model)
    ref_logits, ref_tokens = greedy_with_split_prefill(reference, prompts, OUTPUT_LEN, cut_len=3)
    rel = (logits - ref_logits).abs().max() / ref_logits.abs().max()
    assert rel.item() < 1e-3, rel
    assert tokens == ref_tokens


def test_what_is_quantized(model_factory):
    model_dir = model_factory("small", arch="deepseek_v2")
    runner = _runner(model_dir, "int8wo")
    layer = runner.model.model.layers[1]  # an MoE layer
    attn, moe = layer.self_attn, layer.mlp
    for module in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.o_proj,
                   moe.experts[0].gate_up_proj, moe.experts[15].down_proj,
                   moe.shared_experts.gate_up_proj, moe.shared_experts.down_proj,
                   runner.model.model.layers[0].mlp.down_proj):
        assert isinstance(module.kernel, Int8WeightOnlyKernel) and module.weight.is_meta
    assert not getattr(attn.kv_b_proj, "quantized", False) and not attn.kv_b_proj.weight.is_meta
    assert moe.gate.weight.dtype == torch.float32 and not moe.gate.weight.is_meta  # the router stays
    int4 = _runner(model_dir, "int4wo-32").model.model.layers[1].mlp.experts[3].down_proj
    assert isinstance(int4.kernel, Int4WeightOnlyKernel)


@pytest.mark.parametrize("config", ["int8wo", "int8dq"])
def test_quantized_absorbed_decode_equals_normal_decode(model_factory, config):
    model_dir = model_factory("tiny", arch="deepseek_v2")
    prompts = encode_prompts(model_dir)
    results = {}
    for mode in ("absorbed", "normal"):
        results[mode] = greedy_with_split_prefill(_runner(model_dir, config, mla_decode=mode), prompts, OUTPUT_LEN, 3)
    (a_logits, a_tokens), (n_logits, n_tokens) = results["absorbed"], results["normal"]
    assert torch.equal(a_logits, n_logits)  # prefill is the same path
    assert a_tokens == n_tokens


def test_int8dq_deepseek_close_to_reference(model_factory):
    model_dir = model_factory("small", arch="deepseek_v2")
    prompts = encode_prompts(model_dir)
    logits, _ = greedy_with_split_prefill(_runner(model_dir, "int8dq"), prompts, 1, cut_len=3)
    reference = _runner(model_dir, "int8dq")
    dequantized_reference(reference.model)
    ref_logits, _ = greedy_with_split_prefill(reference, prompts, 1, cut_len=3)
    assert torch.nn.functional.cosine_similarity(logits, ref_logits, dim=-1).min().item() > 0.999
