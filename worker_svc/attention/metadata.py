"""Per-step attention metadata over the request -> token table, built once per step and shared by every
layer: the padded slot index and length mask of a decode, the per-request context slots and causal masks
of an extend. The MHA and MLA torch-native backends both use it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_svc.forward_batch import ForwardBatch, ForwardMode


@dataclass
class DecodeMetadata:
    slot_index: torch.Tensor  # [batch, max_len] KV slots, padded with slot 0
    mask: torch.Tensor | None  # [batch, 1, 1, max_len] bool, None when every request has max_len tokens
    seq_lens: torch.Tensor  # [batch] int64


@dataclass
class ExtendMetadata:
    token_offsets: list[int]  # start of each request in the packed new tokens
    context_slots: list[torch.Tensor | None]  # per request: all cached slots, None when there is no prefix
    masks: list[torch.Tensor | None]  # per request [extend, seq] bool, None for a plain causal prefill


def prepare_metadata(batch: ForwardBatch) -> DecodeMetadata | ExtendMetadata:
    return prepare_decode(batch) if batch.mode is ForwardMode.DECODE else prepare_extend(batch)


def prepare_decode(batch: ForwardBatch) -> DecodeMetadata:
    max_len = max(batch.seq_lens)
    slot_index = batch.req_to_token[batch.req_rows, :max_len]
    lens = torch.tensor(batch.seq_lens, dtype=torch.int64, device=slot_index.device)
    mask = None
    if min(batch.seq_lens) != max_len:
        valid = torch.arange(max_len, device=slot_index.device)[None, :] < lens[:, None]
        mask = valid[:, None, None, :]
    return DecodeMetadata(slot_index=slot_index, mask=mask, seq_lens=lens)


def prepare_decode_fixed(
    req_to_token: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor, max_len: int
) -> DecodeMetadata:
    """A decode's metadata at a fixed shape, from device tensors only (no host read, no shape that depends
    on the data), so a CUDA graph can capture it: [batch, max_len] slots with the length mask always
    present. ``max_len`` (a context bucket) may exceed every request's length: the positions past it are
    masked, as in ``prepare_decode``."""
    valid = torch.arange(max_len, device=req_to_token.device)[None, :] < seq_lens[:, None]  # [batch, max_len]
    slot_index = req_to_token[req_rows, :max_len]
    return DecodeMetadata(slot_index=slot_index, mask=valid[:, None, None, :], seq_lens=seq_lens)


def prepare_extend(batch: ForwardBatch) -> ExtendMetadata:
    offsets: list[int] = []
    slots: list[torch.Tensor | None] = []
    masks: list[torch.Tensor | None] = []
    offset = 0
    device = batch.input_ids.device
    for row, prefix, seq in zip(batch.req_rows.tolist(), batch.prefix_lens, batch.seq_lens, strict=True):
        offsets.append(offset)
        offset += seq - prefix
        if prefix == 0:
            slots.append(None)
            masks.append(None)
            continue
        slots.append(batch.req_to_token[row, :seq])
        # Query i (absolute position prefix + i) sees keys 0 .. prefix + i.
        q_pos = torch.arange(prefix, seq, device=device)[:, None]
        k_pos = torch.arange(seq, device=device)[None, :]
        masks.append(k_pos <= q_pos)
    return ExtendMetadata(token_offsets=offsets, context_slots=slots, masks=masks)
