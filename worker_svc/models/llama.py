"""Llama (1/2/3, GQA, explicit head_dim, tied embeddings, llama3 rope scaling) for the worker.

Only what is Llama's own lives here: its attention (fused q/k/v, rotate-half rope) and the choice of
blocks; the layer, model and LM skeleton is models/decoder.py. HF parameter names; q/k/v and gate/up
are fused at load time through ``stacked_params``. No KV cache or process-group code lives here:
attention goes through the step's backend, collectives through the parallel layers.
"""

from __future__ import annotations

import torch
from torch import nn

from worker_svc.attention.base import AttentionLayer
from worker_svc.config.model_config import ModelConfig
from worker_svc.forward_batch import ForwardBatch
from worker_svc.layers.linear import QKVParallelLinear, RowParallelLinear
from worker_svc.layers.mlp import GatedMLP
from worker_svc.layers.rotary import RotaryEmbedding, RotateHalfRope
from worker_svc.models.decoder import CausalLM, DecoderLayer, DecoderModel, Rope, StackedParams
from worker_svc.parallel.context import TPContext


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPContext) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.attention_bias,
            tp,
        )
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, config.attention_bias, tp)
        self.head_dim = config.head_dim
        self.rotary = RotateHalfRope()
        self.attn = AttentionLayer(
            layer_id,
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            config.head_dim,
            scaling=config.head_dim**-0.5,
        )

    def forward(self, rope: Rope, x: torch.Tensor, batch: ForwardBatch, reduce: bool = True) -> torch.Tensor:
        """x [tokens, hidden] -> [tokens, hidden]; with ``reduce=False`` this rank's partial sum."""
        qkv = self.qkv_proj(x)  # [tokens, q_size + 2 * kv_size] (local heads)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.attn.num_heads, self.head_dim)  # [tokens, q_heads, head_dim]
        k = k.view(-1, self.attn.num_kv_heads, self.head_dim)  # [tokens, kv_heads, head_dim]
        v = v.view(-1, self.attn.num_kv_heads, self.head_dim)  # [tokens, kv_heads, head_dim]
        q, k = self.rotary(q, k, rope)
        out = self.attn(q, k, v, batch)  # [tokens, q_heads * head_dim]
        return self.o_proj(out, reduce=reduce)


def _layer(config: ModelConfig, layer_id: int, tp: TPContext) -> DecoderLayer:
    attention = LlamaAttention(config, layer_id, tp)
    mlp = GatedMLP(config.hidden_size, config.intermediate_size, tp, bias=config.mlp_bias)
    return DecoderLayer(config, attention, mlp, tp)


class LlamaForCausalLM(CausalLM):
    stacked_params: StackedParams = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config: ModelConfig, tp: TPContext) -> None:
        rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        layers = (_layer(config, i, tp) for i in range(config.num_hidden_layers))
        super().__init__(config, DecoderModel(config, rotary, layers, tp), tp)
