"""Deterministic generator of HF-format model folders (config, safetensors weights, BPE tokenizer).

The folders it writes stand in for downloaded checkpoints: HF transformers loads them and is the
correctness oracle for the worker's own model code (DESIGN.md section 4).
"""

from typing import Any

from llmserve.modelgen.presets import ARCHS, PRESETS, preset_config

__all__ = ["ARCHS", "PRESETS", "make_model", "preset_config", "train_tokenizer"]


def __getattr__(name: str) -> Any:
    # The writer and trainer pull in torch and tokenizers; load them on first use so that
    # `llmserve --help` and the light services start fast.
    if name == "make_model":
        from llmserve.modelgen.writer import make_model

        return make_model
    if name == "train_tokenizer":
        from llmserve.modelgen.tokenizer import train_tokenizer

        return train_tokenizer
    raise AttributeError(name)
