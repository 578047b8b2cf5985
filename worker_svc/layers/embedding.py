"""Vocab-parallel token embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.layers.linear import ShapeMismatchError, SliceableTensor, source_shape
from worker_svc.parallel.context import TPContext


def _vocab_range(vocab_size: int, tp: TPContext) -> tuple[int, int]:
    # Pad the vocabulary up to a multiple of tp.size; the last rank's tail rows stay zero.
    per_rank = math.ceil(vocab_size / tp.size)
    return tp.rank * per_rank, (tp.rank + 1) * per_rank


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_end = _vocab_range(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, hidden_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, source: SliceableTensor, shard_id: Any = None) -> None:
        rows, cols = source_shape(source)
        if cols != param.shape[1] or rows != self.vocab_size:
            raise ShapeMismatchError(f"expected ({self.vocab_size}, {param.shape[1]}), got ({rows}, {cols})")
        end = min(self.vocab_end, rows)
        param.data.zero_()
        if end > self.vocab_start:
            param.data[: end - self.vocab_start].copy_(source[self.vocab_start : end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_shard, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        self.tp.all_reduce(out)
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states onto this rank's vocab slice; ``logits`` gathers the full row."""

    kernel = staticmethod(F.linear)  # swappable like KernelLinear's
    quantized: bool = False  # as KernelLinear's
    needs_weight: bool = False

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.kernel(hidden, self.weight, None)  # [tokens, vocab_per_rank]
        full = self.tp.all_gather_last_dim(local)
        return full[..., : self.vocab_size].float()
