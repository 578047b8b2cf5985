"""Seeded random weights under HF Llama parameter names.

Scales are chosen so next-token distributions are peaked (top-1 vs top-2 logit gap mostly > 0.5):
greedy decoding by two fp32 implementations then agrees despite ~1e-6 numerical noise, which a
near-uniform random model would not give.
"""

import math
from typing import Any

import torch

from llmserve.modelgen.presets import head_dim_of

# Gaussian logits of std s over V tokens have a mean top-1/top-2 gap of about s / sqrt(2 ln V);
# this many "gap units" puts the median gap near 2-3 logits at any vocabulary size.
_LOGIT_GAP_SCALE = 4.0
# o_proj/down_proj outputs are scaled up (every model, tied or not) so the residual stream is mostly
# layer output rather than the token embedding: with tied embeddings a dominant embedding makes each
# token predict itself, and greedy output repeats one token forever. Residual RMS grows to ~8*sqrt(2L).
_RESIDUAL_BRANCH_GAIN = 8.0
# Norm weights near 1 but not exactly 1, so a loader that skips them is caught by logit checks.
_NORM_NOISE_STD = 0.1


def _param_specs(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str, float]]:
    """(name, shape, kind, std) in module order; kind is "normal" or "norm" (1 + noise)."""
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    hd = head_dim_of(config)
    q_out = config["num_attention_heads"] * hd
    kv_out = config["num_key_value_heads"] * hd
    # The final norm gives unit-RMS hidden states, so logit std = lm_head std * sqrt(hidden).
    lm_head_std = _LOGIT_GAP_SCALE * math.sqrt(2 * math.log(vocab)) / math.sqrt(hidden)
    tied = bool(config.get("tie_word_embeddings", False))
    specs: list[tuple[str, tuple[int, ...], str, float]] = [
        # Untied: std 1, a unit-RMS start for the residual stream. Tied: the embedding is the LM head.
        ("model.embed_tokens.weight", (vocab, hidden), "normal", lm_head_std if tied else 1.0),
    ]
    # 1/sqrt(fan_in) keeps each projection's output near unit RMS; the residual branches get a gain.
    in_std = 1 / math.sqrt(hidden)
    o_std = _RESIDUAL_BRANCH_GAIN / math.sqrt(q_out)
    down_std = _RESIDUAL_BRANCH_GAIN / math.sqrt(inter)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs += [
            (f"{p}.self_attn.q_proj.weight", (q_out, hidden), "normal", in_std),
            (f"{p}.self_attn.k_proj.weight", (kv_out, hidden), "normal", in_std),
            (f"{p}.self_attn.v_proj.weight", (kv_out, hidden), "normal", in_std),
            (f"{p}.self_attn.o_proj.weight", (hidden, q_out), "normal", o_std),
            (f"{p}.mlp.gate_proj.weight", (inter, hidden), "normal", in_std),
            (f"{p}.mlp.up_proj.weight", (inter, hidden), "normal", in_std),
            (f"{p}.mlp.down_proj.weight", (hidden, inter), "normal", down_std),
            (f"{p}.input_layernorm.weight", (hidden,), "norm", _NORM_NOISE_STD),
            (f"{p}.post_attention_layernorm.weight", (hidden,), "norm", _NORM_NOISE_STD),
        ]
    specs.append(("model.norm.weight", (hidden,), "norm", _NORM_NOISE_STD))
    if not tied:
        specs.append(("lm_head.weight", (vocab, hidden), "normal", lm_head_std))
    return specs


def init_weights(config: dict[str, Any], seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All parameters, drawn in module order from one CPU generator (reproducible bit for bit)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape, kind, std in _param_specs(config):
        t = torch.randn(shape, generator=gen, dtype=torch.float32) * std
        if kind == "norm":
            t += 1.0
        tensors[name] = t.to(dtype).contiguous()
    return tensors


def param_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes the config implies, without drawing any weights."""
    return {name: shape for name, shape, _, _ in _param_specs(config)}


def param_count(config: dict[str, Any]) -> int:
    return sum(math.prod(shape) for shape in param_shapes(config).values())
