"""Torch-native attention backend: the grouped-matmul decode equals SDPA decode and a dense
reference, for GQA, ragged lengths (masking) and both dtypes."""

from __future__ import annotations

import math

import pytest
import torch

from worker_svc.attention.base import AttentionLayer
from worker_svc.attention.torch_native import TorchNativeAttentionBackend
from worker_svc.forward_batch import ForwardBatch, ForwardMode
from worker_svc.kvcache import MHAKVPool


def _decode_batch(backend, dtype, seq_lens, heads=8, kv_heads=2, dim=16):
    gen = torch.Generator().manual_seed(0)
    pool = MHAKVPool(256, 1, kv_heads, dim, dtype, torch.device("cpu"))
    table = torch.zeros(len(seq_lens), 65, dtype=torch.int64)
    next_slot = 1
    for row, length in enumerate(seq_lens):
        slots = torch.arange(next_slot, next_slot + length)
        table[row, :length] = slots
        pool.k_buffers[0][slots] = torch.randn(length, kv_heads, dim, generator=gen).to(dtype)
        pool.v_buffers[0][slots] = torch.randn(length, kv_heads, dim, generator=gen).to(dtype)
        next_slot += length
    last = table[torch.arange(len(seq_lens)), torch.tensor(seq_lens) - 1]
    batch = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(len(seq_lens), dtype=torch.int64),
        positions=torch.tensor(seq_lens) - 1,
        out_slots=last,
        req_rows=torch.arange(len(seq_lens)),
        seq_lens=list(seq_lens),
        prefix_lens=[s - 1 for s in seq_lens],
        req_to_token=table,
        kv_pool=pool,
        attn_backend=backend,
    )
    backend.prepare(batch)
    layer = AttentionLayer(0, heads, kv_heads, dim, scaling=dim**-0.5)
    q = torch.randn(len(seq_lens), heads, dim, generator=gen).to(dtype)
    # The step re-stores each request's newest K/V (as the model would): keep what is in the pool.
    k_new = pool.k_buffers[0][last].clone()
    v_new = pool.v_buffers[0][last].clone()
    return batch, layer, q, k_new, v_new, table


def _dense_reference(q, batch, table, layer):
    outs = []
    groups = layer.num_heads // layer.num_kv_heads
    for i, length in enumerate(batch.seq_lens):
        slots = table[i, :length]
        k = batch.kv_pool.k_buffers[0][slots].float().repeat_interleave(groups, dim=1)  # [len, heads, dim]
        v = batch.kv_pool.v_buffers[0][slots].float().repeat_interleave(groups, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), k) / math.sqrt(layer.head_dim)
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v).reshape(-1))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("seq_lens", [[5, 5, 5], [1, 17, 64, 3]])
def test_decode_grouped_matmul_equals_sdpa_and_reference(dtype, atol, seq_lens):
    results = {}
    for impl in ("grouped_matmul", "sdpa"):
        backend = TorchNativeAttentionBackend(decode_impl=impl)
        batch, layer, q, k_new, v_new, table = _decode_batch(backend, dtype, seq_lens)
        results[impl] = backend.forward(q, k_new, v_new, layer, batch).float()
    ref = _dense_reference(q, batch, table, layer)
    assert torch.allclose(results["grouped_matmul"], ref, atol=atol)
    assert torch.allclose(results["sdpa"], ref, atol=atol)


def test_unknown_decode_impl_is_rejected():
    with pytest.raises(ValueError, match="decode_impl"):
        TorchNativeAttentionBackend(decode_impl="flash")
