"""Typed, frozen model configuration parsed once from an HF ``config.json``.

Everything below the loader takes a ``ModelConfig``; nothing re-reads the JSON dict.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
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
    raw: dict[str, Any] = field(repr=False, compare=False, hash=False, default_factory=dict)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


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
    return RopeConfig(
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
    head_dim = cfg.get("head_dim") or hidden // heads
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
        rope=_rope_from_hf(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
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
