"""Torch-native MLA attention over the latent pool (``MLAKVPool``).

Extend ("normal" path): per request, the cached latents of the prefix plus the new tokens' latents go
through ``kv_b_proj`` into per-head K_nope and V, the shared rotary key is appended to every head, and
attention runs causal with the prefix in front (this project's AVX512-BF16 flash kernel for bf16 where the
CPU has it, ``extend_impl="avx512_bf16"``, else SDPA with the mask). Decode is ``absorbed`` by default:
W_UK is folded into the query and W_UV into the output, so the step attends over the cached latents
directly, as an MQA with one shared head of width kv_lora_rank + rope (no per-token decompression, which
is what makes MLA decode cheap). ``mla_decode="normal"`` decompresses at decode too; the tests hold the
two equal. Decode math runs in fp32 like the MHA backend's grouped matmuls. Per-step metadata (padded
slot index and length mask, extend masks) is the MHA backend's (attention/metadata.py).
"""

from __future__ import annotations

from typing import Literal

import torch

from worker_svc.attention.base import MLAAttentionLayer
from worker_svc.attention.extend_kernel import extend_kernel
from worker_svc.attention.metadata import DecodeMetadata, ExtendMetadata, prepare_decode_fixed, prepare_metadata
from worker_svc.attention.sdpa import attend_tokens_first
from worker_svc.config.engine_config import MLA_DECODE_MODES
from worker_svc.forward_batch import ForwardBatch, ForwardMode
from worker_svc.kernels.row_stable import pad_rows
from worker_svc.kvcache import MLAKVPool


def _latent_pool(batch: ForwardBatch) -> MLAKVPool:
    """The step's pool as the latent pool this backend reads (one isinstance: this runs in every layer)."""
    pool = batch.kv_pool
    if not isinstance(pool, MLAKVPool):
        raise TypeError(f"the MLA attention backend needs an MLAKVPool, got {type(pool).__name__}")
    return pool


class TorchNativeMLABackend:
    kind: Literal["mla"] = "mla"

    def __init__(self, mla_decode: str = "absorbed", row_wise: bool = False,
                 row_padding: tuple[int, ...] | None = None, extend_impl: str = "sdpa", cpu_ops=None) -> None:
        """``row_wise`` (deterministic inference): every query row attends on its own, in extend and
        decode. ``row_padding``: the host's fp32 row padding (kernels/row_stable.py) for absorbed decode's
        per-head GEMMs over the batch. ``extend_impl``: "sdpa" or "avx512_bf16" (needs ``cpu_ops``,
        ``layers.cpu_ext.load()``'s kernels)."""
        if mla_decode not in MLA_DECODE_MODES:
            raise ValueError(f"mla_decode must be one of {', '.join(MLA_DECODE_MODES)}, got {mla_decode!r}")
        self.mla_decode = mla_decode
        self.row_wise = row_wise
        self.row_padding = row_padding
        self._extend_kernel = extend_kernel(extend_impl, cpu_ops)

    def prepare(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = prepare_metadata(batch)

    def prepare_fixed_decode(self, batch: ForwardBatch, seq_lens: torch.Tensor, max_len: int) -> None:
        batch.attn_metadata = prepare_decode_fixed(batch.req_to_token, batch.req_rows, seq_lens, max_len)

    def forward_mla(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, layer: MLAAttentionLayer,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        _latent_pool(batch).store(layer.layer_id, batch.out_slots, latent)
        if batch.mode is ForwardMode.DECODE:
            decode = self._decode_absorbed if self.mla_decode == "absorbed" else self._decode_normal
            out = decode(q_nope, q_pe, layer, batch)
        else:
            out = self._extend_mla(q_nope, q_pe, latent, layer, batch)
        return out.reshape(q_nope.shape[0], layer.num_heads * layer.v_head_dim)

    @staticmethod
    def _keys_values(ctx: torch.Tensor, layer: MLAAttentionLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [n, kv_lora + rope] -> K [n, heads, qk_nope + rope], V [n, heads, v_head_dim]."""
        k_nope, v = layer.decompress(ctx[:, : layer.kv_lora_rank])
        k_pe = ctx[:, None, layer.kv_lora_rank :].expand(-1, layer.num_heads, -1)
        return torch.cat((k_nope, k_pe), dim=-1), v

    def _extend_mla(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, layer: MLAAttentionLayer,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        meta: ExtendMetadata = batch.attn_metadata
        buf = _latent_pool(batch).buffer(layer.layer_id)
        query = torch.cat((q_nope, q_pe), dim=-1)  # [tokens, heads, qk_head]
        out = q_nope.new_empty(q_nope.shape[0], layer.num_heads, layer.v_head_dim)
        contexts = meta.contexts
        for i, start in enumerate(meta.token_offsets):
            end = start + batch.seq_lens[i] - batch.prefix_lens[i]
            slots = contexts.slots[i]
            keys, values = self._keys_values(latent[start:end] if slots is None else buf[slots], layer)
            if self.row_wise:
                out[start:end] = self._attend_rows(query[start:end], keys, values, batch.prefix_lens[i], layer)
                continue
            if self._extend_kernel is not None and query.dtype == torch.bfloat16:  # keys, values: the whole context
                out[start:end] = self._extend_kernel(query[start:end], keys, values, None, batch.prefix_lens[i],
                                                     layer.scaling)
                continue
            out[start:end] = attend_tokens_first(
                query[start:end], keys, values, attn_mask=contexts.masks[i], is_causal=slots is None,
                scale=layer.scaling,
            )
        return out

    @staticmethod
    def _attend_rows(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int,
                     layer: MLAAttentionLayer) -> torch.Tensor:
        """Extend row by row: query [extend, heads, qk_head], keys/values [seq, heads, *] of the whole
        context; new token j attends to the first prefix + j + 1 -> [extend, heads, v_head_dim]."""
        out = query.new_empty(query.shape[0], layer.num_heads, layer.v_head_dim)
        for j in range(query.shape[0]):
            length = prefix + j + 1
            scores = torch.matmul(query[j, :, None], keys[:length].permute(1, 2, 0)) * layer.scaling  # [heads, 1, len]
            out[j] = torch.matmul(torch.softmax(scores.float(), dim=-1).to(values.dtype),
                                  values[:length].transpose(0, 1))[:, 0]  # [heads, v_head_dim]
        return out

    @staticmethod
    def _softmax(scores: torch.Tensor, meta: DecodeMetadata) -> torch.Tensor:
        if meta.mask is not None:
            scores.masked_fill_(~meta.mask[:, 0], float("-inf"))  # mask [batch, 1, 1, len] -> [batch, 1, len]
        return torch.softmax(scores, dim=-1)

    def _decode_absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer: MLAAttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        meta: DecodeMetadata = batch.attn_metadata
        ctx = _latent_pool(batch).buffer(layer.layer_id)[meta.slot_index].float()  # [batch, len, kv_lora + rope]
        w_uk, w_uv = layer.absorbed_weights()
        # q_nope . (W_UK c) == (W_UK^T q_nope) . c: one query of width kv_lora + rope per head.
        bsz = q_nope.shape[0]
        q_rows = pad_rows(q_nope.float(), self.row_padding)  # [batch (+pad), heads, nope]
        q_latent = torch.bmm(q_rows.transpose(0, 1), w_uk.float()).transpose(0, 1)[:bsz]  # [batch, heads, kv_lora]
        query = torch.cat((q_latent, q_pe.float()), dim=-1)
        if self.row_wise:  # each request over its own length: the padded length depends on the others
            out_latent = torch.stack([
                torch.softmax(torch.matmul(query[b], ctx[b, :length].T) * layer.scaling, dim=-1)
                @ ctx[b, :length, : layer.kv_lora_rank]
                for b, length in enumerate(meta.seq_lens.tolist())
            ])  # [batch, heads, kv_lora]
        else:
            scores = torch.matmul(query, ctx.transpose(1, 2)) * layer.scaling  # [batch, heads, len]
            probs = self._softmax(scores, meta)
            out_latent = torch.matmul(probs, ctx[..., : layer.kv_lora_rank])  # [batch, heads, kv_lora]
        out_rows = pad_rows(out_latent, self.row_padding)  # [batch (+pad), heads, kv_lora]
        out = torch.bmm(out_rows.transpose(0, 1), w_uv.float().transpose(1, 2))  # [heads, batch (+pad), v]
        return out.transpose(0, 1)[:bsz].to(q_nope.dtype)

    def _decode_normal(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer: MLAAttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        meta: DecodeMetadata = batch.attn_metadata
        bsz, max_len = meta.slot_index.shape
        buf = _latent_pool(batch).buffer(layer.layer_id)
        ctx = buf[meta.slot_index.flatten()]  # [batch * len, kv_lora + rope]
        keys, values = self._keys_values(ctx, layer)
        keys = keys.view(bsz, max_len, layer.num_heads, -1).float()
        values = values.view(bsz, max_len, layer.num_heads, -1).float()
        query = torch.cat((q_nope, q_pe), dim=-1).float()  # [batch, heads, qk_head]
        if self.row_wise:  # each request over its own length: the padded length depends on the others
            rows = []
            for b, n in enumerate(meta.seq_lens.tolist()):
                scores = torch.einsum("hd,lhd->hl", query[b], keys[b, :n]) * layer.scaling  # [heads, len]
                rows.append(torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), values[b, :n]))
            return torch.stack(rows).to(q_nope.dtype)  # [batch, heads, v_head_dim]
        scores = torch.einsum("bhd,blhd->bhl", query, keys) * layer.scaling
        probs = self._softmax(scores, meta)
        return torch.einsum("bhl,blhd->bhd", probs, values).to(q_nope.dtype)
