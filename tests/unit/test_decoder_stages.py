"""The decoder's stages composed by hand (embed; per layer attention_stage, all-reduce, mlp_stage,
all-reduce; finish; logits) give exactly ``model.forward``'s fp32 logits (torch.equal), for Llama
(plain and with biases on every projection) and DeepSeek-V2 (MLA, a dense first layer, MoE with a shared
expert), at TP=1 and at TP=2 over a real gloo group; at TP=2 a stage's partial sum is un-reduced.

The two TP=2 ranks are two threads of this process, each with its own gloo process group on one
rendezvous store, so the test needs no spawned process and runs in seconds. Each step is prefill, an
extend on the cached prefix (logits at every token) and a decode.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model_variants import with_biases
from tests.ranks import gloo_groups, on_ranks
from tests.unit.oracle import encode_prompts
from worker_svc.config.engine_config import EngineConfig
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.forward_batch import ForwardBatch, ForwardMode
from worker_svc.models.decoder import CausalLM
from worker_svc.parallel.context import TPContext


@pytest.fixture(scope="module")
def models(model_factory, tmp_path_factory) -> dict[str, Path]:
    llama = model_factory("tiny")
    return {
        "llama": llama,
        "llama_bias": with_biases(llama, tmp_path_factory.mktemp("decoder_stages") / "llama_bias"),
        "deepseek_v2": model_factory("tiny", arch="deepseek_v2"),  # layer 0 dense, then MoE + shared expert
    }


@pytest.fixture(scope="module")
def tp2() -> list[TPContext]:
    """Two ranks' contexts on real gloo groups (one per thread of this process)."""
    return [TPContext(rank=rank, size=2, group=group, store=store)
            for rank, (store, group) in enumerate(gloo_groups(2, "decoder_stages"))]

def _batch(runner: ModelRunner, mode: ForwardMode, pieces: list[list[int]], rows: list[int], prefix_lens: list[int],
           all_logits: bool = False) -> ForwardBatch:
    """The runner's ForwardBatch for appending ``pieces[j]`` to request row ``rows[j]``."""
    seq_lens = [start + len(piece) for piece, start in zip(pieces, prefix_lens, strict=True)]
    slots = runner.kv.allocator.alloc(sum(len(piece) for piece in pieces))
    assert slots is not None
    spans = list(zip(prefix_lens, seq_lens, strict=True))
    offset = 0
    for row, (start, end) in zip(rows, spans, strict=True):
        runner.kv.req_table.table[row, start:end] = slots[offset : offset + end - start]
        offset += end - start
    batch = ForwardBatch(
        mode=mode,
        input_ids=torch.tensor([t for piece in pieces for t in piece]),
        positions=torch.tensor([p for start, end in spans for p in range(start, end)]),
        out_slots=slots,
        req_rows=torch.tensor(rows),
        seq_lens=seq_lens,
        prefix_lens=prefix_lens,
        req_to_token=runner.kv.req_table.table,
        kv_pool=runner.kv.pool,
        attn_backend=runner.attn_backend,
        all_logits=all_logits,
    )
    runner.attn_backend.prepare(batch)
    return batch


def _reduce(tp: TPContext, partial: torch.Tensor) -> torch.Tensor:
    """The overlap executor's way: issue the all-reduce, then wait on its handle. At TP=2 first checks
    the stage's output is this rank's partial sum (ranks differ), not an already reduced one (ranks agree)."""
    if tp.size > 1:
        shares = tp.all_gather_last_dim(partial).chunk(tp.size, dim=-1)  # tp.size x [tokens, hidden]
        assert not torch.equal(shares[0], shares[1]), "a stage returned an already reduced sum"
    work = tp.all_reduce(partial, async_op=True)
    if work is not None:
        work.wait()
    return partial


def _composed(lm: CausalLM, tp: TPContext, batch: ForwardBatch) -> torch.Tensor:
    hidden, rope = lm.model.embed(batch)
    residual = None
    for layer in lm.model.layers:
        partial, residual = layer.attention_stage(rope, hidden, residual, batch)
        partial, residual = layer.mlp_stage(_reduce(tp, partial), residual)
        hidden = _reduce(tp, partial)
    assert residual is not None and residual.dtype == torch.float32
    return lm.logits(lm.model.finish(hidden, residual), batch)


def _check_steps(runner: ModelRunner, tp: TPContext, prompts: list[list[int]]) -> int:
    """Prefill, extend on the cached prefix, decode: stage-composed logits == model.forward's each time
    (both write the same KV slots with the same values). Returns the number of steps checked."""
    rows = [runner.kv.req_table.alloc() for _ in prompts]
    assert None not in rows
    cut = 3
    steps = [
        (ForwardMode.EXTEND, [p[:cut] for p in prompts], [0] * len(prompts), False),
        (ForwardMode.EXTEND, [p[cut:] for p in prompts], [cut] * len(prompts), True),
        (ForwardMode.DECODE, [p[:1] for p in prompts], [len(p) for p in prompts], False),
    ]
    for mode, pieces, prefix_lens, all_logits in steps:
        batch = _batch(runner, mode, pieces, rows, prefix_lens, all_logits)
        expected = runner.model(batch)
        assert expected.dtype == torch.float32
        assert torch.equal(_composed(runner.model, tp, batch), expected)
    return len(steps)


def _runner(model_dir: Path, tp: TPContext) -> ModelRunner:
    engine = EngineConfig(model_path=str(model_dir), dtype="float32", max_total_tokens=512, max_running_requests=4)
    return ModelRunner(engine, tp)


def _prompts(model_dir: Path) -> list[list[int]]:
    return [p for p in encode_prompts(model_dir) if len(p) > 4][:3]


@pytest.mark.parametrize("name", ["llama", "llama_bias", "deepseek_v2"])
def test_stages_compose_to_forward_tp1(models, name):
    runner = _runner(models[name], TPContext())
    assert isinstance(runner.model, CausalLM)
    with torch.inference_mode():
        assert _check_steps(runner, TPContext(), _prompts(models[name])) == 3


@pytest.mark.parametrize("name", ["llama", "llama_bias", "deepseek_v2"])
def test_stages_compose_to_forward_tp2(models, tp2, name):
    runners = [_runner(models[name], tp) for tp in tp2]  # loading needs no collectives
    prompts = _prompts(models[name])
    assert on_ranks(2, lambda rank: _check_steps(runners[rank], tp2[rank], prompts)) == [3, 3]
