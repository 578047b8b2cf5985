"""How many waiting requests one extend step admits (the worker's ``--prefill-batching cost``).

Why: a step's time is a fixed part (every weight read once, the running requests riding along) plus each new
request's own part. Admitting all that fits the token budget at once makes every request of a burst wait for
the whole step, and closed-loop clients then stay in waves: requests admitted together finish together, and
their replacements arrive during the next wave's long step and wait for all of it (docs/benchmarks.md,
2026-12-06). One request a step dissolves the waves but pays the fixed part once per request, which a burst
of 64 prompts cannot afford. Between the two, the split of the waiting queue (first come, first served) into
steps that minimizes the waiting requests' summed time to first token depends on the fixed part against the
requests' own parts, both of which this module estimates from the steps just run:

- ``StepTimeModel`` fits a step's fixed part from the decode steps (``ms = fixed + per_row * rows +
  per_row_kpair * attention pairs / 1000``: every weight read once, plus the requests) and a prompt's own part
  from what extend steps took beyond that fixed part for their riders (``per_token * prompt tokens +
  per_kpair * their attention pairs / 1000``), both by least squares with exponential forgetting, so the
  plentiful decode steps pin the fixed part and a long stretch of decoding does not forget what prefill costs;
- ``first_batch_size`` solves the split (a small dynamic programme) and returns the first step's share.

On a 2-core host the 135M model's extend steps take about the decode step of their riders plus 0.25-0.3 ms a
prompt token (64-token prompts over a 512-token cached prefix: 2 at once ~64 ms, 5 ~108 ms, decode steps of 8
~21 ms).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

# Forgetting per observed step: ~10 extend steps and ~20 decode steps carry the fit, so it follows the host
# (shared machines swing 2x within minutes) and the workload.
EXTEND_FORGETTING = 0.9
DECODE_FORGETTING = 0.95
# Steps of each kind seen before the fit is used (until then the token budget alone sizes extend steps).
MIN_EXTEND_STEPS = 3
MIN_DECODE_STEPS = 3
# Relative ridge on the normal equations (not on the intercept): keeps the solve defined when the steps seen
# cannot tell coefficients apart (all decode steps of one batch size: their time goes to the fixed part).
RIDGE = 1e-3
# A smaller first step is taken when its split's summed time to first token exceeds the least one by at most
# this share of what the least split's first step costs its own requests (their count x its time). The sum
# sees only the requests waiting now; in a closed loop the requests admitted together also finish together
# and come back together, while a wave split once stays split: one request a step beside the riders gave
# cached prompts 44 ms steps where pairs kept pairing at 63 ms (served, 2026-12-06), though a pair scores 4.8%
# better than two single steps. Against the first step's own cost (not the whole queue's), so a long queue,
# where any one step's choice moves the sum little, is still batched.
NEAR_TIE = 0.1


@dataclass(frozen=True)
class StepWork:
    """What one step computes: prompt tokens (new prompts, chunks, recomputes) and one-token rows (a decode
    step's requests, or the running requests riding along in an extend step)."""

    prompt_tokens: int
    prompt_pairs: float  # attention (query, key) pairs of the prompt tokens
    rows: int
    row_pairs: float  # attention pairs of the rows: their context lengths

    @staticmethod
    def pairs(new_tokens: int, prefix: int) -> float:
        """(query, key) pairs of ``new_tokens`` computed after ``prefix`` cached tokens (causal)."""
        return new_tokens * (prefix + (new_tokens + 1) / 2)


@dataclass(frozen=True)
class StepCoefficients:
    """Milliseconds: a step's ``fixed`` part, ``per_row`` a one-token row, ``per_row_kpair`` a thousand of its
    attention pairs; a prompt's ``per_token`` and ``per_kpair``."""

    fixed: float
    per_row: float
    per_row_kpair: float
    per_token: float
    per_kpair: float

    def fixed_ms(self, rows: int, row_pairs: float) -> float:
        """A step with these one-token rows and no prompt (a decode step; an extend step's fixed part)."""
        return self.fixed + self.per_row * rows + self.per_row_kpair * row_pairs / 1000

    def prompt_ms(self, tokens: int, pairs: float) -> float:
        """What prompt tokens with these attention pairs add to a step."""
        return self.per_token * tokens + self.per_kpair * pairs / 1000


class StepCostEstimator(Protocol):
    """The scheduler's view of step costs: told each step's work and time, asked for coefficients."""

    def observe(self, work: StepWork, ms: float) -> None: ...

    def coefficients(self) -> StepCoefficients | None: ...


class _ForgettingLeastSquares:
    """Least squares over observations weighted ``forgetting ** age``; a relative ridge on every coefficient
    but the first ``free`` (the intercept), so what the data cannot tell apart goes to the intercept."""

    def __init__(self, size: int, forgetting: float, free: int) -> None:
        self.gram = torch.zeros(size, size, dtype=torch.float64)
        self.moment = torch.zeros(size, dtype=torch.float64)
        self.forgetting = forgetting
        self.free = free
        self.seen = 0

    def add(self, x: list[float], y: float) -> None:
        v = torch.tensor(x, dtype=torch.float64)
        self.gram.mul_(self.forgetting).add_(torch.outer(v, v))
        self.moment.mul_(self.forgetting).add_(v, alpha=y)
        self.seen += 1

    def solve(self) -> list[float] | None:
        """The coefficients, those after the first ``free`` kept >= 0 (a coefficient the fit makes negative
        is dropped and the rest refitted: a step does not get faster with more work; noise, such as the
        client's own work landing on the last decode steps of a wave, says otherwise)."""
        gram = self.gram.clone()
        gram.diagonal()[self.free :] *= 1 + RIDGE
        gram.diagonal()[self.free :] += 1e-12
        kept = list(range(len(self.moment)))
        while True:
            index = torch.tensor(kept)
            try:
                part = torch.linalg.solve(gram[index][:, index], self.moment[index]).tolist()
            except RuntimeError:  # singular: nothing seen that pins the intercept
                return None
            if not all(map(math.isfinite, part)):
                return None
            negative = [(value, i) for value, i in zip(part, kept, strict=True) if i >= self.free and value < 0]
            if not negative:
                coef = [0.0] * len(self.moment)
                for value, i in zip(part, kept, strict=True):
                    coef[i] = value
                return coef
            kept.remove(min(negative)[1])
            if not kept:
                return None


class StepTimeModel:
    """The fixed part from decode steps, a prompt's own part from extend steps' time beyond their fixed
    part (module docstring)."""

    def __init__(self) -> None:
        self._decode = _ForgettingLeastSquares(3, DECODE_FORGETTING, free=1)
        self._extend = _ForgettingLeastSquares(2, EXTEND_FORGETTING, free=0)
        self._fixed: list[float] | None = None  # the decode fit
        self._fit: StepCoefficients | None = None
        self._stale = True

    def observe(self, work: StepWork, ms: float) -> None:
        fixed_features = [1.0, float(work.rows), work.row_pairs / 1000]
        if work.prompt_tokens == 0:
            self._decode.add(fixed_features, ms)
            self._fixed = None
        else:
            fixed = self._decode_fit()
            if fixed is None:
                return  # its fixed part is not known yet: nothing to learn about prompts from it
            beyond = ms - sum(c * x for c, x in zip(fixed, fixed_features, strict=True))
            self._extend.add([float(work.prompt_tokens), work.prompt_pairs / 1000], beyond)
        self._stale = True

    def coefficients(self) -> StepCoefficients | None:
        """The current fit, or None before enough steps of both kinds (or when it is not usable: a step or a
        prompt token costing nothing)."""
        if self._stale:
            self._fit, self._stale = self._solve(), False
        return self._fit

    def _decode_fit(self) -> list[float] | None:
        if self._fixed is None and self._decode.seen >= MIN_DECODE_STEPS:
            self._fixed = self._decode.solve()
        return self._fixed

    def _solve(self) -> StepCoefficients | None:
        fixed = self._decode_fit()
        if fixed is None or self._extend.seen < MIN_EXTEND_STEPS:
            return None
        prompt = self._extend.solve()
        if prompt is None:
            return None
        (base, per_row, per_row_kpair), (per_token, per_kpair) = fixed, prompt
        if base <= 0 or per_token <= 0:
            return None
        return StepCoefficients(fixed=base, per_row=per_row, per_row_kpair=per_row_kpair, per_token=per_token,
                                per_kpair=per_kpair)


def first_batch_size(own_ms: Sequence[float], tokens: Sequence[int], fixed_ms: float, token_budget: int) -> int:
    """How many of the waiting requests (in queue order, each with its own step time ``own_ms`` and
    ``tokens`` to compute) the next step should take so that their summed time to first token is least, when
    every step costs ``fixed_ms`` plus its requests' own times and holds at most ``token_budget`` tokens (a
    request alone may exceed it: it is chunked). A smaller first batch whose split comes within ``NEAR_TIE``
    of the least split's first step is preferred (see NEAR_TIE).

    The dynamic programme over suffixes: a step's time counts once for each request still waiting, so
    ``best[i] = min_j (n - i) * (fixed + own[i:j]) + best[j]``; O(n * batch) for n waiting requests.
    """
    n = len(own_ms)
    if n <= 1:
        return n
    prefix_ms = [0.0]
    prefix_tokens = [0]
    for ms, t in zip(own_ms, tokens, strict=True):
        prefix_ms.append(prefix_ms[-1] + ms)
        prefix_tokens.append(prefix_tokens[-1] + t)
    best = [0.0] * (n + 1)
    totals: list[float] = []
    for i in range(n - 1, -1, -1):
        totals = []  # by first-batch size 1, 2, ...
        for j in range(i + 1, n + 1):
            if j > i + 1 and prefix_tokens[j] - prefix_tokens[i] > token_budget:
                break
            totals.append((n - i) * (fixed_ms + prefix_ms[j] - prefix_ms[i]) + best[j])
        best[i] = min(totals)
    least = min(range(len(totals)), key=totals.__getitem__) + 1  # the first step of a least split
    slack = NEAR_TIE * least * (fixed_ms + prefix_ms[least])  # of what that step's requests wait for it
    return min(k for k, total in enumerate(totals, start=1) if total - best[0] <= slack)
