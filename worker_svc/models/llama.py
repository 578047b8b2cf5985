"""Llama (1/2/3, GQA, explicit head_dim, tied embeddings, llama3 rope scaling) for the worker.

HF parameter names; q/k/v and gate/up are fused at load time through ``stacked_params``. No KV cache or
process-group code lives here: attention goes through the step's backend, collectives through the
parallel layers.
"""

from __future__ import annotations

import torch
from torch import nn

from worker_svc.attention.base import AttentionLayer
from worker_svc.config.model_config import ModelConfig
from worker_svc.forward_batch import ForwardBatch
from worker_svc.layers.activation import silu_and_mul
from worker_svc.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker_svc.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from worker_svc.layers.norm import RMSNorm
from worker_svc.layers.rotary import RotaryEmbedding, apply_rotary
from worker_svc.parallel.context import TPContext

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [tokens, 1, head_dim]


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPContext) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], config.mlp_bias, tp)
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias, tp)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)), reduce=reduce)


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
        self.attn = AttentionLayer(
            layer_id,
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            config.head_dim,
            scaling=config.head_dim**-0.5,
        )

    def forward(self, rope: Rope, x: torch.Tensor, batch: ForwardBatch, reduce: bool = True) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [tokens, q_size + 2 * kv_size] (local heads)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.attn.num_heads, self.head_dim)  # [tokens, q_heads, head_dim]
        k = k.view(-1, self.attn.num_kv_heads, self.head_dim)  # [tokens, kv_heads, head_dim]
        v = v.view(-1, self.attn.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, rope)
        out = self.attn(q, k, v, batch)  # [tokens, q_heads * head_dim]
        return self.o_proj(out, reduce=reduce)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPContext) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, rope: Rope, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual)
        hidden = self.self_attn(rope, hidden, batch)
        hidden, residual = self.post_attention_layernorm.forward_with_residual(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPContext) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(batch.input_ids)  # [tokens, hidden]
        rope = self.rotary.lookup(batch.positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, batch)
        hidden, _ = self.norm.forward_with_residual(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # (fused parameter, checkpoint name fragment, shard id)
    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config: ModelConfig, tp: TPContext) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head; re-run after materialising (to_empty unties)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [batch, vocab] at each request's final token ([tokens, vocab] with all_logits)."""
        hidden = self.model(batch)  # [tokens, hidden]
        return self.lm_head.logits(hidden[batch.logit_indices()])
