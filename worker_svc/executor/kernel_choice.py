"""Kernel policy: which matmul kernel the bf16 linears get, whether RMSNorm and decode attention run
this project's AVX2 kernels (kernels/csrc), which kernels quantized layers use (AVX-512, AVX2 or aten's),
how MoE experts run, and whether fp32 linears pad few rows to round like many (kernels/row_stable.py).
Chosen once, before any weight is read, from the EngineConfig, the model kind and the device (one
``KernelPlan``, logged once), then applied to the loaded model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
import torch
from torch import nn

from worker_svc.attention.base import StepAttentionBackend
from worker_svc.attention.torch_native import TorchNativeAttentionBackend
from worker_svc.attention.torch_native_mla import TorchNativeMLABackend
from worker_svc.config.engine_config import EngineConfig
from worker_svc.executor.quantize import QuantConfig, QuantConfigError
from worker_svc.kernels import cpu_ext
from worker_svc.kernels.bf16_linear import (
    BlockedUpcastLinear,
    PackedBf16Linear,
    PackedFp16Linear,
    cpu_has_native_bf16,
    fbgemm_available,
)
from worker_svc.kernels.row_stable import RowStableLinear, probe_row_padding
from worker_svc.layers.embedding import ParallelLMHead
from worker_svc.layers.linear import KernelLinear, embedding_parameter_ids, release_weight
from worker_svc.layers.mlp import GatedMLP
from worker_svc.layers.moe import DeepseekMoE, TopKRouter
from worker_svc.layers.norm import RMSNorm
from worker_svc.layers.rotary import RotateHalfRope

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class KernelPlan:
    # bf16 linears on the CPU: "aten" (also whenever the weights are not bf16 on the CPU), "amx_bf16", "avx512_bf16",
    # "fbgemm_fp16", "fbgemm_fp16_lowmem" or "blocked_upcast" (EngineConfig.cpu_bf16_linear).
    bf16_linear: str
    cpu_ops: object | None  # the AVX2 kernels (cpu_ext.load()) for RMSNorm, rotary and decode attention; None off x86
    mla: bool  # the model's attention is MLA (one latent per token), not per-head K/V
    mla_decode: str  # MLA only: "absorbed" | "normal"
    quant_ops: object | None  # this project's kernels for quantized CPU layers, None for aten's (or no quantization)
    moe_experts: str = "loop"  # MoE models: "loop" | "grouped" (layers/moe.py)
    quant_kernel: str | None = None  # quantized on the CPU: "avx512" | "avx2" | "aten"; None without quantization
    # --enable-deterministic-inference: attention computes each query row on its own; on the CPU, where the
    # host's sgemm rounds a few rows differently from many (kernels/row_stable.py), the row counts to pad an
    # fp32 linear's input to (None where every count already rounds alike, or not deterministic).
    deterministic: bool = False
    fp32_row_padding: tuple[int, ...] | None = None
    # The CPU grants AMX-BF16 to this project's kernels: int4 / int8 weight-only linears (quant_kernel "avx512")
    # run on AMX tiles from a few bf16 rows (describe() says how many); bf16 linears do under "amx_bf16".
    amx: bool = False

    # Inside the C++ decode attention ("avx2", the backend's name for it): "avx512" where the CPU has AVX-512
    # and the model runs in bf16 / fp16 (head sizes 32, 64, 128; others take the AVX2 code), else "avx2".
    attention_isa: str = "avx2"
    # Extend (prefill) attention: this project's flash kernel (kernels/csrc/extend_attention_avx512.cpp) for bf16
    # models where the CPU has AVX512-BF16 and the head dims fit it, on AMX tiles ("amx_bf16") where the CPU has
    # AMX-BF16 and key heads are a multiple of 32, else on VDPBF16PS ("avx512_bf16"); else "sdpa" (attention/sdpa.py).
    attention_extend: str = "sdpa"

    @property
    def attention_decode(self) -> str:
        if self.mla:
            return self.mla_decode
        return "avx2" if self.cpu_ops is not None else "grouped_matmul"

    def describe(self) -> dict[str, str]:
        """What runs where, for the start-up log and GetServerInfo (``scheduler_info.kernels``)."""
        plan = {
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "bf16_linear": self.bf16_linear,
            "rms_norm": "avx2" if self.cpu_ops is not None else "torch",
            "silu_and_mul": "avx2" if self.cpu_ops is not None else "torch",  # bf16 / fp16; fp32 keeps torch's
            # The sampler (engine/scheduler.py passes cpu_ops to it): truncation and race in C++, or tensor ops.
            "sampling": "fused" if self.cpu_ops is not None else "tensor_ops",
            "rotary": "avx2" if self.cpu_ops is not None else "torch",
            "attention": "torch_native_mla" if self.mla else "torch_native",
            "attention_decode": self.attention_decode,
            **({"attention_decode_isa": self.attention_isa} if self.attention_decode == "avx2" else {}),
            # Deterministic inference attends each extend row on its own, whatever the plan's kernel.
            "attention_extend": "row_wise" if self.deterministic else self.attention_extend,
            "moe_experts": self.moe_experts,
        }
        if self.quant_kernel is not None:
            plan["quant_kernel"] = self.quant_kernel
            if self.quant_kernel == "avx512" and self.amx:
                ops: Any = self.quant_ops
                plan["amx_min_rows"] = f"int4wo {ops.int4_amx_min_rows()}, int8wo {ops.int8_amx_min_rows()}"
        if self.deterministic:
            plan["deterministic"] = "fp32 linears row_stable" if self.fp32_row_padding else "on"
        return plan


def cpu_quant_kernel(choice: str, method: str) -> tuple[str, object | None]:
    """The kernel set quantized layers run on the CPU for ``--cpu-quant-kernel choice`` and quantization
    ``method``: ("avx512" | "avx2" | "aten", this project's kernels ``torch.ops.llmserve_cpu`` or None for aten's).

    ``auto``: the AVX-512 kernels (int8wo, int4wo) where the CPU has AVX-512 F/BW/VL/DQ, the AVX2 kernels on
    AVX2-only CPUs (aten's int kernels are scalar loops there), aten's otherwise. int8dq has no AVX-512
    kernel: on AVX-512 CPUs it runs aten's (vectorized there), also under ``avx512``.
    """
    if choice == "aten":
        return "aten", None
    ops = cpu_ext.load()
    avx512 = ops is not None and bool(ops.quant_avx512_available())  # type: ignore[attr-defined]
    if choice == "avx2":
        if ops is None:
            raise QuantConfigError(
                "--cpu-quant-kernel avx2: the AVX2 kernels cannot run here (needs x86-64 with AVX2 and a C++ "
                "compiler; the log says why); use --cpu-quant-kernel aten"
            )
        return "avx2", ops
    if choice == "avx512" and not avx512:
        raise QuantConfigError(
            "--cpu-quant-kernel avx512: the AVX-512 kernels cannot run here (needs a CPU with AVX-512 F/BW/VL/DQ "
            "and this project's C++ kernels; the log says whether they loaded); use --cpu-quant-kernel auto"
        )
    if avx512:
        return ("aten", None) if method == "int8dq" else ("avx512", ops)
    if ops is not None and torch.backends.cpu.get_cpu_capability() == "AVX2":
        return "avx2", ops
    return "aten", None


def _bf16_linear_kernel(
    engine_config: EngineConfig, device: torch.device, dtype: torch.dtype, cpu_ops: object | None
) -> str:
    if device.type != "cpu" or dtype != torch.bfloat16:
        return "aten"
    avx512_bf16 = cpu_ops is not None and bool(cpu_ops.bf16_linear_available())  # type: ignore[attr-defined]
    amx_bf16 = avx512_bf16 and bool(cpu_ops.bf16_linear_amx_available())  # type: ignore[union-attr]
    choice = engine_config.cpu_bf16_linear
    if choice == "auto":
        if amx_bf16:
            choice = "amx_bf16"
        elif avx512_bf16:
            choice = "avx512_bf16"
        elif not cpu_has_native_bf16():
            choice = "fbgemm_fp16" if fbgemm_available() else "blocked_upcast"
        else:
            choice = "aten"
    if choice == "avx512_bf16" and not avx512_bf16:
        raise ValueError("--cpu-bf16-linear avx512_bf16 needs a CPU with AVX512-BF16 and this project's C++ "
                         "kernels (the log says whether they loaded)")
    if choice == "amx_bf16" and not amx_bf16:
        raise ValueError("--cpu-bf16-linear amx_bf16 needs a CPU with AMX-BF16 and AVX512-BF16, an OS that grants "
                         "the AMX tile state, and this project's C++ kernels (the log says whether they loaded)")
    if choice.startswith("fbgemm") and not fbgemm_available():
        raise ValueError(f"--cpu-bf16-linear {choice} needs a torch build with FBGEMM")
    return choice


def _moe_experts(engine_config: EngineConfig, quant: QuantConfig, device: torch.device) -> str:
    choice = engine_config.moe_experts
    if choice == "grouped" and quant.method != "none":
        raise QuantConfigError("--moe-experts grouped needs unquantized experts (drop --torchao-config)")
    if choice == "auto":
        # On CUDA the loop's per-layer host sync stalls the queue; on the CPU it costs nothing and the
        # loop runs each expert's GEMM on contiguous rows without the grouped GEMM's fallback.
        grouped = device.type == "cuda" and quant.method == "none" and not engine_config.deterministic_inference
        return "grouped" if grouped else "loop"
    return choice


def choose_kernels(
    engine_config: EngineConfig,
    quant: QuantConfig,
    mla: bool,
    device: torch.device,
    dtype: torch.dtype,
    *,
    head_dim: int,
    v_head_dim: int | None = None,
) -> KernelPlan:
    """``head_dim``: the attention head size (per-head K and V of a non-MLA model; MLA's query/key head), which
    decides the decode attention's code path; ``v_head_dim``: the value head size where it differs (MLA)."""
    on_cpu = device.type == "cpu"
    quantized_on_cpu = on_cpu and quant.method != "none"
    cpu_ops = cpu_ext.load() if on_cpu else None
    quant_kernel, quant_ops = (
        cpu_quant_kernel(engine_config.cpu_quant_kernel, quant.method) if quantized_on_cpu else (None, None)
    )
    plan = KernelPlan(
        bf16_linear=_bf16_linear_kernel(engine_config, device, dtype, cpu_ops),
        cpu_ops=cpu_ops,
        mla=mla,
        mla_decode=engine_config.mla_decode,
        quant_ops=quant_ops,
        moe_experts=_moe_experts(engine_config, quant, device),
        quant_kernel=quant_kernel,
        amx=cpu_ops is not None and bool(cpu_ops.quant_amx_available()),  # type: ignore[attr-defined]
        attention_isa=_decode_attention_isa(cpu_ops, dtype, head_dim),
        attention_extend=_extend_attention(cpu_ops, dtype, head_dim, head_dim if v_head_dim is None else v_head_dim),
        deterministic=engine_config.deterministic_inference,
        fp32_row_padding=(probe_row_padding(device)
                          if engine_config.deterministic_inference and on_cpu and dtype == torch.float32 else None),
    )
    log.info("kernel plan", **plan.describe())
    return plan


DECODE_ATTENTION_ISAS = {1: "avx2", 2: "avx512", 3: "avx512_bf16"}  # decode_attention's isa argument


def _decode_attention_isa(cpu_ops: object | None, dtype: torch.dtype, head_dim: int) -> str:
    """The code decode_attention's auto choice runs for this pool dtype and head size, as the kernel itself
    decides it (kernels/csrc/decode_attention_avx2.cpp, ``auto_isa``); K and V heads are one size here."""
    if cpu_ops is None:
        return "avx2"
    return DECODE_ATTENTION_ISAS[int(cpu_ops.decode_attention_auto_isa(dtype, head_dim, head_dim))]  # type: ignore[attr-defined]


def _extend_attention(cpu_ops: object | None, dtype: torch.dtype, head_dim: int, v_head_dim: int) -> str:
    """Where this project's extend attention runs these heads (bf16, AVX512-BF16, an even key head, values in
    multiples of 32): "amx_bf16" where the kernel's own auto choice takes its AMX path (AMX-BF16, key heads a
    multiple of 32), else "avx512_bf16"; "sdpa" where it does not run."""
    fits = dtype == torch.bfloat16 and head_dim % 2 == 0 and v_head_dim % 32 == 0
    if cpu_ops is None or not fits or not cpu_ops.extend_attention_available():  # type: ignore[attr-defined]
        return "sdpa"
    amx = int(cpu_ops.extend_attention_auto_impl(head_dim, v_head_dim)) == 2  # type: ignore[attr-defined]
    return "amx_bf16" if amx else "avx512_bf16"


def apply_kernels(model: nn.Module, plan: KernelPlan) -> None:
    """Give the loaded (and quantized) model's bf16 linears, norms and MoE experts the plan's kernels."""
    if plan.moe_experts == "grouped":  # before the linears: it reads the experts' plain weights
        for module in model.modules():
            if isinstance(module, DeepseekMoE):
                module.use_grouped_experts()
    _apply_linear_kernels(model, plan.bf16_linear, plan.cpu_ops, plan.deterministic)
    if plan.fp32_row_padding is not None:
        row_stable = RowStableLinear(plan.fp32_row_padding)
        for module in model.modules():
            if isinstance(module, (KernelLinear, ParallelLMHead, TopKRouter)) and not module.quantized:
                module.kernel = row_stable
    for module in model.modules():
        if isinstance(module, (RMSNorm, RotateHalfRope, GatedMLP)):
            module.cpu_ops = plan.cpu_ops


# AMX tiles from this many rows up (fewer rows: VDPBF16PS). On the Sapphire Rapids-class host of
# docs/benchmarks.md one row is 8% faster on VDPBF16PS, two rows already 7% faster on AMX, 16 rows 2.4x.
AMX_MIN_ROWS = 2


def _apply_linear_kernels(model: nn.Module, choice: str, cpu_ops: object | None, deterministic: bool) -> None:
    if choice == "aten":
        return
    # Deterministic inference: one kernel for every row count, or a request's rows would round differently
    # alone (VDPBF16PS) than batched (AMX).
    amx_min_rows = (1 if deterministic else AMX_MIN_ROWS) if choice == "amx_bf16" else None
    blocked = BlockedUpcastLinear()  # one shared scratch buffer: the engine runs one step at a time
    shared = embedding_parameter_ids(model)
    for module in model.modules():
        if not isinstance(module, (KernelLinear, ParallelLMHead)) or module.quantized:
            continue
        if module.weight.device.type == "meta":  # its weight moved into a grouped copy (grouped MoE experts)
            continue
        if choice in ("amx_bf16", "avx512_bf16"):
            try:
                module.kernel = PackedBf16Linear(module.weight.data, cpu_ops, amx_min_rows)
            except ValueError:  # an odd number of input features: aten's kernel keeps it
                continue
            release_weight(module, shared)  # the packed copy replaces the bf16 weight
        elif choice.startswith("fbgemm_fp16"):
            keep_bf16 = choice == "fbgemm_fp16"
            try:
                module.kernel = PackedFp16Linear(module.weight.data, gemv_from_bf16=keep_bf16)
            except ValueError:
                module.kernel = blocked
                continue
            if not keep_bf16:
                release_weight(module, shared)  # the packed copy replaces the bf16 weight
        else:
            module.kernel = blocked


def attention_backend(plan: KernelPlan) -> StepAttentionBackend:
    if plan.mla:
        return TorchNativeMLABackend(plan.mla_decode, row_wise=plan.deterministic, row_padding=plan.fp32_row_padding,
                                     extend_impl=plan.attention_extend, cpu_ops=plan.cpu_ops)
    return TorchNativeAttentionBackend(plan.attention_decode, plan.cpu_ops, row_wise=plan.deterministic,
                                       extend_impl=plan.attention_extend)
