"""KV sizing (kvcache/sizing.py): bytes per token for per-head K/V and for MLA's latent, the pool size from
the budget, the bundle it builds; and the request -> token table's two write paths."""

from __future__ import annotations

import pytest
import torch

from worker_svc.kvcache import MHAKVPool, MLAKVPool, ReqToTokenTable
from worker_svc.kvcache.sizing import (
    KVBudget,
    MHALayout,
    MLALayout,
    build_kv_cache,
    bytes_per_token,
    bytes_per_token_if_mha,
    pool_tokens,
)

CPU = torch.device("cpu")
MHA = MHALayout(num_layers=3, num_kv_heads=2, head_dim=16)
MLA = MLALayout(num_layers=3, kv_lora_rank=32, rope_dim=8, num_heads=4, qk_nope_head_dim=16, v_head_dim=16)


@pytest.mark.parametrize("dtype, elem", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_bytes_per_token(dtype, elem):
    assert bytes_per_token(MHA, dtype) == bytes_per_token_if_mha(MHA, dtype) == 2 * 3 * 2 * 16 * elem
    assert bytes_per_token(MLA, dtype) == 3 * (32 + 8) * elem  # one latent per layer, whatever the heads
    assert bytes_per_token_if_mha(MLA, dtype) == 3 * 4 * (16 + 8 + 16) * elem  # per-head K (nope + rope) and V


def test_pool_tokens_from_the_budget():
    budget = KVBudget(max_total_tokens=None, memory_bytes=10_000, max_running_requests=4, context_len=1000)
    assert pool_tokens(100, budget) == 100  # the memory budget
    assert pool_tokens(1, budget) == 4 * 1000  # never more than every running request can use
    assert pool_tokens(1 << 20, budget) == 1  # at least one token
    explicit = KVBudget(max_total_tokens=77, memory_bytes=10_000, max_running_requests=4, context_len=1000)
    assert pool_tokens(100, explicit) == 77


@pytest.mark.parametrize("layout, pool_type", [(MHA, MHAKVPool), (MLA, MLAKVPool)])
def test_build_kv_cache(layout, pool_type):
    budget = KVBudget(max_total_tokens=64, memory_bytes=0, max_running_requests=5, context_len=32)
    kv = build_kv_cache(layout, budget, torch.float32, CPU)
    assert isinstance(kv.pool, pool_type)
    assert kv.pool.size == kv.allocator.size == kv.allocator.available() == 64
    assert kv.pool.nbytes() == 65 * kv.bytes_per_token  # + the padding slot
    assert kv.bytes_per_token == bytes_per_token(layout, torch.float32)
    assert kv.bytes_per_token_if_mha == bytes_per_token_if_mha(layout, torch.float32)
    assert tuple(kv.req_table.table.shape) == (5, 33)


def test_req_table_writes():
    table = ReqToTokenTable(3, 8)
    table.write(1, 2, torch.tensor([5, 6, 7]))  # an extend of three tokens after a 2-token prefix
    assert table.slots(1, 5).tolist() == [0, 0, 5, 6, 7]
    table.write_last(torch.tensor([1, 2]), [6, 1], torch.tensor([9, 4]))  # one decode token each
    assert table.slots(1, 6).tolist() == [0, 0, 5, 6, 7, 9]
    assert table.slots(2, 1).tolist() == [4]
