"""HF transformers reference results, computed once per (model folder, prompts, length)."""

from __future__ import annotations

from functools import cache
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


@cache
def _cached(model_dir: str, prompts: tuple[tuple[int, ...], ...], output_len: int):
    logits, outputs = hf_greedy(model_dir, [list(p) for p in prompts], output_len, dtype=torch.float32)
    return logits, outputs


def hf_reference(model_dir: Path, prompts: list[list[int]], output_len: int) -> tuple[torch.Tensor, list[list[int]]]:
    return _cached(str(model_dir), tuple(tuple(p) for p in prompts), output_len)


def run_with_late_arrivals(engine, prompts: list[list[int]], params, on_head_start=None, early: int = 2,
                           head_start: int = 6):
    """Submit the first ``early`` prompts, run ``head_start`` steps (then call ``on_head_start`` with
    those requests), submit the rest and run to the end.

    Returns (requests in prompt order, each request's final prefill logits taken from whichever
    step completed its prompt: a mixed chunked step, or a decode-joined extend)."""
    steps = []
    forward = engine.runner.forward

    def recording_forward(step):
        logits = forward(step)
        steps.append((step.req_rows.tolist(), list(step.seq_lens), logits.clone()))
        return logits

    engine.runner.forward = recording_forward
    first = [engine.submit(p, params) for p in prompts[:early]]
    for _ in range(head_start):
        engine.scheduler.step()
    if on_head_start is not None:
        on_head_start(first)
    later = [engine.submit(p, params) for p in prompts[early:]]
    rows: dict[int, int] = {}
    while engine.scheduler.has_work():
        engine.scheduler.step()
        for req in first + later:
            if req.req_row is not None:
                rows.setdefault(id(req), req.req_row)
    reqs = first + later
    prefill = []
    for req in reqs:
        found = [
            logits[j] for rows_, lens, logits in steps
            for j, (row, length) in enumerate(zip(rows_, lens, strict=False))
            if row == rows[id(req)] and length == len(req.prompt_ids)
        ]
        assert len(found) == 1, "each prompt completes its prefill in exactly one step"
        prefill.append(found[0])
    return reqs, prefill
