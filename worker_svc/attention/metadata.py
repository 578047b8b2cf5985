"""Per-step attention metadata over the request -> token table, built once per step and shared by every
layer: the padded slot index and length mask of a decode; an extend's rows as the batched kernel takes them,
and (built on first use) the per-request context slots and causal masks. The MHA and MLA torch-native
backends both use it."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

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
class RequestContexts:
    """Per request of an extend step: all its slots (cached prefix and new tokens) and its new tokens' causal
    mask over them ([extend, seq] bool); both None when it has no prefix (a plain causal prefill) or is one of
    ``one_token``'s."""

    slots: list[torch.Tensor | None]
    masks: list[torch.Tensor | None]


@dataclass
class ExtendMetadata:
    token_offsets: list[int]  # start of each request in the packed new tokens
    extends: ExtendRows
    one_token: OneTokenRows | None  # only when asked for (prepare_extend's group_one_token)
    # What ``contexts`` is built from: the request -> token table, each request's row, prefix and length.
    req_to_token: torch.Tensor = field(repr=False)
    rows: list[int] = field(repr=False)
    prefix_lens: list[int] = field(repr=False)
    seq_lens: list[int] = field(repr=False)

    @functools.cached_property
    def contexts(self) -> RequestContexts:
        """Built on first use, once a step: the batched extend kernel reads ``extends`` instead; the SDPA
        fallback and the MLA backend read these."""
        grouped = set(self.one_token.requests) if self.one_token is not None else set()
        contexts = RequestContexts(slots=[], masks=[])
        for i, (row, prefix, seq) in enumerate(zip(self.rows, self.prefix_lens, self.seq_lens, strict=True)):
            if prefix == 0 or i in grouped:
                contexts.slots.append(None)
                contexts.masks.append(None)
                continue
            contexts.slots.append(self.req_to_token[row, :seq])
            # Query i (absolute position prefix + i) sees keys 0 .. prefix + i.
            q_pos = torch.arange(prefix, seq, device=self.req_to_token.device)[:, None]
            k_pos = torch.arange(seq, device=self.req_to_token.device)[None, :]
            contexts.masks.append(k_pos <= q_pos)
        return contexts


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
    """``group_one_token``: requests adding one token to a cached prefix go into ``one_token`` (attended
    together as one decode) instead of ``extends``."""
    offsets: list[int] = []
    one_token: list[int] = []
    extends = ExtendRows(q_starts=[], lens=[], prefix_lens=[], prefix_slots=torch.empty(0, dtype=torch.int64))
    prefix_slots: list[torch.Tensor] = []
    rows = batch.req_rows.tolist()
    offset = 0
    for i, (row, prefix, seq) in enumerate(zip(rows, batch.prefix_lens, batch.seq_lens, strict=True)):
        offsets.append(offset)
        if prefix > 0 and group_one_token and seq - prefix == 1:  # a rider: attended with one_token's decode
            one_token.append(i)
        else:
            extends.q_starts.append(offset)
            extends.lens.append(seq - prefix)
            extends.prefix_lens.append(prefix)
            if prefix > 0:
                prefix_slots.append(batch.req_to_token[row, :prefix])
        offset += seq - prefix
    if prefix_slots:
        extends.prefix_slots = torch.cat(prefix_slots).to(torch.int64)
    return ExtendMetadata(
        token_offsets=offsets, extends=extends,
        one_token=_one_token_rows(batch, one_token, offsets) if one_token else None,
        req_to_token=batch.req_to_token, rows=rows, prefix_lens=batch.prefix_lens, seq_lens=batch.seq_lens,
    )


def _one_token_rows(batch: ForwardBatch, requests: list[int], offsets: list[int]) -> OneTokenRows:
    rows = batch.req_rows[torch.tensor(requests, device=batch.req_rows.device)]
    decode = _padded_decode(batch.req_to_token, rows, [batch.seq_lens[i] for i in requests])
    tokens = torch.tensor([offsets[i] for i in requests], dtype=torch.int64, device=rows.device)
    return OneTokenRows(requests=requests, tokens=tokens, decode=decode)
