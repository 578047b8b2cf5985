"""Model runner: builds the model on the meta device, loads this rank's shard, builds the KV cache and
runs one forward step for a ``StepInput``.

A ``StepInput`` is self-contained (token ids, positions, KV slots, per-request lengths), so a
tensor-parallel follower can replay the leader's step from it alone; the request -> token table is
updated here from the step, not by the scheduler.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import structlog
import torch
from torch import nn

from worker_svc.config.dtype import resolve_dtype
from worker_svc.config.engine_config import EngineConfig
from worker_svc.config.model_config import ModelConfig, load_model_config
from worker_svc.executor.compiled_decode import build_compiled_decode
from worker_svc.executor.cuda_graph_runner import CudaGraphRunner, graph_plan
from worker_svc.executor.fused_layers import build_fused_layers
from worker_svc.executor.kernel_choice import KernelPlan, apply_kernels, attention_backend, choose_kernels
from worker_svc.executor.model_loader import load_checkpoint
from worker_svc.executor.quantize import (
    QuantConfig,
    check_alignment,
    check_runnable,
    parse_quant_config,
    quantize_model,
)
from worker_svc.executor.two_batch import forward_two_batch, split_step
from worker_svc.forward_batch import ForwardBatch, ForwardMode, StepInput
from worker_svc.kvcache import KVCache
from worker_svc.kvcache.sizing import KVBudget, KVLayout, MHALayout, MLALayout, build_kv_cache
from worker_svc.layers.embedding import ParallelLMHead
from worker_svc.layers.linear import KernelLinear
from worker_svc.models.decoder import CausalLM
from worker_svc.models.registry import model_class
from worker_svc.parallel.context import TPContext

log = structlog.get_logger(__name__)


# Post-load hooks a model may offer; the runner calls them where a module has them.
@runtime_checkable
class TiedWeights(Protocol):
    def tie_weights(self) -> None:
        """Share the embedding with the LM head; re-run after materialising (``to_empty`` unties)."""


@runtime_checkable
class DeviceCache(Protocol):
    def build_cache(self, device: torch.device) -> None:
        """Compute derived state (e.g. a rotary cos/sin table) on the target device, after materialising."""


@runtime_checkable
class PackedWeight(Protocol):
    """A kernel that holds its own packed or quantized copy of the weight."""

    nbytes: int


def weight_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in seen and tensor.device.type != "meta":
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    # Weights a kernel holds in its own packed form (their parameters were freed); a shared kernel counts once.
    packed: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, (KernelLinear, ParallelLMHead)) and isinstance(kernel := module.kernel, PackedWeight):
            packed[id(kernel)] = kernel.nbytes
    return total + sum(packed.values())


def kv_layout(config: ModelConfig, tp_size: int) -> KVLayout:
    """What this rank caches per token, from the config and the TP degree (as the attention layers shard)."""
    mla = config.deepseek
    if mla is None:
        return MHALayout(config.num_hidden_layers, config.kv_heads_per_rank(tp_size), config.head_dim)
    return MLALayout(
        num_layers=config.num_hidden_layers,
        kv_lora_rank=mla.kv_lora_rank,
        rope_dim=mla.qk_rope_head_dim,
        num_heads=config.heads_per_rank(tp_size),
        qk_nope_head_dim=mla.qk_nope_head_dim,
        v_head_dim=mla.v_head_dim,
    )


class ModelRunner:
    def __init__(self, engine_config: EngineConfig, tp: TPContext | None = None) -> None:
        self.engine_config = engine_config
        self.tp = tp or TPContext()
        self.device = torch.device(engine_config.device)
        self.model_config = load_model_config(engine_config.model_path, engine_config.json_model_override_args)
        self.dtype = resolve_dtype(engine_config.dtype, self.model_config, self.device)
        self.context_len = engine_config.context_length or self.model_config.max_position_embeddings
        torch.manual_seed(engine_config.random_seed)
        quant = parse_quant_config(engine_config.torchao_config)
        check_runnable(quant, self.device)  # fail before reading any weights
        self.kernels = choose_kernels(
            engine_config, quant, self.model_config.deepseek is not None, self.device, self.dtype,
            head_dim=self.model_config.head_dim,
            v_head_dim=self.model_config.deepseek.v_head_dim if self.model_config.deepseek else None,
        )
        self.model = self._load_model(quant, self.kernels)
        # Two-batch overlap drives the decoder's stages itself (executor/two_batch.py).
        self._staged: CausalLM | None = None
        if engine_config.enable_two_batch_overlap:
            if not isinstance(self.model, CausalLM):
                raise ValueError("--enable-two-batch-overlap needs a decoder model (models/decoder.py CausalLM)")
            self._staged = self.model
        self.kv = self._build_kv_cache()
        self.attn_backend = attention_backend(self.kernels)
        self.cuda_graphs = self._build_cuda_graphs()
        self.compiled_decode, self._compile_off_reason = build_compiled_decode(
            engine_config, self.model, self.tp, self.kv, self.attn_backend, self.device)
        self.fused_layers, self._fused_off_reason = build_fused_layers(
            engine_config, self.model, self.tp, self.kv, self.kernels, self.device, self.dtype)

    def _load_model(self, quant: QuantConfig, kernels: KernelPlan) -> nn.Module:
        engine_config = self.engine_config
        with torch.device("meta"):
            model = model_class(self.model_config.architecture)(self.model_config, self.tp)
        check_alignment(model, quant, self.tp.size, engine_config.quantize_lm_head)
        model = model.to(dtype=self.dtype).to_empty(device=self.device)
        if isinstance(model, TiedWeights):
            model.tie_weights()
        model.requires_grad_(False)
        load_checkpoint(model, engine_config.model_path, tied_embeddings=self.model_config.tie_word_embeddings)
        for module in model.modules():
            if isinstance(module, DeviceCache):
                module.build_cache(self.device)
        quantized = quantize_model(
            model, quant, self.dtype, self.device, engine_config.quantize_lm_head, kernels.quant_ops,
            kernels.quant_kernel,
        )
        apply_kernels(model, kernels)
        self.weight_nbytes = weight_bytes(model)
        model.eval()
        log.info(
            "model loaded",
            architecture=self.model_config.architecture,
            dtype=str(self.dtype),
            tp_rank=self.tp.rank,
            tp_size=self.tp.size,
            weight_bytes=self.weight_nbytes,
            quantization=quant.name,
            quantized_layers=quantized,
        )
        return model

    def _build_kv_cache(self) -> KVCache:
        engine_config = self.engine_config
        budget = KVBudget(
            max_total_tokens=engine_config.max_total_tokens,
            memory_bytes=engine_config.kv_cache_memory_bytes,
            max_running_requests=engine_config.max_running_requests,
            context_len=self.context_len,
        )
        kv = build_kv_cache(kv_layout(self.model_config, self.tp.size), budget, self.dtype, self.device)
        log.info(
            "kv cache ready",
            max_total_tokens=kv.allocator.size,
            bytes_per_token=kv.bytes_per_token,
            bytes_per_token_if_mha=kv.bytes_per_token_if_mha,
            kv_bytes=kv.pool.nbytes(),
        )
        return kv

    @property
    def torch_compile(self) -> str:
        """"on", or "off: <why>" (GetServerInfo's scheduler_info.torch_compile)."""
        compiled = self.compiled_decode
        if compiled is None:
            return f"off: {self._compile_off_reason}"
        return f"off: {compiled.failed}" if compiled.failed else "on"

    @property
    def fused_layers_state(self) -> str:
        """"on", or "off: <why>" (GetServerInfo's scheduler_info.fused_layers)."""
        return "on" if self.fused_layers is not None else f"off: {self._fused_off_reason}"

    def _build_cuda_graphs(self) -> CudaGraphRunner | None:
        capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        plan = graph_plan(self.engine_config, self.device, self.tp, self.model,
                          min(self.context_len, self.kv.allocator.size), capability)
        if not plan.enabled:
            log.info("cuda graphs off", reason=plan.reason)
            return None
        return CudaGraphRunner(self.model, self.kv, self.attn_backend, plan.batch_sizes, plan.context_buckets)

    def _record_slots(self, step: StepInput) -> None:
        table = self.kv.req_table
        writes = step.table_writes
        if writes is not None:  # cached prefixes first: the step's own slots come after them
            offset = 0
            for row, start, length in zip(writes.rows, writes.starts, writes.lens, strict=True):
                table.write(row, start, writes.slots[offset : offset + length])
                offset += length
        if step.mode is ForwardMode.DECODE:
            table.write_last(step.req_rows, step.seq_lens, step.out_slots)
            return
        offset = 0
        for row, prefix, seq in zip(step.req_rows.tolist(), step.prefix_lens, step.seq_lens, strict=True):
            table.write(row, prefix, step.out_slots[offset : offset + seq - prefix])
            offset += seq - prefix

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """Run one step; float32 logits [batch, vocab] at each request's final token, or
        [tokens, vocab] at every new token when ``step.all_logits``."""
        self._record_slots(step)
        split = split_step(step, self.engine_config.tbo_min_tokens) if self._staged is not None else None
        if split is not None:
            assert self._staged is not None
            first, second = self._prepared(split.first), self._prepared(split.second)
            return forward_two_batch(self._staged, self.tp, first, second, split.cut_request)
        if self.cuda_graphs is not None and (logits := self.cuda_graphs.run(step)) is not None:
            return logits
        if self.compiled_decode is not None and self.compiled_decode.accepts(step):
            return self.compiled_decode.forward(self._prepared(step))
        if self.fused_layers is not None and self.fused_layers.accepts(step):
            return self.fused_layers.forward(self._prepared(step))
        return self.model(self._prepared(step))

    def _prepared(self, step: StepInput) -> ForwardBatch:
        """The step's ForwardBatch with its attention metadata (one per micro-batch under overlap). The
        scheduler builds token ids, positions and rows on the host: on CUDA they move here (a no-op on the CPU)."""
        device = self.device
        batch = ForwardBatch(
            mode=step.mode,
            input_ids=step.input_ids.to(device),
            positions=step.positions.to(device),
            out_slots=step.out_slots.to(device),
            req_rows=step.req_rows.to(device),
            seq_lens=step.seq_lens,
            prefix_lens=step.prefix_lens,
            req_to_token=self.kv.req_table.table,
            kv_pool=self.kv.pool,
            attn_backend=self.attn_backend,
            all_logits=step.all_logits,
        )
        self.attn_backend.prepare(batch)
        return batch
