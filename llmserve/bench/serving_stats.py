"""What `llmserve bench-serving` measures: one record per request, filled as its stream arrives, and
the run's statistics computed from them afterwards (sglang's bench_serving definitions: TTFT to the
first token, ITL between tokens, TPOT = (E2E - TTFT) / (output tokens - 1), E2E to the stream's end)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

OK = "OK"
NOT_SENT = "NOT_SENT"  # a multi-turn turn after a failed one


@dataclass(slots=True)
class RequestRecord:
    """What one request did. `stamps[j]` is when the j-th message with tokens arrived, carrying
    `counts[j]` of them (perf_counter seconds, like `sent` and `done`)."""

    index: int
    expected_output_len: int
    input_len: int  # the prompt's ids as the client knows them; the server's count wins when reported
    conversation: int = -1
    turn: int = -1
    group: int = -1
    request_id: str = ""  # the label the target sent (the worker's logs name it), set when sent
    sent: float = 0.0
    done: float = 0.0
    stamps: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    status: str = NOT_SENT
    error: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)  # multi-turn only: the answer, for the next turn
    output_text: list[str] = field(default_factory=list)  # multi-turn with text prompts only

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens or sum(self.counts)

    @property
    def prompt_len(self) -> int:
        return self.prompt_tokens or self.input_len

    @property
    def ttft(self) -> float | None:
        return self.stamps[0] - self.sent if self.stamps else None

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def tpot(self) -> float | None:
        ttft, out = self.ttft, self.output_tokens
        return (self.e2e - ttft) / (out - 1) if ttft is not None and out > 1 else None

    def itls(self) -> list[float]:
        """Gaps between messages; a message with k tokens counts as k gaps of a k-th of its wait."""
        out: list[float] = []
        for j in range(1, len(self.stamps)):
            gap, k = self.stamps[j] - self.stamps[j - 1], self.counts[j]
            out.extend([gap / k] * k)
        return out

    def detail(self) -> dict[str, Any]:
        ttft, tpot = self.ttft, self.tpot
        return {
            "index": self.index, "request_id": self.request_id, "conversation": self.conversation, "turn": self.turn,
            "group": self.group,
            "status": self.status, "error": self.error, "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_len, "output_tokens": self.output_tokens,
            "expected_output_len": self.expected_output_len, "cached_tokens": self.cached_tokens,
            "ttft_ms": None if ttft is None else 1e3 * ttft, "tpot_ms": None if tpot is None else 1e3 * tpot,
            "e2e_ms": 1e3 * self.e2e if self.status != NOT_SENT else None,
            "itl_ms": [1e3 * x for x in self.itls()],
        }


@dataclass
class RunResult:
    request_rate: float
    max_concurrency: int | None
    seed: int
    records: list[RequestRecord]
    duration: float
    client_cpu_s: float


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    rank = (len(s) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def distribution(values: Sequence[float], scale: float = 1e3) -> dict[str, float]:
    """mean, median, p90, p99, std (population) and max of `values` times `scale` (ms by default)."""
    if not values:
        return {k: math.nan for k in ("mean", "median", "p90", "p99", "std", "max")}
    v = [x * scale for x in values]
    mean = sum(v) / len(v)
    return {"mean": mean, "median": percentile(v, 50), "p90": percentile(v, 90), "p99": percentile(v, 99),
            "std": math.sqrt(sum((x - mean) ** 2 for x in v) / len(v)), "max": max(v)}


def summarize(result: RunResult) -> dict[str, Any]:
    """The aggregate metrics of a run, with sglang's names where it has one."""
    ok = [r for r in result.records if r.ok]
    duration = result.duration
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    failures: dict[str, int] = {}
    for r in result.records:
        if not r.ok:
            failures[r.status] = failures.get(r.status, 0) + 1
    ttfts = [t for r in ok if (t := r.ttft) is not None]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    itls = [x for r in ok for x in r.itls()]
    e2es = [r.e2e for r in ok]
    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(result.records) - len(ok),
        "failures": failures,
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": cached,
        "cache_hit_rate": cached / total_in if total_in else 0.0,
        "mean_request_cache_hit_ratio": (sum(r.cached_tokens / r.prompt_len for r in ok if r.prompt_len) / len(ok)
                                         if ok else 0.0),
        "output_len_mismatches": sum(1 for r in ok if r.output_tokens != r.expected_output_len),
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "input_throughput": total_in / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
        # Requests in flight on average (sglang's "Concurrency").
        "concurrency": sum(e2es) / duration if duration > 0 else 0.0,
        "client_cpu_utilization": result.client_cpu_s / duration if duration > 0 else 0.0,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2e_latency", e2es)):
        for stat, value in distribution(values).items():
            out[f"{stat}_{name}_ms"] = value
    return out
