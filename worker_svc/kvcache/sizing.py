"""How large the KV cache is and what one token costs in it, from the KV layout on this rank and the
engine's budget; ``build_kv_cache`` allocates it.

The layouts carry plain numbers (the runner derives them from the model config and the TP degree), so
this package stays below the configs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_svc.kvcache.allocator import KVSlotAllocator
from worker_svc.kvcache.cache import KVCache
from worker_svc.kvcache.mha_pool import MHAKVPool
from worker_svc.kvcache.mla_pool import MLAKVPool
from worker_svc.kvcache.pool import KVPool
from worker_svc.kvcache.req_to_token import ReqToTokenTable


@dataclass(frozen=True)
class MHALayout:
    """Per-head K and V: what multi-head / grouped-query attention caches on this rank."""

    num_layers: int
    num_kv_heads: int  # on this rank
    head_dim: int


@dataclass(frozen=True)
class MLALayout:
    """One latent per token per layer, whatever the head count or TP degree. The head dimensions say
    what per-head K and V would take instead (the MLA saving)."""

    num_layers: int
    kv_lora_rank: int
    rope_dim: int
    num_heads: int  # on this rank
    qk_nope_head_dim: int
    v_head_dim: int


KVLayout = MHALayout | MLALayout


@dataclass(frozen=True)
class KVBudget:
    max_total_tokens: int | None  # an explicit pool size, in tokens
    memory_bytes: int  # the budget when there is no explicit size
    max_running_requests: int
    context_len: int


def bytes_per_token(layout: KVLayout, dtype: torch.dtype) -> int:
    if isinstance(layout, MLALayout):
        return MLAKVPool.bytes_per_token(layout.num_layers, layout.kv_lora_rank, layout.rope_dim, dtype)
    return MHAKVPool.bytes_per_token(layout.num_layers, layout.num_kv_heads, layout.head_dim, dtype)


def bytes_per_token_if_mha(layout: KVLayout, dtype: torch.dtype) -> int:
    """What per-head K and V would take per token on this rank (equal to ``bytes_per_token`` for MHA)."""
    if isinstance(layout, MHALayout):
        return bytes_per_token(layout, dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    head_width = layout.qk_nope_head_dim + layout.rope_dim + layout.v_head_dim  # K (nope + rope) and V
    return layout.num_layers * layout.num_heads * head_width * elem


def pool_tokens(per_token: int, budget: KVBudget) -> int:
    """Without an explicit size: the memory budget, but never more than every running request can use."""
    if budget.max_total_tokens:
        return budget.max_total_tokens
    return max(1, min(budget.memory_bytes // per_token, budget.max_running_requests * budget.context_len))


def build_kv_cache(layout: KVLayout, budget: KVBudget, dtype: torch.dtype, device: torch.device) -> KVCache:
    per_token = bytes_per_token(layout, dtype)
    size = pool_tokens(per_token, budget)
    pool: KVPool
    if isinstance(layout, MLALayout):
        pool = MLAKVPool(size, layout.num_layers, layout.kv_lora_rank, layout.rope_dim, dtype, device)
    else:
        pool = MHAKVPool(size, layout.num_layers, layout.num_kv_heads, layout.head_dim, dtype, device)
    return KVCache(
        pool=pool,
        allocator=KVSlotAllocator(size, device),
        req_table=ReqToTokenTable(budget.max_running_requests, budget.context_len, device),
        bytes_per_token=per_token,
        bytes_per_token_if_mha=bytes_per_token_if_mha(layout, dtype),
    )
