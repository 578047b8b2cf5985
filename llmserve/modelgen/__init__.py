"""Deterministic generator of HF-format model folders (config, safetensors weights, BPE tokenizer).

The folders it writes stand in for downloaded checkpoints: HF transformers loads them and is the
correctness oracle for the worker's own model code (DESIGN.md section 4).
"""

from llmserve.modelgen.presets import ARCHS, PRESETS, preset_config
from llmserve.modelgen.tokenizer import train_tokenizer
from llmserve.modelgen.writer import make_model

__all__ = ["ARCHS", "PRESETS", "make_model", "preset_config", "train_tokenizer"]
