"""The decoder skeleton both architectures share: pre-norm layers on a float32 residual stream, a token
embedding and final norm around them, and a vocab-parallel LM head.

A layer runs as two stages, each ending where a tensor-parallel all-reduce is due:

    attention_stage: (fused add +) input_layernorm -> self_attn   -> partial sum
    mlp_stage:       fused add + post_attention_layernorm -> mlp  -> partial sum

A stage returns its partial sum un-reduced (this rank's share), so a caller can issue the all-reduce
itself and overlap it with other work (the two-micro-batch executor); ``DecoderLayer.forward`` is the
synchronous composition. A row-parallel bias is loaded on rank 0 only (zeros elsewhere), so a partial
sum carries it on one rank and the reduction counts it once, exactly as the synchronous path does.

Architectures supply the attention block, ``forward(rope, x, batch, reduce) -> [tokens, hidden]``, and
the MLP block, ``forward(x, reduce) -> [tokens, hidden]``. Module names follow HF (``model.layers.N.
self_attn``, ``.mlp``, ``.input_layernorm``, ...), so checkpoints load by name. No process-group, KV
cache or gRPC code lives here: the TPContext is handed in, attention goes through the step's backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from worker_svc.config.model_config import ModelConfig
from worker_svc.forward_batch import ForwardBatch
from worker_svc.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker_svc.layers.norm import RMSNorm
from worker_svc.layers.rotary import RotaryEmbedding
from worker_svc.parallel.context import TPContext

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) of RotaryEmbedding.lookup, shared by every layer
# (fused parameter, checkpoint name fragment, shard id), read by the checkpoint loader
StackedParams = tuple[tuple[str, str, object], ...]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module, tp: TPContext) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tp = tp

    def attention_stage(
        self, rope: Rope, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous layer's reduced MLP output, or the embedding when ``residual`` is None
        (first layer). -> (attention partial sum [tokens, hidden], residual in float32)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual)
        return self.self_attn(rope, hidden, batch, reduce=False), residual

    def mlp_stage(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the reduced attention output. -> (MLP partial sum [tokens, hidden], residual)."""
        hidden, residual = self.post_attention_layernorm.forward_with_residual(hidden, residual)
        return self.mlp(hidden, reduce=False), residual

    def forward(
        self, rope: Rope, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        partial, residual = self.attention_stage(rope, hidden, residual, batch)
        self.tp.all_reduce(partial)  # in place
        partial, residual = self.mlp_stage(partial, residual)
        self.tp.all_reduce(partial)
        return partial, residual


class DecoderModel(nn.Module):
    """HF's ``model``: embed_tokens -> layers -> norm (``rotary`` holds derived state, no weights)."""

    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, layers: Iterable[DecoderLayer], tp: TPContext
    ) -> None:
        super().__init__()
        self.rotary = rotary
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def decoder_layers(self) -> list[DecoderLayer]:
        """The layers, typed (an nn.ModuleList yields plain Modules)."""
        return cast("list[DecoderLayer]", list(self.layers))

    def embed(self, batch: ForwardBatch) -> tuple[torch.Tensor, Rope]:
        """-> (token embeddings [tokens, hidden], reduced over the vocab shards; rope for the positions)."""
        hidden = self.embed_tokens(batch.input_ids)  # [tokens, hidden]
        return hidden, self.rotary.lookup(batch.positions, hidden.dtype)

    def finish(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's reduced MLP output and the residual -> final normed hidden [tokens, hidden]."""
        hidden, _ = self.norm.forward_with_residual(hidden, residual)
        return hidden

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden, rope = self.embed(batch)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, batch)
        assert residual is not None, "a decoder needs at least one layer"
        return self.finish(hidden, residual)


class CausalLM(nn.Module):
    """HF's ``*ForCausalLM``: the decoder (``model``) and the LM head (``lm_head``)."""

    stacked_params: StackedParams = ()

    def __init__(self, config: ModelConfig, model: DecoderModel, tp: TPContext) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head; re-run after materialising (to_empty unties)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def logit_rows(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden [tokens, hidden] -> the rows that get logits: each request's final token
        [batch, hidden] (every token with all_logits)."""
        return hidden[batch.logit_indices()]

    def logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden [tokens, hidden] -> float32 logits [batch, vocab] at each request's final token
        ([tokens, vocab] with all_logits), gathered over the vocab shards."""
        return self.lm_head.logits(self.logit_rows(hidden, batch))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.logits(self.model(batch), batch)
