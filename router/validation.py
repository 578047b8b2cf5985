"""Request validation at the router's edge: every message names the field at fault.

The router checks what it can before any token is generated, so a bad request costs no tokenizer
or worker round trip (and the worker's own checks stay a second line). Conventions follow
router.proto: proto3 zeros of plain fields mean "off"/default (top_p 0 -> 1.0, top_k 0 or -1 -> off,
repetition_penalty 0 -> 1.0); `optional` fields distinguish unset from zero (temperature unset ->
1.0, 0 -> greedy; max_new_tokens unset -> what the context leaves, set to <= 0 -> INVALID_ARGUMENT;
n unset -> 1, set to < 1 -> INVALID_ARGUMENT). Caps on counts and sizes are router/limits.py's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from llmserve.token_ids import first_out_of_range
from llmserve.v1 import router_pb2 as pb
from llmserve.worker_protocol import MAX_ABS_PENALTY, MAX_TOP_LOGPROBS


class RouterError(Exception):
    """A request the router answers with a gRPC status instead of a stream."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.field = field

    @property
    def message(self) -> str:
        return str(self)


def invalid(field: str, message: str) -> RouterError:
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}", field)


@dataclass(frozen=True)
class ModelFacts:
    """What validation needs to know about the served model (from the workers and the tokenizer)."""

    name: str
    vocab_size: int  # the model's logit width: token ids must be below it
    context_limit: int  # most tokens (prompt + output) one sequence may hold on every group
    eos_token_ids: tuple[int, ...]


def _finite_range(field: str, value: float, lo: float, hi: float, what: str) -> None:
    if not (math.isfinite(value) and lo <= value <= hi):
        raise invalid(field, f"must be {what}, got {value}")


def validate_sampling(sp: pb.SamplingParams, facts: ModelFacts, prefix: str = "sampling_params.") -> None:
    """Raise RouterError (INVALID_ARGUMENT) for the first invalid sampling field."""
    p = prefix
    if sp.HasField("max_new_tokens") and sp.max_new_tokens <= 0:
        raise invalid(f"{p}max_new_tokens", f"must be >= 1, got {sp.max_new_tokens}")
    if sp.HasField("n") and sp.n < 1:
        raise invalid(f"{p}n", f"must be >= 1, got {sp.n}")
    if sp.HasField("max_new_tokens") and sp.max_new_tokens > facts.context_limit:
        raise invalid(f"{p}max_new_tokens",
                      f"{sp.max_new_tokens} is beyond the context limit of {facts.context_limit} tokens")
    if sp.HasField("max_new_tokens") and sp.min_new_tokens > sp.max_new_tokens:
        raise invalid(f"{p}min_new_tokens", f"{sp.min_new_tokens} exceeds max_new_tokens ({sp.max_new_tokens})")
    if sp.min_new_tokens > facts.context_limit:
        raise invalid(f"{p}min_new_tokens",
                      f"{sp.min_new_tokens} is beyond the context limit of {facts.context_limit} tokens")
    if sp.HasField("temperature") and not (math.isfinite(sp.temperature) and sp.temperature >= 0):
        raise invalid(f"{p}temperature", f"must be >= 0 (0 is greedy), got {sp.temperature}")
    # top_p: 0 is the proto3 zero and means 1.0 (off); otherwise (0, 1].
    _finite_range(f"{p}top_p", sp.top_p, 0.0, 1.0, "in (0, 1] (0 means unset = 1.0)")
    if sp.top_k < -1:
        raise invalid(f"{p}top_k", f"must be >= 1, or 0 / -1 for off, got {sp.top_k}")
    _finite_range(f"{p}min_p", sp.min_p, 0.0, 1.0, "in [0, 1]")
    if not (math.isfinite(sp.repetition_penalty) and sp.repetition_penalty >= 0):
        raise invalid(f"{p}repetition_penalty", f"must be > 0 (0 means unset = 1.0), got {sp.repetition_penalty}")
    penalties = f"in [{-MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}]"
    _finite_range(f"{p}frequency_penalty", sp.frequency_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY, penalties)
    _finite_range(f"{p}presence_penalty", sp.presence_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY, penalties)
    for i, stop in enumerate(sp.stop):
        if not stop:
            raise invalid(f"{p}stop[{i}]", "stop strings must not be empty")
    for i, tok in enumerate(sp.stop_token_ids):
        if tok >= facts.vocab_size:
            raise invalid(f"{p}stop_token_ids[{i}]",
                          f"id {tok} is outside the vocabulary [0, {facts.vocab_size})")
    if sp.top_logprobs > MAX_TOP_LOGPROBS:
        raise invalid(f"{p}top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {sp.top_logprobs}")


def validate_model(model: str, facts: ModelFacts) -> None:
    if model and model != facts.name:
        raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"model: unknown model {echo(model)}; this cluster serves {facts.name!r}", "model")


def echo(text: str, limit: int = 64) -> str:
    """A client string shortened for a status message or a log line (never echoed unbounded)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def validate_token_ids(ids: Sequence[int], facts: ModelFacts, field: str) -> None:
    found = first_out_of_range(ids, facts.vocab_size)
    if found is None:
        return
    pos, bad = found
    raise invalid(field, f"id {bad} at position {pos} is outside the vocabulary [0, {facts.vocab_size})")


def check_fits(num_prompt_tokens: int, sp: pb.SamplingParams, facts: ModelFacts, prompt_field: str) -> None:
    """RESOURCE_EXHAUSTED for a request that can never fit one sequence's context."""
    limit = facts.context_limit
    if num_prompt_tokens >= limit:
        raise RouterError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{prompt_field}: the prompt is {num_prompt_tokens} tokens; at most {limit - 1} fit the context "
            f"limit of {limit} tokens (leaving room for one generated token)", prompt_field)
    if sp.HasField("max_new_tokens") and num_prompt_tokens + sp.max_new_tokens > limit:
        raise RouterError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"sampling_params.max_new_tokens: prompt ({num_prompt_tokens} tokens) + max_new_tokens "
            f"({sp.max_new_tokens}) exceeds the context limit of {limit} tokens", "sampling_params.max_new_tokens")
