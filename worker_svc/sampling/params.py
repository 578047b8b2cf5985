"""Per-request sampling parameters and their validation.

Conventions (shared with the gRPC layer, see DESIGN.md section 2):

* ``temperature == 0`` means greedy (argmax). Temperatures below ``GREEDY_TEMPERATURE_EPS`` are
  also treated as greedy: dividing logits by such a value can overflow float32 and turn the softmax
  into NaN.
* ``top_k == 1`` is greedy-equivalent: the sampler routes it to the argmax path, so it produces
  exactly the tokens greedy would (and consumes no randomness).
* ``top_k`` of ``-1`` or ``0`` disables top-k; ``top_p == 1`` disables top-p; ``min_p == 0``
  disables min-p.
* Proto3 has no "unset" for scalars, so a zero on the wire is not a semantic value for every field;
  :meth:`SamplingParams.normalized` maps the zero values that cannot be meant literally to the
  defaults.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from llmserve.worker_protocol import MAX_ABS_PENALTY, MAX_TOP_LOGPROBS

# Below this, logits / temperature can overflow float32; sglang routes such rows to argmax too.
GREEDY_TEMPERATURE_EPS = 1e-5


class SamplingParamError(ValueError):
    """An invalid sampling parameter; ``field`` names it for the RPC layer's INVALID_ARGUMENT."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    # EOS and stop_token_ids are masked to -inf until this many tokens were generated.
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    # HF-style, over tokens of prompt + output: positive logits are divided, negative multiplied.
    repetition_penalty: float = 1.0
    # OpenAI-style, over output tokens only: logit -= frequency * count + presence * (count > 0).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    return_logprob: bool = False
    top_logprobs_num: int = 0

    @property
    def is_greedy(self) -> bool:
        """True when the sampler takes the argmax path (no randomness consumed)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def needs_logprobs(self) -> bool:
        return self.return_logprob or self.top_logprobs_num > 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def normalized(self) -> SamplingParams:
        """Map proto3 zero values that cannot be meant literally to their defaults.

        * ``top_p == 0`` -> ``1.0`` (an empty nucleus is meaningless; proto3 sends 0 when unset).
        * ``top_k == 0`` -> ``-1`` (off).
        * ``repetition_penalty == 0`` -> ``1.0`` (a zero divisor is meaningless).

        ``temperature == 0`` is kept: it means greedy. Other fields are returned unchanged, so
        ``validate`` still rejects what is wrong. ``stop_token_ids`` is coerced to a tuple (a
        repeated proto field arrives as a list-like container).
        """
        changes: dict[str, Any] = {}
        if self.top_p == 0:
            changes["top_p"] = 1.0
        if self.top_k == 0:
            changes["top_k"] = -1
        if self.repetition_penalty == 0:
            changes["repetition_penalty"] = 1.0
        if not isinstance(self.stop_token_ids, tuple):
            changes["stop_token_ids"] = tuple(self.stop_token_ids)
        return dataclasses.replace(self, **changes) if changes else self

    def validate(self, *, vocab_size: int, max_new_tokens_limit: int | None = None) -> None:
        """Raise :class:`SamplingParamError` naming the first invalid field.

        Comparisons are written as ``not (valid range)`` so that NaN is rejected too.
        """
        if not self.max_new_tokens > 0:
            raise SamplingParamError("max_new_tokens", f"must be > 0, got {self.max_new_tokens}")
        if max_new_tokens_limit is not None and self.max_new_tokens > max_new_tokens_limit:
            raise SamplingParamError(
                "max_new_tokens",
                f"must be <= {max_new_tokens_limit}, got {self.max_new_tokens}",
            )
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise SamplingParamError(
                "min_new_tokens",
                f"must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}",
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise SamplingParamError(
                "temperature", f"must be finite and >= 0, got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise SamplingParamError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not self.top_k >= -1:
            raise SamplingParamError(
                "top_k", f"must be -1 (off), 0 (off) or >= 1, got {self.top_k}"
            )
        if not 0 <= self.min_p <= 1:
            raise SamplingParamError("min_p", f"must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise SamplingParamError(
                "repetition_penalty", f"must be finite and > 0, got {self.repetition_penalty}"
            )
        penalties = f"[{-MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}]"
        if not -MAX_ABS_PENALTY <= self.frequency_penalty <= MAX_ABS_PENALTY:
            raise SamplingParamError(
                "frequency_penalty", f"must be in {penalties}, got {self.frequency_penalty}"
            )
        if not -MAX_ABS_PENALTY <= self.presence_penalty <= MAX_ABS_PENALTY:
            raise SamplingParamError(
                "presence_penalty", f"must be in {penalties}, got {self.presence_penalty}"
            )
        for tok in self.stop_token_ids:
            if not 0 <= tok < vocab_size:
                raise SamplingParamError(
                    "stop_token_ids", f"id {tok} is outside the vocabulary [0, {vocab_size})"
                )
        if not self.n >= 1:
            raise SamplingParamError("n", f"must be >= 1, got {self.n}")
        if not 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise SamplingParamError(
                "top_logprobs_num",
                f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs_num}",
            )
