"""make_model: one call that writes a complete HF-format model folder."""

import copy
import json
from pathlib import Path
from typing import Any

import torch

from llmserve.modelgen.chat_template import special_tokens_map, tokenizer_config
from llmserve.modelgen.presets import WEIGHTS_DTYPE, apply_variants, check_arch, preset_config
from llmserve.modelgen.safetensors_io import save_weights
from llmserve.modelgen.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    EOT_TOKEN,
    special_token_ids,
    train_tokenizer,
)
from llmserve.modelgen.weights import init_weights

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                   "float16": torch.float16}


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    # Sorted keys and a fixed layout: same arguments give byte-identical files.
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def build_config(
    arch: str,
    preset: str,
    token_ids: dict[str, int] | None = None,
    config_override: dict[str, Any] | None = None,
    **variants: Any,
) -> dict[str, Any]:
    """config.json content: preset, then variants, then tokenizer ids, then explicit overrides."""
    config = apply_variants(preset_config(arch, preset), **variants)
    if token_ids is not None:
        config["bos_token_id"] = token_ids[BOS_TOKEN]
        config["eos_token_id"] = token_ids[EOS_TOKEN]
    config.update(copy.deepcopy(config_override or {}))
    return config


def make_model(
    out_dir: str | Path,
    arch: str = "llama",
    preset: str = "tiny",
    seed: int = 0,
    *,
    tie_word_embeddings: bool = False,
    head_dim: int | None = None,
    rope_scaling: str | None = None,
    config_override: dict[str, Any] | None = None,
    shards: int = 1,
    weights_dtype: str | None = None,
) -> Path:
    """Write config, weights, tokenizer and generation config into out_dir; return it.

    Deterministic: the same arguments give byte-identical files. The tokenizer depends only on the
    final vocab_size; the weights on the final config and seed.
    """
    check_arch(arch)
    variants: dict[str, Any] = dict(tie_word_embeddings=tie_word_embeddings, head_dim=head_dim,
                                    rope_scaling=rope_scaling)
    # vocab_size may come from the override, so the tokenizer is trained on the merged config.
    vocab_size = build_config(arch, preset, config_override=config_override, **variants)["vocab_size"]
    tok = train_tokenizer(vocab_size)
    ids = special_token_ids(tok)
    config = build_config(arch, preset, token_ids=ids, config_override=config_override, **variants)
    dtype_name = weights_dtype or WEIGHTS_DTYPE[preset]
    if dtype_name not in _DTYPES:
        raise ValueError(f"unknown weights dtype {dtype_name!r}; choose from {', '.join(_DTYPES)}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_weights(init_weights(config, seed, _DTYPES[dtype_name]), out, shards=shards)
    _write_json(out / "config.json", config)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config(ids, config["max_position_embeddings"]))
    _write_json(out / "special_tokens_map.json", special_tokens_map())
    _write_json(out / "generation_config.json", {
        "bos_token_id": config["bos_token_id"],
        # Like Llama 3 Instruct: stop at end of text or at the end of a chat turn.
        "eos_token_id": [config["eos_token_id"], ids[EOT_TOKEN]],
        "do_sample": False,
    })
    return out
