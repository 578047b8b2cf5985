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
class OneTokenRows:
    """The requests of an extend step that add one token to a cached prefix (the decode rows of a mixed
    step), attended together as one decode instead of one masked attention each."""

    requests: list[int]  # their indices in the step
    tokens: torch.Tensor  # [n] int64: their rows in the packed new tokens
    decode: DecodeMetadata  # over them alone


@dataclass
class ExtendRows:
    """The requests an extend step attends as extends (all but ``one_token``'s), as the batched extend kernel
    takes them: their rows in the packed new tokens and their cached slots, concatenated in order."""

    q_starts: list[int]
    lens: list[int]  # new tokens
    prefix_lens: list[int]
    prefix_slots: torch.Tensor  # [sum of prefix_lens] int64


@dataclass
class ExtendMetadata:
    token_offsets: list[int]  # start of each request in the packed new tokens
    # per request: all cached slots, None when there is no prefix (or the request is in one_token)
    context_slots: list[torch.Tensor | None]
    masks: list[torch.Tensor | None]  # per request [extend, seq] bool, None for a plain causal prefill
    extends: ExtendRows
    one_token: OneTokenRows | None = None  # only when asked for (prepare_extend's group_one_token)


def prepare_metadata(batch: ForwardBatch, group_one_token: bool = False) -> DecodeMetadata | ExtendMetadata:
    return prepare_decode(batch) if batch.mode is ForwardMode.DECODE else prepare_extend(batch, group_one_token)


def prepare_decode(batch: ForwardBatch) -> DecodeMetadata:
    return _padded_decode(batch.req_to_token, batch.req_rows, batch.seq_lens)


def _padded_decode(req_to_token: torch.Tensor, req_rows: torch.Tensor, seq_lens: list[int]) -> DecodeMetadata:
    """One query token per row of ``req_rows`` over its first ``seq_lens`` slots: [rows, max_len] slots, and
    the length mask only when the lengths differ."""
    max_len = max(seq_lens)
    slot_index = req_to_token[req_rows, :max_len]
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=slot_index.device)
    mask = None
    if min(seq_lens) != max_len:
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


def prepare_extend(batch: ForwardBatch, group_one_token: bool = False) -> ExtendMetadata:
    """``group_one_token``: requests adding one token to a cached prefix go into ``one_token`` (their
    per-request entries stay None)."""
    offsets: list[int] = []
    slots: list[torch.Tensor | None] = []
    masks: list[torch.Tensor | None] = []
    one_token: list[int] = []
    extends = ExtendRows(q_starts=[], lens=[], prefix_lens=[], prefix_slots=torch.empty(0, dtype=torch.int64))
    prefix_slots: list[torch.Tensor] = []
    offset = 0
    device = batch.input_ids.device
    for i, (row, prefix, seq) in enumerate(zip(batch.req_rows.tolist(), batch.prefix_lens, batch.seq_lens,
                                               strict=True)):
        offsets.append(offset)
        rides = prefix > 0 and group_one_token and seq - prefix == 1  # attended with one_token's decode
        if rides:
            one_token.append(i)
        else:
            extends.q_starts.append(offset)
            extends.lens.append(seq - prefix)
            extends.prefix_lens.append(prefix)
            if prefix > 0:
                prefix_slots.append(batch.req_to_token[row, :prefix])
        offset += seq - prefix
        if prefix == 0 or rides:
            slots.append(None)
            masks.append(None)
            continue
        slots.append(batch.req_to_token[row, :seq])
        # Query i (absolute position prefix + i) sees keys 0 .. prefix + i.
        q_pos = torch.arange(prefix, seq, device=device)[:, None]
        k_pos = torch.arange(seq, device=device)[None, :]
        masks.append(k_pos <= q_pos)
    if prefix_slots:
        extends.prefix_slots = torch.cat(prefix_slots).to(torch.int64)
    return ExtendMetadata(token_offsets=offsets, context_slots=slots, masks=masks, extends=extends,
                          one_token=_one_token_rows(batch, one_token, offsets) if one_token else None)


def _one_token_rows(batch: ForwardBatch, requests: list[int], offsets: list[int]) -> OneTokenRows:
    rows = batch.req_rows[torch.tensor(requests, device=batch.req_rows.device)]
    decode = _padded_decode(batch.req_to_token, rows, [batch.seq_lens[i] for i in requests])
    tokens = torch.tensor([offsets[i] for i in requests], dtype=torch.int64, device=rows.device)
    return OneTokenRows(requests=requests, tokens=tokens, decode=decode)
