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


Spec = tuple[str, tuple[int, ...], str, float]


def _mlp_specs(prefix: str, hidden: int, inter: int) -> list[Spec]:
    return [
        (f"{prefix}.gate_proj.weight", (inter, hidden), "normal", 1 / math.sqrt(hidden)),
        (f"{prefix}.up_proj.weight", (inter, hidden), "normal", 1 / math.sqrt(hidden)),
        (f"{prefix}.down_proj.weight", (hidden, inter), "normal", _RESIDUAL_BRANCH_GAIN / math.sqrt(inter)),
    ]


def _deepseek_layer_specs(config: dict[str, Any], i: int) -> list[Spec]:
    """MLA attention + (dense MLP or MoE) under HF DeepseekV2 names; experts one by one, as real
    checkpoints store them (transformers 5 fuses them into 3D tensors at load time)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    kv_rank, q_rank = config["kv_lora_rank"], config.get("q_lora_rank")
    in_std = 1 / math.sqrt(hidden)
    p = f"model.layers.{i}"
    specs: list[Spec] = []
    if q_rank is None:
        specs.append((f"{p}.self_attn.q_proj.weight", (heads * (nope + rope), hidden), "normal", in_std))
    else:
        specs += [
            (f"{p}.self_attn.q_a_proj.weight", (q_rank, hidden), "normal", in_std),
            (f"{p}.self_attn.q_a_layernorm.weight", (q_rank,), "norm", _NORM_NOISE_STD),
            (f"{p}.self_attn.q_b_proj.weight", (heads * (nope + rope), q_rank), "normal", 1 / math.sqrt(q_rank)),
        ]
    specs += [
        (f"{p}.self_attn.kv_a_proj_with_mqa.weight", (kv_rank + rope, hidden), "normal", in_std),
        (f"{p}.self_attn.kv_a_layernorm.weight", (kv_rank,), "norm", _NORM_NOISE_STD),
        (f"{p}.self_attn.kv_b_proj.weight", (heads * (nope + v_dim), kv_rank), "normal", 1 / math.sqrt(kv_rank)),
        (f"{p}.self_attn.o_proj.weight", (hidden, heads * v_dim), "normal",
         _RESIDUAL_BRANCH_GAIN / math.sqrt(heads * v_dim)),
    ]
    if i < config.get("first_k_dense_replace", 0):
        specs += _mlp_specs(f"{p}.mlp", hidden, config["intermediate_size"])
    else:
        moe_inter = config["moe_intermediate_size"]
        # Router logits of std ~2: decisive top-k choices, so fp32 noise never flips an expert.
        specs.append((f"{p}.mlp.gate.weight", (config["n_routed_experts"], hidden), "normal", 2 * in_std))
        for e in range(config["n_routed_experts"]):
            specs += _mlp_specs(f"{p}.mlp.experts.{e}", hidden, moe_inter)
        if config.get("n_shared_experts"):
            specs += _mlp_specs(f"{p}.mlp.shared_experts", hidden, moe_inter * config["n_shared_experts"])
    specs += [
        (f"{p}.input_layernorm.weight", (hidden,), "norm", _NORM_NOISE_STD),
        (f"{p}.post_attention_layernorm.weight", (hidden,), "norm", _NORM_NOISE_STD),
    ]
    return specs


def _param_specs(config: dict[str, Any]) -> list[Spec]:
    """(name, shape, kind, std) in module order; kind is "normal" or "norm" (1 + noise)."""
    deepseek = config.get("model_type") == "deepseek_v2"
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    hd = config["qk_rope_head_dim"] if deepseek else head_dim_of(config)
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
        if deepseek:
            specs += _deepseek_layer_specs(config, i)
            continue
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
