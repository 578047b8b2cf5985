"""Variants of generated models that tests build from the tiny presets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def with_biases(src: Path, dst: Path) -> Path:
    """A copy of ``src`` with random biases on every projection (attention_bias and mlp_bias)."""
    if dst.exists():
        return dst
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    for name in list(tensors):
        if name.endswith(("_proj.weight",)):
            rows = tensors[name].shape[0]
            tensors[name.replace(".weight", ".bias")] = torch.randn(rows, generator=gen) * 0.1
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config.update(attention_bias=True, mlp_bias=True)
    (dst / "config.json").write_text(json.dumps(config))
    return dst
