"""Typed, frozen model configuration parsed once from an HF ``config.json``.

Everything below the loader takes a ``ModelConfig``; nothing re-reads the JSON dict.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "DeepseekV2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_TOPK_METHODS = ("greedy", "group_limited_greedy")
SUPPORTED_ACTIVATIONS = ("silu",)


class ConfigError(ValueError):
    """A config value this engine cannot run; the message names the field and what is supported."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # YaRN (DeepSeek-V2): ramp bounds, and the mscale pair giving the cos/sin attention factor and
    # (mscale_all_dim) the softmax-scale correction.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class DeepseekV2Fields:
    """The MLA and MoE fields of a DeepseekV2ForCausalLM config.json."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    topk_method: str
    n_group: int | None
    topk_group: int | None
    norm_topk_prob: bool
    routed_scaling_factor: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached MLA latent: the compressed KV plus the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    deepseek: DeepseekV2Fields | None = None  # set for DeepseekV2ForCausalLM (MLA + MoE)
    raw: dict[str, Any] = field(repr=False, compare=False, hash=False, default_factory=dict)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def heads_per_rank(self, tp_size: int) -> int:
        """Attention heads each tensor-parallel rank holds (the model checks that they divide)."""
        return self.num_attention_heads // tp_size

    def kv_heads_per_rank(self, tp_size: int) -> int:
        """KV heads each rank holds: its share, or one replicated head when there are fewer KV heads
        than ranks (as ``QKVParallelLinear`` shards them)."""
        return max(1, self.num_key_value_heads // tp_size)


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 nests rope settings under "rope_parameters"; 4.x uses rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"rope_scaling.rope_type={rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    orig = merged.get("original_max_position_embeddings")
    if rope_type == "yarn" and (orig is None or "factor" not in merged):
        raise ConfigError("rope_scaling of type 'yarn' needs 'factor' and 'original_max_position_embeddings'")
    optional = {k: float(merged[k]) for k in ("mscale", "mscale_all_dim", "attention_factor")
                if merged.get(k) is not None}
    return RopeConfig(
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        truncate=bool(merged.get("truncate", True)),
        **optional,
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig is not None else None,
    )


def _positive_int(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config.json field {key!r} must be a positive integer, got {value!r}")
    return value


def _parse_deepseek(cfg: dict[str, Any]) -> DeepseekV2Fields:
    q_lora = cfg.get("q_lora_rank")
    if q_lora is not None:
        q_lora = _positive_int(cfg, "q_lora_rank")
    method = cfg.get("topk_method", "greedy") or "greedy"
    if method not in SUPPORTED_TOPK_METHODS:
        raise ConfigError(f"topk_method={method!r} is not supported; supported: {', '.join(SUPPORTED_TOPK_METHODS)}")
    scoring = cfg.get("scoring_func", "softmax")
    if scoring != "softmax":
        raise ConfigError(f"scoring_func={scoring!r} is not supported; supported: softmax")
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"moe_layer_freq={cfg.get('moe_layer_freq')!r} is not supported; supported: 1")
    experts = _positive_int(cfg, "n_routed_experts")
    top_k = _positive_int(cfg, "num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"num_experts_per_tok={top_k} exceeds n_routed_experts={experts}")
    n_group = topk_group = None
    if method == "group_limited_greedy":
        n_group, topk_group = _positive_int(cfg, "n_group"), _positive_int(cfg, "topk_group")
        if experts % n_group or topk_group > n_group:
            raise ConfigError(f"n_group={n_group} must divide n_routed_experts={experts} and be >= "
                              f"topk_group={topk_group}")
    dense = cfg.get("first_k_dense_replace", 0)
    if not isinstance(dense, int) or dense < 0:
        raise ConfigError(f"config.json field 'first_k_dense_replace' must be an integer >= 0, got {dense!r}")
    shared = cfg.get("n_shared_experts") or 0
    if not isinstance(shared, int) or shared < 0:
        raise ConfigError(f"config.json field 'n_shared_experts' must be an integer >= 0, got {shared!r}")
    rope_dim = _positive_int(cfg, "qk_rope_head_dim")
    if rope_dim % 2:
        raise ConfigError(f"qk_rope_head_dim={rope_dim} must be even for rotary embeddings")
    return DeepseekV2Fields(
        q_lora_rank=q_lora,
        kv_lora_rank=_positive_int(cfg, "kv_lora_rank"),
        qk_nope_head_dim=_positive_int(cfg, "qk_nope_head_dim"),
        qk_rope_head_dim=rope_dim,
        v_head_dim=_positive_int(cfg, "v_head_dim"),
        moe_intermediate_size=_positive_int(cfg, "moe_intermediate_size"),
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        n_shared_experts=shared,
        first_k_dense_replace=dense,
        topk_method=method,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
    )


def parse_model_config(cfg: dict[str, Any]) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    act = cfg.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(f"hidden_act={act!r} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
    hidden = _positive_int(cfg, "hidden_size")
    heads = _positive_int(cfg, "num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    deepseek = _parse_deepseek(cfg) if arch == "DeepseekV2ForCausalLM" else None
    rope = _rope_from_hf(cfg)
    if rope.rope_type == "yarn" and deepseek is None:
        raise ConfigError(
            f"rope_scaling.rope_type='yarn' is supported for DeepseekV2ForCausalLM only; supported for {arch}: "
            + ", ".join(t for t in SUPPORTED_ROPE_TYPES if t != "yarn")
        )
    # DeepSeek's config.json head_dim (if any) is the rotary width; the q/k head is nope + rope.
    head_dim = deepseek.qk_head_dim if deepseek else cfg.get("head_dim") or hidden // heads
    if head_dim % 2:
        raise ConfigError(f"head_dim={head_dim} must be even for rotary embeddings")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelConfig(
        architecture=arch,
        model_type=cfg.get("model_type", "llama"),
        vocab_size=_positive_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_positive_int(cfg, "intermediate_size"),
        num_hidden_layers=_positive_int(cfg, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=rope,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        deepseek=deepseek,
        raw=cfg,
    )


def load_model_config(model_dir: str | Path, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """Read ``config.json``, apply ``--json-model-override-args`` (shallow merge, as sglang does), parse."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: --model must be an HF-format model folder")
    cfg = json.loads(path.read_text())
    if overrides:
        cfg.update(overrides)
    config = parse_model_config(cfg)
    # As HF generate and sglang do, generation_config.json's eos ids also end generation (Llama 3
    # Instruct lists <|eot_id|> only there).
    gen_path = Path(model_dir) / "generation_config.json"
    gen_eos = json.loads(gen_path.read_text()).get("eos_token_id") if gen_path.is_file() else None
    gen_ids = gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
    extra = tuple(t for t in dict.fromkeys(gen_ids) if t not in config.eos_token_ids)
    return dataclasses.replace(config, eos_token_ids=config.eos_token_ids + extra) if extra else config
