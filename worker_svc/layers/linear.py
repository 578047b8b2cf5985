"""Tensor-parallel linear layers built on plain ``nn.Linear``.

Each layer holds only this rank's shard and has a ``weight_loader(param, source, shard_id)`` that reads
exactly that shard from a lazily sliced source (a safetensors slice or a tensor), so a rank never materialises
the full checkpoint tensor. Staying an ``nn.Linear`` subclass lets torchao quantize them in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.parallel.context import TPContext


class SliceableTensor(Protocol):
    """A safetensors ``PySafeSlice`` or a ``torch.Tensor``: indexable without loading everything."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


def source_shape(source: Any) -> tuple[int, ...]:
    return tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)


class ShapeMismatchError(ValueError):
    pass


def check_source_shape(source: Any, dim: int, expected: int, what: str) -> None:
    """Catch a mis-shaped checkpoint tensor before slicing hides it."""
    actual = source_shape(source)
    if len(actual) <= dim or actual[dim] != expected:
        raise ShapeMismatchError(f"{what}: expected size {expected} in dimension {dim}, checkpoint has {actual}")


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise ShapeMismatchError(f"{what}: expected shard shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.data.copy_(loaded)


LinearKernel = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class KernelLinear(nn.Linear):
    """An ``nn.Linear`` whose matmul is a swappable kernel (chosen by the runner for the device and
    dtype, or by quantization); the default is aten's ``F.linear``."""

    kernel: LinearKernel = staticmethod(F.linear)
    quantized: bool = False  # the kernel holds a quantized copy of the weight (set by executor/quantize.py)
    # Other code reads the weight itself (MLA's kv_b_proj for absorbed decode): never quantize or release it.
    needs_weight: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias)


def embedding_parameter_ids(model: nn.Module) -> set[int]:
    """Parameters the input embedding owns (an LM head tied to it shares one of them)."""
    return {id(p) for name, p in model.named_parameters() if "embed_tokens" in name}


def release_weight(module: nn.Module, keep: set[int]) -> None:
    """Once a kernel holds its own packed or quantized copy, drop the parameter's storage and keep
    only its shape, unless the weight is in ``keep`` (shared with the embedding) or the module says
    other code reads it (``needs_weight``, e.g. MLA's kv_b_proj for absorbed decode). ``module``: a
    ``KernelLinear`` or the LM head (both declare ``needs_weight``)."""
    if id(module.weight) in keep or module.needs_weight:
        return
    weight = cast(torch.Tensor, module.weight)  # nn.Module attribute access is typed Tensor | Module
    module.weight = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)


class ColumnParallelLinear(KernelLinear):
    """y = x W^T with W split by output rows; each rank produces its slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext) -> None:
        start, end = tp.shard_range(out_features)
        super().__init__(in_features, end - start, bias=bias)
        self.tp = tp
        self.full_out_features = out_features

    def weight_loader(self, param: nn.Parameter, source: SliceableTensor, shard_id: Any = None) -> None:
        check_source_shape(source, 0, self.full_out_features, "column-parallel weight")
        start, end = self.tp.shard_range(self.full_out_features)
        _copy_checked(param, source[start:end], "column-parallel weight")


class MergedColumnParallelLinear(KernelLinear):
    """Several column-parallel outputs fused in one matmul (gate_proj + up_proj -> gate_up_proj)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TPContext) -> None:
        self.output_sizes = output_sizes
        self.local_sizes = [size // tp.size for size in output_sizes]
        for size in output_sizes:
            tp.shard_range(size)  # raises when a size does not divide over the ranks
        super().__init__(in_features, sum(self.local_sizes), bias=bias)
        self.tp = tp

    def weight_loader(self, param: nn.Parameter, source: SliceableTensor, shard_id: int) -> None:
        check_source_shape(source, 0, self.output_sizes[shard_id], f"merged shard {shard_id}")
        start, end = self.tp.shard_range(self.output_sizes[shard_id])
        offset = sum(self.local_sizes[:shard_id])
        target = param.data.narrow(0, offset, self.local_sizes[shard_id])
        _copy_checked(target, source[start:end], f"merged shard {shard_id}")


class QKVParallelLinear(KernelLinear):
    """Fused q/k/v projection, sharded by attention head.

    When there are fewer KV heads than ranks, each KV head is replicated on ``tp.size / num_kv_heads``
    consecutive ranks, so every rank holds at least one.
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp: TPContext
    ) -> None:
        if num_heads % tp.size:
            raise ValueError(f"num_attention_heads={num_heads} must be divisible by tp size {tp.size}")
        if num_kv_heads >= tp.size and num_kv_heads % tp.size:
            raise ValueError(f"num_key_value_heads={num_kv_heads} must be divisible by tp size {tp.size}")
        if num_kv_heads < tp.size and tp.size % num_kv_heads:
            raise ValueError(f"tp size {tp.size} must be a multiple of num_key_value_heads={num_kv_heads}")
        self.head_dim = head_dim
        self.total_heads = num_heads
        self.total_kv_heads = num_kv_heads
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        # Index of this rank's first KV head in the checkpoint.
        self.kv_head_start = (self.num_kv_heads * tp.rank if num_kv_heads >= tp.size
                              else tp.rank * num_kv_heads // tp.size)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.tp = tp

    def weight_loader(self, param: nn.Parameter, source: SliceableTensor, shard_id: str) -> None:
        total_heads = self.total_heads if shard_id == "q" else self.total_kv_heads
        check_source_shape(source, 0, total_heads * self.head_dim, f"{shard_id}_proj")
        if shard_id == "q":
            start = self.tp.rank * self.q_size
            rows, offset = self.q_size, 0
        else:
            start = self.kv_head_start * self.head_dim
            rows = self.kv_size
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        _copy_checked(param.data.narrow(0, offset, rows), source[start : start + rows], f"{shard_id}_proj shard")


class RowParallelLinear(KernelLinear):
    """y = x W^T with W split by input columns; each rank holds a partial sum that is all-reduced.

    ``forward(x, reduce=False)`` returns the partial sum instead, so a caller (the two-micro-batch
    overlap executor) can launch the all-reduce itself and hide it under other work.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext) -> None:
        start, end = tp.shard_range(in_features)
        super().__init__(end - start, out_features, bias=bias)
        self.tp = tp
        self.full_in_features = in_features

    def weight_loader(self, param: nn.Parameter, source: SliceableTensor, shard_id: Any = None) -> None:
        if param is self.bias:
            # The bias is added once, on rank 0's partial sum, so the reduction counts it once.
            loaded = source[:]
            _copy_checked(param, loaded if self.tp.rank == 0 else torch.zeros_like(loaded), "row-parallel bias")
            return
        check_source_shape(source, 1, self.full_in_features, "row-parallel weight")
        start, end = self.tp.shard_range(self.full_in_features)
        _copy_checked(param, source[:, start:end], "row-parallel weight")

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        out = self.kernel(x, self.weight, self.bias)
        if reduce:
            self.tp.all_reduce(out)
        return out
