"""`llmserve bench-serving`'s output: sglang's result block on the terminal and one JSON line per run."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from llmserve.bench.serving_stats import RunResult


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.2f}"
    return str(value)


def report(backend: str, dataset: str, result: RunResult, metrics: dict[str, Any]) -> str:
    """sglang's result block: 40-column labels, then the value."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<40} {_fmt(value)}")

    def section(title: str) -> None:
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))

    row("Backend:", backend)
    row("Dataset:", dataset)
    row("Traffic request rate:", "inf" if math.isinf(result.request_rate) else result.request_rate)
    row("Max request concurrency:", result.max_concurrency if result.max_concurrency else "not set")
    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    for status, n in sorted(metrics["failures"].items()):
        row(f"  {status}:", n)
    row("Benchmark duration (s):", metrics["duration"])
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Total cached tokens:", metrics["total_cached_tokens"])
    row("Prefix cache hit rate (%):", 100 * metrics["cache_hit_rate"])
    row("Request throughput (req/s):", metrics["request_throughput"])
    row("Input token throughput (tok/s):", metrics["input_throughput"])
    row("Output token throughput (tok/s):", metrics["output_throughput"])
    row("Total token throughput (tok/s):", metrics["total_throughput"])
    row("Concurrency:", metrics["concurrency"])
    row("Client CPU (% of one core):", 100 * metrics["client_cpu_utilization"])
    if metrics["output_len_mismatches"]:
        row("Outputs not of the requested length:", metrics["output_len_mismatches"])
    for title, key, label in (("End-to-End Latency", "e2e_latency", "E2E Latency"),
                              ("Time to First Token", "ttft", "TTFT"),
                              ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
                              ("Inter-Token Latency", "itl", "ITL")):
        section(title)
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            row(f"{name} {label} (ms):", metrics[f"{stat}_{key}_ms"])
        if key == "itl":
            row(f"Max {label} (ms):", metrics["max_itl_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def _json_float(value: Any) -> Any:
    """JSON has no inf or nan: inf as the string "inf", nan as null."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf"
    return value


def result_line(settings: dict[str, Any], result: RunResult, metrics: dict[str, Any],
                details: bool = False) -> dict[str, Any]:
    """One JSONL record: the benchmark's `settings`, this run's load, every aggregate metric and,
    with `details`, every request's record."""
    line: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(), **settings,
        "request_rate": result.request_rate, "max_concurrency": result.max_concurrency, "seed": result.seed,
        "num_requests": len(result.records), **metrics,
    }
    if details:
        line["requests"] = [r.detail() for r in result.records]
    return {k: _json_float(v) for k, v in line.items()}


def write_results(path: Path, lines: Sequence[dict[str, Any]]) -> None:
    """Append one JSON object per run (JSONL, like sglang's --output-file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line, allow_nan=False) + "\n")
