"""DeepSeek-V2 / V2-Lite for the worker: multi-head latent attention (MLA), DeepSeek MoE, YaRN rotary.

Only what is DeepSeek's own lives here: MLA, and dense MLPs in the first ``first_k_dense_replace`` layers,
MoE (routed + shared experts) after; the layer, model and LM skeleton is models/decoder.py.
HF parameter names (per-expert checkpoint names; gate/up fused at load time through
``stacked_params``). No KV cache or process-group code lives here: attention goes through the step's
MLA backend (which owns the latent pool), collectives through the parallel layers.
"""

from __future__ import annotations

import torch
from torch import nn

from worker_svc.attention.base import MLAAttentionLayer
from worker_svc.config.model_config import ModelConfig
from worker_svc.forward_batch import ForwardBatch
from worker_svc.layers.linear import ColumnParallelLinear, KernelLinear, RowParallelLinear
from worker_svc.layers.mlp import GatedMLP
from worker_svc.layers.moe import DeepseekMoE
from worker_svc.layers.norm import RMSNorm
from worker_svc.layers.rotary import RotaryEmbedding, apply_rotary_interleaved, softmax_scale_factor
from worker_svc.models.decoder import CausalLM, DecoderLayer, DecoderModel, Rope, StackedParams
from worker_svc.parallel.context import TPContext


class DeepseekV2Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPContext) -> None:
        super().__init__()
        f = config.deepseek
        assert f is not None
        hidden, heads, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        if heads % tp.size:
            raise ValueError(f"num_attention_heads={heads} must be divisible by tp size {tp.size}")
        self.num_heads = heads // tp.size
        self.nope, self.rope_dim, self.kv_lora_rank = f.qk_nope_head_dim, f.qk_rope_head_dim, f.kv_lora_rank
        self.q_lora_rank = f.q_lora_rank
        if f.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * f.qk_head_dim, False, tp)
        else:
            # The q LoRA down-projection and the KV down-projection are small and replicated on every rank.
            self.q_a_proj = KernelLinear(hidden, f.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(f.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(f.q_lora_rank, heads * f.qk_head_dim, False, tp)
        self.kv_a_proj_with_mqa = KernelLinear(hidden, f.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(f.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(f.kv_lora_rank, heads * (f.qk_nope_head_dim + f.v_head_dim), False, tp)
        self.kv_b_proj.needs_weight = True  # the absorbed decode reads the weight itself
        self.o_proj = RowParallelLinear(heads * f.v_head_dim, hidden, bias, tp)
        self.attn = MLAAttentionLayer(
            layer_id, self.num_heads, f.kv_lora_rank, f.qk_nope_head_dim, f.qk_rope_head_dim, f.v_head_dim,
            scaling=f.qk_head_dim**-0.5 * softmax_scale_factor(config.rope), kv_b_proj=self.kv_b_proj,
        )

    def forward(self, rope: Rope, x: torch.Tensor, batch: ForwardBatch, reduce: bool = True) -> torch.Tensor:
        """x [tokens, hidden] -> [tokens, hidden]; with ``reduce=False`` this rank's partial sum."""
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(-1, self.num_heads, self.nope + self.rope_dim)  # [tokens, heads, qk_head]
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        compressed, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_pe, k_pe = apply_rotary_interleaved(q_pe, k_pe.unsqueeze(1), rope)
        latent = torch.cat((self.kv_a_layernorm(compressed), k_pe.squeeze(1)), dim=-1)  # [tokens, kv_lora + rope]
        out = self.attn(q_nope, q_pe, latent, batch)  # [tokens, heads * v_head_dim]
        return self.o_proj(out, reduce=reduce)


def _layer(config: ModelConfig, layer_id: int, tp: TPContext) -> DecoderLayer:
    f = config.deepseek
    assert f is not None
    attention = DeepseekV2Attention(config, layer_id, tp)
    mlp: nn.Module
    if layer_id < f.first_k_dense_replace:
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, tp)
    else:
        mlp = DeepseekMoE(config.hidden_size, f, tp)  # its partial sum is routed + shared, reduced once
    return DecoderLayer(config, attention, mlp, tp)


class DeepseekV2ForCausalLM(CausalLM):
    # (fused parameter, checkpoint name fragment, shard id): dense MLP, routed and shared experts.
    stacked_params: StackedParams = (
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config: ModelConfig, tp: TPContext) -> None:
        if config.deepseek is None:
            raise ValueError("DeepseekV2ForCausalLM needs the DeepSeek fields of config.json")
        rope_dim = config.deepseek.qk_rope_head_dim
        rotary = RotaryEmbedding(config.rope, rope_dim, config.max_position_embeddings, interleaved=True)
        layers = (_layer(config, i, tp) for i in range(config.num_hidden_layers))
        super().__init__(config, DecoderModel(config, rotary, layers, tp), tp)
