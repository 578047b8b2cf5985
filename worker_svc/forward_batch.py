"""The explicit input of one model step (``StepInput``: which tokens, at which positions, writing which KV
slots) and what the model's layers see of it (``ForwardBatch``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # annotations only: attention sits above this module, kvcache beside it
    from worker_svc.attention.base import StepAttentionBackend
    from worker_svc.kvcache.pool import KVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill, possibly on top of a cached prefix (chunked prefill, retraction)
    DECODE = "decode"  # exactly one new token per request


class FatalStepError(RuntimeError):
    """A step failed in a way that leaves the engine unusable (e.g. a tensor-parallel peer is gone):
    the scheduler re-raises it, so the engine loop fails, instead of failing only the step's requests."""


@dataclass
class TableWrites:
    """Request -> token table writes a step carries ahead of its own slots: row ``rows[i]`` gets the
    next ``lens[i]`` entries of ``slots`` at positions ``starts[i] ..``, in order. They point rows at
    KV the radix prefix cache holds (a request admitted on a cached prefix, or re-pointed at the
    cache's copy of what it computed). The leader's scheduler makes them in its own table at once;
    tensor-parallel followers learn them from the step broadcast."""

    rows: list[int]
    starts: list[int]
    lens: list[int]
    slots: torch.Tensor  # [sum(lens)] int64


@dataclass
class StepInput:
    mode: ForwardMode
    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    out_slots: torch.Tensor  # [tokens] int64
    req_rows: torch.Tensor  # [batch] int64
    seq_lens: list[int]
    prefix_lens: list[int]
    all_logits: bool = False  # logits at every new token (eval-ppl), not only each request's last
    table_writes: TableWrites | None = None  # applied before out_slots are recorded


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64, requests packed back to back
    positions: torch.Tensor  # [num_tokens] int64
    out_slots: torch.Tensor  # [num_tokens] int64: KV slot each new token writes
    req_rows: torch.Tensor  # [batch] int64: rows of the request -> token table
    seq_lens: list[int]  # per request: tokens in the KV cache after this step
    prefix_lens: list[int]  # per request: tokens already cached before this step
    req_to_token: torch.Tensor  # [max_requests, max_context + 1] table shared with the scheduler
    kv_pool: KVPool  # the per-head K/V pool, or MLA's latent pool: the backend of that kind reads it
    attn_backend: StepAttentionBackend
    # Filled by attn_backend.prepare(); only that backend reads it (attention/metadata.py for the torch-native ones).
    attn_metadata: Any = field(default=None)
    all_logits: bool = False  # EXTEND: logits at every new token (teacher-forced scoring), not only the last

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def extend_lens(self) -> list[int]:
        return [s - p for s, p in zip(self.seq_lens, self.prefix_lens, strict=True)]

    def logit_indices(self) -> torch.Tensor:
        """Indices into the packed tokens where logits are taken: each request's final token, or
        every token when ``all_logits`` (then [num_tokens], in packed order)."""
        if self.all_logits:
            return torch.arange(self.input_ids.numel(), device=self.input_ids.device)
        return self.last_token_indices()

    def last_token_indices(self) -> torch.Tensor:
        """[batch]: index into the packed tokens of each request's final token."""
        if self.mode is ForwardMode.DECODE:
            return torch.arange(self.batch_size, device=self.input_ids.device)
        ends = torch.tensor(self.extend_lens, device=self.input_ids.device).cumsum(0)
        return ends - 1
