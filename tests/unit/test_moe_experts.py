"""The MoE layer's two ways to run its routed experts (layers/moe.py): the grouped GEMMs give the
per-expert loop's output, and they queue with no device-to-host read, which is what lets a CUDA stream
run a layer without waiting (two-batch overlap, CUDA graphs). The HF oracle runs both end to end
(test_deepseek_oracle.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from worker_svc.config.engine_config import EngineConfig
from worker_svc.config.model_config import DeepseekV2Fields
from worker_svc.executor.kernel_choice import choose_kernels
from worker_svc.executor.quantize import QuantConfigError, parse_quant_config
from worker_svc.layers.moe import DeepseekMoE
from worker_svc.parallel.context import TPContext

HIDDEN = 32
FIELDS = DeepseekV2Fields(
    q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    first_k_dense_replace=0, topk_method="greedy", n_group=None, topk_group=None, norm_topk_prob=False,
    routed_scaling_factor=1.0,
)
# What reads a device value on the host: .item()/.tolist() (_local_scalar_dense) and the ops whose output
# size depends on the data (CUDA computes it on the device and waits for it).
HOST_SYNC_OPS = {"_local_scalar_dense", "nonzero", "bincount", "masked_select", "unique", "_unique2"}


class OpRecorder(TorchDispatchMode):
    """Records the name of every aten op run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func._schema.name.split("::")[-1])
        return func(*args, **(kwargs or {}))


def _moe(fields: DeepseekV2Fields = FIELDS, dtype: torch.dtype = torch.float32, seed: int = 0) -> DeepseekMoE:
    torch.manual_seed(seed)
    moe = DeepseekMoE(HIDDEN, fields, TPContext()).to(dtype)
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    return moe.requires_grad_(False)


def _grouped_copy(moe: DeepseekMoE, fields: DeepseekV2Fields = FIELDS) -> DeepseekMoE:
    copy = DeepseekMoE(HIDDEN, fields, TPContext()).to(moe.gate.weight.dtype)
    copy.load_state_dict(moe.state_dict())
    copy.requires_grad_(False).use_grouped_experts()
    return copy


@pytest.mark.parametrize("tokens", [1, 3, 17, 64])
@pytest.mark.parametrize("routing", ["greedy", "group_limited_greedy"])
def test_grouped_experts_give_the_loops_output(tokens, routing):
    fields = replace(FIELDS, topk_method=routing, n_group=4 if routing != "greedy" else None,
                     topk_group=2 if routing != "greedy" else None, routed_scaling_factor=2.0)
    loop = _moe(fields)
    grouped = _grouped_copy(loop, fields)
    x = torch.randn(tokens, HIDDEN)
    torch.testing.assert_close(grouped(x), loop(x), rtol=0, atol=1e-5)
    # Some experts get no token at all at one or three tokens: empty groups must be skipped, not misread.
    assert grouped.grouped is not None and all(e.gate_up_proj.weight.device.type == "meta" for e in grouped.experts)


def test_grouped_experts_in_bf16_stay_within_rounding_of_the_fp32_loop():
    loop = _moe()
    grouped = _grouped_copy(loop).to(torch.bfloat16)
    x = torch.randn(32, HIDDEN)
    ref = loop(x)
    err = (grouped(x.bfloat16()).float() - ref).abs().max().item()
    assert err < 0.02 * ref.abs().max().item(), err


def test_grouped_experts_never_read_the_device_on_the_host():
    moe = _moe()
    x = torch.randn(16, HIDDEN)
    with OpRecorder() as loop_ops:
        moe(x)
    # The recorder sees the loop's per-layer sync, so its silence below means something.
    assert loop_ops.ops & HOST_SYNC_OPS, loop_ops.ops
    grouped = _grouped_copy(moe)
    with OpRecorder() as grouped_ops:
        grouped(x)
    assert not grouped_ops.ops & HOST_SYNC_OPS, grouped_ops.ops & HOST_SYNC_OPS


def test_the_plan_picks_grouped_experts_only_where_they_can_run():
    none, int8 = parse_quant_config("none"), parse_quant_config("int8wo")

    def plan(device: str, quant=none, **kw):
        return choose_kernels(EngineConfig(model_path="unused", **kw), quant, True, torch.device(device),
                              torch.bfloat16, head_dim=64).moe_experts

    assert plan("cpu") == "loop"
    assert plan("cuda") == "grouped"  # chosen from the device alone: nothing runs on it here
    assert plan("cuda", quant=int8) == "loop"
    assert plan("cpu", moe_experts="grouped") == "grouped"
    with pytest.raises(QuantConfigError, match="moe-experts grouped"):
        plan("cpu", quant=int8, moe_experts="grouped")
    with pytest.raises(ValueError, match="--moe-experts"):
        EngineConfig(model_path="unused", moe_experts="fused")
