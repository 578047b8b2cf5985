"""Weight quantization of this rank's loaded shard, selected by an sglang-style config string.

    none | int8wo | int4wo-<group> (32, 64, 128, 256) | int8dq | fp8wo | fp8dq-per_row

Applied after loading, to the attention and MLP projections, including DeepSeek's MoE experts (each
routed expert's and the shared experts' gate_up/down are ordinary parallel linears; the router
``mlp.gate`` is not a projection and stays in fp32), and the LM head only when asked. Because
each rank quantizes its own shard, quantization composes with tensor parallelism; int4 groups must
not straddle a row-parallel shard boundary, which is checked at start.

On CUDA the configs map onto torchao's own (``quantize_`` with Int8WeightOnlyConfig,
Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig, Float8...), which reach fast kernels
there. On the CPU torchao 0.15's configs either miss the fast kernels or need extensions built for
another torch, so the CPU path uses torchao's quantization primitives (``choose_qparams_affine``,
``quantize_affine`` and the tinygemm variants) to produce the same quantized values and runs them
with one of three kernel sets (``--cpu-quant-kernel``, picked in executor/kernel_choice.py; the kernel
classes are in kernels/quant_linear.py):

- ``aten``: ``_weight_int8pack_mm`` (int8 weight-only), ``_weight_int4pack_mm_for_cpu`` (int4,
  grouped asymmetric) and ``_int_mm`` (int8 x int8, dynamic per-token activations). They are
  vectorized for AVX-512 only: on an AVX2-only CPU they run scalar loops, and ``_int_mm`` is slower
  than bf16 at every batch size.
- ``avx2``: this project's kernels (kernels/csrc/quant_linear_avx2.cpp, built on first use), the
  same arithmetic vectorized for AVX2 + FMA. ``auto`` picks them on AVX2-only CPUs.
- ``avx512``: this project's AVX-512 kernels for int8wo and int4wo (kernels/csrc/quant_linear_avx512.cpp),
  on weights packed at load for 16 outputs per register, with VDPBF16PS for bf16 activations where the
  CPU has AVX512-BF16. ``auto`` picks them on AVX-512 CPUs; int8dq keeps aten's kernel there.

Each kernel can also produce its dequantized weight, which the tests use as the reference.

MLA's ``kv_b_proj`` is deliberately left unquantized (any layer marked ``needs_weight``): the absorbed
decode does not call it as a linear but reads its weight as W_UK / W_UV for two batched matmuls, and
the extend path's decompression through the same weight must stay equal to the absorbed decode. Using
a dequantized copy for the absorption would keep a full-precision copy in memory anyway (no bytes
saved) while making int8dq's two paths disagree (activation quantization happens only on one), so the
layer keeps its model-dtype weight: ``kv_lora_rank x heads * (qk_nope + v)`` per layer, about 0.4% of
V2-Lite's parameters (5% of the bench preset's). Its input dimension is not subject to the int4 group
check either.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.kernels.quant_linear import Int4WeightOnlyKernel, Int8DynamicKernel, Int8WeightOnlyKernel
from worker_svc.layers.embedding import ParallelLMHead
from worker_svc.layers.linear import (
    KernelLinear,
    LinearKernel,
    RowParallelLinear,
    embedding_parameter_ids,
    release_weight,
)

log = structlog.get_logger(__name__)


INT4_GROUP_SIZES = (32, 64, 128, 256)
CPU_CONFIGS = ("int8wo", *(f"int4wo-{g}" for g in INT4_GROUP_SIZES), "int8dq")
ALL_CONFIGS = ("none", *CPU_CONFIGS, "fp8wo", "fp8dq-per_row")


class QuantConfigError(ValueError):
    pass


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "none" | "int8wo" | "int4wo" | "int8dq" | "fp8wo" | "fp8dq"
    group_size: int = 0  # int4 only
    name: str = "none"


def parse_quant_config(text: str | None) -> QuantConfig:
    name = (text or "none").strip().lower()
    if name in ("none", "int8wo", "int8dq", "fp8wo", "fp8dq-per_row"):
        return QuantConfig(method=name.split("-")[0], name=name)
    match = re.fullmatch(r"int4wo-(\d+)", name)
    if match and int(match.group(1)) in INT4_GROUP_SIZES:
        return QuantConfig(method="int4wo", group_size=int(match.group(1)), name=name)
    raise QuantConfigError(f"--torchao-config {text!r} is not supported; choose one of {', '.join(ALL_CONFIGS)}")


def check_runnable(config: QuantConfig, device: torch.device) -> None:
    if config.method.startswith("fp8") and device.type == "cpu":
        raise QuantConfigError(
            f"--torchao-config {config.name} needs a CUDA GPU with fp8 support; on the CPU use one of: "
            f"{', '.join(CPU_CONFIGS)}"
        )


# ---- applying a config -------------------------------------------------------------------------


def _targets(model: nn.Module, include_lm_head: bool) -> list[tuple[str, KernelLinear | ParallelLMHead]]:
    return [
        (name, module)
        for name, module in model.named_modules()
        if (isinstance(module, KernelLinear) and not module.needs_weight)
        or (include_lm_head and isinstance(module, ParallelLMHead))
    ]


def check_alignment(model: nn.Module, config: QuantConfig, tp_size: int, include_lm_head: bool = False) -> None:
    """int4 groups must lie inside one rank's shard of every quantized layer's input dimension."""
    if config.method != "int4wo":
        return
    for name, module in _targets(model, include_lm_head):
        in_features = module.weight.shape[1]
        if in_features % config.group_size:
            raise QuantConfigError(
                f"--torchao-config {config.name}: {name} has {in_features} input features per rank"
                f"{f' at tp size {tp_size}' if tp_size > 1 else ''}, not a multiple of the group size "
                f"{config.group_size}; choose a group size that divides it or another --tp"
            )


def _row_absmax_over_ranks(module: KernelLinear | ParallelLMHead) -> torch.Tensor | None:
    """For a row-parallel shard, each output row's |max| over every rank's columns."""
    if not isinstance(module, RowParallelLinear) or module.tp.size == 1:
        return None
    absmax = module.weight.data.float().abs().amax(dim=1)  # [out]
    module.tp.all_reduce_max(absmax)
    return absmax


def quantize_model(
    model: nn.Module,
    config: QuantConfig,
    dtype: torch.dtype,
    device: torch.device,
    include_lm_head: bool = False,
    cpu_ops: object | None = None,
    cpu_kernel: str | None = None,
) -> int:
    """Quantize the projection layers in place; returns how many layers were quantized. Every rank
    must call it (row-parallel int8 scales take one max-reduction per layer). ``cpu_ops``: this project's
    kernels the CPU layers run, or None for aten's; ``cpu_kernel``: which of its sets, "avx2" (the default
    with ``cpu_ops``) or "avx512" (executor/kernel_choice.py picks both from ``--cpu-quant-kernel``)."""
    if config.method == "none":
        return 0
    check_runnable(config, device)
    targets = _targets(model, include_lm_head)
    if device.type == "cuda":
        return _quantize_with_torchao(model, config, [m for _, m in targets])
    tied = embedding_parameter_ids(model)
    cpu_kernel = (cpu_kernel or "avx2") if cpu_ops is not None else "aten"
    isa = "avx512" if cpu_kernel == "avx512" else "avx2"
    for _, module in targets:
        weight = module.weight.data
        kernel: Int8WeightOnlyKernel | Int4WeightOnlyKernel
        if config.method == "int8wo":
            kernel = Int8WeightOnlyKernel(weight, dtype, _row_absmax_over_ranks(module), cpu_ops, isa)
        elif config.method == "int8dq":
            kernel = Int8DynamicKernel(weight, dtype, _row_absmax_over_ranks(module), cpu_ops, isa)
        else:
            kernel = Int4WeightOnlyKernel(weight, dtype, config.group_size, cpu_ops, isa)
        module.kernel = kernel
        module.quantized = True
        release_weight(module, tied)  # the kernel holds the quantized copy
    log.info("quantized", config=config.name, layers=len(targets), cpu_kernel=cpu_kernel)
    return len(targets)


def _quantize_with_torchao(
    model: nn.Module, config: QuantConfig, targets: list[KernelLinear | ParallelLMHead]
) -> int:
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Float8WeightOnlyConfig,
        Int4WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        PerRow,
        quantize_,
    )

    ao_config = {
        "int8wo": lambda: Int8WeightOnlyConfig(),
        "int4wo": lambda: Int4WeightOnlyConfig(group_size=config.group_size),
        "int8dq": lambda: Int8DynamicActivationInt8WeightConfig(),
        "fp8wo": lambda: Float8WeightOnlyConfig(),
        "fp8dq": lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
    }[config.method]()
    target_ids = {id(m) for m in targets}
    # Our parallel linears use F.linear by default, which dispatches on torchao's tensor subclasses.
    quantize_(model, ao_config, filter_fn=lambda module, _: id(module) in target_ids)
    for module in targets:  # quantize_ swaps their weights in place: the modules stay
        module.quantized = True
    return len(targets)


def dequantized_reference(model: nn.Module) -> None:
    """Swap every quantized CPU kernel for a plain fp32 linear over its dequantized weight: the
    reference that says what the quantized weights mean (tests and accuracy reports)."""
    for module in model.modules():
        if not isinstance(module, (KernelLinear, ParallelLMHead)):
            continue
        kernel = module.kernel
        if not isinstance(kernel, (Int8WeightOnlyKernel, Int4WeightOnlyKernel)):
            continue
        prepare: Callable[[torch.Tensor], torch.Tensor] = (
            kernel.fake_quantize_activations if isinstance(kernel, Int8DynamicKernel) else lambda x: x.float()
        )
        module.kernel = _fp32_linear(kernel.dequantized().float(), prepare)


def _fp32_linear(weight: torch.Tensor, prepare: Callable[[torch.Tensor], torch.Tensor]) -> LinearKernel:
    """A kernel computing ``prepare(x) @ weight.T`` in fp32, returned in x's dtype; ignores the module's
    own (released) weight."""

    def linear(x: torch.Tensor, _weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(prepare(x), weight, None if bias is None else bias.float()).to(x.dtype)

    return linear
