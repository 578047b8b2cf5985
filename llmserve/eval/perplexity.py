"""Perplexity of a causal LM over one long text, with a sliding window.

The text is tokenized once (``n`` tokens). Windows of at most ``window`` tokens start every
``stride`` tokens; each window is a fresh prefill (no cache carried over) and scores only the tokens
no earlier window scored, so every token 1..n-1 is predicted exactly once, and with at least
``window - stride`` tokens of context once the first window is past (the first window's tokens see
everything before them). Token 0 has no context and is never scored. stride == window gives
windows that share one token (the context of each window's first scored token: cheapest, least
context); smaller strides cost ``window / stride`` times the forward work for more context per
scored token. This is the scheme of HF transformers' "Perplexity
of fixed-length models" guide.

Scorers are the seam: this engine's ModelRunner (logits at every position of one EXTEND step) and
HF transformers on the same folder, as the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from llmserve.bench.driver import StaticBatch
from worker_svc.executor.step_runner import StepRunner


class Scorer(Protocol):
    def logits(self, ids: list[int]) -> torch.Tensor:
        """float32 logits [len(ids), vocab]: row t predicts token t + 1."""
        ...


class EngineScorer:
    """This engine's forward: one EXTEND step over the window with logits at every token."""

    def __init__(self, runner: StepRunner) -> None:
        self.runner = runner

    def logits(self, ids: list[int]) -> torch.Tensor:
        batch = StaticBatch(self.runner, 1)
        try:
            return batch.extend([ids], all_logits=True)
        finally:
            batch.release()


class HFScorer:
    """HF transformers on the same folder (the reference), float32 by default."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([ids])).logits[0].float()


@dataclass(frozen=True)
class Window:
    begin: int  # first token fed
    end: int  # one past the last token fed
    first_target: int  # first token scored (predicted from the logits at first_target - 1)


def windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    if window < 2 or not 1 <= stride <= window:
        raise ValueError(f"need window >= 2 and 1 <= stride <= window (got window {window}, stride {stride})")
    if num_tokens < 2:
        raise ValueError(f"the text has {num_tokens} token(s); perplexity needs at least 2")
    out: list[Window] = []
    scored_to = 1  # tokens below this are scored (token 0 never is)
    start = 0
    while scored_to < num_tokens:
        # The first scored token is predicted from the one before it, so that one must be in the
        # window: with stride == window consecutive windows share one token.
        begin = min(start, scored_to - 1)
        end = min(begin + window, num_tokens)
        out.append(Window(begin, end, scored_to))
        scored_to = end
        start += stride
    return out


@dataclass(frozen=True)
class PerplexityResult:
    tokens_scored: int
    nll_sum: float
    windows: int
    predictions: list[int]  # argmax at every scored position, in text order (for top-1 agreement)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.tokens_scored)

    def top1_agreement(self, other: PerplexityResult) -> float:
        if len(self.predictions) != len(other.predictions):
            raise ValueError("results cover different tokens (another text, window or stride)")
        same = sum(a == b for a, b in zip(self.predictions, other.predictions, strict=False))
        return same / len(self.predictions)

    def to_json(self) -> dict[str, Any]:
        return {"tokens_scored": self.tokens_scored, "nll_sum": self.nll_sum, "windows": self.windows,
                "perplexity": self.perplexity, "predictions": self.predictions}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PerplexityResult:
        return cls(int(data["tokens_scored"]), float(data["nll_sum"]), int(data["windows"]),
                   [int(p) for p in data["predictions"]])


def perplexity(scorer: Scorer, ids: list[int], window: int, stride: int) -> PerplexityResult:
    nll_sum, predictions, plan = 0.0, [], windows(len(ids), window, stride)
    for w in plan:
        logits = scorer.logits(ids[w.begin : w.end])  # [w.end - w.begin, vocab]
        rows = logits[w.first_target - 1 - w.begin : w.end - 1 - w.begin]  # predict first_target .. end-1
        targets = torch.tensor(ids[w.first_target : w.end])
        log_probs = torch.log_softmax(rows.float(), dim=-1)
        nll_sum -= log_probs.gather(1, targets[:, None]).sum().item()
        predictions += rows.argmax(dim=-1).tolist()
    return PerplexityResult(len(ids) - 1, nll_sum, len(plan), predictions)
