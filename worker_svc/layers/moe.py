"""DeepSeek-style mixture of experts: a softmax router with greedy or group-limited top-k, routed
experts, always-on shared experts, and ``routed_scaling_factor`` on the routing weights.

Experts are ordinary gated MLPs (column-parallel gate/up, row-parallel down) under the checkpoint's own
per-expert names, so the loader, TP sharding and quantization treat them like any other linear. Each
expert's down projection skips its all-reduce; the layer reduces the summed output once.

Two ways to run the routed experts, fixed after loading:
- a loop over the experts, each on its tokens (the default on the CPU, and for quantized experts). Slicing
  the sorted tokens needs every expert's count on the host, one device-to-host copy per layer;
- ``use_grouped_experts()``: the experts' weights stacked into one tensor and run as two grouped GEMMs
  (``torch._grouped_mm``) whose group boundaries stay on the device. No host sync, so on CUDA a layer
  queues without waiting (what the two-batch overlap's stream ordering and CUDA graphs need).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.config.model_config import DeepseekV2Fields
from worker_svc.layers.activation import silu_and_mul
from worker_svc.layers.linear import release_weight
from worker_svc.layers.mlp import GatedMLP
from worker_svc.parallel.context import TPContext


class TopKRouter(nn.Module):
    """``mlp.gate``: scores = softmax(x W^T) in fp32, then top-k experts per token."""

    kernel = staticmethod(F.linear)  # swappable like KernelLinear's (the runner's fp32 kernel)
    quantized: bool = False  # as KernelLinear's: the router's weight is never quantized

    def __init__(self, hidden_size: int, fields: DeepseekV2Fields) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(fields.n_routed_experts, hidden_size), requires_grad=False)
        self.fields = fields

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [tokens, top_k] fp32, expert ids [tokens, top_k])."""
        f = self.fields
        scores = self.kernel(x.float(), self.weight.float(), None).softmax(dim=-1)  # [tokens, experts]
        if f.topk_method == "group_limited_greedy":
            n_group, topk_group = f.n_group, f.topk_group
            assert n_group is not None and topk_group is not None  # the config requires both for this method
            # Keep only the topk_group groups with the best single expert, then top-k among them.
            grouped = scores.view(-1, n_group, f.n_routed_experts // n_group)  # [tokens, groups, experts/group]
            best_groups = grouped.max(dim=-1).values.topk(topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros(scores.shape[0], n_group, dtype=torch.bool, device=x.device)
            keep.scatter_(1, best_groups, True)
            scores = (grouped * keep.unsqueeze(-1)).view(-1, f.n_routed_experts)  # [tokens, experts]
        weights, ids = scores.topk(f.num_experts_per_tok, dim=-1, sorted=False)
        if f.norm_topk_prob and f.num_experts_per_tok > 1:
            # sglang's semantics (renormalise, then scale). transformers 5 ignores norm_topk_prob.
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * f.routed_scaling_factor, ids


class GroupedExperts(nn.Module):
    """Every routed expert's (TP-sharded) weights in two stacked tensors, run as grouped GEMMs over
    tokens sorted by expert; ``group_ends[e]`` is where expert e's rows end (on the device)."""

    gate_up_t: torch.Tensor
    down_t: torch.Tensor

    def __init__(self, experts: list[GatedMLP]) -> None:
        super().__init__()
        # [experts, hidden, 2 * inter] and [experts, inter, hidden], each a transposed view of the stacked
        # nn.Linear weights ([out, in] contiguous), the column-major B that CUDA's grouped GEMM wants.
        gate_up = torch.stack([e.gate_up_proj.weight.detach() for e in experts])  # [E, 2 * inter, hidden]
        down = torch.stack([e.down_proj.weight.detach() for e in experts])  # [E, hidden, inter]
        self.register_buffer("gate_up_t", gate_up.transpose(1, 2), persistent=False)
        self.register_buffer("down_t", down.transpose(1, 2), persistent=False)

    def forward(self, x_sorted: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
        """x_sorted [rows, hidden] grouped by expert, group_ends [experts] int32 -> [rows, hidden]."""
        hidden = torch._grouped_mm(x_sorted, self.gate_up_t, offs=group_ends)  # [rows, 2 * inter]
        return torch._grouped_mm(silu_and_mul(hidden), self.down_t, offs=group_ends)


class DeepseekMoE(nn.Module):
    def __init__(self, hidden_size: int, fields: DeepseekV2Fields, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = fields.num_experts_per_tok
        self.gate = TopKRouter(hidden_size, fields)
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, fields.moe_intermediate_size, tp) for _ in range(fields.n_routed_experts)
        )
        self.shared_experts = (
            GatedMLP(hidden_size, fields.moe_intermediate_size * fields.n_shared_experts, tp)
            if fields.n_shared_experts else None
        )
        self.grouped: GroupedExperts | None = None

    def use_grouped_experts(self) -> None:
        """Run the routed experts as grouped GEMMs from now on; the per-expert weights are dropped (the
        stacked copy replaces them). Unquantized, bias-free experts only."""
        experts = cast(list[GatedMLP], list(self.experts))
        for expert in experts:
            for linear in (expert.gate_up_proj, expert.down_proj):
                if linear.quantized or linear.bias is not None:
                    raise ValueError("grouped experts need unquantized, bias-free expert weights")
        self.grouped = GroupedExperts(experts)
        for expert in experts:
            for linear in (expert.gate_up_proj, expert.down_proj):
                release_weight(linear, keep=set())

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """x [tokens, hidden] -> routed + shared output; with ``reduce=False`` this rank's partial sum."""
        weights, ids = self.gate(x)
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids, stable=True)  # (token, choice) pairs grouped by expert
        tokens = order // self.top_k
        flat_weights = weights.flatten()[order]
        out = torch.zeros_like(x)
        if self.grouped is not None:
            # Per-expert row counts by scatter-add (bincount sizes its output from a host-side max on CUDA).
            counts = torch.zeros(len(self.experts), dtype=torch.int32, device=x.device)
            counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
            y = self.grouped(x[tokens], counts.cumsum(0, dtype=torch.int32)) * flat_weights[:, None]
            out.index_add_(0, tokens, y.to(x.dtype))
        else:
            counts_on_host = torch.bincount(flat_ids, minlength=len(self.experts)).tolist()
            start = 0
            for expert, count in zip(self.experts, counts_on_host, strict=True):
                if count:
                    idx = tokens[start : start + count]
                    y = expert(x[idx], reduce=False) * flat_weights[start : start + count, None]
                    out.index_add_(0, idx, y.to(x.dtype))
                    start += count
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, reduce=False)
        if reduce:
            self.tp.all_reduce(out)
        return out
