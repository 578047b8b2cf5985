"""Tensor parallelism over real groups, on the shared-memory communicator (TP=2, TP=4) and on gloo
(TP=2, --tp-comm gloo: what a group spread over hosts uses): TP=1's logits (fp32, within 2e-4) and
greedy tokens, with chunked prefill, mixed lengths, replicated KV heads, tied embeddings, a
vocabulary that does not divide over the ranks, biased linears, quantized shards and DeepSeek-V2 (MLA
heads, MoE experts, absorbed decode); each rank holds only its shard; the leader -> follower step
message round-trips exactly.

The pytest process is rank 0; ranks 1.. are spawned once per TP size and replay every model in turn.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from llmserve.bench.driver import chunked_prefill_logits, greedy_with_split_prefill
from llmserve.eval.perplexity import EngineScorer
from tests.model_variants import with_biases
from tests.unit.oracle import encode_prompts
from worker_svc.config.engine_config import EngineConfig
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.executor.tp_runners import LeaderRunner, join_followers, spawn_followers
from worker_svc.forward_batch import ForwardMode, StepInput, TableWrites
from worker_svc.layers.embedding import VocabParallelEmbedding
from worker_svc.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from worker_svc.parallel.context import TPContext
from worker_svc.parallel.group import backend_for, destroy_tp, free_port, init_tp
from worker_svc.parallel.shm_communicator import available as shm_unavailable
from worker_svc.parallel.step_broadcast import HEADER_LEN, pack_step, unpack_step

OUTPUT_LEN = 16
# fp32 partial sums added in another order than TP=1's matmul: logits up to ~30 differ by a few ulps.
ATOL = 2e-4
CHUNK = 5
TIMEOUT_S = 90


@pytest.fixture(scope="module")
def models(model_factory, tmp_path_factory) -> dict[str, Path]:
    tiny = model_factory("tiny")
    return {
        "tiny": tiny,  # 2 KV heads: replicated at TP=4
        "small": model_factory("small"),
        "tied": model_factory("tiny", tie_word_embeddings=True),
        "odd_vocab": model_factory("tiny", config_override={"vocab_size": 509}),
        "bias": with_biases(tiny, tmp_path_factory.mktemp("bias") / "tiny_bias"),
        # Quantized shards (the quantization issue): int8 row-parallel scales are max-reduced over
        # ranks and int4 groups never straddle a shard, so the quantized weights equal TP=1's.
        "small_int8wo": model_factory("small"),
        "small_int4wo": model_factory("small"),
        # DeepSeek-V2 (MLA + MoE): heads, expert intermediates and kv_b_proj (by head) are sharded, the
        # latent projections and the router replicated; at TP=4 tiny has one head per rank.
        "ds_tiny": model_factory("tiny", arch="deepseek_v2"),
        "ds_small": model_factory("small", arch="deepseek_v2"),
        "ds_tiny_int8wo": model_factory("tiny", arch="deepseek_v2"),
    }


QUANT = {"small_int8wo": "int8wo", "small_int4wo": "int4wo-64", "ds_tiny_int8wo": "int8wo"}


def _engine(model_dir: Path, name: str = "") -> EngineConfig:
    return EngineConfig(model_path=str(model_dir), dtype="float32", max_total_tokens=2048, max_running_requests=8,
                        torchao_config=QUANT.get(name, "none"))


def _run_checks(runner, prompts: list[list[int]]) -> dict:
    logits, tokens = greedy_with_split_prefill(runner, prompts, OUTPUT_LEN, cut_len=3)
    return {"logits": logits, "tokens": tokens, "chunked": chunked_prefill_logits(runner, prompts, CHUNK),
            # eval-ppl's step: logits at every token (the all_logits flag crosses the step broadcast)
            "every_position": EngineScorer(runner).logits(prompts[-1])}


_TP1: dict[str, dict] = {}


def _reference(name: str, model_dir: Path) -> dict:
    if name not in _TP1:
        _TP1[name] = _run_checks(ModelRunner(_engine(model_dir, name)), encode_prompts(model_dir))
    return _TP1[name]


TP_RUNS = [(2, "shm"), (4, "shm"), (2, "gloo")] if shm_unavailable() is None else [(2, "gloo"), (4, "gloo")]


@pytest.fixture(scope="module", params=TP_RUNS, ids=lambda run: f"tp{run[0]}-{run[1]}")
def tp_run(request, models):
    """Run every model at TP=size with one spawned group; returns (size, {name: results})."""
    size, comm = request.param
    names = list(models)
    addr = f"127.0.0.1:{free_port()}"
    procs = spawn_followers(size, addr, [_engine(models[n], n) for n in names], threads=1, timeout_s=TIMEOUT_S,
                            comm=comm)
    tp = init_tp(0, size, addr, "cpu", timeout_s=TIMEOUT_S, comm=comm)
    assert tp.comm_kind == comm
    results = {}
    try:
        for name in names:
            runner = LeaderRunner(ModelRunner(_engine(models[name], name), tp), tp)
            try:
                results[name] = _run_checks(runner, encode_prompts(models[name]))
            finally:
                runner.stop_followers()
    finally:
        destroy_tp(tp)
        join_followers(procs, TIMEOUT_S)
    return size, results


@pytest.mark.parametrize("name", ["tiny", "small", "tied", "odd_vocab", "bias", "small_int8wo", "small_int4wo",
                                  "ds_tiny", "ds_small", "ds_tiny_int8wo"])
def test_tp_matches_tp1(tp_run, models, name):
    size, results = tp_run
    ours, ref = results[name], _reference(name, models[name])
    assert (ours["logits"] - ref["logits"]).abs().max().item() < ATOL
    assert ours["tokens"] == ref["tokens"]
    assert (ours["chunked"] - ref["chunked"]).abs().max().item() < ATOL
    assert ours["every_position"].shape == (len(encode_prompts(models[name])[-1]), ref["logits"].shape[-1])
    assert (ours["every_position"] - ref["every_position"]).abs().max().item() < ATOL
    # Chunked and split prefill agree too (same final-token logits, different step shapes).
    assert (ours["chunked"] - ours["logits"]).abs().max().item() < ATOL


# ---- sharding, without a process group (loading needs no collectives) -----------------------------


def _sharded(model_dir: Path, rank: int, size: int) -> ModelRunner:
    return ModelRunner(_engine(model_dir), TPContext(rank=rank, size=size))


def _linear_bytes(model: torch.nn.Module) -> int:
    kinds = (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear)
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, kinds))


def test_tp2_shards_halve_parameter_memory(models):
    full = _sharded(models["small"], 0, 1)
    vocab, hidden = full.model_config.vocab_size, full.model_config.hidden_size
    for rank in range(2):
        shard = _sharded(models["small"], rank, 2)
        ratio = _linear_bytes(shard.model) / _linear_bytes(full.model)
        assert 0.45 <= ratio <= 0.55, ratio
        for module in (shard.model.model.embed_tokens, shard.model.lm_head):
            assert tuple(module.weight.shape) == (vocab // 2, hidden)
        assert 0.45 <= shard.weight_nbytes / full.weight_nbytes <= 0.55  # norms are the only replicas
        assert shard.kv.pool.nbytes() * 2 == full.kv.pool.nbytes()


def test_kv_heads_replicated_when_fewer_than_ranks(models):
    model_dir = models["tiny"]  # 4 query heads, 2 KV heads
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        k_full = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
        v_full = f.get_tensor("model.layers.0.self_attn.v_proj.weight")
        q_full = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    head_dim = k_full.shape[0] // 2
    for rank in range(4):
        runner = _sharded(model_dir, rank, 4)
        qkv = runner.model.model.layers[0].self_attn.qkv_proj
        assert (qkv.num_heads, qkv.num_kv_heads) == (1, 1)
        # The runner sizes the pool from config + TP; it must agree with how the layer sharded.
        assert runner.kv.pool.k_buffers[0].shape[1:] == (qkv.num_kv_heads, head_dim)
        kv_head = rank // 2  # query head `rank` belongs to KV group rank // (4 / 2)
        q, k, v = qkv.weight.split([head_dim, head_dim, head_dim])
        assert torch.equal(q, q_full[rank * head_dim : (rank + 1) * head_dim])
        assert torch.equal(k, k_full[kv_head * head_dim : (kv_head + 1) * head_dim])
        assert torch.equal(v, v_full[kv_head * head_dim : (kv_head + 1) * head_dim])


def test_odd_vocab_is_padded_on_the_last_rank(models):
    model_dir = models["odd_vocab"]
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    assert embed.shape[0] == 509
    per_rank = 128  # ceil(509 / 4)
    for rank in range(4):
        shard = _sharded(model_dir, rank, 4).model.model.embed_tokens
        assert isinstance(shard, VocabParallelEmbedding) and shard.weight.shape[0] == per_rank
        rows = embed[rank * per_rank : (rank + 1) * per_rank]
        assert torch.equal(shard.weight[: rows.shape[0]], rows)
        assert not shard.weight[rows.shape[0] :].any()


def test_row_parallel_bias_counted_once(models):
    model_dir = models["bias"]
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        bias = f.get_tensor("model.layers.0.self_attn.o_proj.bias")
    for rank in range(2):
        o_proj = _sharded(model_dir, rank, 2).model.model.layers[0].self_attn.o_proj
        assert torch.equal(o_proj.bias, bias if rank == 0 else torch.zeros_like(bias))


def test_tied_embedding_shares_the_vocab_shard(models):
    model = _sharded(models["tied"], 1, 2).model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.vocab_start == model.model.embed_tokens.vocab_start > 0


def test_deepseek_shards_heads_experts_and_replicates_latents(models):
    """kv_a_proj_with_mqa (the latent) and the router are whole on every rank; kv_b_proj, q and o are
    split by head, each expert's intermediate by rank; the absorbed decode's W_UK/W_UV are this
    rank's heads of kv_b_proj."""
    model_dir = models["ds_small"]  # 8 heads, q LoRA, 16 experts of intermediate 64
    cfg = json.loads((model_dir / "config.json").read_text())
    heads, nope, v, rank_ = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    prefix = "model.layers.1."
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        kv_a = f.get_tensor(prefix + "self_attn.kv_a_proj_with_mqa.weight")
        kv_b = f.get_tensor(prefix + "self_attn.kv_b_proj.weight").view(heads, nope + v, rank_)
        q_a = f.get_tensor(prefix + "self_attn.q_a_proj.weight")
        gate = f.get_tensor(prefix + "mlp.gate.weight")
        down = f.get_tensor(prefix + "mlp.experts.3.down_proj.weight")
    size = 4
    local = heads // size
    for rank in (0, size - 1):
        layer = _sharded(model_dir, rank, size).model.model.layers[1]
        attn = layer.self_attn
        assert torch.equal(attn.kv_a_proj_with_mqa.weight, kv_a) and torch.equal(attn.q_a_proj.weight, q_a)
        assert torch.equal(layer.mlp.gate.weight, gate)
        mine = kv_b[rank * local : (rank + 1) * local]
        assert attn.attn.num_heads == local
        w_uk, w_uv = attn.attn.absorbed_weights()
        assert torch.equal(w_uk, mine[:, :nope]) and torch.equal(w_uv, mine[:, nope:])
        cols = down.shape[1] // size
        assert torch.equal(layer.mlp.experts[3].down_proj.weight, down[:, rank * cols : (rank + 1) * cols])


# ---- the step message ------------------------------------------------------------------------------


def _assert_same_step(a: StepInput, b: StepInput) -> None:
    assert a.mode is b.mode
    for field in ("input_ids", "positions", "out_slots", "req_rows"):
        x, y = getattr(a, field), getattr(b, field)
        assert y.dtype == torch.int64 and torch.equal(x.to(torch.int64), y), field
    assert a.seq_lens == b.seq_lens and a.prefix_lens == b.prefix_lens
    assert a.all_logits == b.all_logits
    if a.table_writes is None or not a.table_writes.rows:
        assert b.table_writes is None
    else:
        x, y = a.table_writes, b.table_writes
        assert y is not None and (x.rows, x.starts, x.lens) == (y.rows, y.starts, y.lens)
        assert y.slots.dtype == torch.int64 and torch.equal(x.slots, y.slots)


def test_step_pack_unpack_round_trips():
    extend = StepInput(
        mode=ForwardMode.EXTEND,
        input_ids=torch.tensor([5, 6, 7, 8, 9, 2**40]),
        positions=torch.tensor([0, 1, 2, 3, 4, 0]),
        out_slots=torch.tensor([11, 12, 13, 14, 15, 16]),
        req_rows=torch.tensor([3, 0]),
        seq_lens=[5, 1],
        prefix_lens=[0, 0],
    )
    decode = StepInput(
        mode=ForwardMode.DECODE,
        input_ids=torch.tensor([1, 2], dtype=torch.int32),
        positions=torch.tensor([7, 3]),
        out_slots=torch.tensor([20, 21]),
        req_rows=torch.tensor([3, 0]),
        seq_lens=[8, 4],
        prefix_lens=[7, 3],
    )
    scored = dataclasses.replace(extend, all_logits=True)
    # Radix-cache prefixes: row 3 gets 4 cached slots at 0.., row 0 two at 5.. (re-pointed after a chunk).
    writes = TableWrites([3, 0], [0, 5], [4, 2], torch.tensor([7, 8, 9, 2**33, 1, 2]))
    cached = dataclasses.replace(extend, table_writes=writes)
    for step in (extend, decode, scored, cached):
        packed = pack_step(step)
        assert packed.dtype == torch.int64 and packed.dim() == 1
        n, b = step.input_ids.numel(), len(step.seq_lens)
        w = len(step.table_writes.rows) if step.table_writes else 0
        s = step.table_writes.slots.numel() if step.table_writes else 0
        mode = 0 if step.mode is ForwardMode.EXTEND else 1
        assert packed[:HEADER_LEN].tolist() == [mode, n, b, int(step.all_logits), w, s]
        assert packed.numel() == HEADER_LEN + 3 * n + 3 * b + 3 * w + s
        _assert_same_step(step, unpack_step(packed))
    assert unpack_step(torch.tensor([2] + [0] * (HEADER_LEN - 1))) is None
    with pytest.raises(ValueError, match="payload"):
        unpack_step(pack_step(cached)[:-1])


def test_pack_rejects_inconsistent_steps():
    bad = StepInput(ForwardMode.DECODE, torch.tensor([1]), torch.tensor([1, 2]), torch.tensor([3]),
                    torch.tensor([0]), [2], [1])
    with pytest.raises(ValueError):
        pack_step(bad)
    good = StepInput(ForwardMode.DECODE, torch.tensor([1]), torch.tensor([1]), torch.tensor([3]), torch.tensor([0]),
                     [2], [1])
    with pytest.raises(ValueError, match="table writes"):
        pack_step(dataclasses.replace(good, table_writes=TableWrites([0], [0], [3], torch.tensor([1, 2]))))


def test_backend_follows_device():
    assert backend_for("cpu") == "gloo"
    assert backend_for("cuda:1") == "nccl"
    assert init_tp(0, 1, "unused:0").size == 1
    with pytest.raises(ValueError):
        init_tp(0, 2, "no-port", timeout_s=1)
