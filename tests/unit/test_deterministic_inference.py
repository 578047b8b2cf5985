"""Deterministic inference (--enable-deterministic-inference): row-stable fp32 linears
(kernels/row_stable.py) and attention row by row make a request's logits independent of what shares its
step: alone or beside other requests, prefilled in one chunk or in several, decoded in a batch of one or of
five, Llama and DeepSeek-V2 (MLA, MoE), bit for bit. The mode stays within the default mode's rounding
(which the HF oracle tests hold), and the plan and the flag say it is on."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmserve.bench.driver import StaticBatch
from tests.unit.oracle import encode_prompts
from worker_svc.config.engine_config import EngineConfig
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.kernels.row_stable import REFERENCE_ROWS, RowStableLinear, pad_rows, probe_row_padding
from worker_svc.parallel.context import TPContext

ROW_PADDING = probe_row_padding()


@pytest.fixture(scope="module")
def models(model_factory) -> dict[str, Path]:
    return {"llama": model_factory("tiny"), "deepseek_v2": model_factory("tiny", arch="deepseek_v2")}


def _runner(model_dir: Path, deterministic: bool = True) -> ModelRunner:
    engine = EngineConfig(model_path=str(model_dir), dtype="float32", max_total_tokens=1024, max_running_requests=8,
                          deterministic_inference=deterministic)
    return ModelRunner(engine, TPContext())


@pytest.mark.parametrize("out_features, in_features", [(96, 80), (320, 128), (40, 1000)])
def test_row_stable_linear_rounds_every_row_as_a_big_gemm(out_features, in_features):
    """Shapes the probe did not see: every row count from 1 to 40 gives each row as a 64-row GEMM does
    (where the host needs no padding, the probe says so and aten's rows already agree)."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(REFERENCE_ROWS, in_features, generator=generator)
    reference = F.linear(x, weight)
    linear = RowStableLinear(ROW_PADDING) if ROW_PADDING is not None else F.linear
    for rows in range(1, 41):
        assert torch.equal(linear(x[:rows], weight, None), reference[:rows]), f"{rows} rows"


def test_the_probe_pads_only_upwards_to_stable_counts():
    if ROW_PADDING is None:
        pytest.skip("this host's fp32 GEMM rounds every row count alike: nothing to pad")
    assert all(rows <= target for rows, target in enumerate(ROW_PADDING))
    assert all(ROW_PADDING[target] == target for target in ROW_PADDING if target < len(ROW_PADDING))
    x = torch.ones(3, 2)
    padded = pad_rows(x, ROW_PADDING)
    assert padded.shape[0] == ROW_PADDING[3] and torch.equal(padded[:3], x) and not padded[3:].any()
    assert pad_rows(x, None) is x


def _final_logits(runner: ModelRunner, prompts: list[list[int]], chunk: int, decode_steps: int = 4) -> list:
    """Per request: the logits after prefill (in chunks of ``chunk``) and after each greedy decode step."""
    batch = StaticBatch(runner, len(prompts))
    try:
        steps = [batch.prefill_in_chunks(prompts, chunk)]  # [B, V] each
        for _ in range(decode_steps):
            steps.append(batch.decode(steps[-1].argmax(dim=-1)))
    finally:
        batch.release()
    return [[step[i] for step in steps] for i in range(len(prompts))]


@pytest.mark.parametrize("name", ["llama", "deepseek_v2"])
def test_a_request_gives_the_same_logits_whatever_shares_its_step(models, name):
    prompts = encode_prompts(models[name])
    target = prompts[1]  # 43 tokens
    runner = _runner(models[name])
    alone_whole = _final_logits(runner, [target], chunk=64)[0]
    alone_chunked = _final_logits(runner, [target], chunk=5)[0]
    crowded = _final_logits(runner, [prompts[0], target, prompts[2], prompts[3], prompts[4][:9]], chunk=7)[1]
    for a, b, c in zip(alone_whole, alone_chunked, crowded, strict=True):
        assert torch.equal(a, b), (a - b).abs().max().item()
        assert torch.equal(a, c), (a - c).abs().max().item()


@pytest.mark.parametrize("name", ["llama", "deepseek_v2"])
def test_deterministic_mode_stays_within_the_default_modes_rounding(models, name):
    """The default mode is what the HF oracle tests check; deterministic inference computes the same
    thing in another order."""
    prompts = encode_prompts(models[name])[:4]
    default = _final_logits(_runner(models[name], deterministic=False), prompts, chunk=6)
    deterministic = _final_logits(_runner(models[name]), prompts, chunk=6)
    for rows_default, rows_deterministic in zip(default, deterministic, strict=True):
        for a, b in zip(rows_default, rows_deterministic, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
            assert a.argmax() == b.argmax()


def test_the_plan_says_so_and_the_flag_reaches_followers(models):
    runner = _runner(models["deepseek_v2"])
    plan = runner.kernels.describe()
    assert plan["moe_experts"] == "loop"
    assert plan["deterministic"] == ("fp32 linears row_stable" if ROW_PADDING else "on")
    with pytest.raises(ValueError, match="deterministic"):
        EngineConfig(model_path="m", deterministic_inference=True, moe_experts="grouped")

    from llmserve.commands.engine_args import add_engine_args, engine_argv, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", "m", "--enable-deterministic-inference"])
    assert engine_config_from_args(args).deterministic_inference
    assert "--enable-deterministic-inference" in engine_argv(args)


def test_row_wise_attention_without_the_cpu_kernels(models):
    """Hosts without this project's AVX2 kernels attend row by row in torch: the same batch invariance,
    and the kernel's numbers within rounding."""
    from worker_svc.attention.torch_native import TorchNativeAttentionBackend

    prompts = encode_prompts(models["llama"])
    runner = _runner(models["llama"])
    with_kernel = _final_logits(runner, [prompts[1]], chunk=64)[0]
    runner.attn_backend = TorchNativeAttentionBackend(decode_impl="grouped_matmul", row_wise=True)
    alone = _final_logits(runner, [prompts[1]], chunk=64)[0]
    crowded = _final_logits(runner, [prompts[0], prompts[1], prompts[2]], chunk=5)[1]
    for kernel, a, c in zip(with_kernel, alone, crowded, strict=True):
        assert torch.equal(a, c), (a - c).abs().max().item()
        torch.testing.assert_close(a, kernel, rtol=0, atol=1e-4)
