"""torch.compile of the decode forward (worker_svc/executor/compiled_decode.py): where it is on and why not
elsewhere; a compiled runner gives the eager runner's logits, bit for bit, over decode steps with requests
joining and finishing (one request, several, unequal contexts, more than --torch-compile-max-bs, which run
eagerly), with no graph compiled after the warm-up; the warm-up writes only the padding slot; the state
reaches GetServerInfo's plan; the flags reach the EngineConfig. Compiling takes ~10-30 s per model on 2
cores (inductor caches it for later runs)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch

from tests.ranks import gloo_groups
from tests.unit.lockstep import decode_script, run_lockstep
from tests.unit.oracle import encode_prompts
from tests.unit.test_cuda_graph_runner import Requests
from worker_svc.config.engine_config import EngineConfig
from worker_svc.executor.compiled_decode import compile_plan
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.kernels import cpu_ext
from worker_svc.kernels.bf16_linear import fbgemm_available
from worker_svc.parallel.context import TPContext

CPU_OPS = cpu_ext.load()
CPU = torch.device("cpu")


def _engine_config(model_dir: Path, **overrides) -> EngineConfig:
    return EngineConfig(model_path=str(model_dir), dtype="bfloat16", max_total_tokens=2048, max_running_requests=12,
                        **overrides)


def test_compile_plan(model_factory) -> None:
    llama = ModelRunner(_engine_config(model_factory("tiny")))
    assert llama.compiled_decode is None and llama.torch_compile == "off: --enable-torch-compile not given"
    config = dataclasses.replace(llama.engine_config, enable_torch_compile=True)
    plan = compile_plan(config, CPU, TPContext(), llama.model)
    assert plan.enabled and plan.max_bs == 12  # never past the largest possible decode (default 32)
    assert compile_plan(dataclasses.replace(config, torch_compile_max_bs=4), CPU, TPContext(), llama.model).max_bs == 4
    cuda = compile_plan(config, torch.device("cuda"), TPContext(), llama.model)
    assert not cuda.enabled and "CUDA graphs" in cuda.reason
    (store, group), _ = gloo_groups(2, "compile-plan")
    tp = compile_plan(config, CPU, TPContext(rank=0, size=2, group=group, store=store), llama.model)
    assert not tp.enabled and "all-reduce" in tp.reason
    deepseek = ModelRunner(_engine_config(model_factory("tiny", arch="deepseek_v2"), moe_experts="loop"))
    looped = compile_plan(dataclasses.replace(deepseek.engine_config, enable_torch_compile=True), CPU, TPContext(),
                          deepseek.model)
    assert not looped.enabled and "host sync" in looped.reason


@pytest.mark.skipif(CPU_OPS is None, reason="the CPU kernels (AVX2) are unavailable: the compiled path is theirs")
@pytest.mark.parametrize(("torchao_config", "bf16_linear"), [
    (None, "auto"),
    ("int4wo-32", "auto"),
    # What an AVX2-only host picks for bf16: FBGEMM's fp16 GEMM (an opaque op to dynamo). Forced here so
    # every host compiles through it; it once made compiling fail on such hosts (decode ran eagerly).
    pytest.param(None, "fbgemm_fp16", marks=pytest.mark.skipif(not fbgemm_available(),
                                                                reason="this torch build has no FBGEMM")),
])
def test_compiled_decode_gives_the_eager_logits(model_factory, torchao_config, bf16_linear) -> None:
    """bf16 on this host's kernels (and its int4 weight-only kernel): the same logits as the eager runner
    at every decode step, bit for bit (inductor rounds where eager does: emulate_precision_casts)."""
    model_dir = model_factory("tiny")
    config = _engine_config(model_dir, torchao_config=torchao_config, cpu_bf16_linear=bf16_linear)
    eager = Requests(ModelRunner(dataclasses.replace(config, disable_fused_layers=True)))  # layer by layer
    compiled_runner = ModelRunner(dataclasses.replace(config, enable_torch_compile=True, torch_compile_max_bs=4))
    compiled = compiled_runner.compiled_decode
    assert compiled is not None and compiled_runner.torch_compile == "on"
    # The warm-up wrote only the padding slot: nothing else of the pool moved from its initial zeros.
    for layer in range(len(compiled_runner.kv.pool.k_buffers)):
        for buffers in compiled_runner.kv.pool.buffers(layer):
            assert not buffers[1:].any()
    batch_sizes = run_lockstep(decode_script(encode_prompts(model_dir)), eager, Requests(compiled_runner))
    compiled_steps = sum(size <= 4 for size in batch_sizes)
    assert compiled.failed is None  # no step needed a graph the warm-up did not build
    assert compiled.steps_run == compiled_steps == len(batch_sizes) - 2  # the two steps of five requests ran eagerly


def test_flags_reach_the_engine_config() -> None:
    from llmserve.commands.engine_args import add_engine_args, engine_argv, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    default = engine_config_from_args(parser.parse_args(["--model", "m"]))
    assert not default.enable_torch_compile and default.torch_compile_max_bs == 32
    args = parser.parse_args(["--model", "m", "--enable-torch-compile", "--torch-compile-max-bs", "8"])
    config = engine_config_from_args(args)
    assert config.enable_torch_compile and config.torch_compile_max_bs == 8
    argv = engine_argv(args)  # what a worker under `serve` is started with
    assert "--enable-torch-compile" in argv and argv[argv.index("--torch-compile-max-bs") + 1] == "8"
    with pytest.raises(ValueError, match="torch-compile-max-bs"):
        dataclasses.replace(config, torch_compile_max_bs=0)
