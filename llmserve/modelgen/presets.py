"""Model shapes per (arch, preset) and the HF config.json fields they expand to."""

import copy
from typing import Any

ARCHS: tuple[str, ...] = ("llama", "deepseek_v2")
# Recognised on the command line but written by a later issue.
PLANNED_ARCHS: tuple[str, ...] = ()
PRESETS: tuple[str, ...] = ("tiny", "small", "bench")

_LLAMA_SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, max_position_embeddings=2048),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=512, vocab_size=2048, max_position_embeddings=4096),
    # ~156M parameters: the model DESIGN.md section 5 measures decode speed on.
    "bench": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                  intermediate_size=2816, vocab_size=32000, max_position_embeddings=4096),
}

# Dtype the weights are stored in. fp32 for the test sizes keeps the HF-vs-ours comparison exact
# to fp32 noise; bench is stored in bf16 like a real checkpoint (and half the disk).
WEIGHTS_DTYPE: dict[str, str] = {"tiny": "float32", "small": "float32", "bench": "bfloat16"}


def check_arch(arch: str) -> None:
    if arch in PLANNED_ARCHS:
        raise NotImplementedError(f"--arch {arch} is not supported yet (only {', '.join(ARCHS)})")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")


# DeepSeek-V2 shapes. tiny is V2-Lite-like (no q LoRA, greedy routing); small is V2-like (q LoRA,
# group-limited routing over 4 groups, 2 shared experts). bench keeps V2-Lite's attention geometry
# (16 heads, kv_lora_rank 512, nope/rope/v 128/64/128, 64 routed experts, top-6, 2 shared, first layer
# dense) at hidden 1024, 8 layers, moe_intermediate_size 128: about 320M parameters (~0.64 GB in bf16),
# ~160M of them read per token (the routed experts a token does not pick are skipped).
_DEEPSEEK_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 vocab_size=512, max_position_embeddings=2048, q_lora_rank=None, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32,
                 n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                 topk_method="greedy", n_group=None, topk_group=None, routed_scaling_factor=1.0),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, intermediate_size=512,
                  vocab_size=2048, max_position_embeddings=4096, q_lora_rank=96, kv_lora_rank=64,
                  qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, moe_intermediate_size=64,
                  n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=2, first_k_dense_replace=1,
                  topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0),
    "bench": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, intermediate_size=2816,
                  vocab_size=32000, max_position_embeddings=4096, q_lora_rank=None, kv_lora_rank=512,
                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=128,
                  n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
                  topk_method="greedy", n_group=None, topk_group=None, routed_scaling_factor=1.0),
}


def _deepseek_config(preset: str) -> dict[str, Any]:
    shape = copy.deepcopy(_DEEPSEEK_SHAPES[preset])
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        **shape,
        "num_key_value_heads": shape["num_attention_heads"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "moe_layer_freq": 1,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def preset_config(arch: str = "llama", preset: str = "tiny") -> dict[str, Any]:
    """The config.json content for a preset, before tokenizer ids and variants are filled in."""
    check_arch(arch)
    if arch == "deepseek_v2":
        if preset not in _DEEPSEEK_SHAPES:
            raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
        return _deepseek_config(preset)
    if preset not in _LLAMA_SHAPES:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **copy.deepcopy(_LLAMA_SHAPES[preset]),
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        # The serving dtype; both spellings so transformers 4.x (torch_dtype) and 5.x (dtype) read it.
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def llama3_rope_scaling(max_position_embeddings: int) -> dict[str, Any]:
    """Llama 3.1's rope_scaling block, scaled down so the low/high frequency split falls in range."""
    return {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": max(max_position_embeddings // 4, 1),
    }


def yarn_rope_scaling(max_position_embeddings: int, mscale: float = 0.707,
                      mscale_all_dim: float = 0.707) -> dict[str, Any]:
    """DeepSeek-V2's YaRN block (factor 40 over 4096 there), scaled down to the preset's context."""
    return {
        "type": "yarn",
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": max(max_position_embeddings // 4, 1),
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
    }


def apply_variants(
    config: dict[str, Any],
    tie_word_embeddings: bool = False,
    head_dim: int | None = None,
    rope_scaling: str | None = None,
) -> dict[str, Any]:
    """Return config with the structural variants the loaders must handle."""
    config = copy.deepcopy(config)
    config["tie_word_embeddings"] = tie_word_embeddings
    if head_dim is not None:
        config["head_dim"] = head_dim
    if rope_scaling == "llama3":
        config["rope_scaling"] = llama3_rope_scaling(config["max_position_embeddings"])
    elif rope_scaling == "yarn":
        config["rope_scaling"] = yarn_rope_scaling(config["max_position_embeddings"])
    elif rope_scaling is not None:
        raise ValueError(f"unknown rope scaling {rope_scaling!r}; choose from llama3, yarn")
    return config


def head_dim_of(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
