"""Torch-native attention over the paged KV pool with ``F.scaled_dot_product_attention``.

Decode gathers every request's cached K/V into one padded [batch, max_len, kv_heads, head_dim] tensor
(indices and mask built once per step) and attends with two grouped matmuls in fp32: the query heads
sharing a KV head become the rows of one matmul, so GQA needs no K/V repetition. On the CPU this is
several times faster than SDPA's flash kernel for one query token (docs/benchmarks.md). On x86 CPUs
with AVX2 the runner picks ``decode_impl="avx2"``: the same fp32 arithmetic in one C++ kernel
(kernels/csrc/decode_attention_avx2.cpp) that reads each request's slots in place, instead of ~10 small
torch ops per layer. SDPA stays selectable (``decode_impl="sdpa"``) and the tests hold the three
equal. Extend runs one attention per request, causal with the cached prefix in front: on bf16 models where
the CPU has AVX512-BF16 (``extend_impl="avx512_bf16"``) this project's flash kernel
(kernels/csrc/extend_attention_avx512.cpp), which reads the prefix's K/V from the pool by slot and runs
2-4x faster than SDPA's flash kernel on the Zen 4 host (docs/benchmarks.md); else SDPA with the mask.

``row_wise`` (--enable-deterministic-inference): extend computes each new token's attention on its own,
as decode computes a request's one token (the AVX2 kernel where the host has it, else a loop of small
matmuls), so a token's attention rounds alike whatever else its step holds: how many of its request's
tokens, and which other requests. SDPA's kernel rounds a row by the block of rows and keys around it.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from worker_svc.attention.base import AttentionLayer
from worker_svc.attention.extend_kernel import extend_batch_kernel
from worker_svc.attention.metadata import DecodeMetadata, ExtendMetadata, prepare_decode_fixed, prepare_metadata
from worker_svc.attention.sdpa import attend_tokens_first
from worker_svc.forward_batch import ForwardBatch, ForwardMode
from worker_svc.kvcache import MHAKVPool

DECODE_IMPLS = ("grouped_matmul", "sdpa", "avx2")


def _mha_pool(batch: ForwardBatch) -> MHAKVPool:
    """The step's pool as the per-head K/V pool this backend reads (one isinstance, not a protocol check:
    this runs in every layer)."""
    pool = batch.kv_pool
    if not isinstance(pool, MHAKVPool):
        raise TypeError(f"the MHA attention backend needs an MHAKVPool, got {type(pool).__name__}")
    return pool


class TorchNativeAttentionBackend:
    kind: Literal["mha"] = "mha"

    def __init__(self, decode_impl: str = "grouped_matmul", cpu_ops=None, row_wise: bool = False,
                 extend_impl: str = "sdpa") -> None:
        """``cpu_ops``: ``layers.cpu_ext.load()``'s kernels, required by ``decode_impl="avx2"`` and
        ``extend_impl="avx512_bf16"``. ``row_wise``: every query row attends on its own, in extend and decode
        (deterministic inference), whatever ``extend_impl`` says."""
        if decode_impl not in DECODE_IMPLS:
            raise ValueError(f"decode_impl must be one of {', '.join(DECODE_IMPLS)}, got {decode_impl!r}")
        if decode_impl == "avx2" and cpu_ops is None:
            raise ValueError("decode_impl 'avx2' needs the CPU kernels (layers.cpu_ext.load())")
        self.decode_impl = decode_impl
        self.cpu_ops = cpu_ops
        self._extend_kernel = extend_batch_kernel(extend_impl, cpu_ops)
        self.row_wise = row_wise
        if row_wise and decode_impl != "avx2":
            decode_impl = "row_wise"
        self._decode = {"grouped_matmul": self._decode_grouped, "sdpa": self._decode_sdpa, "avx2": self._decode_avx2,
                        "row_wise": self._decode_row_wise}[decode_impl]

    def prepare(self, batch: ForwardBatch) -> None:
        # Extend steps attend the requests that add one token to a cached prefix (a mixed step's decode
        # rows) as one decode: one call per layer instead of one masked attention per request.
        batch.attn_metadata = prepare_metadata(batch, group_one_token=not self.row_wise)

    def prepare_fixed_decode(self, batch: ForwardBatch, seq_lens: torch.Tensor, max_len: int) -> None:
        batch.attn_metadata = prepare_decode_fixed(batch.req_to_token, batch.req_rows, seq_lens, max_len)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        _mha_pool(batch).store(layer.layer_id, batch.out_slots, k, v)
        if batch.mode is ForwardMode.DECODE:
            out = self._decode(q, layer, batch, batch.attn_metadata)
        else:
            out = self._extend_row_wise(q, layer, batch) if self.row_wise else self._extend(q, k, v, layer, batch)
        return out.reshape(q.shape[0], layer.num_heads * layer.head_dim)

    @staticmethod
    def _decode_grouped(q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch,
                        meta: DecodeMetadata) -> torch.Tensor:
        k_buf, v_buf = _mha_pool(batch).buffers(layer.layer_id)
        bsz, groups = q.shape[0], layer.num_heads // layer.num_kv_heads
        keys = k_buf[meta.slot_index].float()  # [batch, max_len, kv_heads, head_dim]
        values = v_buf[meta.slot_index].float()
        query = q.view(bsz, layer.num_kv_heads, groups, layer.head_dim).float()  # q head = kv head * groups + g
        scores = torch.matmul(query, keys.permute(0, 2, 3, 1)) * layer.scaling  # [batch, kv_heads, groups, max_len]
        if meta.mask is not None:
            scores.masked_fill_(~meta.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, values.transpose(1, 2))  # [batch, kv_heads, groups, head_dim]
        return out.view(bsz, layer.num_heads, layer.head_dim).to(q.dtype)

    def _decode_avx2(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch,
                     meta: DecodeMetadata) -> torch.Tensor:
        k_buf, v_buf = _mha_pool(batch).buffers(layer.layer_id)
        return self.cpu_ops.decode_attention(
            q.contiguous(), k_buf, v_buf, meta.slot_index, meta.seq_lens, layer.scaling
        )

    def _decode_row_wise(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch,
                         meta: DecodeMetadata) -> torch.Tensor:
        k_buf, v_buf = _mha_pool(batch).buffers(layer.layer_id)
        return self._attend_rows(q, k_buf, v_buf, meta.slot_index, meta.seq_lens, layer)

    def _extend_row_wise(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        """Each new token as a decode of its own: token j of a request with prefix p attends to the
        request's first p + j + 1 slots (its own K/V were stored before)."""
        meta: ExtendMetadata = batch.attn_metadata
        k_buf, v_buf = _mha_pool(batch).buffers(layer.layer_id)
        out = torch.empty_like(q)
        for i, (start, row) in enumerate(zip(meta.token_offsets, batch.req_rows.tolist(), strict=True)):
            prefix, seq = batch.prefix_lens[i], batch.seq_lens[i]
            slots = batch.req_to_token[row, :seq].expand(seq - prefix, seq).contiguous()  # [extend, seq]
            lens = torch.arange(prefix + 1, seq + 1, dtype=torch.int64, device=q.device)
            out[start:start + seq - prefix] = self._attend_rows(q[start:start + seq - prefix], k_buf, v_buf, slots,
                                                                lens, layer)
        return out

    def _attend_rows(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
                     lens: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
        """q [rows, q_heads, head_dim]: row r attends to slots[r, :lens[r]] alone -> [rows, q_heads, head_dim]."""
        if self.cpu_ops is not None:
            return self.cpu_ops.decode_attention(q.contiguous(), k_buf, v_buf, slots, lens, layer.scaling)
        groups = layer.num_heads // layer.num_kv_heads
        out = torch.empty_like(q)
        for r, length in enumerate(lens.tolist()):
            keys = k_buf[slots[r, :length]].float()  # [len, kv_heads, head_dim]
            values = v_buf[slots[r, :length]].float()
            query = q[r].view(layer.num_kv_heads, groups, layer.head_dim).float()
            scores = torch.matmul(query, keys.permute(1, 2, 0)) * layer.scaling  # [kv_heads, groups, len]
            row = torch.matmul(torch.softmax(scores, dim=-1), values.transpose(0, 1))  # [kv_heads, groups, dim]
            out[r] = row.reshape(layer.num_heads, layer.head_dim).to(q.dtype)
        return out

    @staticmethod
    def _decode_sdpa(q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch, meta: DecodeMetadata) -> torch.Tensor:
        k_buf, v_buf = _mha_pool(batch).buffers(layer.layer_id)
        keys = k_buf[meta.slot_index].transpose(1, 2)  # [batch, kv_heads, max_len, head_dim]
        values = v_buf[meta.slot_index].transpose(1, 2)
        query = q.unsqueeze(2)  # [batch, q_heads, 1, head_dim]
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=meta.mask, scale=layer.scaling, enable_gqa=True
        )
        return out.squeeze(2)  # [batch, q_heads, head_dim]

    def _extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        meta: ExtendMetadata = batch.attn_metadata
        out = q.new_empty(q.shape)  # contiguous, whatever q's row stride
        k_buf, v_buf = _mha_pool(batch).buffers(layer.layer_id)
        grouped: set[int] = set()
        if meta.one_token is not None:
            one = meta.one_token
            grouped = set(one.requests)
            rows = q.index_select(0, one.tokens)  # [n, q_heads, head_dim]
            out.index_copy_(0, one.tokens, self._decode(rows, layer, batch, one.decode))
        if self._extend_kernel is not None and q.dtype == torch.bfloat16:
            # Every extend in one call: the kernel reads prefixes from the pool by slot and the new tokens' K/V
            # from k / v, and writes their rows of out.
            ext = meta.extends
            self._extend_kernel(q, k, v, k_buf, v_buf, ext.prefix_slots, ext.q_starts, ext.lens, ext.prefix_lens,
                                layer.scaling, out=out)
            return out
        contexts = meta.contexts
        for i, start in enumerate(meta.token_offsets):
            if i in grouped:
                continue
            end = start + batch.seq_lens[i] - batch.prefix_lens[i]
            if contexts.slots[i] is None:
                out[start:end] = attend_tokens_first(
                    q[start:end], k[start:end], v[start:end], is_causal=True, scale=layer.scaling, enable_gqa=True
                )
            else:
                slots = contexts.slots[i]
                out[start:end] = attend_tokens_first(
                    q[start:end], k_buf[slots], v_buf[slots], attn_mask=contexts.masks[i], scale=layer.scaling,
                    enable_gqa=True,
                )
        return out
