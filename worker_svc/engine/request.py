"""A generation request as the scheduler tracks it, and what each step reports back about it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from worker_svc.kvcache.radix_cache import RadixNode
from worker_svc.sampling import SamplingParams


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"  # cancelled, or failed (see Request.error)


class RequestError(ValueError):
    """A request that can never be served as asked. ``field`` names the culprit; ``resource`` marks
    requests that are well-formed but too large for this worker (RESOURCE_EXHAUSTED, not INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str, resource: bool = False) -> None:
        super().__init__(message)
        self.field = field
        self.resource = resource


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    # Addresses the request's sampling noise with its step (sampling/noise.py): no state to carry.
    noise_key: int
    output_ids: list[int] = field(default_factory=list)
    # KV state: this request's row in the request -> token table and how many tokens are cached.
    req_row: int | None = None
    num_cached: int = 0
    # Radix prefix cache: the row's first prefix_len slots are the cache's (matched at admission, or
    # handed over after a prefill step), pinned by a lock on cache_node; the rest are the request's own.
    prefix_len: int = 0
    cache_node: RadixNode | None = None
    finish_reason: FinishReason | None = None
    matched_stop: int | None = None
    error: str | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Prompt tokens found in the radix prefix cache at first admission (usage's cached_tokens; the
    # recompute of a retracted request does not count its own KV again).
    cached_prompt_tokens: int = 0
    num_retractions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # first admission to a step (the metrics' queue time)
    first_token_time: float | None = None

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the request needs: the prompt plus what it has generated so far."""
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """``fill_ids[start:end]`` without building ``fill_ids`` (a copy of the whole prompt)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.params.max_new_tokens - len(self.output_ids))


@dataclass
class StepOutput:
    """What one scheduler step produced for one request."""

    rid: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    new_top_logprobs: list[list[tuple[int, float]]]
    finish_reason: FinishReason | None
    matched_stop: int | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def first_token(self) -> bool:
        """Whether this output carries the request's first token (its prompt has just been computed)."""
        return bool(self.new_token_ids) and self.completion_tokens == len(self.new_token_ids)
