"""Our Llama against HF transformers on the same generated folders (fp32: logits within 1e-4 and
identical greedy tokens; bf16: logits cosine >= 0.999)."""

from __future__ import annotations

import pytest
import torch

from llmserve.bench.driver import chunked_prefill_logits, greedy_with_split_prefill
from tests.unit.oracle import encode_prompts, hf_reference, run_with_late_arrivals
from worker_svc.config.engine_config import EngineConfig
from worker_svc.engine.engine import Engine
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.kernels import cpu_ext
from worker_svc.sampling import SamplingParams

pytest.importorskip("transformers")

OUTPUT_LEN = 32
ATOL = 1e-4
CASES = {
    "tiny": ("tiny", {}),
    "small": ("small", {}),
    "tied": ("tiny", {"tie_word_embeddings": True}),
    "head_dim": ("tiny", {"head_dim": 32}),
    "llama3_rope": ("tiny", {"rope_scaling": "llama3"}),
    "sharded": ("tiny", {"shards": 2}),
}
GREEDY = SamplingParams(max_new_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, model_factory):
    preset, variants = CASES[request.param]
    model_dir = model_factory(preset, **variants)
    prompts = encode_prompts(model_dir)
    ref_logits, ref_tokens = hf_reference(model_dir, prompts, OUTPUT_LEN)
    return model_dir, prompts, ref_logits, ref_tokens


def _runner(model_dir, dtype="float32", **kw) -> ModelRunner:
    return ModelRunner(EngineConfig(model_path=str(model_dir), dtype=dtype, max_total_tokens=4096, **kw))


def test_prefill_extend_decode_match_hf(case):
    model_dir, prompts, ref_logits, ref_tokens = case
    logits, tokens = greedy_with_split_prefill(_runner(model_dir), prompts, OUTPUT_LEN, cut_len=3)
    assert (logits - ref_logits).abs().max().item() < ATOL
    assert tokens == ref_tokens


def test_chunked_prefill_logits_match_hf(case):
    model_dir, prompts, ref_logits, _ = case
    final = chunked_prefill_logits(_runner(model_dir), prompts, chunk=5)
    assert (final - ref_logits).abs().max().item() < ATOL


def test_continuous_batching_matches_hf(case):
    """Prompts arrive while others decode; long prompts are prefilled in chunks of 8 tokens. Each
    request's final prefill logits (taken from whichever mixed step completed its prompt) and its
    greedy tokens match HF."""
    model_dir, prompts, ref_logits, ref_tokens = case
    engine = Engine(EngineConfig(model_path=str(model_dir), dtype="float32", max_total_tokens=4096,
                                 chunked_prefill_size=8, max_prefill_tokens=16))

    def short_prompt_decodes_while_long_one_is_chunked(first):
        assert len(first[0].output_ids) >= 4
        assert engine.scheduler.chunked is first[1] or len(first[1].output_ids) > 0

    reqs, prefill = run_with_late_arrivals(engine, prompts, GREEDY, short_prompt_decodes_while_long_one_is_chunked)
    assert [r.output_ids for r in reqs] == ref_tokens
    for logits, ref in zip(prefill, ref_logits, strict=False):
        assert (logits - ref).abs().max().item() < ATOL
    assert engine.flush_cache()[0]  # the radix cache keeps finished prompts until flushed
    assert engine.runner.kv.allocator.available() == engine.runner.kv.allocator.size


def test_retraction_under_memory_pressure_matches_hf(case):
    model_dir, prompts, _, ref_tokens = case
    total = sum(len(p) for p in prompts) + OUTPUT_LEN * 2
    engine = Engine(EngineConfig(model_path=str(model_dir), dtype="float32", max_total_tokens=total))
    results = engine.generate(prompts, GREEDY)
    assert [r.output_ids for r in results] == ref_tokens
    assert sum(r.num_retractions for r in results) > 0, "the pool was sized to force retraction"
    assert engine.flush_cache()[0]  # the radix cache keeps finished prompts until flushed
    assert engine.runner.kv.allocator.available() == total


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("kernel", ["auto", "aten", "amx_bf16", "avx512_bf16", "fbgemm_fp16_lowmem", "blocked_upcast"])
def test_bf16_logits_close_to_hf_fp32(model_factory, preset, kernel):
    if kernel.startswith("fbgemm") and "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("torch built without FBGEMM")
    if kernel == "avx512_bf16" and ((ops := cpu_ext.load()) is None or not ops.bf16_linear_available()):
        pytest.skip("this CPU lacks AVX512-BF16 (or the C++ kernels did not build)")
    if kernel == "amx_bf16" and ((ops := cpu_ext.load()) is None or not ops.bf16_linear_amx_available()):
        pytest.skip("this CPU lacks AMX-BF16 (or the OS does not grant it, or the C++ kernels did not build)")
    model_dir = model_factory(preset)
    prompts = encode_prompts(model_dir)
    ref_logits, _ = hf_reference(model_dir, prompts, OUTPUT_LEN)
    runner = _runner(model_dir, dtype="bfloat16", cpu_bf16_linear=kernel)
    logits, _ = greedy_with_split_prefill(runner, prompts, 1, cut_len=3)
    cosine = torch.nn.functional.cosine_similarity(logits, ref_logits, dim=-1)
    assert cosine.min().item() >= 0.999, cosine
