"""HF transformers reference results, computed once per (model folder, prompts, length)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from tokenizers import Tokenizer

from llmserve.bench.reference_hf import hf_greedy

# Different lengths on purpose; the last one is long enough to be prefilled in several chunks.
PROMPT_TEXTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "日本語の文章 😀 and",
    "Rivers carry water from the mountains to the sea. Along the way they shape valleys, feed "
    "farmland and give towns a reason to exist. Engineers have long studied how",
)


def encode_prompts(model_dir: Path) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tokenizer.encode(text).ids for text in PROMPT_TEXTS]


@lru_cache(maxsize=None)
def _cached(model_dir: str, prompts: tuple[tuple[int, ...], ...], output_len: int):
    logits, outputs = hf_greedy(model_dir, [list(p) for p in prompts], output_len, dtype=torch.float32)
    return logits, outputs


def hf_reference(model_dir: Path, prompts: list[list[int]], output_len: int) -> tuple[torch.Tensor, list[list[int]]]:
    return _cached(str(model_dir), tuple(tuple(p) for p in prompts), output_len)
