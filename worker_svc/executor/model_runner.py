"""Model runner: builds the model on the meta device, loads this rank's shard, sizes the KV pool and
runs one forward step for a ``StepInput``.

A ``StepInput`` is self-contained (token ids, positions, KV slots, per-request lengths), so a
tensor-parallel follower can replay the leader's step from it alone; the request -> token table is
updated here from the step, not by the scheduler.
"""

from __future__ import annotations

import structlog
import torch

from worker_svc.attention.torch_native import TorchNativeAttentionBackend
from worker_svc.attention.torch_native_mla import TorchNativeMLABackend
from worker_svc.config.engine_config import EngineConfig
from worker_svc.config.model_config import ModelConfig, load_model_config
from worker_svc.executor.model_loader import load_checkpoint
from worker_svc.executor.quantize import check_alignment, check_runnable, parse_quant_config, quantize_model
from worker_svc.forward_batch import ForwardBatch, ForwardMode, StepInput
from worker_svc.kernels import cpu_ext
from worker_svc.kernels.bf16_linear import (
    BlockedUpcastLinear,
    PackedFp16Linear,
    cpu_has_native_bf16,
    fbgemm_available,
)
from worker_svc.kvcache import KVSlotAllocator, MHAKVPool, MLAKVPool, ReqToTokenTable
from worker_svc.layers.embedding import ParallelLMHead
from worker_svc.layers.linear import KernelLinear, embedding_parameter_ids, release_weight
from worker_svc.layers.norm import RMSNorm
from worker_svc.models.registry import model_class
from worker_svc.parallel.context import TPContext

log = structlog.get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(requested: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    name = config.torch_dtype if requested == "auto" else requested
    dtype = _DTYPES.get(name.replace("torch.", ""), torch.float32)
    if dtype is torch.float16 and device.type == "cpu":
        # fp16 matmuls have no fast CPU path; bf16 keeps the range and is fast on AVX-512-BF16.
        log.info("float16 requested on CPU; using bfloat16")
        dtype = torch.bfloat16
    return dtype


class ModelRunner:
    def __init__(self, engine: EngineConfig, tp: TPContext | None = None) -> None:
        self.engine = engine
        self.tp = tp or TPContext()
        self.device = torch.device(engine.device)
        self.config = load_model_config(engine.model_path, engine.json_model_override_args)
        self.dtype = resolve_dtype(engine.dtype, self.config, self.device)
        self.context_len = engine.context_length or self.config.max_position_embeddings
        torch.manual_seed(engine.random_seed)
        self.model = self._load_model()
        self._init_kv_cache()
        self.attn_backend = (
            TorchNativeMLABackend(engine.mla_decode) if self.config.deepseek else self._mha_backend()
        )

    def _mha_backend(self) -> TorchNativeAttentionBackend:
        """The AVX2 decode-attention kernel on x86 CPUs that have it, else the grouped fp32 matmuls."""
        cpu_ops = cpu_ext.load() if self.device.type == "cpu" else None
        decode_impl = "avx2" if cpu_ops is not None else "grouped_matmul"
        log.info("attention backend", backend="torch_native", decode=decode_impl)
        return TorchNativeAttentionBackend(decode_impl, cpu_ops)

    def _load_model(self) -> torch.nn.Module:
        quant = parse_quant_config(self.engine.torchao_config)
        check_runnable(quant, self.device)  # fail before reading any weights
        with torch.device("meta"):
            model = model_class(self.config.architecture)(self.config, self.tp)
        check_alignment(model, quant, self.tp.size, self.engine.quantize_lm_head)
        model = model.to(dtype=self.dtype).to_empty(device=self.device)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        model.requires_grad_(False)
        load_checkpoint(model, self.engine.model_path)
        for module in model.modules():
            if hasattr(module, "build_cache"):
                module.build_cache(self.device)
        quantized = quantize_model(
            model, quant, self.dtype, self.device, self.engine.quantize_lm_head, self.engine.cpu_quant_kernel
        )
        self._select_linear_kernels(model)
        self._select_norm_kernels(model)
        self.weight_nbytes = self.weight_bytes(model)
        model.eval()
        log.info(
            "model loaded",
            architecture=self.config.architecture,
            dtype=str(self.dtype),
            tp_rank=self.tp.rank,
            tp_size=self.tp.size,
            weight_bytes=self.weight_nbytes,
            quantization=quant.name,
            quantized_layers=quantized,
        )
        return model

    def _select_linear_kernels(self, model: torch.nn.Module) -> None:
        choice = self.engine.cpu_bf16_linear
        if choice == "auto":
            slow_bf16 = self.device.type == "cpu" and self.dtype == torch.bfloat16 and not cpu_has_native_bf16()
            choice = ("fbgemm_fp16" if fbgemm_available() else "blocked_upcast") if slow_bf16 else "aten"
        if choice.startswith("fbgemm") and not fbgemm_available():
            raise ValueError(f"--cpu-bf16-linear {choice} needs a torch build with FBGEMM")
        if choice == "aten" or self.dtype != torch.bfloat16 or self.device.type != "cpu":
            return
        blocked = BlockedUpcastLinear()  # one shared scratch buffer: the engine runs one step at a time
        shared = embedding_parameter_ids(model)
        for module in model.modules():
            if not isinstance(module, (KernelLinear, ParallelLMHead)) or getattr(module, "quantized", False):
                continue
            if choice.startswith("fbgemm_fp16"):
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
        log.info("cpu bf16 linear kernel", kernel=choice)

    def _select_norm_kernels(self, model: torch.nn.Module) -> None:
        cpu_ops = cpu_ext.load() if self.device.type == "cpu" else None
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.cpu_ops = cpu_ops

    @staticmethod
    def weight_bytes(model: torch.nn.Module) -> int:
        seen, total = set(), 0
        for tensor in list(model.parameters()) + list(model.buffers()):
            if id(tensor) not in seen and tensor.device.type != "meta":
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
        # Weights a kernel holds in its own packed form (their parameters were freed).
        packed = {id(k): k.nbytes for m in model.modules() if hasattr(k := getattr(m, "kernel", None), "nbytes")}
        return total + sum(packed.values())

    def _init_kv_cache(self) -> None:
        cfg, mla = self.config, self.config.deepseek
        attn = self.model.model.layers[0].self_attn.attn
        if mla:  # one latent per token per layer, whatever the head count or TP degree
            per_token = MLAKVPool.bytes_per_token(cfg.num_hidden_layers, mla.kv_lora_rank, mla.qk_rope_head_dim,
                                                  self.dtype)
        else:
            per_token = MHAKVPool.bytes_per_token(cfg.num_hidden_layers, attn.num_kv_heads, cfg.head_dim, self.dtype)
        # Without an explicit size: the memory budget, but never more than every running request can use.
        size = self.engine.max_total_tokens or max(
            1, min(self.engine.kv_cache_memory_bytes // per_token, self.engine.max_running_requests * self.context_len)
        )
        self.kv_bytes_per_token = per_token
        # What per-head K and V would take on this rank (the MLA saving; equal to per_token for MHA).
        self.kv_bytes_per_token_if_mha = per_token
        if mla:
            elem = torch.empty((), dtype=self.dtype).element_size()
            local_heads = attn.num_heads  # heads on this rank
            self.kv_bytes_per_token_if_mha = (
                cfg.num_hidden_layers
                * local_heads
                * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)
                * elem
            )
        if mla:
            self.kv_pool = MLAKVPool(
                size, cfg.num_hidden_layers, mla.kv_lora_rank, mla.qk_rope_head_dim, self.dtype, self.device
            )
        else:
            self.kv_pool = MHAKVPool(
                size, cfg.num_hidden_layers, attn.num_kv_heads, cfg.head_dim, self.dtype, self.device
            )
        self.allocator = KVSlotAllocator(size, self.device)
        self.req_table = ReqToTokenTable(self.engine.max_running_requests, self.context_len, self.device)
        log.info(
            "kv cache ready",
            max_total_tokens=size,
            bytes_per_token=per_token,
            bytes_per_token_if_mha=self.kv_bytes_per_token_if_mha,
            kv_bytes=self.kv_pool.nbytes(),
        )

    @property
    def max_total_tokens(self) -> int:
        return self.kv_pool.size

    def _record_slots(self, step: StepInput) -> None:
        table = self.req_table.table
        if step.mode is ForwardMode.DECODE:
            lens = torch.tensor(step.seq_lens, device=table.device)
            table[step.req_rows, lens - 1] = step.out_slots
            return
        offset = 0
        for row, prefix, seq in zip(step.req_rows.tolist(), step.prefix_lens, step.seq_lens, strict=True):
            table[row, prefix:seq] = step.out_slots[offset : offset + seq - prefix]
            offset += seq - prefix

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """Run one step; float32 logits [batch, vocab] at each request's final token, or
        [tokens, vocab] at every new token when ``step.all_logits``."""
        self._record_slots(step)
        batch = ForwardBatch(
            mode=step.mode,
            input_ids=step.input_ids,
            positions=step.positions,
            out_slots=step.out_slots,
            req_rows=step.req_rows,
            seq_lens=step.seq_lens,
            prefix_lens=step.prefix_lens,
            req_to_token=self.req_table.table,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            all_logits=step.all_logits,
        )
        self.attn_backend.prepare(batch)
        return self.model(batch)
