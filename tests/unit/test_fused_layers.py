"""Fused layers (worker_svc/executor/fused_layers.py, kernels/csrc/fused_layers.cpp): where it is on and why
not elsewhere; a fused runner gives the layer-by-layer runner's logits bit for bit over decode steps with
requests joining and finishing (bf16, int4 and int8 weight-only) and over extend steps (prefills, extends over a
cached prefix, mixed steps with riders), and leaves the same KV in the pool;
FusedLayers refuses a layer whose shapes disagree with the model; the flag reaches the EngineConfig."""

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
from worker_svc.executor.fused_layers import fused_layers_plan
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.forward_batch import ForwardMode, StepInput
from worker_svc.kernels import cpu_ext
from worker_svc.parallel.context import TPContext

CPU_OPS = cpu_ext.load()
CPU = torch.device("cpu")
needs_kernels = pytest.mark.skipif(CPU_OPS is None, reason="this project's C++ kernels are unavailable (not x86-64 "
                                   "with AVX2, or no compiler): the fused layers run them")


def _engine_config(model_dir: Path, **overrides) -> EngineConfig:
    return EngineConfig(model_path=str(model_dir), dtype="bfloat16", max_total_tokens=2048, max_running_requests=12,
                        **overrides)


def _packed_kernels_here() -> str | None:
    """Why this host's bf16 linears are not on a packed kernel the fused layers run (None: they are)."""
    if CPU_OPS is None:
        return "no C++ kernels"
    if not CPU_OPS.bf16_linear_available():
        return "no AVX512-BF16: bf16 linears run FBGEMM or aten, which the fused layers do not call"
    return None


@needs_kernels
def test_fused_layers_plan(model_factory) -> None:
    off_here = _packed_kernels_here()
    llama = ModelRunner(_engine_config(model_factory("tiny")))
    if off_here is None:
        assert llama.fused_layers is not None and llama.fused_layers_state == "on"
    else:
        assert llama.fused_layers is None and "packed kernels" in llama.fused_layers_state
    config, model, plan = llama.engine_config, llama.model, llama.kernels

    def reason(**changes) -> str:
        kwargs = {"engine_config": config, "device": CPU, "tp": TPContext(), "model": model, "kernels": plan,
                  "dtype": torch.bfloat16, **changes}
        result = fused_layers_plan(**kwargs)
        assert not result.enabled
        return result.reason

    assert reason(engine_config=dataclasses.replace(config, disable_fused_layers=True)) == "--disable-fused-layers"
    assert "for the CPU" in reason(device=torch.device("cuda"))
    (store, group), _ = gloo_groups(2, "fused-plan")
    assert "all-reduce" in reason(tp=TPContext(rank=0, size=2, group=group, store=store))
    assert "C++ kernels" in reason(kernels=dataclasses.replace(plan, cpu_ops=None))
    assert "bf16 / fp16" in reason(dtype=torch.float32)
    aten = ModelRunner(_engine_config(model_factory("tiny"), cpu_bf16_linear="aten"))
    assert aten.fused_layers is None and "not one of this project's packed kernels" in aten.fused_layers_state
    deepseek = ModelRunner(_engine_config(model_factory("tiny", arch="deepseek_v2")))
    assert deepseek.fused_layers is None
    assert "Llama-family" in deepseek.fused_layers_state or "decode attention" in deepseek.fused_layers_state


@needs_kernels
@pytest.mark.parametrize("torchao_config", [None, "int4wo-32", "int8wo"])
def test_fused_layers_gives_the_layer_by_layer_logits(model_factory, torchao_config) -> None:
    """Same kernels in the same order: every decode step's logits equal the modules' bit for bit, and the KV
    the fused layers stored equals what the modules stored."""
    if (why := _packed_kernels_here()) is not None:
        pytest.skip(why)
    model_dir = model_factory("tiny")
    config = _engine_config(model_dir, torchao_config=torchao_config)
    fused_runner = ModelRunner(config)
    assert fused_runner.fused_layers is not None, fused_runner.fused_layers_state
    modules_runner = ModelRunner(dataclasses.replace(config, disable_fused_layers=True))
    batch_sizes = run_lockstep(decode_script(encode_prompts(model_dir)), Requests(modules_runner),
                               Requests(fused_runner))
    assert batch_sizes == [1] * 3 + [3] * 3 + [2] * 2 + [5] * 2 + [3] * 3 + [1] * 2
    for layer in range(len(fused_runner.kv.pool.k_buffers)):
        for ours, theirs in zip(fused_runner.kv.pool.buffers(layer), modules_runner.kv.pool.buffers(layer),
                                strict=True):
            assert torch.equal(ours, theirs)


def _extend(requests: Requests, new_tokens: dict[str, list[int]]) -> torch.Tensor:
    """One EXTEND step: each request adds its tokens after what it holds (a new one from position 0); a request
    adding one token after a prefix is a mixed step's rider. -> the step's logits."""
    kv, rows, prefix_lens, seq_lens, positions, slots = requests.kv, [], [], [], [], []
    for rid, tokens in new_tokens.items():
        if rid not in requests.live:
            row = kv.req_table.alloc()
            assert row is not None
            requests.live[rid] = (row, [])
        row, held = requests.live[rid]
        new = kv.allocator.alloc(len(tokens))
        assert new is not None
        rows.append(row)
        prefix_lens.append(len(held))
        seq_lens.append(len(held) + len(tokens))
        positions.append(torch.arange(len(held), len(held) + len(tokens)))
        slots.append(new)
        held.extend(new.tolist())
        kv.req_table.table[row, : len(held)] = torch.tensor(held)
    return requests.runner.forward(StepInput(
        mode=ForwardMode.EXTEND, input_ids=torch.tensor([t for tokens in new_tokens.values() for t in tokens]),
        positions=torch.cat(positions), out_slots=torch.cat(slots), req_rows=torch.tensor(rows), seq_lens=seq_lens,
        prefix_lens=prefix_lens))


@needs_kernels
def test_fused_extend_steps_give_the_layer_by_layer_logits(model_factory) -> None:
    """Extend steps through FusedLayers.forward_extend: a prefill, an extend over a cached prefix beside a fresh
    prompt, and mixed steps whose riders (one token after their prefix) attend as one decode; each step's
    logits equal the modules' bit for bit, and so does the KV left in the pool."""
    if (why := _packed_kernels_here()) is not None:
        pytest.skip(why)
    if not CPU_OPS.extend_attention_available():
        pytest.skip("this CPU lacks AVX512-BF16: extend attention runs SDPA, and extend steps stay on the modules")
    model_dir = model_factory("tiny", config_override={"hidden_size": 128})  # heads of 32: the kernel takes them
    config = _engine_config(model_dir)
    fused_runner = ModelRunner(config)
    assert fused_runner.fused_layers is not None and fused_runner.fused_layers.extend_impl is not None
    modules_runner = ModelRunner(dataclasses.replace(config, disable_fused_layers=True))
    prompts = encode_prompts(model_dir)
    runners = (Requests(modules_runner), Requests(fused_runner))
    steps = [
        {"a": prompts[0][:40]},  # a prefill
        {"a": prompts[1][:20], "b": prompts[2][:9]},  # 20 more after a's 40, beside a fresh prompt
        {"a": [5], "b": prompts[3][:30], "c": prompts[4][:70]},  # a rides along; b extends; c is new
        {"a": [7], "b": [9], "c": prompts[0][:3]},  # two riders and a short extend
    ]
    for step in steps:
        logits = [_extend(r, step) for r in runners]
        assert logits[0].shape[0] == len(step)
        torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)
    for layer in range(len(fused_runner.kv.pool.k_buffers)):
        for ours, theirs in zip(fused_runner.kv.pool.buffers(layer), modules_runner.kv.pool.buffers(layer),
                                strict=True):
            assert torch.equal(ours, theirs)


@needs_kernels
def test_fused_layers_refuse_shapes_the_model_does_not_have() -> None:
    layers = torch.classes.llmserve_cpu.FusedLayers(64, 4, 2, 16, 128, 1e-5, 0.25)
    norm = torch.ones(64, dtype=torch.bfloat16)
    kv = torch.zeros(8, 2, 16, dtype=torch.bfloat16)
    weights = [torch.zeros(1, dtype=torch.uint8)] * 4
    shapes = [128, 64, 0, 0, 0, 64, 64, 0, 0, 0, 256, 64, 0, 0, 0, 64, 128, 0, 0, 0]
    wrong = list(shapes)
    wrong[0] = 96  # qkv must be (4 + 2 * 2) * 16 = 128 outputs
    with pytest.raises(RuntimeError, match="linear 0 is 96 x 64"):
        layers.add_layer(norm, norm, kv, kv, [0] * 4, weights, [torch.empty(0)] * 4, wrong)
    with pytest.raises(RuntimeError, match="KV buffers"):
        layers.add_layer(norm, norm, kv[:, :1], kv, [0] * 4, weights, [torch.empty(0)] * 4, shapes)
    with pytest.raises(RuntimeError, match="int8 needs scales"):
        layers.add_layer(norm, norm, kv, kv, [2] * 4, weights, [torch.empty(0)] * 4, shapes)
    with pytest.raises(RuntimeError, match="no layers"):
        layers.forward(torch.zeros(1, 64, dtype=torch.bfloat16), norm, norm, torch.zeros(1, dtype=torch.int64),
                       torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64))
    assert layers.num_layers() == 0
    # The step stores K/V rows at its slots itself (a row copy, not index_copy_): a slot past the pool is refused
    # before anything runs or is written.
    layers.add_layer(norm, norm, kv, kv, [0] * 4, weights, [torch.empty(0)] * 4, shapes)
    rope = torch.ones(1, 1, 16, dtype=torch.bfloat16)
    for bad in (8, -1):
        with pytest.raises(RuntimeError, match=f"slot {bad} out of the pool"):
            layers.forward(torch.zeros(1, 64, dtype=torch.bfloat16), rope, rope, torch.tensor([bad]),
                           torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64))
    assert not kv.any()


def test_flag_reaches_the_engine_config() -> None:
    from llmserve.commands.engine_args import add_engine_args, engine_argv, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert not engine_config_from_args(parser.parse_args(["--model", "m"])).disable_fused_layers
    args = parser.parse_args(["--model", "m", "--disable-fused-layers"])
    assert engine_config_from_args(args).disable_fused_layers
    assert "--disable-fused-layers" in engine_argv(args)  # what a worker under `serve` is started with
    # The flag's former name (before it covered extend steps too) still works.
    assert engine_config_from_args(parser.parse_args(["--model", "m", "--disable-fused-decode"])).disable_fused_layers
