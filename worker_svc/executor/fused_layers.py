"""Fused layers on the CPU: a Llama step's layers in one C++ call (kernels/csrc/fused_layers.cpp); decode
steps, and extend steps on bf16 (below).

Why: a one-token step of a small model is ~10 kernel calls per layer, and from Python each costs a module
call, the op's argument parsing and the dispatcher (5-8 us) on top of its own work; on SmolLM2-135M's 30
layers that overhead is of the order of the int4 linears themselves (docs/engine.md, "Fused layers").
``FusedLayers`` binds every layer's packed weights, norm weights and KV buffers once, here, and runs the
layers back to back in C++ through the same functions the ops register, in the modules' order: the logits
are those of the layer-by-layer path, bit for bit (tests/unit/test_fused_layers.py). The embedding, the
rope table lookup, the final norm and the LM head stay in Python (one call each per step).

On (``fused_layers_plan``) where: the CPU, one rank (each layer's all-reduce is host code between the layers
under TP), a Llama-family decoder (rotate-half rope, fused q/k/v and gate/up, SwiGLU), bf16 or fp16
activations, this project's C++ norm / rotary / decode-attention kernels, and every layer linear on one of
this project's packed kernels (bf16 VDPBF16PS/AMX, AVX-512 int4 or int8 weight-only) without bias. Otherwise
off with the reason logged; ``--disable-fused-layers`` turns it off for A/B runs.

Extend steps (prefills, chunks, cached-prefix extends, mixed steps with their one-token riders) take the same
call's ``forward_extend`` where their attention is this project's batched extend kernel (bf16, the plan's
``attention_extend`` avx512_bf16 / amx_bf16, not deterministic inference): a 64-token extend over a cached
prefix is ~15 calls a layer from Python, ~5 ms of a 28 ms step (docs/benchmarks.md). All-logits steps run the
modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import structlog
import torch

from worker_svc.attention.extend_kernel import EXTEND_KERNEL_IMPL
from worker_svc.attention.metadata import ExtendMetadata
from worker_svc.config.engine_config import EngineConfig
from worker_svc.executor.kernel_choice import KernelPlan
from worker_svc.forward_batch import ForwardBatch, ForwardMode, StepInput
from worker_svc.kernels.bf16_linear import PackedBf16Linear
from worker_svc.kernels.quant_linear import Int4WeightOnlyKernel, Int8WeightOnlyKernel
from worker_svc.kvcache import KVCache, MHAKVPool
from worker_svc.layers.linear import KernelLinear
from worker_svc.layers.mlp import GatedMLP
from worker_svc.models.decoder import CausalLM, DecoderLayer
from worker_svc.models.llama import LlamaAttention
from worker_svc.parallel.context import TPContext

log = structlog.get_logger(__name__)


class LinearKind(IntEnum):
    """fused_layers.cpp's LinearKind."""

    BF16_PACKED = 0
    INT4_AVX512 = 1
    INT8_AVX512 = 2


_SCALE_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class LinearSpec:
    """What FusedLayers.add_layer needs of one linear."""

    kind: LinearKind
    packed: torch.Tensor
    scale: torch.Tensor  # int8's per-channel scales; empty for the others
    fields: tuple[int, int, int, int, int]  # n, k, group, scale dtype code, amx_min_rows (0: never AMX)


def linear_spec(module: KernelLinear) -> LinearSpec | str:
    """The linear as FusedLayers runs it, or why it cannot."""
    if module.bias is not None:
        return "a linear has a bias"
    kernel = module.kernel
    n, k = module.out_features, module.in_features
    empty = torch.empty(0)
    if type(kernel) is PackedBf16Linear:
        return LinearSpec(LinearKind.BF16_PACKED, kernel.packed, empty, (n, k, 0, 0, kernel.amx_min_rows or 0))
    if type(kernel) is Int4WeightOnlyKernel and kernel.avx512:
        code = _SCALE_DTYPE_CODES[kernel.scale_dtype]
        return LinearSpec(LinearKind.INT4_AVX512, kernel.packed, empty, (n, k, kernel.group_size, code, 0))
    if type(kernel) is Int8WeightOnlyKernel and kernel.avx512:
        return LinearSpec(LinearKind.INT8_AVX512, kernel.packed, kernel.kernel_scale, (n, k, 0, 0, 0))
    name = getattr(kernel, "__name__", type(kernel).__name__)
    return f"a linear runs {name}, not one of this project's packed kernels"


def _llama_parts(layer: DecoderLayer) -> tuple[LlamaAttention, GatedMLP] | None:
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(attn, LlamaAttention) and isinstance(mlp, GatedMLP):
        return attn, mlp
    return None


def layer_specs(layer: DecoderLayer) -> list[LinearSpec] | str:
    """The layer's qkv, o, gate_up and down as FusedLayers runs them, or why it cannot."""
    parts = _llama_parts(layer)
    if parts is None:
        return "not a Llama-family decoder (rotate-half rope, fused q/k/v, SwiGLU MLP)"
    attn, mlp = parts
    specs = []
    for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        spec = linear_spec(linear)
        if isinstance(spec, str):
            return spec
        specs.append(spec)
    return specs


@dataclass(frozen=True)
class FusedLayersPlan:
    enabled: bool
    reason: str  # why not, when disabled
    extend_impl: int | None = None  # the extend kernel's impl for extend steps; None: they run the modules


def fused_layers_plan(engine_config: EngineConfig, device: torch.device, tp: TPContext, model: torch.nn.Module,
                      kernels: KernelPlan, dtype: torch.dtype) -> FusedLayersPlan:
    def off(reason: str) -> FusedLayersPlan:
        return FusedLayersPlan(enabled=False, reason=reason)

    if engine_config.disable_fused_layers:
        return off("--disable-fused-layers")
    if device.type != "cpu":
        return off(f"device {device.type}: fused layers are for the CPU")
    if tp.size > 1:
        return off("tensor parallelism: each layer's all-reduce is host code between the layers")
    if kernels.cpu_ops is None:
        return off("this project's C++ kernels are not loaded")
    if kernels.attention_decode != "avx2":
        return off(f"decode attention {kernels.attention_decode!r}, not this project's kernel")
    if dtype not in (torch.bfloat16, torch.float16):
        return off(f"dtype {dtype}: the C++ norm and rotary kernels run bf16 / fp16")
    if not isinstance(model, CausalLM):
        return off("not a decoder model")
    for layer in model.model.decoder_layers():
        specs = layer_specs(layer)
        if isinstance(specs, str):
            return off(specs)
    extends = dtype == torch.bfloat16 and not kernels.deterministic
    return FusedLayersPlan(enabled=True, reason="",
                           extend_impl=EXTEND_KERNEL_IMPL.get(kernels.attention_extend) if extends else None)


class FusedForward:
    """Decode steps (and, with ``extend_impl``, extend steps) through the C++ ``FusedLayers``, the embedding and
    the LM head around it. Built once the KV pool exists (its buffers are bound)."""

    def __init__(self, model: CausalLM, pool: MHAKVPool, extend_impl: int | None = None) -> None:
        self.model = model
        self.extend_impl = extend_impl
        config = model.config
        layers = model.model.decoder_layers()
        parts = _llama_parts(layers[0])
        assert parts is not None, "fused_layers_plan checks every layer"
        attn, mlp = parts
        self.layers = torch.classes.llmserve_cpu.FusedLayers(
            config.hidden_size, attn.attn.num_heads, attn.attn.num_kv_heads, attn.head_dim,
            mlp.gate_up_proj.out_features // 2, layers[0].input_layernorm.eps, attn.attn.scaling)
        for layer in layers:
            specs, parts = layer_specs(layer), _llama_parts(layer)
            assert not isinstance(specs, str) and parts is not None, "fused_layers_plan checks every layer"
            k_buf, v_buf = pool.buffers(parts[0].attn.layer_id)
            self.layers.add_layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight, k_buf, v_buf,
                [int(s.kind) for s in specs], [s.packed for s in specs], [s.scale for s in specs],
                [f for s in specs for f in s.fields])

    def accepts(self, step: StepInput) -> bool:
        if step.all_logits:
            return False
        return step.mode is ForwardMode.DECODE or (step.mode is ForwardMode.EXTEND and self.extend_impl is not None)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """A prepared DECODE or EXTEND batch -> float32 logits [batch, vocab]."""
        decoder = self.model.model
        hidden, (cos, sin) = decoder.embed(batch)
        meta = batch.attn_metadata
        if batch.mode is ForwardMode.DECODE:
            hidden, residual = self.layers.forward(hidden, cos, sin, batch.out_slots, meta.slot_index, meta.seq_lens)
        else:
            assert isinstance(meta, ExtendMetadata) and self.extend_impl is not None
            ext, one = meta.extends, meta.one_token
            none = torch.empty(0, dtype=torch.int64)
            hidden, residual = self.layers.forward_extend(
                hidden, cos, sin, batch.out_slots, ext.prefix_slots, ext.q_starts, ext.lens, ext.prefix_lens,
                self.extend_impl, none if one is None else one.tokens,
                none.view(0, 0) if one is None else one.decode.slot_index, none if one is None else one.decode.seq_lens)
        return self.model.logits(decoder.finish(hidden, residual), batch)


def build_fused_layers(
    engine_config: EngineConfig, model: torch.nn.Module, tp: TPContext, kv: KVCache, kernels: KernelPlan,
    device: torch.device, dtype: torch.dtype,
) -> tuple[FusedForward | None, str]:
    """(the fused layers, "") or (None, why it is off); logged either way."""
    plan = fused_layers_plan(engine_config, device, tp, model, kernels, dtype)
    if not plan.enabled:
        log.info("fused layers off", reason=plan.reason)
        return None, plan.reason
    # The plan's attention_decode "avx2" is what makes the runner's backend the MHA pool's C++ decode kernel.
    assert isinstance(model, CausalLM) and isinstance(kv.pool, MHAKVPool)
    fused = FusedForward(model, kv.pool, plan.extend_impl)
    log.info("fused layers on", layers=fused.layers.num_layers(), extend_steps=plan.extend_impl is not None)
    return fused, ""
